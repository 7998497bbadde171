"""``flywheel demo --inject-regression``: ops deploy a damaged checkpoint; the canary controller rolls it back.

The scene is played as an operator would play it on a live fleet, through the admin API
(:class:`~flywheel.demo.damage.Ops`), bounded by ``regression_budget_minutes``:

1. Pause the trainer, so that no new candidate arrives meanwhile.
2. A canary already on trial (the controller deploys every gated candidate) gets up to
   ``regression_settle_minutes`` to reach its own decision.
3. Pause the canary controller: it would deploy the next gated candidate the moment the
   fleet has no canary. Wait one look, so that a look already past the pause check ends,
   then roll back a canary still on trial.
4. Deploy the damaged copy of the stable as canary (:func:`~flywheel.demo.damage.damaged_checkpoint`).
   A refusal while another deployment operation holds the fleet's lock (the controller's
   reconcile, a swap) is retried; a canary deployed meanwhile after all is rolled back first.
5. Resume the controller: it judges the damaged canary on the live rewards and rolls it back,
   and the scene waits until the rollback has returned the canary's replicas to the stable
   (its audit entry). If it has not decided when the budget runs out, ops roll the damaged
   canary back.
6. Resume the trainer and the controller, whatever happened above.

The outcome is a part of the demo's summary, never a traceback: ``regression_status`` is
the damaged canary's end (``rolled_back``, ``promoted``, ``failed``), ``still canary`` when
the controller had not decided in time, or ``error`` when the scene could not be played;
``regression_error`` then says why.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from flywheel.core.settings import Settings
from flywheel.demo.damage import AdminRefused, Ops, damaged_checkpoint

if TYPE_CHECKING:
    from flywheel.demo.loop import DemoConfig
    from flywheel.stack.services import ServiceGroup

console = Console(width=130)

REASON = "flywheel demo --inject-regression"
"""The reason every ops action of the scene leaves in the audit log."""
RETRY_S = 1.0
"""Pause between tries while the fleet is busy or the admin API does not answer."""
CLEANUP_S = 120.0
"""Time allowed, past the budget, to roll back a damaged canary the controller has not decided on."""
ENDED = ("rolled_back", "promoted", "failed")
"""Deployment statuses that end a canary."""


class RegressionFailed(RuntimeError):
    """The scene could not be played; the message says what went wrong (not recoverable by retrying as is)."""


class _Clock:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def check(self, doing: str) -> None:
        if self.expired():
            raise RegressionFailed(f"the regression budget ran out while {doing}")


def inject_regression(engine: Any, settings: Settings, config: DemoConfig, group: ServiceGroup) -> dict[str, Any]:
    """Play the scene (module docstring); returns the summary's ``regression_*`` fields."""
    started = time.monotonic()
    clock = _Clock(config.regression_budget_minutes * 60)
    result: dict[str, Any] = {
        "regression_checkpoint": None,
        "regression_status": "error",
        "regression_rolled_back": False,
        "regression_rollback_sessions": None,
        "regression_cleared": [],
    }
    paused: list[str] = []
    ops = Ops.for_demo(engine, settings)
    try:
        _pause(ops, "trainer", paused, "so that no new candidate arrives meanwhile")
        _wait_for_decision(ops, clock, config.regression_settle_minutes * 60, group)
        _pause(ops, "canary", paused, "so that it deploys no gated candidate while ops deploy theirs")
        time.sleep(settings.serving.canary.interval_s + 1.0)  # a look already past the pause check ends
        _clear_canary(ops, clock, result["regression_cleared"], group)
        console.print("writing a damaged copy of the stable checkpoint ...")
        checkpoint_id = damaged_checkpoint(engine, settings)
        result["regression_checkpoint"] = checkpoint_id
        _deploy(ops, checkpoint_id, config.canary_steps[0], clock, result["regression_cleared"], group)
        deployed = time.monotonic()
        result["regression_wait_seconds"] = round(deployed - started, 1)
        console.print(
            f"ops deployed the damaged checkpoint {checkpoint_id} as canary at {config.canary_steps[0]:.0%}; "
            "resuming the canary controller, which judges it on the live rewards ..."
        )
        _resume(ops, "canary", paused)
        status = _wait_for_end(engine, checkpoint_id, clock, group)
        result["regression_seconds"] = round(time.monotonic() - deployed, 1)
        result["regression_rollback_sessions"] = _canary_sessions(engine, checkpoint_id)
        result["regression_status"] = status or "still canary"
        result["regression_rolled_back"] = status == "rolled_back"
        if status is None:
            result["regression_error"] = (
                f"the controller had not decided on the damaged canary within {config.regression_budget_minutes:g} "
                f"minutes ({result['regression_rollback_sessions']} canary sessions); {_end_by_hand(ops, group)}"
            )
        elif status != "rolled_back":
            result["regression_error"] = f"the damaged canary ended {status}, not rolled back"
        elif problem := _wait_for_swap_back(ops, checkpoint_id, group):
            result["regression_error"] = problem
    except (RegressionFailed, AdminRefused) as err:
        result["regression_error"] = str(err)
    finally:
        for what in reversed(paused):
            try:
                _resume(ops, what, paused)
            except AdminRefused as err:  # said plainly; the summary still comes
                console.print(f"[red]could not resume the {what}: {escape(str(err))}; "
                              f"run `flywheel {'train' if what == 'trainer' else 'canary'} resume`[/]")  # fmt: skip
    if result["regression_rolled_back"]:
        console.print(
            f"[green]the canary controller rolled the damaged canary back after "
            f"{result['regression_rollback_sessions']} canary sessions ({result['regression_seconds']:.0f} s)[/]"
        )
    if "regression_error" in result:
        console.print(f"[red]regression scene: {result['regression_status']}: {escape(result['regression_error'])}[/]")
    return result


# ---------------------------------------------------------------- steps


def _pause(ops: Ops, what: str, paused: list[str], why: str) -> None:
    console.print(f"ops pause the {'trainer' if what == 'trainer' else 'canary controller'} ({why})")
    ops.pause(what, REASON)
    paused.append(what)


def _resume(ops: Ops, what: str, paused: list[str]) -> None:
    ops.resume(what, REASON)
    paused.remove(what)


def _fleet(ops: Ops, clock: _Clock, group: ServiceGroup) -> dict[str, Any]:
    """``GET /v1/canary``, retried while the admin API does not answer (a restart)."""
    while True:
        try:
            return ops.canary()
        except AdminRefused as err:
            if err.status is not None:
                raise
            clock.check(f"waiting for the admin API ({err.reason})")
        group.revive()
        time.sleep(RETRY_S)


def _wait_for_decision(ops: Ops, clock: _Clock, settle_s: float, group: ServiceGroup) -> None:
    """Give a canary already on trial up to ``settle_s`` to be promoted or rolled back by the controller."""
    canary = _fleet(ops, clock, group).get("canary")
    if canary is None:
        return
    console.print(
        f"canary {canary['checkpoint_id']} is on trial: waiting up to {settle_s:.0f} s for the controller's decision"
    )
    until = min(time.monotonic() + settle_s, clock.deadline)
    while time.monotonic() < until:
        group.revive()
        time.sleep(2.0)
        now = _fleet(ops, clock, group).get("canary")
        if now is None or now["id"] != canary["id"]:
            return


def _clear_canary(ops: Ops, clock: _Clock, cleared: list[str], group: ServiceGroup, keep: str | None = None) -> bool:
    """Roll back the fleet's canary, if any, as ops would; False when it is ``keep`` (left running)."""
    while True:
        fleet = _fleet(ops, clock, group)
        canary, stable = fleet.get("canary"), fleet.get("stable")
        if canary is None:
            return True
        if canary["checkpoint_id"] == keep:
            return False
        if stable is None:
            raise RegressionFailed(f"fleet {fleet.get('fleet')!r} has a canary but no stable deployment")
        clock.check(f"rolling back canary {canary['checkpoint_id']} to make room")
        try:
            ops.rollback_canary(stable["checkpoint_id"], f"{REASON}: making room for the damaged canary")
        except AdminRefused as err:
            if err.status not in (409, None):
                raise RegressionFailed(f"rolling back canary {canary['checkpoint_id']} failed: {err}") from err
            time.sleep(RETRY_S)  # another operation holds the fleet, or the canary ended meanwhile: look again
            continue
        cleared.append(canary["checkpoint_id"])
        console.print(f"ops rolled back canary {canary['checkpoint_id']} (still undecided) to make room")


def _deploy(ops: Ops, checkpoint_id: str, weight: float, clock: _Clock, cleared: list[str],
            group: ServiceGroup) -> None:  # fmt: skip
    """``POST /v1/canary`` until the damaged checkpoint is the fleet's canary."""
    last = "not tried yet"
    while True:
        clock.check(f"deploying the damaged checkpoint {checkpoint_id} (last refusal: {last})")
        try:
            ops.deploy_canary(checkpoint_id, weight)
            return
        except AdminRefused as err:
            if err.status not in (409, None):  # 404, 422, a failed swap (502): not a matter of waiting
                raise RegressionFailed(f"the admin API refused the damaged canary: {err}") from err
            last = str(err)
        # 409: another operation holds the fleet (transient), or a canary exists (a look deployed one after
        # all: roll it back). No answer: the call may still have deployed it (then it is ours: done).
        if not _clear_canary(ops, clock, cleared, group, keep=checkpoint_id):
            _until_active(ops, checkpoint_id, clock, group)
            return
        time.sleep(RETRY_S)


def _until_active(ops: Ops, checkpoint_id: str, clock: _Clock, group: ServiceGroup) -> None:
    while True:
        canary = _fleet(ops, clock, group).get("canary")
        if canary is None or canary["checkpoint_id"] != checkpoint_id:
            raise RegressionFailed(f"the damaged canary {checkpoint_id} did not become active (see the audit log)")
        if canary["status"] == "active":
            return
        clock.check(f"waiting for the damaged canary {checkpoint_id} to become active")
        time.sleep(RETRY_S)


def _wait_for_end(engine: Any, checkpoint_id: str, clock: _Clock, group: ServiceGroup) -> str | None:
    """The damaged canary's end (``rolled_back``, ``promoted``, ``failed``), or None at the deadline."""
    while not clock.expired():
        status = _canary_status(engine, checkpoint_id)
        if status in ENDED:
            return status
        group.revive()
        time.sleep(2.0)
    status = _canary_status(engine, checkpoint_id)
    return status if status in ENDED else None


def _wait_for_swap_back(ops: Ops, checkpoint_id: str, group: ServiceGroup) -> str | None:
    """Wait for the rollback's audit entry (written once the canary's replicas are back on the stable).

    The deployment ends ``rolled_back`` before its replicas swap back; None once they have,
    else what went wrong.
    """
    clock = _Clock(CLEANUP_S)
    while True:
        for entry in _audit(ops, "deploy.rollback", clock, group):
            if entry["details"].get("from_checkpoint_id") == checkpoint_id:
                if entry["success"]:
                    return None
                return f"the rollback did not return every replica to the stable: {entry['details'].get('message')}"
        if clock.expired():
            return f"the rollback's swap back to the stable had not finished after {CLEANUP_S:.0f} s"
        group.revive()
        time.sleep(RETRY_S)


def _audit(ops: Ops, action: str, clock: _Clock, group: ServiceGroup) -> list[dict[str, Any]]:
    while True:
        try:
            return ops.audit(action)
        except AdminRefused as err:
            if err.status is not None:
                raise
            clock.check(f"waiting for the admin API ({err.reason})")
        group.revive()
        time.sleep(RETRY_S)


def _end_by_hand(ops: Ops, group: ServiceGroup) -> str:
    """Roll the undecided damaged canary back as ops (the fleet must not keep serving it); says how it went."""
    try:
        _clear_canary(ops, _Clock(CLEANUP_S), [], group)
    except (RegressionFailed, AdminRefused) as err:
        return f"rolling it back by hand failed too ({err}): run `flywheel rollback`"
    return "ops rolled it back"


def _canary_status(engine: Any, checkpoint_id: str) -> str | None:
    from sqlalchemy import text

    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT status FROM deployments WHERE checkpoint_id = :c AND role = 'canary' ORDER BY id DESC LIMIT 1"
            ),
            {"c": checkpoint_id},
        ).scalar()


def _canary_sessions(engine: Any, checkpoint_id: str) -> int:
    """Scored sessions the checkpoint served."""
    from sqlalchemy import text

    with engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(DISTINCT (project, session_id)) FROM rewards r JOIN checkpoints c "
                    "ON c.policy_version = r.policy_version WHERE c.id = :c"
                ),
                {"c": checkpoint_id},
            ).scalar_one()
        )
