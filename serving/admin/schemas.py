"""Request and response bodies of the admin API (``serving.admin``), and the conversions into them.

These are the API's own models, apart from the tables (``flywheel.core.db.models``): ``XCreate``
is what a client sends, ``XPublic`` what it gets back. Request models forbid unknown
fields, so a misspelt field is refused with its name instead of being ignored. The
functions at the end turn registry rows and the fleet's own objects into these models.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from flywheel.core.contracts.checkpoint import CheckpointEval

if TYPE_CHECKING:
    from flywheel.core.db.models import AuditLog, Checkpoint, Operation
    from flywheel.core.pause import PauseState

OPS_ROLES = ("viewer", "operator", "admin")
"""Roles accepted on the admin API, weakest first (each includes the ones before it)."""
TOKEN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@-]*$"
"""Token names: letters, digits and ``._@-`` (they appear in the audit log as ``token:<name>``)."""
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:+-]*$"
"""Checkpoint ids (``c000042-1a2b3c4d``, a base model's ``base-1a2b3c4d5e6f``): no spaces or control characters."""
TEXT_PATTERN = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*$"
"""Free text (reasons): any characters but control characters other than tab and newlines
(Postgres refuses NUL in text and JSONB, so it is refused here with the field's name)."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- errors


class ErrorPublic(BaseModel):
    """Every error the admin API returns: a machine-readable kind and a sentence naming what is wrong."""

    error: str
    """``unauthorized``, ``forbidden``, ``not_found``, ``conflict``, ``invalid``, ``failed`` or ``internal``."""
    reason: str
    """What is wrong, in words."""
    required_role: str | None = None
    """On 403: the role the route needs."""
    errors: list[dict[str, Any]] | None = None
    """On 422 from request validation: one entry per invalid field (``loc``, ``msg``, ``type``)."""
    operation_id: str | None = None
    """When a deployment operation ran and failed (``?wait=true``): its id (``GET /v1/operations/{id}``)."""


# --------------------------------------------------------------------------- checkpoints


class HeldoutEvalPublic(BaseModel):
    """A checkpoint's held-out evaluation, as its eval gate (or the base model's build) measured it."""

    success_rate: float | None = None
    """Held-out success rate of the checkpoint."""
    n: int | None = None
    """Problems evaluated."""
    key: str | None = None
    """Evaluation setup (task version, n, seed, temperature, max tokens)."""
    gate_passed: bool | None = None
    """Whether the eval gate let it serve (None for a root checkpoint)."""
    gate_reason: str | None = None
    """The gate's verdict in words."""


class CheckpointPublic(BaseModel):
    """One checkpoint of the registry, as listed."""

    id: str
    policy_version: str
    parent_id: str | None
    status: str
    """``candidate``, ``rejected``, ``deployed``, ``retired`` or ``deleted``."""
    status_reason: str | None
    format: str
    """``full`` or ``lora``."""
    n_samples: int
    created_at: datetime
    last_deployed_at: datetime | None
    heldout: HeldoutEvalPublic | None
    """Held-out evaluation summary; None when none was recorded."""


class CheckpointDetailPublic(CheckpointPublic):
    """One checkpoint with everything the registry records of it."""

    base_model: str
    path: str
    data_window_start: datetime | None
    data_window_end: datetime | None
    config_hash: str | None
    sample_ids_hash: str | None
    metrics: dict[str, Any]
    eval: dict[str, Any]


class CheckpointPage(BaseModel):
    """A page of checkpoints, newest first."""

    items: list[CheckpointPublic]
    total: int
    """Checkpoints matching the filter, over all pages."""
    limit: int
    offset: int


# --------------------------------------------------------------------------- deployments


class CanaryCreate(_Request):
    """Deploy a checkpoint as the fleet's canary."""

    checkpoint_id: str = Field(min_length=1, max_length=64, pattern=ID_PATTERN)
    """Registry id of the checkpoint."""
    weight: float = Field(0.05, gt=0.0, le=1.0)
    """Share of new sessions routed to the canary, in (0, 1]."""


class WeightUpdate(_Request):
    """Change the canary's traffic weight."""

    weight: float = Field(gt=0.0, le=1.0)
    """Share of new sessions routed to the canary, in (0, 1] (to stop it, roll back)."""
    reason: str | None = Field(None, max_length=500, pattern=TEXT_PATTERN)
    """Why (kept in the audit log)."""


class PromoteRequest(_Request):
    """Promote the canary to stable."""

    reason: str | None = Field(None, max_length=500, pattern=TEXT_PATTERN)
    """Why (kept in the audit log)."""


class RollbackRequest(_Request):
    """Roll the fleet back."""

    to_checkpoint_id: str | None = Field(None, min_length=1, max_length=64, pattern=ID_PATTERN)
    """Checkpoint to serve as stable; None ends the canary (or returns to the previous stable)."""
    reason: str | None = Field(None, max_length=500, pattern=TEXT_PATTERN)
    """Why (kept in the audit log)."""


class PinCreate(_Request):
    """Pin an agent role to a checkpoint: every request of the role is served by it."""

    checkpoint_id: str = Field(min_length=1, max_length=128, pattern=ID_PATTERN)
    """Registry id or policy version of the checkpoint."""
    reason: str | None = Field(None, max_length=500, pattern=TEXT_PATTERN)
    """Why (kept in the audit log)."""


class DeploymentPublic(BaseModel):
    """A deployment: a checkpoint's place in a fleet (stable, canary, or pinned to an agent role)."""

    model_config = ConfigDict(extra="allow")

    id: int
    fleet: str
    checkpoint_id: str
    policy_version: str | None = None
    role: str
    """``stable``, ``canary`` or ``pinned``."""
    agent_role: str | None = None
    """The agent role a ``pinned`` deployment serves."""
    weight: float
    """Share of new sessions routed to it, 0..1."""
    strategy: str | None = None
    status: str
    """``pending``, ``active``, ``promoted``, ``rolled_back``, ``failed``, ``superseded`` or ``unpinned``."""
    reason: str | None = None
    created_by: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    ended_at: datetime | None = None


class ReplicaPublic(BaseModel):
    """A vLLM replica of the fleet and what it serves."""

    model_config = ConfigDict(extra="allow")

    id: int | None = None
    """The replica's public id: what the router tells its clients (``x-flywheel-replica``, ``/ready``,
    error messages) and its metrics' ``replica`` label. ``url`` is shown to ops only."""
    url: str
    state: str
    """``serving``, ``draining``, ``swapping`` or ``failed``."""
    policy_version: str | None = None
    checkpoint_id: str | None = None
    deployment_id: int | None = None
    reason: str | None = None
    updated_at: datetime | None = None


class FleetPublic(BaseModel):
    """What a fleet serves: its stable and canary deployments and its replicas."""

    model_config = ConfigDict(extra="allow")

    fleet: str
    stable: DeploymentPublic | None = None
    canary: DeploymentPublic | None = None
    """The active canary, else a pending one (being deployed), else None."""
    replicas: list[ReplicaPublic] = Field(default_factory=list)
    pins: list[DeploymentPublic] = Field(default_factory=list)
    """Active and pending role pins, by agent role."""


class DeployResultPublic(BaseModel):
    """What a deployment action did: the fleet's deployments after it, what it ended, the swaps it ran."""

    model_config = ConfigDict(extra="allow")

    action: str
    """The audit-log action (``deploy.canary``, ``deploy.weight``, ``deploy.promote``, ``deploy.rollback``,
    ``deploy.pin``, ``deploy.unpin``)."""
    actor: str
    """Who, as the audit log records it (``token:<name>``)."""
    fleet: str
    stable: DeploymentPublic | None = None
    canary: DeploymentPublic | None = None
    pins: list[DeploymentPublic] = Field(default_factory=list)
    """Active and pending role pins after it."""
    ended: list[dict[str, Any]] = Field(default_factory=list)
    """Deployments this action ended (id, checkpoint, role, status, reason)."""
    swaps: list[dict[str, Any]] = Field(default_factory=list)
    """Per replica: from/to version, ok, reverted, reason and the drain/pause/total times."""


# --------------------------------------------------------------------------- operations


class OperationPublic(BaseModel):
    """A deployment operation (deploy, weight, promote, rollback) and how it went."""

    id: str
    """Its id (``GET /v1/operations/{id}``)."""
    kind: str
    """The audit action it performs: ``deploy.canary``, ``deploy.weight``, ``deploy.promote``, ``deploy.rollback``."""
    fleet: str
    state: Literal["queued", "running", "succeeded", "failed"]
    actor: str
    """Who asked, as the audit log records it (``token:<name>``)."""
    params: dict[str, Any]
    """The request (checkpoint, weight, reason ...)."""
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    owner: str
    """The admin API process that runs it (``host:pid:nonce``)."""
    heartbeat_at: datetime
    """Last renewal of its lease by ``owner`` (while queued or running)."""
    lease_s: float
    """Unrenewed this long, a queued or running operation is failed as ``abandoned``."""
    result: DeployResultPublic | None = None
    """Once succeeded: what the action did (the deployments after it, what it ended, each replica's swap)."""
    error: str | None = None
    """Once failed: ``not_found``, ``conflict``, ``invalid``, ``failed`` (a swap), ``internal`` or ``abandoned``."""
    reason: str | None = None
    """Once failed: why, in words."""


class OperationPage(BaseModel):
    """Operations, newest first."""

    items: list[OperationPublic]
    limit: int


# --------------------------------------------------------------------------- pause flags


class PauseRequest(_Request):
    """Pause or resume the trainer or the canary controller."""

    reason: str | None = Field(None, max_length=500, pattern=TEXT_PATTERN)
    """Why (kept in the audit log)."""


class PauseStatePublic(BaseModel):
    """A pause flag: the newest pause/resume entry of the audit log."""

    paused: bool
    actor: str | None = None
    at: datetime | None = None
    reason: str | None = None


class CanaryDecisionPublic(BaseModel):
    """A decision of the canary controller: its ``canary.decision`` audit entry (every number is in the audit log)."""

    at: datetime
    """When it was decided."""
    target: str | None = None
    """The canary deployment it was about (``deployment:<id>``)."""
    action: str | None = None
    """``hold``, ``step_up``, ``promote`` or ``rollback``."""
    reason: str | None = None
    """The decision in one line, with its numbers."""
    success: bool
    """Whether its action went through."""
    error: str | None = None
    """Why the action failed, when it did."""


class CanaryStatusPublic(BaseModel):
    """The canary controller's flag and the fleet's current canary."""

    fleet: str
    enabled: bool
    """``serving.canary.enabled`` of this admin API's settings."""
    controller: PauseStatePublic
    """Paused through ``flywheel canary pause`` (the audit log)."""
    canary: DeploymentPublic | None
    """The active (else pending) canary deployment, if any."""
    stable: DeploymentPublic | None
    """The active stable deployment, if any."""
    last_decision: CanaryDecisionPublic | None = None
    """The controller's newest decision about a canary of this fleet, if any."""


class StatusPublic(BaseModel):
    """Everything ``flywheel status`` shows of the serving side."""

    fleet: FleetPublic
    """``serving.fleet.registry.fleet_status`` of this API's fleet."""
    trainer: PauseStatePublic
    canary_controller: PauseStatePublic


# --------------------------------------------------------------------------- audit log


class AuditPublic(BaseModel):
    """One audit-log entry."""

    id: int
    at: datetime
    actor: str
    action: str
    target: str | None
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    details: dict[str, Any]
    success: bool


class AuditPage(BaseModel):
    """Audit-log entries, newest first."""

    items: list[AuditPublic]
    limit: int
    offset: int


# --------------------------------------------------------------------------- tokens


class TokenCreate(_Request):
    """A new ops token."""

    name: str = Field(min_length=1, max_length=64, pattern=TOKEN_NAME_PATTERN)
    """Who or what holds it; unique among active tokens (audit rows say ``token:<name>``)."""
    role: Literal["viewer", "operator", "admin"]
    """viewer reads; operator also deploys, changes weights, promotes, rolls back, pauses; admin also manages tokens."""


class TokenPublic(BaseModel):
    """An API token as listed: never the token itself."""

    id: int
    name: str
    role: str
    project: str | None
    token_prefix: str
    """First characters of the token, to recognise it."""
    created_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None
    active: bool


class TokenCreated(TokenPublic):
    """A token just created: ``token`` is shown this once and never again."""

    token: str


class TokenList(BaseModel):
    """API tokens, newest first."""

    items: list[TokenPublic]


# --------------------------------------------------------------------------- conversions


def heldout_summary(eval_: dict[str, Any] | None) -> HeldoutEvalPublic | None:
    """The held-out evaluation of a checkpoint's ``eval`` column: its gate's, else the first cached one by key."""
    evaluation = CheckpointEval.parse(eval_)
    gate = evaluation.gate
    if gate is not None:
        return HeldoutEvalPublic(
            success_rate=gate.candidate.success_rate,
            n=gate.candidate.n,
            key=gate.key,
            gate_passed=gate.passed,
            gate_reason=gate.reason,
        )
    if not evaluation.heldout:
        return None
    key = min(evaluation.heldout)
    result = evaluation.heldout[key]
    return HeldoutEvalPublic(success_rate=result.success_rate, n=result.n, key=key)


def checkpoint_public(row: Checkpoint) -> CheckpointPublic:
    """A registry row as listed."""
    return CheckpointPublic(
        id=row.id,
        policy_version=row.policy_version,
        parent_id=row.parent_id,
        status=row.status,
        status_reason=row.status_reason,
        format=row.format,
        n_samples=row.n_samples,
        created_at=row.created_at,
        last_deployed_at=row.last_deployed_at,
        heldout=heldout_summary(row.eval),
    )


def checkpoint_detail(row: Checkpoint) -> CheckpointDetailPublic:
    """A registry row with everything recorded."""
    return CheckpointDetailPublic(
        **checkpoint_public(row).model_dump(),
        base_model=row.base_model,
        path=row.path,
        data_window_start=row.data_window_start,
        data_window_end=row.data_window_end,
        config_hash=row.config_hash,
        sample_ids_hash=row.sample_ids_hash,
        metrics=row.metrics or {},
        eval=row.eval or {},
    )


def decision_public(row: AuditLog) -> CanaryDecisionPublic:
    """A ``canary.decision`` audit row as answered."""
    details = row.details or {}
    return CanaryDecisionPublic(
        at=row.at,
        target=row.target,
        action=details.get("action"),
        reason=details.get("reason"),
        success=row.success,
        error=details.get("error"),
    )


def pause_public(state: PauseState) -> PauseStatePublic:
    """A pause flag (:mod:`flywheel.core.pause`) as answered."""
    return PauseStatePublic(paused=state.paused, actor=state.actor, at=state.at, reason=state.reason)


def as_dict(value: Any) -> dict[str, Any]:
    """A fleet object (``to_dict()``) or a dict as a dict; anything else as ``{"value": value}``."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    return value if isinstance(value, dict) else {"value": value}


def operation_public(row: Operation) -> OperationPublic:
    """An ``operations`` row as answered."""
    return OperationPublic(
        id=str(row.id),
        kind=row.kind,
        fleet=row.fleet,
        state=row.state,  # type: ignore[arg-type]  # the table's check constraint
        actor=row.actor,
        params=row.params or {},
        created_at=row.created_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        owner=row.owner,
        heartbeat_at=row.heartbeat_at,
        lease_s=row.lease_s,
        result=DeployResultPublic.model_validate(row.result) if row.result is not None else None,
        error=row.error,
        reason=row.reason,
    )


def deploy_result(action: str, actor: str, result: Any) -> DeployResultPublic:
    """What a ``serving.fleet.deploy`` operation returned, under its audit action and actor."""
    return DeployResultPublic(action=action, actor=actor, **as_dict(result))
