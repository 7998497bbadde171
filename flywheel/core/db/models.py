"""SQLAlchemy 2.0 tables: the system of record.

Tables are separate from API schemas (those live beside each API). Migrations in
``migrations/`` must agree with these models; ``tests/integration/test_migrations.py``
checks that autogenerate finds no difference.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ROLES = ("viewer", "operator", "admin", "writer", "product")
PROJECT_ROLES = ("writer", "product")
"""Roles whose keys are scoped to one project: gateway write keys and the router's product keys."""
CHECKPOINT_STATUSES = ("candidate", "rejected", "deployed", "retired", "deleted")
CYCLE_STATUSES = ("running", "skipped", "failed", "candidate", "rejected")
DEPLOYMENT_STATUSES = ("pending", "active", "promoted", "rolled_back", "failed", "superseded", "unpinned")
REPLICA_STATES = ("serving", "draining", "swapping", "failed")
OPERATION_STATES = ("queued", "running", "succeeded", "failed")
OPERATION_ACTIVE = ("queued", "running")
"""States of an operation that has not ended (at most one such operation per fleet)."""


class Base(DeclarativeBase):
    """Declarative base with a constraint naming convention (stable migration names)."""

    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSONB, uuid.UUID: UUID(as_uuid=True)}


def _now() -> Any:
    return mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class RawEvent(Base):
    """Every valid event exactly once, as received (idempotent by event id)."""

    __tablename__ = "raw_events"

    event_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    project: Mapped[str] = mapped_column(String(128))
    session_id: Mapped[str] = mapped_column(String(128))
    type: Mapped[str] = mapped_column(String(32))
    schema_version: Mapped[int] = mapped_column(SmallInteger)
    occurred_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    received_at: Mapped[datetime] = _now()
    payload: Mapped[dict[str, Any]]
    source: Mapped[str] = mapped_column(String(32), server_default="kafka")
    kafka_partition: Mapped[int | None] = mapped_column(Integer)
    kafka_offset: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        Index("ix_raw_events_session", "project", "session_id", "occurred_at"),
        Index("ix_raw_events_type_time", "type", "occurred_at"),
        # Finds a completion by its id (for feedback that names the completion alone), within the
        # time window that the UUIDv7 id bounds; only completions are indexed.
        Index(
            "ix_raw_events_completion_id",
            text("(payload ->> 'completion_id')"),
            "occurred_at",
            postgresql_where=text("type = 'completion'"),
        ),
    )


class DeadLetter(Base):
    """A record that could not be accepted, with the reason; never silently dropped."""

    __tablename__ = "dead_letters"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    source: Mapped[str] = mapped_column(String(32))
    topic: Mapped[str | None] = mapped_column(String(256))
    kafka_partition: Mapped[int | None] = mapped_column(Integer)
    kafka_offset: Mapped[int | None] = mapped_column(BigInteger)
    key: Mapped[bytes | None] = mapped_column(LargeBinary)
    value: Mapped[bytes | None] = mapped_column(LargeBinary)
    field: Mapped[str | None] = mapped_column(String(256))
    reason: Mapped[str] = mapped_column(Text)
    project: Mapped[str | None] = mapped_column(String(128))
    received_at: Mapped[datetime] = _now()

    __table_args__ = (
        UniqueConstraint("topic", "kafka_partition", "kafka_offset", name="uq_dead_letters_position"),
        Index("ix_dead_letters_received_at", "received_at"),
    )


class PendingFeedback(Base):
    """Feedback that names a completion but no session, kept until ingest finds the completion's session.

    Once found, the resolved copy (same event id, ``session_id`` filled) is produced to the events
    topic and stored in ``raw_events`` like any feedback; the row stays as the record of it.
    """

    __tablename__ = "pending_feedback"

    event_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    project: Mapped[str] = mapped_column(String(128))
    completion_id: Mapped[uuid.UUID]
    completion_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    """The time in the UUIDv7 completion id: the centre of the window searched for the completion."""
    occurred_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    payload: Mapped[dict[str, Any]]
    """The unattached event, as received."""
    received_at: Mapped[datetime] = _now()
    session_id: Mapped[str | None] = mapped_column(String(128))
    """The completion's session, once found."""
    resolved_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    """When Kafka acknowledged the resolved copy; until then the row is retried."""
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    next_attempt_at: Mapped[datetime] = _now()
    reported_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    """When it was first reported as ``unknown_completion`` (still retried after)."""

    __table_args__ = (
        Index("ix_pending_feedback_due", "next_attempt_at", postgresql_where=text("published_at IS NULL")),
    )


class AgentSession(Base):
    """One agent session, as far as its events have told."""

    __tablename__ = "sessions"

    project: Mapped[str] = mapped_column(String(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    user_id: Mapped[str | None] = mapped_column(String(128))
    agent: Mapped[str | None] = mapped_column(String(128))
    task: Mapped[str | None] = mapped_column(String(128))
    group_key: Mapped[str | None] = mapped_column(String(256))
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSONB, server_default=text("'{}'::jsonb"))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    status: Mapped[str] = mapped_column(String(32), server_default="open")
    policy_versions: Mapped[list[str]] = mapped_column(ARRAY(String(128)), server_default=text("'{}'"))
    n_events: Mapped[int] = mapped_column(Integer, server_default="0")
    last_event_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = _now()

    __table_args__ = (Index("ix_sessions_ended_at", "ended_at"),)


class Reward(Base):
    """A versioned reward for a session; later feedback adds a version, never overwrites."""

    __tablename__ = "rewards"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    project: Mapped[str] = mapped_column(String(128))
    session_id: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    reward: Mapped[float] = mapped_column(Float)
    components: Mapped[dict[str, Any]]
    """Each extractor's terms, e.g. ``{"outcome": {"value": 1.0, "weight": 1.0}, ...}``."""
    extractor_versions: Mapped[dict[str, Any]]
    config_hash: Mapped[str] = mapped_column(String(64))
    policy_version: Mapped[str | None] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(String(64), server_default="finalized")
    """Why this version exists: ``finalized``, ``late_feedback``, ``timeout``, ``recompute``."""
    created_at: Mapped[datetime] = _now()

    __table_args__ = (
        UniqueConstraint("project", "session_id", "version", name="uq_rewards_session_version"),
        CheckConstraint("version >= 1", name="version_positive"),
        Index("ix_rewards_policy_version", "policy_version", "created_at"),
    )


class TrainingSample(Base):
    """One completion ready for the trainer, under one reward version."""

    __tablename__ = "training_samples"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    project: Mapped[str] = mapped_column(String(128))
    session_id: Mapped[str] = mapped_column(String(128))
    completion_id: Mapped[uuid.UUID]
    reward_id: Mapped[int] = mapped_column(ForeignKey("rewards.id", ondelete="CASCADE"))
    reward_version: Mapped[int] = mapped_column(Integer)
    policy_version: Mapped[str] = mapped_column(String(128))
    group_key: Mapped[str | None] = mapped_column(String(256))
    task: Mapped[str | None] = mapped_column(String(128))
    agent_role: Mapped[str] = mapped_column(String(64), server_default="agent")
    prompt_token_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    completion_token_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    loss_mask: Mapped[list[int]] = mapped_column(ARRAY(SmallInteger))
    """1 for a model-generated completion token that is trained, 0 otherwise."""
    behaviour_logprobs: Mapped[list[float]] = mapped_column(ARRAY(Float))
    reward: Mapped[float] = mapped_column(Float)
    components: Mapped[dict[str, Any]]
    sampling: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    """The completion's sampling parameters (``SamplingParams``): the distribution of ``behaviour_logprobs``."""
    created_at: Mapped[datetime] = _now()

    __table_args__ = (
        UniqueConstraint("completion_id", "reward_version", name="uq_training_samples_completion_version"),
        Index("ix_training_samples_policy_created", "policy_version", "created_at"),
        Index("ix_training_samples_session", "project", "session_id"),
        Index("ix_training_samples_created_at", "created_at"),
    )


class TrainingCycle(Base):
    """One run of the trainer, whatever its result (``skipped: <reason>`` included)."""

    __tablename__ = "training_cycles"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    trigger: Mapped[str] = mapped_column(String(32))
    """``beat``, ``manual`` or ``api``."""
    idempotency_key: Mapped[str | None] = mapped_column(String(128), unique=True)
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    parent_checkpoint_id: Mapped[str | None] = mapped_column(ForeignKey("checkpoints.id"))
    checkpoint_id: Mapped[str | None] = mapped_column(ForeignKey("checkpoints.id"))
    sample_ids: Mapped[list[int] | None] = mapped_column(ARRAY(BigInteger))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    started_at: Mapped[datetime] = _now()
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        CheckConstraint(_in("status", CYCLE_STATUSES), name="status_known"),
        Index("ix_training_cycles_started_at", "started_at"),
    )


class Checkpoint(Base):
    """A complete checkpoint on disk; the row is written only after its files are."""

    __tablename__ = "checkpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    policy_version: Mapped[str] = mapped_column(String(128), unique=True)
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("checkpoints.id"))
    base_model: Mapped[str] = mapped_column(String(512))
    path: Mapped[str] = mapped_column(String(1024))
    format: Mapped[str] = mapped_column(String(16))
    """``full`` (HF safetensors) or ``lora`` (peft adapter)."""
    status: Mapped[str] = mapped_column(String(16))
    status_reason: Mapped[str | None] = mapped_column(Text)
    data_window_start: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    data_window_end: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    n_samples: Mapped[int] = mapped_column(Integer, server_default="0")
    sample_ids_hash: Mapped[str | None] = mapped_column(String(64))
    config_hash: Mapped[str | None] = mapped_column(String(64))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    eval: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    created_at: Mapped[datetime] = _now()
    last_deployed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        CheckConstraint(_in("status", CHECKPOINT_STATUSES), name="status_known"),
        CheckConstraint("format IN ('full', 'lora')", name="format_known"),
        Index("ix_checkpoints_created_at", "created_at"),
    )


class Deployment(Base):
    """A checkpoint's place in a fleet: stable or canary, with its traffic weight, or ``pinned``: the
    frozen checkpoint that serves every request of one agent role (``agent_role``)."""

    __tablename__ = "deployments"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    fleet: Mapped[str] = mapped_column(String(64))
    checkpoint_id: Mapped[str] = mapped_column(ForeignKey("checkpoints.id"))
    role: Mapped[str] = mapped_column(String(16))
    agent_role: Mapped[str] = mapped_column(String(64), server_default="")
    """The agent role a ``pinned`` deployment serves (``''`` for stable and canary)."""
    weight: Mapped[float] = mapped_column(Float)
    """Share of new sessions routed to it, 0..1."""
    strategy: Mapped[str] = mapped_column(String(16), server_default="full")
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    created_by: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = _now()
    updated_at: Mapped[datetime] = _now()
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        CheckConstraint("role IN ('stable', 'canary', 'pinned')", name="role_known"),
        CheckConstraint("(role = 'pinned') = (agent_role <> '')", name="pin_has_agent_role"),
        CheckConstraint("weight >= 0 AND weight <= 1", name="weight_range"),
        CheckConstraint(_in("status", DEPLOYMENT_STATUSES), name="status_known"),
        CheckConstraint("strategy ~ '^[a-z][a-z0-9_]*$'", name="strategy_named"),  # a registered swap strategy
        Index(
            "uq_deployments_active_role",
            "fleet",
            "role",
            "agent_role",
            unique=True,
            postgresql_where=text("status = 'active'"),
        ),
    )


class Replica(Base):
    """One vLLM replica of a fleet: what it serves and whether the router may send it traffic.

    The hot swap owns this row: it sets ``draining`` (the router stops sending new requests),
    ``swapping`` (paused, weights being replaced), then ``serving`` with the new policy
    version, or ``failed`` with the reason. The router routes a new request to a replica only
    when its state is ``serving``, its own health checks pass and the replica's
    ``/weight_info`` agrees with ``policy_version``.
    """

    __tablename__ = "replicas"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    fleet: Mapped[str] = mapped_column(String(64))
    url: Mapped[str] = mapped_column(String(512), unique=True)
    state: Mapped[str] = mapped_column(String(16), server_default="serving")
    policy_version: Mapped[str | None] = mapped_column(String(128))
    checkpoint_id: Mapped[str | None] = mapped_column(ForeignKey("checkpoints.id"))
    deployment_id: Mapped[int | None] = mapped_column(ForeignKey("deployments.id"))
    """The deployment whose weights the replica serves (or is being swapped to)."""
    reason: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime] = _now()

    __table_args__ = (
        CheckConstraint(_in("state", REPLICA_STATES), name="state_known"),
        Index("ix_replicas_fleet", "fleet"),
    )


class Operation(Base):
    """A deployment action of the admin API (deploy, weight, promote, rollback), run in the background.

    The admin API process that accepted it (``owner``) runs it and renews ``heartbeat_at``
    while it is queued or running; one whose lease has lapsed is marked ``failed``
    (``error = 'abandoned'``) by any admin API process (``serving.admin.operations``).
    """

    __tablename__ = "operations"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    fleet: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(32))
    """The audit action it performs: ``deploy.canary``, ``deploy.weight``, ``deploy.promote``, ``deploy.rollback``."""
    state: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str] = mapped_column(String(128))
    params: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    """The request (checkpoint, weight, reason ...)."""
    owner: Mapped[str] = mapped_column(String(128))
    """The admin API process that runs it (``host:pid:nonce``)."""
    created_at: Mapped[datetime] = _now()
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime] = _now()
    """Renewed by ``owner`` while the operation is queued or running."""
    lease_s: Mapped[float] = mapped_column(Float)
    """How long after ``heartbeat_at`` the operation counts as abandoned (the owner's ``serving.operation_lease_s``)."""
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    """What the deployment function returned, once succeeded."""
    error: Mapped[str | None] = mapped_column(String(32))
    """Once failed: ``not_found``, ``conflict``, ``invalid``, ``failed``, ``internal`` or ``abandoned``."""
    reason: Mapped[str | None] = mapped_column(Text)
    """Once failed: why, in words."""

    __table_args__ = (
        CheckConstraint(_in("state", OPERATION_STATES), name="state_known"),
        CheckConstraint("lease_s > 0", name="lease_positive"),
        Index("ix_operations_created_at", "created_at"),
        Index(
            "uq_operations_active_fleet",
            "fleet",
            unique=True,
            postgresql_where=text("state IN ('queued', 'running')"),
        ),
    )


class ApiKey(Base):
    """A gateway write key (role ``writer``), a router product key (role ``product``), both scoped to one
    project, or an ops token; only the hash is stored."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    project: Mapped[str | None] = mapped_column(String(128))
    token_prefix: Mapped[str] = mapped_column(String(16))
    """First characters of the token, to recognise it in listings."""
    token_hash: Mapped[str] = mapped_column(String(128), unique=True)
    created_by: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = _now()
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    rate_per_s: Mapped[float | None] = mapped_column(Float)
    """A product key's own router rate limit (requests per second); None: ``serving.key_rate_per_s``."""
    burst: Mapped[int | None] = mapped_column(Integer)
    """A product key's own burst (requests above the rate); None: ``serving.key_burst``."""

    __table_args__ = (
        CheckConstraint(_in("role", ROLES), name="role_known"),
        CheckConstraint("role <> 'writer' OR project IS NOT NULL", name="writer_has_project"),
        CheckConstraint("role <> 'product' OR project IS NOT NULL", name="product_has_project"),
        CheckConstraint("rate_per_s IS NULL OR rate_per_s > 0", name="rate_positive"),
        CheckConstraint("burst IS NULL OR burst >= 1", name="burst_positive"),
    )


class AuditLog(Base):
    """Who did what, when, with the state before and after; append-only."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = _now()
    actor: Mapped[str] = mapped_column(String(128))
    """Token name, ``canary-controller``, ``trainer`` or ``cli:<user>``."""
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str | None] = mapped_column(String(256))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    success: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))

    __table_args__ = (Index("ix_audit_log_at", "at"), Index("ix_audit_log_action", "action", "at"))
