"""The answer of ``GET /v1/dashboard`` (:class:`DashboardPublic`), as typed models for the OpenAPI schema.

Every model allows extra fields, so a number added to the data later reaches the page
without a schema change; the fields listed here are the ones the page relies on.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Public(BaseModel):
    model_config = ConfigDict(extra="allow")


class CheckpointViewPublic(_Public):
    """One checkpoint on the timeline, with its lineage, status and numbers."""

    id: str
    policy_version: str
    parent_id: str | None
    """The checkpoint it was trained from (None for the base model)."""
    status: str
    """candidate, rejected, deployed, retired or deleted."""
    created_at: datetime
    heldout: float | None
    """Held-out success rate (the eval gate's, or the base model's from its build)."""
    live_sessions: int = 0
    """Scored sessions this version served (newest reward version per session)."""
    live_success: float | None = None
    live_reward: float | None = None
    deployed_as: str | None = None
    """``stable`` or ``canary`` while it has an active deployment."""


class TrafficPublic(_Public):
    """The share of new sessions a deployment gets."""

    role: str
    policy_version: str | None
    checkpoint_id: str | None
    weight: float = Field(ge=0.0, le=1.0)


class ComparisonPointPublic(_Public):
    """One earlier decision about the same canary: estimate and bounds over time."""

    at: datetime
    action: str | None
    estimate: float | None
    lower: float | None
    upper: float | None
    n_canary: int | None


class ComparisonPublic(_Public):
    """The canary controller's newest decision: canary minus stable on its metric, with always-valid bounds."""

    at: datetime
    target: str | None
    deployment_id: int | None
    current: bool
    """Whether it is about the fleet's active canary (else the last canary's, now ended)."""
    action: str | None
    reason: str | None
    metric: str | None
    estimate: float | None
    lower: float | None
    upper: float | None
    n_canary: int | None
    n_stable: int | None
    margin: float | None
    """The non-inferiority margin that applied at the canary's step."""
    non_inferiority_margin: float
    """The margin for promotion (settings)."""
    regression_margin: float
    history: list[ComparisonPointPublic] = Field(default_factory=list)


class LagPublic(_Public):
    """One pipeline stage's backlog; ``value`` is None (with ``reason``) when it cannot be measured."""

    value: int | None
    unit: str
    reason: str | None = None


class PipelineLagPublic(_Public):
    """Backlogs: the ingest consumer group on the broker, rewarding, training."""

    kafka: LagPublic
    rewarding: LagPublic
    trainer: LagPublic


class ViewerPublic(_Public):
    """Who asked (the token's name and role)."""

    name: str
    role: str


class DashboardPublic(_Public):
    """Everything the dashboard draws, read at one moment."""

    generated_at: datetime
    fleet: str
    stable: dict[str, Any] | None
    """The active stable deployment (``serving.fleet.registry.DeploymentInfo``)."""
    canary: dict[str, Any] | None
    """The active (or pending) canary deployment."""
    replicas: list[dict[str, Any]]
    traffic: list[TrafficPublic]
    checkpoints: list[CheckpointViewPublic]
    canary_comparison: ComparisonPublic | None
    lag: PipelineLagPublic
    counts: dict[str, Any]
    last_cycle: dict[str, Any] | None
    paused: dict[str, Any]
    """Pause flags of the trainer and of the canary controller."""
    events: list[dict[str, Any]]
    """The newest deployment changes and canary decisions of the audit log, newest first."""
    viewer: ViewerPublic | None = None
