"""initial schema

Revision ID: 0001
Revises: (none)
Create Date: 2026-12-02 11:26:27.054229
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("project", sa.String(length=128), nullable=True),
        sa.Column("token_prefix", sa.String(length=16), nullable=False),
        sa.Column("token_hash", sa.String(length=128), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("role <> 'writer' OR project IS NOT NULL", name=op.f("ck_api_keys_writer_has_project")),
        sa.CheckConstraint("role IN ('viewer', 'operator', 'admin', 'writer')", name=op.f("ck_api_keys_role_known")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_keys_token_hash")),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=256), nullable=True),
        sa.Column("before", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("after", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column(
            "details", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column("success", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index("ix_audit_log_action", "audit_log", ["action", "at"], unique=False)
    op.create_index("ix_audit_log_at", "audit_log", ["at"], unique=False)
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("policy_version", sa.String(length=128), nullable=False),
        sa.Column("parent_id", sa.String(length=64), nullable=True),
        sa.Column("base_model", sa.String(length=512), nullable=False),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("format", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("data_window_start", sa.DateTime(timezone=True), nullable=True),
        sa.Column("data_window_end", sa.DateTime(timezone=True), nullable=True),
        sa.Column("n_samples", sa.Integer(), server_default="0", nullable=False),
        sa.Column("sample_ids_hash", sa.String(length=64), nullable=True),
        sa.Column("config_hash", sa.String(length=64), nullable=True),
        sa.Column(
            "metrics", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column(
            "eval", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("last_deployed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("format IN ('full', 'lora')", name=op.f("ck_checkpoints_format_known")),
        sa.CheckConstraint(
            "status IN ('candidate', 'rejected', 'deployed', 'retired', 'deleted')",
            name=op.f("ck_checkpoints_status_known"),
        ),
        sa.ForeignKeyConstraint(["parent_id"], ["checkpoints.id"], name=op.f("fk_checkpoints_parent_id_checkpoints")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("policy_version", name=op.f("uq_checkpoints_policy_version")),
    )
    op.create_index("ix_checkpoints_created_at", "checkpoints", ["created_at"], unique=False)
    op.create_table(
        "dead_letters",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.Column("topic", sa.String(length=256), nullable=True),
        sa.Column("kafka_partition", sa.Integer(), nullable=True),
        sa.Column("kafka_offset", sa.BigInteger(), nullable=True),
        sa.Column("key", sa.LargeBinary(), nullable=True),
        sa.Column("value", sa.LargeBinary(), nullable=True),
        sa.Column("field", sa.String(length=256), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("project", sa.String(length=128), nullable=True),
        sa.Column("received_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dead_letters")),
        sa.UniqueConstraint("topic", "kafka_partition", "kafka_offset", name="uq_dead_letters_position"),
    )
    op.create_index("ix_dead_letters_received_at", "dead_letters", ["received_at"], unique=False)
    op.create_table(
        "raw_events",
        sa.Column("event_id", sa.UUID(), nullable=False),
        sa.Column("project", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("type", sa.String(length=32), nullable=False),
        sa.Column("schema_version", sa.SmallInteger(), nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("payload", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("source", sa.String(length=32), server_default="kafka", nullable=False),
        sa.Column("kafka_partition", sa.Integer(), nullable=True),
        sa.Column("kafka_offset", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("event_id", name=op.f("pk_raw_events")),
    )
    op.create_index("ix_raw_events_session", "raw_events", ["project", "session_id", "occurred_at"], unique=False)
    op.create_index("ix_raw_events_type_time", "raw_events", ["type", "occurred_at"], unique=False)
    op.create_table(
        "rewards",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("project", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=False),
        sa.Column("components", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("extractor_versions", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("config_hash", sa.String(length=64), nullable=False),
        sa.Column("policy_version", sa.String(length=128), nullable=True),
        sa.Column("reason", sa.String(length=64), server_default="finalized", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("version >= 1", name=op.f("ck_rewards_version_positive")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rewards")),
        sa.UniqueConstraint("project", "session_id", "version", name="uq_rewards_session_version"),
    )
    op.create_index("ix_rewards_policy_version", "rewards", ["policy_version", "created_at"], unique=False)
    op.create_table(
        "sessions",
        sa.Column("project", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=128), nullable=True),
        sa.Column("agent", sa.String(length=128), nullable=True),
        sa.Column("task", sa.String(length=128), nullable=True),
        sa.Column("group_key", sa.String(length=256), nullable=True),
        sa.Column(
            "metadata", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("status", sa.String(length=32), server_default="open", nullable=False),
        sa.Column(
            "policy_versions", postgresql.ARRAY(sa.String(length=128)), server_default=sa.text("'{}'"), nullable=False
        ),
        sa.Column("n_events", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_event_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("project", "session_id", name=op.f("pk_sessions")),
    )
    op.create_index("ix_sessions_ended_at", "sessions", ["ended_at"], unique=False)
    op.create_table(
        "deployments",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("fleet", sa.String(length=64), nullable=False),
        sa.Column("checkpoint_id", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("strategy", sa.String(length=16), server_default="full", nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_by", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("role IN ('stable', 'canary')", name=op.f("ck_deployments_role_known")),
        sa.CheckConstraint(
            "status IN ('pending', 'active', 'promoted', 'rolled_back', 'failed', 'superseded')",
            name=op.f("ck_deployments_status_known"),
        ),
        sa.CheckConstraint("strategy IN ('full', 'lora')", name=op.f("ck_deployments_strategy_known")),
        sa.CheckConstraint("weight >= 0 AND weight <= 1", name=op.f("ck_deployments_weight_range")),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_deployments_checkpoint_id_checkpoints")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployments")),
    )
    op.create_index(
        "uq_deployments_active_role",
        "deployments",
        ["fleet", "role"],
        unique=True,
        postgresql_where=sa.text("status = 'active'"),
    )
    op.create_table(
        "training_cycles",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("trigger", sa.String(length=32), nullable=False),
        sa.Column("idempotency_key", sa.String(length=128), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("parent_checkpoint_id", sa.String(length=64), nullable=True),
        sa.Column("checkpoint_id", sa.String(length=64), nullable=True),
        sa.Column("sample_ids", postgresql.ARRAY(sa.BigInteger()), nullable=True),
        sa.Column(
            "metrics", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column("started_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('running', 'skipped', 'failed', 'candidate', 'rejected')",
            name=op.f("ck_training_cycles_status_known"),
        ),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_training_cycles_checkpoint_id_checkpoints")
        ),
        sa.ForeignKeyConstraint(
            ["parent_checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_training_cycles_parent_checkpoint_id_checkpoints"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_cycles")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_training_cycles_idempotency_key")),
    )
    op.create_index("ix_training_cycles_started_at", "training_cycles", ["started_at"], unique=False)
    op.create_table(
        "training_samples",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("project", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("completion_id", sa.UUID(), nullable=False),
        sa.Column("reward_id", sa.BigInteger(), nullable=False),
        sa.Column("reward_version", sa.Integer(), nullable=False),
        sa.Column("policy_version", sa.String(length=128), nullable=False),
        sa.Column("group_key", sa.String(length=256), nullable=True),
        sa.Column("task", sa.String(length=128), nullable=True),
        sa.Column("agent_role", sa.String(length=64), server_default="agent", nullable=False),
        sa.Column("prompt_token_ids", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.Column("completion_token_ids", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.Column("loss_mask", postgresql.ARRAY(sa.SmallInteger()), nullable=False),
        sa.Column("behaviour_logprobs", postgresql.ARRAY(sa.Float()), nullable=False),
        sa.Column("reward", sa.Float(), nullable=False),
        sa.Column("components", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(
            ["reward_id"], ["rewards.id"], name=op.f("fk_training_samples_reward_id_rewards"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_samples")),
        sa.UniqueConstraint("completion_id", "reward_version", name="uq_training_samples_completion_version"),
    )
    op.create_index(
        "ix_training_samples_policy_created", "training_samples", ["policy_version", "created_at"], unique=False
    )
    op.create_index("ix_training_samples_session", "training_samples", ["project", "session_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_training_samples_session", table_name="training_samples")
    op.drop_index("ix_training_samples_policy_created", table_name="training_samples")
    op.drop_table("training_samples")
    op.drop_index("ix_training_cycles_started_at", table_name="training_cycles")
    op.drop_table("training_cycles")
    op.drop_index("uq_deployments_active_role", table_name="deployments", postgresql_where=sa.text("status = 'active'"))
    op.drop_table("deployments")
    op.drop_index("ix_sessions_ended_at", table_name="sessions")
    op.drop_table("sessions")
    op.drop_index("ix_rewards_policy_version", table_name="rewards")
    op.drop_table("rewards")
    op.drop_index("ix_raw_events_type_time", table_name="raw_events")
    op.drop_index("ix_raw_events_session", table_name="raw_events")
    op.drop_table("raw_events")
    op.drop_index("ix_dead_letters_received_at", table_name="dead_letters")
    op.drop_table("dead_letters")
    op.drop_index("ix_checkpoints_created_at", table_name="checkpoints")
    op.drop_table("checkpoints")
    op.drop_index("ix_audit_log_at", table_name="audit_log")
    op.drop_index("ix_audit_log_action", table_name="audit_log")
    op.drop_table("audit_log")
    op.drop_table("api_keys")
