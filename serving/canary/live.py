"""Live observations per policy version, read from Postgres in one query per look.

The unit is the *session* (the router is sticky by session, so sessions are what is
randomised between the arms). Over the newest reward version of every session rewarded
since the canary deployment was created (``rewards``, by ``ix_rewards_policy_version``:
``policy_version IN (canary, stable) AND created_at >= since``), per arm:

- **success**: the outcome extractor's value (``components.outcome.value``, see
  :mod:`rewarding.extractors.outcome`) is at least ``canary.success_threshold``; a session
  without an outcome value is not counted for success;
- **reward**: the composite reward clipped to ``[reward_min, reward_max]`` and rescaled to
  ``[0, 1]`` (the bounded confidence sequence needs a known range);
- **error_rate**: the session ended ``failed`` (``sessions.status``, from its SessionEnd
  event; sessions still open are not counted) — the failed-request signal the events
  carry;
- **latency**: the session's mean completion ``latency_ms`` (the SDK's wall time per
  request, from the ``completion`` raw events by ``ix_raw_events_session``); the guard
  compares the share of sessions slower than the *stable* arm's ``latency_quantile`` (p95),
  which is about 5 % for stable by construction;
- **detectors** (:mod:`rewarding.detectors`, the counts every reward row carries in
  ``components._meta.stats``): per session ``tool_errors / tool_results``,
  ``clarifying / completions``, ``edited`` and, for judged sessions, ``grm_disagree``. These
  are session-level means (each session weighs the same), where the detector report pools
  counts; ``mean_completion_tokens`` is reported, not guarded (it has no natural bound).

A late reward version (feedback after the window) replaces its session's earlier value at
the next look. The test treats the current values as the data; strictly, a revised past
observation is outside the sequential model, so the guarantee is approximate where many
sessions are revised late (each session's *final* value is still one draw per session).

Everything is aggregated in the database (count, sum, sum of squares per arm and metric:
the sufficient statistics of :class:`serving.canary.stats.ArmStats`), so a look transfers
two rows whatever the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from flywheel.core.settings import CanarySettings, DetectorSettings
from serving.canary.policy import GuardInput, Observations
from serving.canary.stats import ArmStats

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

GUARDED = ("error_rate", "slow_rate", "tool_error_rate", "clarifying_rate", "edit_rate", "judge_disagreement_rate")
"""Per-session metrics in [0, 1] (higher is worse) aggregated per arm."""
METRICS = ("success", "reward01", *GUARDED)

LIVE_SQL = """
WITH latest AS (
    SELECT DISTINCT ON (r.project, r.session_id)
           r.project, r.session_id, r.policy_version, r.reward, r.components, r.created_at
    FROM rewards r
    WHERE r.policy_version IN (:canary, :stable) AND r.created_at >= :since
    ORDER BY r.project, r.session_id, r.version DESC
), per AS (
    SELECT
        CASE WHEN l.policy_version = :canary THEN 'canary' ELSE 'stable' END AS arm,
        l.created_at >= :step_since AS at_step,
        CASE WHEN jsonb_typeof(l.components -> 'outcome' -> 'value') = 'number' THEN
            CASE WHEN (l.components -> 'outcome' ->> 'value')::float8 >= :threshold THEN 1.0 ELSE 0.0 END
        END AS success,
        LEAST(GREATEST((l.reward - :reward_min) / (:reward_max - :reward_min), 0.0), 1.0) AS reward01,
        CASE WHEN s.status IN ('completed', 'failed', 'abandoned', 'timeout') THEN
            CASE WHEN s.status = 'failed' THEN 1.0 ELSE 0.0 END
        END AS error_rate,
        lat.mean_ms AS latency_ms,
        COALESCE(l.components -> '_meta' -> 'stats', '{{}}'::jsonb) AS st
    FROM latest l
    LEFT JOIN sessions s ON s.project = l.project AND s.session_id = l.session_id
    LEFT JOIN LATERAL (
        SELECT avg(NULLIF((e.payload ->> 'latency_ms')::float8, 0.0)) AS mean_ms
        FROM raw_events e
        WHERE e.project = l.project AND e.session_id = l.session_id AND e.type = 'completion'
    ) lat ON true
), ref AS (
    SELECT percentile_cont(:quantile) WITHIN GROUP (ORDER BY latency_ms) AS threshold_ms,
           count(latency_ms) AS n_ref
    FROM per WHERE arm = 'stable'
), m AS (
    SELECT
        per.arm, per.at_step, per.success, per.reward01, per.error_rate, per.latency_ms,
        CASE WHEN per.latency_ms IS NOT NULL AND ref.n_ref >= :min_ref THEN
            CASE WHEN per.latency_ms > ref.threshold_ms THEN 1.0 ELSE 0.0 END
        END AS slow_rate,
        CASE WHEN (st ->> 'tool_results')::float8 > 0 THEN
            LEAST((st ->> 'tool_errors')::float8 / (st ->> 'tool_results')::float8, 1.0)
        END AS tool_error_rate,
        CASE WHEN (st ->> 'completions')::float8 > 0 THEN
            LEAST((st ->> 'clarifying')::float8 / (st ->> 'completions')::float8, 1.0)
        END AS clarifying_rate,
        LEAST(GREATEST((st ->> 'edited')::float8, 0.0), 1.0) AS edit_rate,
        CASE WHEN (st ->> 'grm_scored')::float8 > 0 THEN
            LEAST(GREATEST((st ->> 'grm_disagree')::float8, 0.0), 1.0)
        END AS judge_disagreement_rate,
        CASE WHEN (st ->> 'completions')::float8 > 0 THEN
            (st ->> 'completion_tokens')::float8 / (st ->> 'completions')::float8
        END AS mean_completion_tokens
    FROM per CROSS JOIN ref
)
SELECT
    m.arm,
    count(*) AS sessions,
    count({primary}) FILTER (WHERE m.at_step) AS primary_at_step,
    {aggregates},
    percentile_cont(:quantile) WITHIN GROUP (ORDER BY m.latency_ms) AS latency_q_ms,
    avg(m.mean_completion_tokens) AS mean_completion_tokens,
    max(ref.threshold_ms) AS latency_threshold_ms,
    max(ref.n_ref) AS latency_reference_n
FROM m CROSS JOIN ref
GROUP BY m.arm
"""


def _aggregates() -> str:
    parts = []
    for name in METRICS:
        parts.append(f"count(m.{name}) AS {name}_n, sum(m.{name}) AS {name}_sum, sum(m.{name} * m.{name}) AS {name}_sq")
    return ",\n    ".join(parts)


def live_sql(metric: str) -> str:
    """The look's query for primary ``metric`` (``success`` or ``reward``)."""
    primary = {"success": "m.success", "reward": "m.reward01"}[metric]
    return LIVE_SQL.format(primary=primary, aggregates=_aggregates())


@dataclass(frozen=True)
class ArmLive:
    """One arm's aggregates."""

    sessions: int = 0
    """Sessions rewarded since the deployment (whatever their metrics)."""
    primary_at_step: int = 0
    """Sessions with a primary-metric value rewarded since the current step began."""
    metrics: dict[str, ArmStats] = field(default_factory=dict)
    latency_q_ms: float | None = None
    mean_completion_tokens: float | None = None

    def stats(self, name: str) -> ArmStats:
        """Statistics of metric ``name`` (empty when the arm has none)."""
        return self.metrics.get(name, ArmStats())


@dataclass(frozen=True)
class LiveData:
    """Both arms' aggregates at one look."""

    canary: ArmLive
    stable: ArmLive
    latency_threshold_ms: float | None
    latency_reference_n: int

    def observations(self, settings: CanarySettings, detectors: DetectorSettings, elapsed_s: float) -> Observations:
        """The policy's input: primary metric, guards with their margins, step sample, time."""
        primary = "success" if settings.metric == "success" else "reward01"
        guards = {
            "error_rate": GuardInput(
                self.canary.stats("error_rate"), self.stable.stats("error_rate"), settings.error_margin
            ),
            "latency_p95": GuardInput(
                self.canary.stats("slow_rate"),
                self.stable.stats("slow_rate"),
                settings.latency_margin,
                {
                    "quantile": settings.latency_quantile,
                    "canary_latency_q_ms": _r(self.canary.latency_q_ms),
                    "stable_latency_q_ms": _r(self.stable.latency_q_ms),
                    "threshold_ms": _r(self.latency_threshold_ms),
                    "reference_n": self.latency_reference_n,
                },
            ),
        }
        for name in settings.detector_guards:
            bound = detectors.bounds.get(name)
            if bound is None or bound.max_abs is None:
                raise ValueError(
                    f"canary.detector_guards names {name!r}, which has no "
                    f"rewarding.detectors.bounds[{name!r}].max_abs margin"
                )
            if name not in GUARDED:
                known = ", ".join(GUARDED[2:])
                raise ValueError(f"canary.detector_guards: {name!r} is not a per-session detector metric ({known})")
            guards[name] = GuardInput(self.canary.stats(name), self.stable.stats(name), bound.max_abs)
        return Observations(
            canary=self.canary.stats(primary),
            stable=self.stable.stats(primary),
            canary_at_step=self.canary.primary_at_step,
            elapsed_s=elapsed_s,
            guards=guards,
        )

    def to_json(self) -> dict[str, Any]:
        """Session counts and descriptive numbers, for the audit log."""
        return {
            "sessions": {"canary": self.canary.sessions, "stable": self.stable.sessions},
            "mean_completion_tokens": {
                "canary": _r(self.canary.mean_completion_tokens),
                "stable": _r(self.stable.mean_completion_tokens),
            },
        }


def _r(value: float | None) -> float | None:
    return None if value is None else round(float(value), 3)


def _arm(row: Any) -> ArmLive:
    mapping = row._mapping
    metrics = {
        name: ArmStats(
            int(mapping[f"{name}_n"]), float(mapping[f"{name}_sum"] or 0.0), float(mapping[f"{name}_sq"] or 0.0)
        )
        for name in METRICS
    }
    return ArmLive(
        sessions=int(mapping["sessions"]),
        primary_at_step=int(mapping["primary_at_step"]),
        metrics=metrics,
        latency_q_ms=mapping["latency_q_ms"],
        mean_completion_tokens=mapping["mean_completion_tokens"],
    )


def read_live(
    conn: Connection,
    settings: CanarySettings,
    canary_version: str,
    stable_version: str,
    since: datetime,
    step_since: datetime,
) -> LiveData:
    """Both arms' aggregates over sessions rewarded since ``since`` (one query)."""
    if canary_version == stable_version:
        raise ValueError(f"canary and stable serve the same policy version {canary_version!r}: nothing to compare")
    params = {
        "canary": canary_version,
        "stable": stable_version,
        "since": since,
        "step_since": step_since,
        "threshold": settings.success_threshold,
        "reward_min": settings.reward_min,
        "reward_max": settings.reward_max,
        "quantile": settings.latency_quantile,
        "min_ref": settings.min_latency_reference,
    }
    arms = {row.arm: row for row in conn.execute(text(live_sql(settings.metric)), params)}
    threshold = None
    reference_n = 0
    for row in arms.values():
        threshold = row.latency_threshold_ms if row.latency_threshold_ms is not None else threshold
        reference_n = max(reference_n, int(row.latency_reference_n or 0))
    return LiveData(
        canary=_arm(arms["canary"]) if "canary" in arms else ArmLive(),
        stable=_arm(arms["stable"]) if "stable" in arms else ArmLive(),
        latency_threshold_ms=threshold,
        latency_reference_n=reference_n,
    )
