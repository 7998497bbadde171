"""Role pins: every request of one agent role served by a frozen checkpoint, whatever stable and canary do.

PARL's sub-agents run on a frozen checkpoint while the orchestrator learns. A pin is a
deployment row with role ``pinned`` and its ``agent_role``; the router sends each request
whose ``x-flywheel-agent-role`` header names a pinned role to the pin's policy version (and
answers 503 naming the pin when no replica serves it: a pinned role never silently runs on
the learning policy).

How a pin reaches replicas follows the fleet's strategy, as a canary's does:

- ``full``: the pin owns ``serving.pin_replicas`` replicas, taken from those serving the
  stable (never all of them), swapped to the pinned checkpoint. Promotions, rollbacks and
  canaries leave them alone; unpinning swaps them back to the stable.
- ``lora``: the pinned adapter is loaded on every replica beside the others (a full-weight
  checkpoint under ``lora`` is the base, already on every replica).

Pins come from two places: ``serving.role_pins`` in settings (applied by the canary
controller's reconcile tick, :func:`apply_settings_pins`) and the admin API. A role pinned
in settings cannot be re-pinned or unpinned through the API (``conflict``, naming the
setting). A role the trainer trains (``trainer.data.trainable_roles`` or
``rewarding.scoring.trainable_roles``) cannot be pinned: its samples come from a frozen
checkpoint and must not be trained on as if they were the policy's own.

Every operation holds the fleet lock and writes one audit row, like :mod:`serving.fleet.deploy`.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from flywheel.core.db.models import Checkpoint, Deployment
from serving.fleet.deploy import (
    _answer,
    _audited,
    _describe,
    _end,
    _failure,
    _require_stable,
    _rollout,
    _snapshot,
    usable_checkpoint,
    without_pins,
)
from serving.fleet.registry import DeployError, active_pins, fleet_lock, fleet_replicas, try_fleet_lock

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from flywheel.core.settings import Settings
    from serving.fleet.swap import SwapResult, Verifier

__all__ = [
    "apply_settings_pins",
    "check_pin",
    "check_unpin",
    "pin_role",
    "unpin_role",
]

log = logging.getLogger(__name__)

SETTINGS_ACTOR = "settings"


def _pin_of(session: Session, fleet: str, agent_role: str) -> Deployment | None:
    return next((p for p in active_pins(session, fleet) if p.agent_role == agent_role), None)


def _resolve(session: Session, ref: str) -> str:
    """A checkpoint id from a checkpoint id or a policy version."""
    if session.get(Checkpoint, ref) is not None:
        return ref
    found = session.scalars(select(Checkpoint.id).where(Checkpoint.policy_version == ref)).first()
    return found if found is not None else ref


def validate_agent_role(agent_role: str) -> str:
    """An agent role as the SDK's header carries it: 1-64 characters of ``[A-Za-z0-9._-]``."""
    if not isinstance(agent_role, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", agent_role):
        raise DeployError(
            "invalid", f"agent role {agent_role!r} is not 1-64 characters of letters, digits, '.', '_', '-'"
        )
    return agent_role


def _trained_roles(settings: Settings) -> set[str]:
    return set(settings.trainer.data.trainable_roles) | set(settings.rewarding.scoring.trainable_roles)


def _check_role(settings: Settings, agent_role: str, actor: str) -> None:
    validate_agent_role(agent_role)
    if agent_role in _trained_roles(settings):
        raise DeployError(
            "conflict",
            f"agent role {agent_role!r} is trained (trainer.data.trainable_roles / "
            "rewarding.scoring.trainable_roles): a pinned role's completions come from a frozen checkpoint "
            "and must not be trained on; take it out of the trainable roles first",
        )
    if actor != SETTINGS_ACTOR and agent_role in settings.serving.role_pins:
        raise DeployError(
            "conflict",
            f"agent role {agent_role!r} is pinned by settings (serving.role_pins = "
            f"{settings.serving.role_pins[agent_role]!r}); change the setting instead",
        )


def _plan_pin(
    session: Session, settings: Settings, agent_role: str, checkpoint_ref: str, actor: str, *, finite: bool = True
) -> tuple[Checkpoint, Deployment, Deployment | None, list[str]]:
    """The checkpoint, the stable, the pin it replaces and the replicas a pin would take; refusals raise."""
    fleet, strategy = settings.serving.fleet, settings.serving.strategy
    _check_role(settings, agent_role, actor)
    checkpoint_id = _resolve(session, checkpoint_ref)
    checkpoint = usable_checkpoint(session, checkpoint_id, strategy, finite=finite)
    stable = _require_stable(session, fleet)
    current = _pin_of(session, fleet, agent_role)
    if current is not None and current.status == "pending":
        raise DeployError("conflict", f"agent role {agent_role!r} is being pinned (deployment {current.id})")
    if current is not None and current.checkpoint_id == checkpoint_id:
        raise DeployError("conflict", f"agent role {agent_role!r} is already pinned to checkpoint {checkpoint_id}")
    replicas = [r for r in fleet_replicas(session, fleet) if r.state != "failed"]
    if strategy != "full":
        return checkpoint, stable, current, [r.url for r in replicas]
    if current is not None:  # re-pin: the same replicas take the new checkpoint
        return checkpoint, stable, current, [r.url for r in replicas if r.deployment_id == current.id]
    candidates = [
        r.url
        for r in without_pins(session, fleet, replicas)
        if r.state == "serving" and r.checkpoint_id == stable.checkpoint_id
    ]
    wanted = settings.serving.pin_replicas
    if wanted >= len(candidates):
        raise DeployError(
            "conflict",
            f"fleet {fleet!r} has {len(candidates)} replica(s) serving the stable checkpoint and no pin; pinning "
            f"agent role {agent_role!r} on serving.pin_replicas={wanted} of them would leave no stable replica: "
            "add replicas, or use the lora strategy",
        )
    return checkpoint, stable, current, candidates[:wanted]


def check_pin(engine: Engine, settings: Settings, agent_role: str, checkpoint_ref: str, actor: str) -> None:
    """The refusals of :func:`pin_role` as of now, without the lock and without reading every tensor."""
    with Session(engine) as session:
        _plan_pin(session, settings, agent_role, checkpoint_ref, actor, finite=False)


def check_unpin(engine: Engine, settings: Settings, agent_role: str, actor: str) -> None:
    """The refusals of :func:`unpin_role` as of now."""
    validate_agent_role(agent_role)
    if actor != SETTINGS_ACTOR and agent_role in settings.serving.role_pins:
        raise DeployError(
            "conflict",
            f"agent role {agent_role!r} is pinned by settings (serving.role_pins); change the setting instead",
        )
    with Session(engine) as session:
        if _pin_of(session, settings.serving.fleet, agent_role) is None:
            raise DeployError(
                "not_found", f"agent role {agent_role!r} is not pinned in fleet {settings.serving.fleet!r}"
            )


def pin_role(
    engine: Engine,
    settings: Settings,
    agent_role: str,
    checkpoint_ref: str,
    actor: str,
    details: dict[str, Any] | None = None,
    *,
    verify: Verifier | None = None,
) -> dict[str, Any]:
    """Pin ``agent_role`` to a checkpoint (its id or policy version); a role already pinned moves to it.

    Refused (nothing changed): bad role name, a trained role, a role pinned by settings (unless
    ``actor`` is ``settings``) (``invalid`` / ``conflict``); unknown, rejected or invalid
    checkpoint; no stable; too few stable replicas under ``full``. Otherwise a ``pending``
    pinned row, its replicas swapped, then ``active`` (a pin it replaces stays active until
    then, and ends ``unpinned``). When a swap fails the replicas already moved go back (to the
    pin it replaces, else the stable), the row ends ``failed`` and :class:`DeployError`
    ``failed`` is raised.
    """
    fleet, strategy = settings.serving.fleet, settings.serving.strategy
    info = {"agent_role": agent_role, "checkpoint": checkpoint_ref, "strategy": strategy, **(details or {})}
    with _audited(engine, actor, "deploy.pin", fleet, info) as record, fleet_lock(engine, fleet):
        record.before = _snapshot(engine, fleet)
        with Session(engine, expire_on_commit=False) as session:
            checkpoint, stable, current, urls = _plan_pin(session, settings, agent_role, checkpoint_ref, actor)
            record.details["checkpoint_id"] = checkpoint.id
            # Where a failed swap returns the replicas already moved: the pin being replaced, else the stable.
            back_to = session.get(Checkpoint, current.checkpoint_id if current else stable.checkpoint_id)
            back_id = current.id if current else stable.id
            pin = Deployment(
                fleet=fleet,
                checkpoint_id=checkpoint.id,
                role="pinned",
                agent_role=agent_role,
                weight=0.0,
                strategy=strategy,
                status="pending",
                created_by=actor,
            )
            session.add(pin)
            session.commit()
        # A pin being replaced stays active until the new one is: the role's requests never go to
        # the learning policy meanwhile (they wait for the replica being swapped, or get 503).
        swaps = _rollout(engine, settings, urls, checkpoint, pin.id, verify, actor)
        failed = _failure(swaps)
        if failed is not None:
            moved = [s.url for s in swaps if s.ok and s.from_version != s.to_version]
            back = _rollout(engine, settings, moved, back_to, back_id, verify, actor) if strategy == "full" else []
            reason = _describe(failed)
            with Session(engine) as session:
                _end(session, session.get(Deployment, pin.id), "failed", reason, record)
                session.commit()
            record.details["swaps"] = [s.to_dict() for s in swaps + back]
            _answer(engine, fleet, record, swaps + back)
            raise DeployError("failed", reason)
        with Session(engine) as session:
            if current is not None:
                old = session.get(Deployment, current.id)
                _end(session, old, "unpinned", f"re-pinned to {checkpoint.id} by {actor}", record)
            row = session.get(Deployment, pin.id)
            row.status, row.updated_at = "active", func.now()
            session.commit()
        record.details["swaps"] = [s.to_dict() for s in swaps]
        return _answer(engine, fleet, record, swaps)


def unpin_role(
    engine: Engine,
    settings: Settings,
    agent_role: str,
    actor: str,
    details: dict[str, Any] | None = None,
    *,
    verify: Verifier | None = None,
) -> dict[str, Any]:
    """End ``agent_role``'s pin (``unpinned``): its requests follow stable and canary again.

    Under ``full`` the pin's replicas are swapped back to the stable afterwards (a failed swap
    raises ``failed``; the reconciler finishes it). Refused: a role pinned by settings
    (``conflict``), a role not pinned (``not_found``).
    """
    fleet = settings.serving.fleet
    with (
        _audited(engine, actor, "deploy.unpin", fleet, {"agent_role": agent_role, **(details or {})}) as record,
        fleet_lock(engine, fleet),
    ):
        record.before = _snapshot(engine, fleet)
        check_unpin(engine, settings, agent_role, actor)
        with Session(engine, expire_on_commit=False) as session:
            pin = _pin_of(session, fleet, agent_role)
            if pin is None:  # unpinned meanwhile
                raise DeployError("not_found", f"agent role {agent_role!r} is not pinned in fleet {fleet!r}")
            stable = _require_stable(session, fleet)
            _end(session, pin, "unpinned", f"unpinned by {actor}", record)
            session.commit()
            checkpoint = session.get(Checkpoint, stable.checkpoint_id)
            urls = [r.url for r in fleet_replicas(session, fleet) if r.state != "failed" and r.deployment_id == pin.id]
        swaps: list[SwapResult] = []
        if settings.serving.strategy == "full":
            swaps = _rollout(engine, settings, urls, checkpoint, stable.id, verify, actor)
        record.details["swaps"] = [s.to_dict() for s in swaps]
        failed = _failure(swaps)
        if failed is not None:
            _answer(engine, fleet, record, swaps)
            raise DeployError("failed", f"unpinned, but a replica did not return to the stable: {_describe(failed)}")
        return _answer(engine, fleet, record, swaps)


def apply_settings_pins(engine: Engine, settings: Settings, *, verify: Verifier | None = None) -> list[dict[str, Any]]:
    """Pin each role of ``serving.role_pins`` that is not pinned to its checkpoint yet; returns what it did.

    Called on the canary controller's reconcile tick. A pin the settings name but cannot take
    (unknown checkpoint, too few replicas, a trained role) is logged and tried again next
    tick; the other pins go on. Skipped while another operation holds the fleet lock.
    """
    wanted = settings.serving.role_pins
    if not wanted:
        return []
    fleet = settings.serving.fleet
    done: list[dict[str, Any]] = []
    with try_fleet_lock(engine, fleet) as free:
        if not free:
            return []
    for agent_role, ref in sorted(wanted.items()):
        with Session(engine) as session:
            pin = _pin_of(session, fleet, agent_role)
            target = _resolve(session, ref)
            if pin is not None and pin.checkpoint_id == target and pin.status == "active":
                continue
        try:
            done.append(
                pin_role(
                    engine, settings, agent_role, ref, SETTINGS_ACTOR, {"source": "serving.role_pins"}, verify=verify
                )
            )
        except DeployError as err:
            log.warning("serving.role_pins[%r] = %r not applied: %s", agent_role, ref, err.message)
    return done
