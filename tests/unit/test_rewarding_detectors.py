"""Reward-hacking detectors: per-policy metrics and flagged shifts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from flywheel.core.settings import DetectorSettings, ShiftBound
from rewarding.detectors import aggregate, flag_shifts

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def stats(**kw: float) -> dict[str, float]:
    base = {
        "completions": 2.0,
        "completion_tokens": 20.0,
        "clarifying": 0.0,
        "tool_results": 2.0,
        "tool_errors": 0.0,
        "edited": 0.0,
        "grm_scored": 1.0,
        "grm_disagree": 0.0,
    }
    return {**base, **kw}


def test_metrics_per_policy_version() -> None:
    rows = [
        ("v1", stats(), T0),
        ("v1", stats(tool_errors=1.0, edited=1.0, grm_disagree=1.0), T0),
        ("v2", stats(clarifying=2.0, completion_tokens=60.0), T0 + timedelta(hours=1)),
        (None, stats(), T0),
    ]
    v1, v2 = aggregate(rows)
    assert v1.policy_version == "v1" and v1.sessions == 2
    assert v1.metrics() == {
        "tool_error_rate": 0.25,
        "clarifying_rate": 0.0,
        "edit_rate": 0.5,
        "mean_completion_tokens": 10.0,
        "judge_disagreement_rate": 0.5,
    }
    assert v2.metrics()["clarifying_rate"] == 1.0 and v2.metrics()["mean_completion_tokens"] == 30.0


def test_shift_beyond_bound_is_flagged_against_previous_or_given_baseline() -> None:
    rows = [("v1", stats(), T0)] * 30 + [("v2", stats(tool_errors=1.0, completion_tokens=22.0), T0 + timedelta(1))] * 30
    settings = DetectorSettings(min_sessions=20)
    shifts = flag_shifts(aggregate(rows), settings)
    assert [(s.policy_version, s.baseline, s.metric) for s in shifts] == [("v2", "v1", "tool_error_rate")]
    assert shifts[0].value == 0.5 and shifts[0].baseline_value == 0.0
    tight = DetectorSettings(min_sessions=20, bounds={"mean_completion_tokens": ShiftBound(max_rel=0.05)})
    assert [s.metric for s in flag_shifts(aggregate(rows), tight, baseline="v1")] == ["mean_completion_tokens"]
    assert flag_shifts(aggregate(rows), DetectorSettings(min_sessions=31)) == []


def test_no_denominator_is_no_metric() -> None:
    (p,) = aggregate([("v", stats(tool_results=0.0, grm_scored=0.0), T0)])
    assert p.metrics()["tool_error_rate"] is None and p.metrics()["judge_disagreement_rate"] is None
    assert p.metrics()["edit_rate"] == pytest.approx(0.0)
