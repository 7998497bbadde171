"""The regression scene's ops moves (flywheel.demo.regression) against a fake admin API and a fake clock.

The real scene runs in tests/e2e/test_flywheel_e2e.py (after its learning phase); here the races that made it fail
are played out quickly: a canary that never decides, a look that deploys another candidate
after ops rolled one back, a fleet lock held by another operation, refusals and a controller
that never decides.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from flywheel.core.settings import Settings
from flywheel.demo import regression
from flywheel.demo.damage import AdminRefused
from flywheel.demo.loop import DemoConfig

BUSY = "another deployment operation is running on fleet 'default'"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.01)


class FakeOps:
    """The admin API of a fleet: one stable, maybe a canary; records every call."""

    def __init__(self, canary: str | None = None, busy: int = 0, raced: list[str] | None = None):
        self.canary_id = canary
        self.canary_status = "active"
        self.busy = busy
        """Deploy calls refused because another operation holds the fleet's lock."""
        self.raced = list(raced or [])
        """Candidates a look in progress deploys right after a rollback by ops."""
        self.calls: list[tuple[str, ...]] = []
        self.refuse_deploy: AdminRefused | None = None
        self.deployment = 0

    def canary(self) -> dict[str, Any]:
        canary = None
        if self.canary_id is not None:
            canary = {"id": self.deployment, "checkpoint_id": self.canary_id, "status": self.canary_status}
        return {"fleet": "default", "canary": canary, "stable": {"checkpoint_id": "stable-1"}}

    def pause(self, what: str, reason: str) -> None:
        self.calls.append(("pause", what))

    def resume(self, what: str, reason: str) -> None:
        self.calls.append(("resume", what))

    def rollback_canary(self, stable: str, reason: str) -> dict[str, Any]:
        assert stable == "stable-1"
        if self.canary_id is None:
            raise AdminRefused("POST", "/v1/rollback", 409, "checkpoint stable-1 is already the stable deployment")
        self.calls.append(("rollback", self.canary_id))
        self.canary_id = self.raced.pop(0) if self.raced else None
        self.deployment += 1
        return {}

    def audit(self, action: str, limit: int = 20) -> list[dict[str, Any]]:
        assert action == "deploy.rollback"
        return [
            {"details": {"from_checkpoint_id": checkpoint_id}, "success": True}
            for what, checkpoint_id in self.calls
            if what == "controller rollback"
        ]

    def deploy_canary(self, checkpoint_id: str, weight: float) -> dict[str, Any]:
        if self.refuse_deploy is not None:
            raise self.refuse_deploy
        if self.canary_id is not None:
            raise AdminRefused(
                "POST", "/v1/canary", 409, f"fleet 'default' already has an active canary ({self.canary_id})"
            )
        if self.busy:
            self.busy -= 1
            raise AdminRefused("POST", "/v1/canary", 409, BUSY)
        self.calls.append(("deploy", checkpoint_id))
        self.canary_id = checkpoint_id
        self.deployment += 1
        return {}


@pytest.fixture
def scene(monkeypatch: pytest.MonkeyPatch, tmp_path):
    clock = FakeClock()
    monkeypatch.setattr(regression, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    monkeypatch.setattr(regression, "damaged_checkpoint", lambda engine, settings: "damaged-1")
    monkeypatch.setattr(regression, "_canary_sessions", lambda engine, checkpoint_id: 42)

    def play(ops: FakeOps, decides: bool = True, **config: Any) -> dict[str, Any]:
        def status(engine: Any, checkpoint_id: str) -> str | None:
            if ops.canary_id == checkpoint_id and decides and ("resume", "canary") in ops.calls:
                ops.calls.append(("controller rollback", checkpoint_id))
                ops.canary_id = None
                return "rolled_back"
            return None if ops.canary_id == checkpoint_id else "rolled_back"

        monkeypatch.setattr(regression, "_canary_status", status)
        monkeypatch.setattr(regression.Ops, "for_demo", classmethod(lambda cls, engine, settings: ops))
        group = SimpleNamespace(revive=lambda: [])
        return regression.inject_regression(None, Settings(run_dir=tmp_path), DemoConfig(**config), group)

    return play


def test_an_undecided_canary_and_a_raced_candidate_are_rolled_back_and_a_busy_fleet_waited_for(scene):
    ops = FakeOps(canary="candidate-1", busy=2, raced=["candidate-2"])
    result = scene(ops)
    assert result["regression_status"] == "rolled_back" and result["regression_rolled_back"] is True, result
    assert result["regression_cleared"] == ["candidate-1", "candidate-2"]
    assert result["regression_rollback_sessions"] == 42 and "regression_error" not in result
    assert ops.calls == [
        ("pause", "trainer"),
        ("pause", "canary"),
        ("rollback", "candidate-1"),
        ("rollback", "candidate-2"),
        ("deploy", "damaged-1"),
        ("resume", "canary"),
        ("controller rollback", "damaged-1"),
        ("resume", "trainer"),
    ]


def test_a_canary_that_decides_while_waiting_is_not_touched(scene, monkeypatch):
    ops = FakeOps(canary="candidate-1")
    real_fleet = regression._fleet

    def decided_after_a_while(*args: Any) -> dict[str, Any]:
        if ops.canary_id == "candidate-1" and regression.time.monotonic() > 10:
            ops.canary_id = None  # the controller promoted it
        return real_fleet(*args)

    monkeypatch.setattr(regression, "_fleet", decided_after_a_while)
    result = scene(ops)
    assert result["regression_rolled_back"] is True and result["regression_cleared"] == []


def test_a_refused_deploy_ends_with_a_message_and_everything_resumed(scene):
    ops = FakeOps()
    ops.refuse_deploy = AdminRefused("POST", "/v1/canary", 422, "checkpoint damaged-1 has no weights")
    result = scene(ops)
    assert result["regression_status"] == "error" and result["regression_rolled_back"] is False
    assert "HTTP 422" in result["regression_error"] and "no weights" in result["regression_error"]
    assert ops.calls[-2:] == [("resume", "canary"), ("resume", "trainer")]


def test_a_fleet_busy_past_the_budget_says_so(scene):
    ops = FakeOps(busy=10**6)
    result = scene(ops, regression_budget_minutes=0.5)
    assert result["regression_status"] == "error"
    assert "budget ran out while deploying" in result["regression_error"] and BUSY in result["regression_error"]
    assert ("resume", "canary") in ops.calls and ops.calls[-1] == ("resume", "trainer")


def test_an_undecided_damaged_canary_is_rolled_back_by_ops_at_the_deadline(scene):
    ops = FakeOps()
    result = scene(ops, decides=False, regression_budget_minutes=0.5)
    assert result["regression_status"] == "still canary" and result["regression_rolled_back"] is False
    assert "had not decided" in result["regression_error"] and "ops rolled it back" in result["regression_error"]
    assert ("rollback", "damaged-1") in ops.calls and ops.canary_id is None


def test_a_rollback_whose_swap_back_failed_is_reported(scene, monkeypatch):
    ops = FakeOps()
    failed = [{"details": {"from_checkpoint_id": "damaged-1", "message": "replica 2 did not answer"}, "success": False}]
    monkeypatch.setattr(ops, "audit", lambda action, limit=20: failed if ("resume", "canary") in ops.calls else [])
    result = scene(ops)
    assert result["regression_rolled_back"] is True
    assert "did not return every replica" in result["regression_error"] and "replica 2" in result["regression_error"]
