"""The canary controller: one look (:func:`run_once`) and the loop (:func:`run`).

A look reads the fleet's active stable and canary deployments (``deployments`` joined to
``checkpoints`` for their policy versions), the live observations since the canary was
created (:func:`serving.canary.live.read_live`, one query), decides
(:func:`serving.canary.policy.decide`) and acts through :mod:`serving.fleet.deploy`
(``set_canary_weight`` on a step up, ``promote``, ``rollback``; actor
``canary-controller``, ``details={"reason": ..., "decision": <the numbers>}``; those
functions write their own audit rows).

Every decision is also written to the audit log as action ``canary.decision`` (target
``deployment:<canary id>``, ``before``/``after`` weight, ``details`` = every number the
decision used, ``success`` = whether its action went through). A ``hold`` is written only
when it says something new, so a canary that holds for hours does not flood the log:
when it is the first decision about this deployment, when the previous written decision
was not a hold or held for another kind of reason (``collecting`` vs ``inconclusive``),
when the canary's sample grew by ``hold_log_growth`` (25 %) since, or when
``hold_log_interval_s`` (5 min) passed since. Non-hold decisions are always written.

Each look of the loop (:func:`run`) first registers the replicas ``vllm.urls`` names
(:func:`register_configured`: idempotent, skipped while another operation holds the fleet lock)
and reconciles the fleet, so a compose or Kubernetes fleet needs no separate registration step.

Pause: ``canary.pause`` / ``canary.resume`` audit entries, the same flag as the trainer's
(:mod:`flywheel.core.pause`); while the newest one is a pause the controller
reads nothing and decides nothing. ``canary.enabled = false`` does the same from the
settings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from flywheel.core import pause
from flywheel.core.contracts.checkpoint import CheckpointEval
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import AuditLog, Checkpoint, Deployment
from flywheel.core.endpoints import postgres_url
from flywheel.core.pause import PauseState
from flywheel.core.vllm_admin import VllmAdminError
from flywheel.model.base import BaseModelMissing
from flywheel.model.check import ModelCheckError
from serving.canary.live import read_live
from serving.canary.policy import Decision, decide
from serving.fleet import deploy
from serving.fleet.pins import apply_settings_pins
from serving.fleet.registry import DeployError, Registration, register_replicas

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from flywheel.core.settings import Settings

log = logging.getLogger(__name__)

ACTOR = "canary-controller"
DECISION_ACTION = "canary.decision"

Action = Callable[..., Any]


# --------------------------------------------------------------------------- pause


def canary_pause_state(session: Session) -> PauseState:
    """The controller's pause flag (:mod:`flywheel.core.pause`)."""
    return pause.pause_state(session, "canary")


def set_canary_paused(session: Session, paused: bool, actor: str, reason: str | None = None) -> PauseState:
    """Pause or resume the canary controller: one append-only audit entry; returns the new state."""
    return pause.set_paused(session, "canary", paused, actor, reason)


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Arm:
    """An active deployment with its checkpoint's policy version."""

    deployment_id: int
    checkpoint_id: str
    policy_version: str
    weight: float
    created_at: datetime
    updated_at: datetime

    def to_json(self) -> dict[str, Any]:
        """Identity of the arm, for the audit log."""
        return {
            "deployment_id": self.deployment_id,
            "checkpoint_id": self.checkpoint_id,
            "policy_version": self.policy_version,
            "weight": self.weight,
        }


def active_arm(session: Session, fleet: str, role: str) -> Arm | None:
    """The fleet's active deployment of ``role`` (``stable`` or ``canary``), if any."""
    row = session.execute(
        select(Deployment, Checkpoint.policy_version)
        .join(Checkpoint, Checkpoint.id == Deployment.checkpoint_id)
        .where(Deployment.fleet == fleet, Deployment.role == role, Deployment.status == "active")
        .order_by(Deployment.id.desc())
        .limit(1)
    ).first()
    if row is None:
        return None
    dep, version = row
    return Arm(dep.id, dep.checkpoint_id, version, dep.weight, dep.created_at, dep.updated_at)


def _last_decision(session: Session, target: str) -> AuditLog | None:
    return session.scalars(
        select(AuditLog)
        .where(AuditLog.action == DECISION_ACTION, AuditLog.target == target)
        .order_by(AuditLog.at.desc(), AuditLog.id.desc())
        .limit(1)
    ).first()


def latest_decision(session: Session, fleet: str) -> AuditLog | None:
    """The newest ``canary.decision`` audit entry about any canary of ``fleet`` (its ``details.fleet``)."""
    return session.scalars(
        select(AuditLog)
        .where(AuditLog.action == DECISION_ACTION, AuditLog.details["fleet"].astext == fleet)
        .order_by(AuditLog.at.desc(), AuditLog.id.desc())
        .limit(1)
    ).first()


def reason_kind(reason: str) -> str:
    """The kind of a decision's reason: the text before its first ``:`` (numbers excluded)."""
    return reason.split(":", 1)[0]


def hold_worth_logging(
    decision: Decision, previous: AuditLog | None, now: datetime, interval_s: float, growth: float
) -> bool:
    """Whether a ``hold`` says something the previous written decision did not (module docstring)."""
    if decision.action != "hold" or previous is None:
        return True
    details = previous.details or {}
    if details.get("action") != "hold" or reason_kind(str(details.get("reason", ""))) != reason_kind(decision.reason):
        return True
    if (now - previous.at).total_seconds() >= interval_s:
        return True
    before = int((details.get("primary") or {}).get("n_canary") or 0)
    after = int(decision.primary.get("n_canary") or 0)
    return after >= before + max(1.0, growth * before)


# --------------------------------------------------------------------------- acting


def _default_actions() -> dict[str, Action]:
    return {"step_up": deploy.set_canary_weight, "promote": deploy.promote, "rollback": deploy.rollback}


def _act(
    engine: Engine, settings: Settings, decision: Decision, details: dict[str, Any], actions: dict[str, Action]
) -> Any:
    """Call the deploy function of ``decision``; its audit row gets ``{"reason", "decision": numbers}``.

    The numbers are nested under ``decision`` so they cannot collide with the deploy
    function's own detail keys (``weight``, ``canary_id``, ...).
    """
    info = {"reason": decision.reason, "decision": details}
    if decision.action == "step_up":
        return actions["step_up"](engine, settings, decision.new_weight, actor=ACTOR, details=info)
    if decision.action == "promote":
        return actions["promote"](engine, settings, actor=ACTOR, details=info)
    if decision.action == "rollback":
        return actions["rollback"](engine, settings, actor=ACTOR, details=info)
    return None


def _record(
    engine: Engine, target: str, decision: Decision, details: dict[str, Any], success: bool, error: str | None = None
) -> None:
    with Session(engine) as session:
        session.add(
            AuditLog(
                actor=ACTOR,
                action=DECISION_ACTION,
                target=target,
                before={"weight": decision.weight},
                after={"weight": decision.new_weight if success else decision.weight, "action": decision.action},
                details={**details, **({"error": error} if error else {})},
                success=success,
            )
        )
        session.commit()


def run_once(engine: Engine, settings: Settings, actions: dict[str, Action] | None = None) -> Decision | None:
    """One look: decide about the fleet's active canary and act; None when there is nothing to decide.

    Nothing is decided when the controller is disabled or paused, or the fleet has no
    active canary (or no active stable). ``actions`` maps ``step_up``/``promote``/``rollback``
    to functions with :mod:`serving.fleet.deploy`'s signatures (the default); an action that raises
    is recorded in the ``canary.decision`` row (``success=false``, the error) and re-raised.
    """
    cs = settings.serving.canary
    if not cs.enabled:
        return None
    fleet = settings.serving.fleet
    with Session(engine) as session:
        if canary_pause_state(session).paused:
            return None
        canary = active_arm(session, fleet, "canary")
        stable = active_arm(session, fleet, "stable")
        if canary is None or stable is None:
            return None
        now = session.scalar(select(func.now()))
        step_since = max(canary.created_at, canary.updated_at)
        live = read_live(
            session.connection(), cs, canary.policy_version, stable.policy_version, canary.created_at, step_since
        )
        target = f"deployment:{canary.deployment_id}"
        previous = _last_decision(session, target)
    elapsed = (now - canary.created_at).total_seconds()
    decision = decide(live.observations(cs, settings.rewarding.detectors, elapsed), canary.weight, cs)
    details = {
        **decision.to_details(),
        "fleet": fleet,
        "canary": canary.to_json(),
        "stable": stable.to_json(),
        "step_since": step_since.isoformat(),
        **live.to_json(),
    }
    if decision.action == "hold":
        if hold_worth_logging(decision, previous, now, cs.hold_log_interval_s, cs.hold_log_growth):
            _record(engine, target, decision, details, success=True)
        return decision
    try:
        _act(engine, settings, decision, details, actions or _default_actions())
    except Exception as err:  # recorded as a failed decision, then re-raised
        _record(engine, target, decision, details, success=False, error=f"{type(err).__name__}: {err}")
        raise
    _record(engine, target, decision, details, success=True)
    log.info("canary %s: %s (%s)", target, decision.action, decision.reason)
    return decision


def next_candidate(session: Session, fleet: str) -> Checkpoint | None:
    """The newest checkpoint worth a canary: a gated ``candidate`` trained from the fleet's stable, never deployed.

    "Gated" means the trainer's eval gate measured it (its ``eval`` holds a held-out result):
    a checkpoint registered by hand (no gate) is deployed only by ops, never automatically.
    """
    stable = active_arm(session, fleet, "stable")
    if stable is None:
        return None
    tried = select(Deployment.checkpoint_id).where(Deployment.fleet == fleet)
    query = (
        select(Checkpoint)
        .where(
            Checkpoint.status == "candidate",
            Checkpoint.parent_id == stable.checkpoint_id,
            Checkpoint.id.not_in(tried),
            Checkpoint.eval["heldout"].is_not(None),
        )
        .order_by(Checkpoint.created_at.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def auto_deploy(engine: Engine, settings: Settings, deploy_canary: Action | None = None) -> str | None:
    """With ``canary.auto_deploy``: when the fleet has no canary, deploy :func:`next_candidate` at the first step.

    Returns the deployed checkpoint id (None when nothing was deployed). Paused or
    disabled controllers deploy nothing; the deployment is audited by :mod:`serving.fleet.deploy`
    with this controller as the actor.
    """
    cs = settings.serving.canary
    if not (cs.enabled and cs.auto_deploy):
        return None
    fleet = settings.serving.fleet
    with Session(engine) as session:
        if canary_pause_state(session).paused or active_arm(session, fleet, "canary") is not None:
            return None
        candidate = next_candidate(session, fleet)
        if candidate is None:
            return None
        checkpoint_id = candidate.id
        heldout = {key: result.to_dict() for key, result in CheckpointEval.parse(candidate.eval).heldout.items()}
    if deploy_canary is None:
        deploy_canary = deploy.deploy_canary
    details = {"reason": "auto-deploy: the newest gated candidate trained from the stable", "heldout": heldout}
    deploy_canary(engine, settings, checkpoint_id, cs.steps[0], ACTOR, details)
    log.info("auto-deployed %s as canary at %.0f%%", checkpoint_id, cs.steps[0] * 100)
    return checkpoint_id


def register_configured(engine: Engine, settings: Settings) -> Registration | None:
    """Register the replicas ``vllm.urls`` names (:func:`serving.fleet.registry.register_replicas`).

    New replicas get a row (``failed`` while they do not answer), the base becomes the stable of
    a fleet without one, and a replica registered ``failed`` that answers now is recorded as
    serving. Nothing when no URL is configured. The base model is never built here (a missing
    one is :class:`flywheel.model.base.BaseModelMissing`, retried at the next look).
    """
    if not settings.vllm.urls:
        return None
    result = register_replicas(engine, settings, list(settings.vllm.urls), actor=ACTOR, build=False)
    for row in result.added:
        log.info("registered replica %s: %s (%s)", row["url"], row["state"], row["reason"] or row["policy_version"])
    for row in result.adopted:
        log.info("replica %s answers now: registered as %s (%s)", row["url"], row["state"], row["policy_version"])
    if result.stable_created:
        log.info("fleet %s had no stable deployment: the base model is its stable now", result.fleet)
    return result


REGISTRATION_ERRORS = (DeployError, OperationalError, BaseModelMissing, ModelCheckError)
"""Registration failures the loop retries at the next look (a replica in another fleet, the
database away, the base model not there yet); they do not stop the canary's look."""


def run(settings: Settings, max_looks: int | None = None) -> None:
    """Look every ``canary.interval_s`` until interrupted (or ``max_looks``); also register and reconcile the fleet.

    Each look first registers the replicas ``vllm.urls`` names (:func:`register_configured`), so
    a fleet deployed without the demo routes from its first minute and a replica that joins
    late is registered and routed once healthy; then it reconciles the fleet, applies the role
    pins of ``serving.role_pins`` (:func:`serving.fleet.pins.apply_settings_pins`) and decides about
    the canary. A refused or failed action (:class:`serving.fleet.registry.DeployError`, e.g. ops
    changed the canary meanwhile) and a lost database connection are logged and retried at the
    next look; anything else stops the loop.
    """
    engine = get_engine(postgres_url(settings))
    reconcile = getattr(deploy, "reconcile", None)
    interval = settings.serving.canary.interval_s
    log.info("canary controller on fleet %s, every %.1f s", settings.serving.fleet, interval)
    if settings.vllm.urls:
        log.info("registering the replicas vllm.urls names: %s", ", ".join(settings.vllm.urls))
    else:
        log.info("vllm.urls is empty: the fleet's replicas are the ones registered already (flywheel fleet register)")
    looks = 0
    while max_looks is None or looks < max_looks:
        looks += 1
        started = time.monotonic()
        try:
            register_configured(engine, settings)
        except REGISTRATION_ERRORS as err:
            log.warning("fleet registration failed, retrying at the next look: %s", err)
        try:
            if reconcile is not None:
                reconcile(engine, settings, actor=ACTOR)
            apply_settings_pins(engine, settings)
            run_once(engine, settings)
            auto_deploy(engine, settings)
        except (DeployError, OperationalError, VllmAdminError) as err:
            log.warning("canary look failed, retrying at the next one: %s", err)
        if max_looks is None or looks < max_looks:
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
