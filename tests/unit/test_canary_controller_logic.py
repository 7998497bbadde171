"""The controller's rule for writing ``hold`` decisions to the audit log (no flooding, nothing missed)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from flywheel.core.db.models import AuditLog
from flywheel.core.settings import CanarySettings
from serving.canary.controller import hold_worth_logging, reason_kind
from serving.canary.policy import Observations, decide
from serving.canary.stats import ArmStats

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
SETTINGS = CanarySettings()


def hold(n_canary: int, at_step: int | None = None):
    stats = ArmStats(n_canary, n_canary * 0.46, n_canary * 0.46)
    step = at_step if at_step is not None else n_canary
    d = decide(Observations(stats, ArmStats(5000, 2500.0, 2500.0), step, 60.0), 0.05, SETTINGS)
    assert d.action == "hold"
    return d


def written(decision, seconds_ago: float) -> AuditLog:
    return AuditLog(action="canary.decision", details=decision.to_details(), at=NOW - timedelta(seconds=seconds_ago))


def should(decision, previous) -> bool:
    return hold_worth_logging(decision, previous, NOW, SETTINGS.hold_log_interval_s, SETTINGS.hold_log_growth)


def test_reason_kind_drops_the_numbers() -> None:
    assert reason_kind("collecting: 3/100 canary sessions at step 0") == "collecting"
    assert reason_kind("inconclusive: lower bound -0.2 <= -0.1") == "inconclusive"


def test_first_hold_is_written() -> None:
    assert should(hold(300), None)


def test_unchanged_hold_is_not_written_again_soon() -> None:
    assert not should(hold(310), written(hold(300), 10))


def test_hold_is_written_after_the_interval() -> None:
    assert should(hold(310), written(hold(300), SETTINGS.hold_log_interval_s + 1))


def test_hold_is_written_when_the_sample_grew_materially() -> None:
    assert should(hold(380), written(hold(300), 10))


def test_hold_is_written_when_its_kind_of_reason_changes() -> None:
    collecting = hold(300, at_step=10)
    assert collecting.reason.startswith("collecting")
    assert should(hold(300), written(collecting, 10))


def test_a_hold_after_another_action_is_written() -> None:
    details = {"action": "step_up", "reason": "x", "primary": {"n_canary": 300}}
    previous = AuditLog(action="canary.decision", details=details, at=NOW)
    assert should(hold(300), previous)
