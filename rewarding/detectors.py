"""Reward-hacking detectors: per-policy-version behaviour metrics, and shifts beyond bounds.

Every reward row carries the session's counts in ``components._meta.stats`` (computed
from the events when it is scored). Over the newest reward version of each session, per
policy version:

- ``tool_error_rate``: tool results flagged ``is_error`` / tool results;
- ``clarifying_rate``: completions without tool calls that ask a question / completions;
- ``edit_rate``: sessions the user edited / sessions;
- ``mean_completion_tokens``: generated tokens / completions;
- ``judge_disagreement_rate``: judged sessions whose rubrics disagreed / judged sessions.

A policy version is compared with a baseline (given, else the previous policy version by
first appearance); a metric that moved beyond its configured bound is flagged. The canary
reads these from :func:`detector_report` (or the worker's Prometheus gauges).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import text

from flywheel.core.contracts.events import FeedbackKind
from flywheel.core.db.engine import get_engine
from flywheel.core.settings import DetectorSettings, ShiftBound
from rewarding.extractors.base import Components
from rewarding.session_state import Session

METRICS = ("tool_error_rate", "clarifying_rate", "edit_rate", "mean_completion_tokens", "judge_disagreement_rate")
STAT_KEYS = (
    "completions",
    "completion_tokens",
    "clarifying",
    "tool_results",
    "tool_errors",
    "edited",
    "grm_scored",
    "grm_disagree",
)


def session_stats(session: Session, grm: Components | None, clarifying_pattern: str) -> dict[str, float]:
    """The counts one session contributes to its policy version's detector metrics."""
    clarifying = re.compile(clarifying_pattern)
    results = [r for turn in session.turns for r in turn.tool_results]
    judged = grm is not None and grm.value is not None
    return {
        "completions": float(len(session.completions)),
        "completion_tokens": float(sum(len(c.completion_token_ids or ()) for c in session.completions)),
        "clarifying": float(
            sum(1 for c in session.completions if not c.tool_calls and clarifying.search(c.completion_text))
        ),
        "tool_results": float(len(results)),
        "tool_errors": float(sum(1 for r in results if r.is_error)),
        "edited": 1.0 if any(f.kind is FeedbackKind.EDIT for f in session.feedback) else 0.0,
        "grm_scored": 1.0 if judged else 0.0,
        "grm_disagree": 1.0 if judged and "disagreement" in grm.flags else 0.0,
    }


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


@dataclass
class PolicyStats:
    """Summed session counts of one policy version."""

    policy_version: str
    sessions: int = 0
    first_seen: datetime | None = None
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAT_KEYS, 0.0))

    def add(self, stats: dict[str, float], at: datetime | None) -> None:
        """Count one session."""
        self.sessions += 1
        for key in STAT_KEYS:
            self.sums[key] += float(stats.get(key, 0.0))
        if at is not None and (self.first_seen is None or at < self.first_seen):
            self.first_seen = at

    def metrics(self) -> dict[str, float | None]:
        """The detector metrics (None where the denominator is zero)."""
        s = self.sums
        return {
            "tool_error_rate": _ratio(s["tool_errors"], s["tool_results"]),
            "clarifying_rate": _ratio(s["clarifying"], s["completions"]),
            "edit_rate": _ratio(s["edited"], float(self.sessions)),
            "mean_completion_tokens": _ratio(s["completion_tokens"], s["completions"]),
            "judge_disagreement_rate": _ratio(s["grm_disagree"], s["grm_scored"]),
        }


@dataclass(frozen=True)
class Shift:
    """A metric of a policy version that moved beyond its bound against the baseline."""

    policy_version: str
    baseline: str
    metric: str
    value: float
    baseline_value: float
    bound: str


@dataclass(frozen=True)
class DetectorReport:
    """Metrics per policy version and the flagged shifts."""

    policies: list[PolicyStats]
    shifts: list[Shift]

    def to_json(self) -> dict:
        """JSON-ready form (for the CLI and the canary)."""
        return {
            "policies": [
                {"policy_version": p.policy_version, "sessions": p.sessions, "metrics": p.metrics()}
                for p in self.policies
            ],
            "shifts": [s.__dict__ for s in self.shifts],
        }


def aggregate(rows: Iterable[tuple[str | None, dict[str, float], datetime | None]]) -> list[PolicyStats]:
    """(policy version, session stats, created at) rows -> stats per policy version, oldest first."""
    by_policy: dict[str, PolicyStats] = {}
    for policy, stats, at in rows:
        if policy is None:
            continue
        by_policy.setdefault(policy, PolicyStats(policy)).add(stats, at)
    return sorted(by_policy.values(), key=_first_seen)


def _first_seen(policy: PolicyStats) -> tuple[bool, datetime, str]:
    return (policy.first_seen is None, policy.first_seen or datetime.min, policy.policy_version)


def beyond(bound: ShiftBound, value: float, base: float) -> str | None:
    """Which part of ``bound`` the move from ``base`` to ``value`` breaks, or None."""
    delta = abs(value - base)
    if bound.max_abs is not None and delta > bound.max_abs:
        return f"|change| {delta:.4g} > {bound.max_abs}"
    if bound.max_rel is not None and base != 0 and delta / abs(base) > bound.max_rel:
        return f"relative change {delta / abs(base):.4g} > {bound.max_rel}"
    return None


def flag_shifts(policies: list[PolicyStats], settings: DetectorSettings, baseline: str | None = None) -> list[Shift]:
    """Metrics that moved beyond their bounds, each policy against the baseline (or its predecessor)."""
    by_name = {p.policy_version: p for p in policies}
    shifts: list[Shift] = []
    for i, policy in enumerate(policies):
        base = by_name.get(baseline) if baseline else (policies[i - 1] if i > 0 else None)
        if base is None or base is policy:
            continue
        if min(policy.sessions, base.sessions) < settings.min_sessions:
            continue
        new, old = policy.metrics(), base.metrics()
        for metric, bound in settings.bounds.items():
            if new.get(metric) is None or old.get(metric) is None:
                continue
            broken = beyond(bound, new[metric], old[metric])
            if broken:
                shifts.append(
                    Shift(policy.policy_version, base.policy_version, metric, new[metric], old[metric], broken)
                )
    return shifts


LATEST_STATS_SQL = """
SELECT DISTINCT ON (project, session_id) policy_version, components -> '_meta' -> 'stats', created_at
FROM rewards WHERE created_at >= :since
ORDER BY project, session_id, version DESC
"""


def detector_report(
    db_url: str, since: datetime, settings: DetectorSettings, baseline: str | None = None
) -> DetectorReport:
    """The detector metrics over the newest reward of every session rewarded since ``since``."""
    with get_engine(db_url).connect() as conn:
        rows = [(r[0], r[1] or {}, r[2]) for r in conn.execute(text(LATEST_STATS_SQL), {"since": since})]
    policies = aggregate(rows)
    return DetectorReport(policies, flag_shifts(policies, settings, baseline))
