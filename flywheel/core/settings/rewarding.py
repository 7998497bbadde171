"""Settings: rewarding: the stream processor, the scoring (weights and extractor sections), detectors."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


def _default_weights() -> dict[str, float]:
    return {
        "outcome": 1.0,
        "user_signal": 0.5,
        "grm": 0.5,
        "shaping": 1.0,
        "parl": 0.0,
        "retrieval": 0.0,
        "summary": 1.0,
        "scores": 1.0,
    }


class ScoringSettings(BaseModel):
    """Everything that decides a reward's value; its hash is every reward row's ``config_hash``.

    Each extractor is a plug-in (entry-point group ``flywheel.reward_extractors``) that brings
    its own settings model; its section here is a plain mapping, validated against that model
    when the worker builds its extractors (``rewarding.extractors``). From the environment:
    ``FLYWHEEL_REWARDING__SCORING__EXTRACTORS__<NAME>__<FIELD>``, e.g.
    ``FLYWHEEL_REWARDING__SCORING__EXTRACTORS__GRM__TIMEOUT_S=10``.
    """

    weights: dict[str, float] = Field(default_factory=_default_weights)
    """Composite weight per extractor name; 0 (or absent) does not run it."""
    task_weights: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Per session task (SessionStart.task): weights that replace ``weights`` entry by entry."""
    trainable_roles: list[str] = Field(default_factory=lambda: ["agent", "orchestrator"], min_length=1)
    """Span roles whose completion tokens get loss-mask 1; other roles' samples are all-zero masks."""
    extractors: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Extractor name -> its settings section (fields of the extractor's own ``Settings`` model); an
    extractor without a section runs with its defaults."""


class ShiftBound(BaseModel):
    """How far a detector metric may move from the baseline policy version before it is flagged."""

    max_abs: float | None = Field(None, ge=0.0)
    """Largest allowed absolute change; None: not checked."""
    max_rel: float | None = Field(None, ge=0.0)
    """Largest allowed relative change (|new - old| / |old|); None: not checked."""


def _default_bounds() -> dict[str, ShiftBound]:
    return {
        "tool_error_rate": ShiftBound(max_abs=0.1),
        "clarifying_rate": ShiftBound(max_abs=0.1),
        "edit_rate": ShiftBound(max_abs=0.1),
        "mean_completion_tokens": ShiftBound(max_rel=0.5),
        "judge_disagreement_rate": ShiftBound(max_abs=0.15),
    }


class DetectorSettings(BaseModel):
    """Reward-hacking detectors: per-policy-version metrics and the shifts that get flagged."""

    bounds: dict[str, ShiftBound] = Field(default_factory=_default_bounds)
    """Metric name -> allowed shift against the baseline policy version."""
    min_sessions: int = Field(20, ge=1, le=10_000_000)
    """Fewest scored sessions of a policy version (and of its baseline) before a shift is flagged."""
    clarifying_pattern: str = Field(r"\?\s*$", min_length=1, max_length=512)
    """Regex: a completion without tool calls whose text matches it is a clarifying question."""
    window_s: float = Field(86400.0, gt=0.0, le=365 * 86400.0)
    """The worker's detector gauges cover rewards created within this many seconds."""
    refresh_s: float = Field(30.0, gt=0.0, le=86400.0)
    """How often the worker recomputes its detector gauges."""


class RewardingSettings(BaseModel):
    """The rewarding stream processor (faust), its windows, and the scoring configuration."""

    group_id: str = Field("flywheel-rewarding", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    """Faust app id: consumer group and table changelog prefix; scale out by starting more workers."""
    feedback_window_s: float = Field(600.0, ge=0.0, le=30 * 86400.0)
    """A session is first scored this long after its end; feedback arriving later makes a new version."""
    session_timeout_s: float = Field(3600.0, gt=0.0, le=30 * 86400.0)
    """A session that never ends is scored this long after its last event (reason ``timeout``)."""
    rescore_delay_s: float = Field(5.0, ge=0.0, le=86400.0)
    """Late events are gathered this long before the session is scored again."""
    state_retention_s: float = Field(7 * 86400.0, gt=0.0, le=365 * 86400.0)
    """A scored session's state is dropped this long after its last event (later events: ``recompute``)."""
    timer_interval_s: float = Field(0.5, gt=0.0, le=60.0)
    """How often each worker looks for sessions whose window closed."""
    finalize_batch_max: int = Field(500, ge=1, le=100_000)
    """Most sessions scored (and written in one transaction) at once; a tick scores chunks until none is due."""
    batch_max_events: int = Field(1000, ge=1, le=100_000)
    """Most events the agent takes from the stream at once."""
    batch_max_wait_s: float = Field(0.2, gt=0.0, le=10.0)
    """Longest the agent waits to fill a batch."""
    publish_scored: bool = True
    """Publish every new reward version, with its samples, on the ``rewards.scored`` topic."""
    session_timeout_broker_s: float = Field(10.0, ge=1.0, le=300.0)
    """Consumer-group session timeout (a killed worker's partitions move after this)."""
    rebalance_timeout_s: float = Field(10.0, ge=1.0, le=600.0)
    """Consumer-group rebalance timeout. Tansu's joins wait about half of session_timeout_broker_s, not this
    (docs/reliability.md, "Joining after a stop")."""
    max_poll_interval_s: float = Field(300.0, ge=1.0, le=3600.0)
    """Longest gap between polls before the broker drops the worker from its group."""
    commit_interval_s: float = Field(1.0, gt=0.0, le=60.0)
    """Offset commit interval."""
    rebalance_watchdog_s: float = Field(300.0, ge=0.0, le=86400.0)
    """A worker that stays in a rebalance (not recovering a table) this long exits (code 75)
    for its supervisor to restart it; 0 disables. The soak once left a CPU-starved worker
    wedged after its partitions were revoked, never rejoining its group."""
    fetch_max_wait_s: float = Field(0.1, gt=0.0, le=30.0)
    """Longest a fetch waits for new records (faust's fixed 1.5 s delays every record that long on Tansu)."""
    event_cache_size: int = Field(200_000, ge=0, le=100_000_000)
    """Parsed events kept in memory between consume and scoring (saves a re-parse)."""
    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Port of the worker's Prometheus endpoint; None disables it."""
    web_port: int | None = Field(None, ge=1, le=65535)
    """Port of faust's own web server; None disables it."""
    scoring: ScoringSettings = Field(default_factory=ScoringSettings)
    """Composite weights and extractor sections (hashed into ``config_hash``)."""
    detectors: DetectorSettings = Field(default_factory=DetectorSettings)
    """Reward-hacking detectors."""
