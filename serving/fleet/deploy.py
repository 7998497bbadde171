"""The deployment state machine of a fleet: canary, weight, promote, rollback, reconcile.

A deployment row (``deployments``) is ``pending`` while its replicas are being swapped,
``active`` while it serves (one active ``stable`` and at most one active ``canary`` per
fleet), and ends ``promoted``, ``rolled_back``, ``superseded`` or ``failed``. Under the
full-weight strategy a canary owns ``serving.canary_replicas`` replicas (never all of
them); under ``lora`` its adapter is loaded on every replica beside the stable weights.

Every operation holds the fleet's advisory lock (:func:`serving.fleet.registry.fleet_lock`: a
concurrent one is refused with ``conflict``) and writes one ``audit_log`` row (actor,
action, ``fleet:<name>``, the fleet status before and after, details with the swaps'
numbers), also when it is refused or fails (``success=false``). Each returns
``{"fleet", "stable", "canary", "pins", "ended", "swaps"}``: the fleet's active (or pending) stable
and canary deployments and role pins after the change, the deployments it ended, and the swaps it ran.

:func:`check_canary`, :func:`check_weight`, :func:`check_promote` and :func:`check_rollback`
raise the refusals an operation would raise as of now, without the lock and without reading
every tensor of a checkpoint: the admin API answers them at once, before it accepts the
operation it runs in the background (the operation checks again under the lock).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from flywheel.core import vllm_admin
from flywheel.core.db.models import AuditLog, Checkpoint, Deployment, Replica
from serving.fleet.registry import (
    DeployError,
    active_deployment,
    active_pins,
    fleet_lock,
    fleet_replicas,
    fleet_status,
    set_replica,
    try_fleet_lock,
)
from serving.fleet.strategies import Target, get_strategy
from serving.fleet.swap import SwapResult, Verifier, check_weights, rolling_swap, swap_replica

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from flywheel.core.settings import Settings

__all__ = [
    "DeployError",
    "check_canary",
    "check_promote",
    "check_rollback",
    "check_weight",
    "deploy_canary",
    "promote",
    "reconcile",
    "rollback",
    "set_canary_weight",
]

UNUSABLE_STATUSES = ("rejected", "deleted")

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- audit


@dataclass
class _Audit:
    actor: str
    action: str
    target: str
    details: dict[str, Any]
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    ended: list[dict[str, Any]] = field(default_factory=list)


def _write_audit(engine: Engine, record: _Audit, success: bool) -> None:
    with Session(engine) as session:
        session.add(
            AuditLog(
                actor=record.actor,
                action=record.action,
                target=record.target,
                before=record.before,
                after=record.after,
                details=record.details,
                success=success,
            )
        )
        session.commit()


@contextmanager
def _audited(engine: Engine, actor: str, action: str, fleet: str, details: dict[str, Any]) -> Iterator[_Audit]:
    """One audit row for the operation in the block: ``success`` unless it raised (then re-raised)."""
    record = _Audit(actor, action, f"fleet:{fleet}", details)
    try:
        yield record
    except DeployError as err:
        record.details.update(error=err.kind, message=err.message)
        _write_audit(engine, record, success=False)
        raise
    except Exception as err:  # unexpected: recorded as a failed operation, then re-raised
        record.details.update(error=type(err).__name__, message=str(err)[:2000])
        _write_audit(engine, record, success=False)
        raise
    _write_audit(engine, record, success=True)


def _snapshot(engine: Engine, fleet: str) -> dict[str, Any]:
    return fleet_status(engine, fleet).to_dict()


def _answer(engine: Engine, fleet: str, record: _Audit, swaps: list[SwapResult]) -> dict[str, Any]:
    """The operation's return value; also the audit row's ``after``."""
    status = _snapshot(engine, fleet)
    record.after = status
    return {
        "fleet": fleet,
        "stable": status["stable"],
        "canary": status["canary"],
        "pins": status["pins"],
        "ended": record.ended,
        "swaps": [s.to_dict() for s in swaps],
    }


# --------------------------------------------------------------------------- checks


def validate_weight(weight: float) -> float:
    """A canary's traffic weight: a number in (0, 1]; :class:`DeployError` ``invalid`` otherwise."""
    try:
        value = float(weight)
    except (TypeError, ValueError):
        raise DeployError("invalid", f"weight {weight!r} is not a number") from None
    if math.isnan(value) or not 0.0 < value <= 1.0:
        raise DeployError("invalid", f"weight {weight!r} is outside (0, 1]")
    return value


def usable_checkpoint(session: Session, checkpoint_id: str, strategy: str, *, finite: bool = True) -> Checkpoint:
    """The checkpoint row, refused when unknown, rejected or deleted, of the wrong format, or its files invalid.

    ``finite=False`` checks the files' headers, sizes and shapes but does not read every tensor
    (:func:`~serving.fleet.swap.check_weights`).
    """
    row = session.get(Checkpoint, checkpoint_id)
    if row is None:
        raise DeployError("not_found", f"no checkpoint {checkpoint_id!r} in the registry")
    if row.status in UNUSABLE_STATUSES:
        why = f": {row.status_reason}" if row.status_reason else ""
        raise DeployError("invalid", f"checkpoint {checkpoint_id} is {row.status}{why}")
    if strategy == "full" and row.format != "full":
        raise DeployError(
            "invalid", f"checkpoint {checkpoint_id} is a {row.format} checkpoint; the fleet's strategy is full weights"
        )
    try:
        check_weights(row.path, reference=_served_model_folder(row), finite=finite)
    except vllm_admin.CheckpointInvalid as err:
        raise DeployError("invalid", f"checkpoint {checkpoint_id} has invalid files: {err}") from None
    return row


def _served_model_folder(row: Checkpoint) -> str | None:
    """The base model folder a full-weight checkpoint's shapes are checked against, when this host sees it."""
    if row.format == "full" and row.base_model and Path(row.base_model).is_dir():
        return row.base_model
    return None


def _require_stable(session: Session, fleet: str) -> Deployment:
    stable = active_deployment(session, fleet, "stable")
    if stable is None:
        raise DeployError("conflict", f"fleet {fleet!r} has no active stable deployment (run ensure_fleet first)")
    return stable


def canary_urls(replicas: list[Replica], stable_checkpoint_id: str, wanted: int, fleet: str) -> list[str]:
    """The replicas a full-weight canary takes: the last ``wanted`` serving the stable, never all of them."""
    candidates = [r.url for r in replicas if r.state == "serving" and r.checkpoint_id == stable_checkpoint_id]
    if wanted >= len(candidates):
        raise DeployError(
            "conflict",
            f"fleet {fleet!r} has {len(candidates)} replica(s) serving the stable checkpoint; a full-weight canary "
            f"on serving.canary_replicas={wanted} of them would leave no stable replica: add replicas, lower "
            "serving.canary_replicas, or use the lora strategy",
        )
    return candidates[-wanted:]


def pin_ids(session: Session, fleet: str) -> set[int]:
    """Ids of the fleet's active or pending pins (:mod:`serving.fleet.pins`)."""
    return {row.id for row in active_pins(session, fleet)}


def without_pins(session: Session, fleet: str, replicas: list[Replica]) -> list[Replica]:
    """``replicas`` less those a role pin owns: stable and canary operations never move them."""
    owned = pin_ids(session, fleet)
    return [r for r in replicas if r.deployment_id is None or r.deployment_id not in owned]


def _live_urls(replicas: list[Replica]) -> list[str]:
    return [r.url for r in replicas if r.state != "failed"]


def _plan_canary(
    session: Session, settings: Settings, checkpoint_id: str, *, finite: bool = True
) -> tuple[Checkpoint, Deployment, list[str]]:
    """The checkpoint, the stable and the replicas a canary of ``checkpoint_id`` would take; refusals raise."""
    fleet, strategy = settings.serving.fleet, settings.serving.strategy
    checkpoint = usable_checkpoint(session, checkpoint_id, strategy, finite=finite)
    if strategy == "lora" and checkpoint.format != "lora":
        raise DeployError(
            "invalid", f"checkpoint {checkpoint_id} holds full weights; the fleet's strategy is lora adapters"
        )
    current = active_deployment(session, fleet, "canary")
    if current is not None:
        raise DeployError(
            "conflict",
            f"fleet {fleet!r} already has an active canary "
            f"(deployment {current.id}, checkpoint {current.checkpoint_id})",
        )
    stable = _require_stable(session, fleet)
    if stable.checkpoint_id == checkpoint_id:
        raise DeployError("conflict", f"checkpoint {checkpoint_id} is already the stable deployment of fleet {fleet!r}")
    replicas = fleet_replicas(session, fleet)
    if strategy == "full":
        replicas = without_pins(session, fleet, replicas)
        urls = canary_urls(replicas, stable.checkpoint_id, settings.serving.canary_replicas, fleet)
    else:
        urls = _live_urls(replicas)
    return checkpoint, stable, urls


def _require_canary(session: Session, fleet: str, doing: str = "") -> Deployment:
    canary = active_deployment(session, fleet, "canary")
    if canary is None:
        raise DeployError("conflict", f"fleet {fleet!r} has no active canary{doing}")
    return canary


def _check_rollback_with_canary(fleet: str, stable: Deployment, canary: Deployment, to: str | None) -> None:
    if to not in (None, stable.checkpoint_id):
        raise DeployError(
            "conflict",
            f"fleet {fleet!r} has an active canary (deployment {canary.id}): roll it back first, "
            f"then roll the stable back to {to}",
        )


def _stable_target(
    session: Session, settings: Settings, stable: Deployment, to_checkpoint_id: str | None, *, finite: bool = True
) -> Checkpoint:
    """The checkpoint a rollback without a canary makes the stable: ``to_checkpoint_id`` or the previous stable."""
    fleet = settings.serving.fleet
    target_id = to_checkpoint_id or _previous_stable(session, fleet, stable)
    if target_id is None:
        raise DeployError("not_found", f"fleet {fleet!r} has no previous stable deployment to roll back to")
    checkpoint = usable_checkpoint(session, target_id, settings.serving.strategy, finite=finite)
    if target_id == stable.checkpoint_id:
        raise DeployError("conflict", f"checkpoint {target_id} is already the stable deployment of fleet {fleet!r}")
    return checkpoint


# --------------------------------------------------------------------------- checks before an operation


def check_canary(engine: Engine, settings: Settings, checkpoint_id: str, weight: float) -> None:
    """The refusals of :func:`deploy_canary` as of now, without the lock and without reading every tensor.

    Raises the :class:`DeployError` the operation would raise before touching a replica
    (``deploy_canary`` checks again, under the lock, and reads the tensors).
    """
    validate_weight(weight)
    with Session(engine) as session:
        _plan_canary(session, settings, checkpoint_id, finite=False)


def check_weight(engine: Engine, settings: Settings, weight: float) -> None:
    """The refusals of :func:`set_canary_weight` as of now (bad weight, no active canary)."""
    validate_weight(weight)
    with Session(engine) as session:
        _require_canary(session, settings.serving.fleet)


def check_promote(engine: Engine, settings: Settings) -> None:
    """The refusals of :func:`promote` as of now (no active canary, no stable)."""
    with Session(engine) as session:
        _require_canary(session, settings.serving.fleet, " to promote")
        _require_stable(session, settings.serving.fleet)


def check_rollback(engine: Engine, settings: Settings, to_checkpoint_id: str | None) -> None:
    """The refusals of :func:`rollback` as of now, without reading every tensor of the target."""
    fleet = settings.serving.fleet
    with Session(engine) as session:
        stable = _require_stable(session, fleet)
        canary = active_deployment(session, fleet, "canary")
        if canary is not None:
            _check_rollback_with_canary(fleet, stable, canary, to_checkpoint_id)
        else:
            _stable_target(session, settings, stable, to_checkpoint_id, finite=False)


# --------------------------------------------------------------------------- rows


def _end(session: Session, row: Deployment, status: str, reason: str, record: _Audit) -> None:
    row.status, row.reason = status, reason
    row.ended_at = row.updated_at = func.now()
    session.flush()
    record.ended.append(
        {"id": row.id, "checkpoint_id": row.checkpoint_id, "role": row.role, "status": status, "reason": reason}
    )


def _mark_deployed(session: Session, checkpoint_id: str, reason: str) -> None:
    row = session.get(Checkpoint, checkpoint_id)
    if row is not None:
        row.status, row.status_reason, row.last_deployed_at = "deployed", reason, func.now()


def _rollout(
    engine: Engine,
    settings: Settings,
    urls: list[str],
    checkpoint: Checkpoint,
    deployment_id: int,
    verify: Verifier | None,
    actor: str,
) -> list[SwapResult]:
    """Swap ``urls`` one at a time; under ``lora`` a full checkpoint (the base) is already on every replica."""
    if settings.serving.strategy == "lora" and checkpoint.format == "full":
        return []
    return rolling_swap(engine, settings, urls, checkpoint.id, deployment_id, verify=verify, actor=actor)


def _swap_back(
    engine: Engine,
    settings: Settings,
    swaps: list[SwapResult],
    checkpoint: Checkpoint,
    deployment_id: int,
    verify: Verifier | None,
    actor: str,
) -> list[SwapResult]:
    """Return the replicas that ``swaps`` moved successfully to ``checkpoint`` (after a later one failed)."""
    moved = [s.url for s in swaps if s.ok and s.from_version != s.to_version]
    if not moved or settings.serving.strategy == "lora":
        return []
    return rolling_swap(engine, settings, moved, checkpoint.id, deployment_id, verify=verify, actor=actor)


def _failure(swaps: list[SwapResult]) -> SwapResult | None:
    return next((s for s in swaps if not s.ok), None)


def _describe(failed: SwapResult) -> str:
    outcome = "reverted to its previous weights" if failed.reverted else f"replica {failed.state or 'untouched'}"
    return f"swap of {failed.url} to {failed.to_version} failed ({outcome}): {failed.reason}"


# --------------------------------------------------------------------------- operations


def deploy_canary(
    engine: Engine,
    settings: Settings,
    checkpoint_id: str,
    weight: float,
    actor: str,
    details: dict[str, Any] | None = None,
    *,
    verify: Verifier | None = None,
) -> dict[str, Any]:
    """Deploy ``checkpoint_id`` as the fleet's canary with traffic ``weight``.

    Refused (nothing changed): unknown checkpoint (``not_found``); rejected or deleted
    checkpoint, invalid files, weight outside (0, 1] (``invalid``); a canary already active,
    no stable, or too few replicas for a full-weight canary (``conflict``). Otherwise a
    ``pending`` canary row, its replicas swapped, then ``active``; when a swap fails the
    replicas already moved go back to the stable, the row ends ``failed`` with the reason
    and :class:`DeployError` ``failed`` is raised.
    """
    fleet, strategy = settings.serving.fleet, settings.serving.strategy
    info = {"checkpoint_id": checkpoint_id, "weight": weight, "strategy": strategy, **(details or {})}
    with _audited(engine, actor, "deploy.canary", fleet, info) as record, fleet_lock(engine, fleet):
        record.before = _snapshot(engine, fleet)
        weight = validate_weight(weight)
        with Session(engine, expire_on_commit=False) as session:
            checkpoint, stable, urls = _plan_canary(session, settings, checkpoint_id)
            canary = Deployment(
                fleet=fleet,
                checkpoint_id=checkpoint_id,
                role="canary",
                weight=weight,
                strategy=strategy,
                status="pending",
                created_by=actor,
            )
            session.add(canary)
            session.commit()
            stable_checkpoint = session.get(Checkpoint, stable.checkpoint_id)
        swaps = _rollout(engine, settings, urls, checkpoint, canary.id, verify, actor)
        failed = _failure(swaps)
        if failed is not None:
            back = _swap_back(engine, settings, swaps, stable_checkpoint, stable.id, verify, actor)
            reason = _describe(failed)
            if _failure(back) is not None:
                reason += f"; returning the replicas already swapped failed: {_describe(_failure(back))}"
            with Session(engine) as session:
                _end(session, session.get(Deployment, canary.id), "failed", reason, record)
                session.commit()
            record.details["swaps"] = [s.to_dict() for s in swaps + back]
            _answer(engine, fleet, record, swaps + back)
            raise DeployError("failed", reason)
        with Session(engine) as session:
            row = session.get(Deployment, canary.id)
            row.status, row.updated_at = "active", func.now()
            session.commit()
        record.details["swaps"] = [s.to_dict() for s in swaps]
        return _answer(engine, fleet, record, swaps)


def set_canary_weight(
    engine: Engine,
    settings: Settings,
    weight: float,
    actor: str,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Change the active canary's traffic weight (in (0, 1]); ``conflict`` without an active canary."""
    fleet = settings.serving.fleet
    with (
        _audited(engine, actor, "deploy.weight", fleet, {"weight": weight, **(details or {})}) as record,
        fleet_lock(engine, fleet),
    ):
        record.before = _snapshot(engine, fleet)
        weight = validate_weight(weight)
        with Session(engine) as session:
            canary = _require_canary(session, fleet)
            record.details["previous_weight"] = canary.weight
            canary.weight, canary.updated_at = weight, func.now()
            session.commit()
        return _answer(engine, fleet, record, [])


def promote(
    engine: Engine,
    settings: Settings,
    actor: str,
    details: dict[str, Any] | None = None,
    *,
    verify: Verifier | None = None,
) -> dict[str, Any]:
    """Make the active canary the stable: swap every other replica to it, one at a time, then flip the rows.

    Old stable ``superseded``, canary ``promoted``, a new active stable row of the canary's
    checkpoint (weight 1.0), the checkpoint ``deployed``. When a swap fails the promotion
    stops (``failed``): stable and canary stay active, the replicas already swapped serve the
    canary, the failed one is reverted or marked failed; promoting again continues.
    """
    fleet = settings.serving.fleet
    with _audited(engine, actor, "deploy.promote", fleet, dict(details or {})) as record, fleet_lock(engine, fleet):
        record.before = _snapshot(engine, fleet)
        with Session(engine, expire_on_commit=False) as session:
            canary = _require_canary(session, fleet, " to promote")
            stable = _require_stable(session, fleet)
            checkpoint = session.get(Checkpoint, canary.checkpoint_id)
            replicas = without_pins(session, fleet, fleet_replicas(session, fleet))
            urls = [r.url for r in replicas if r.state != "failed" and r.checkpoint_id != canary.checkpoint_id]
            pins = pin_ids(session, fleet)
        record.details.update(canary_id=canary.id, stable_id=stable.id, checkpoint_id=canary.checkpoint_id)
        swaps = _rollout(engine, settings, urls, checkpoint, canary.id, verify, actor)
        record.details["swaps"] = [s.to_dict() for s in swaps]
        failed = _failure(swaps)
        if failed is not None:
            _answer(engine, fleet, record, swaps)
            raise DeployError("failed", f"promotion stopped, stable and canary stay active: {_describe(failed)}")
        with Session(engine) as session:
            old, promoted = session.get(Deployment, stable.id), session.get(Deployment, canary.id)
            _end(
                session, old, "superseded", f"superseded by canary deployment {canary.id} (promoted by {actor})", record
            )
            _end(session, promoted, "promoted", f"promoted by {actor}", record)
            new = Deployment(
                fleet=fleet,
                checkpoint_id=canary.checkpoint_id,
                role="stable",
                weight=1.0,
                strategy=canary.strategy,
                status="active",
                reason=f"promoted from canary deployment {canary.id}",
                created_by=actor,
            )
            session.add(new)
            session.flush()
            session.execute(
                update(Replica)
                .where(
                    Replica.fleet == fleet,
                    Replica.checkpoint_id == canary.checkpoint_id,
                    or_(Replica.deployment_id.is_(None), Replica.deployment_id.not_in(pins or {-1})),
                )
                .values(deployment_id=new.id, updated_at=func.now())
            )
            _mark_deployed(session, canary.checkpoint_id, f"promoted to stable of fleet {fleet} by {actor}")
            session.commit()
        return _answer(engine, fleet, record, swaps)


def rollback(
    engine: Engine,
    settings: Settings,
    actor: str,
    to_checkpoint_id: str | None = None,
    details: dict[str, Any] | None = None,
    *,
    verify: Verifier | None = None,
) -> dict[str, Any]:
    """Roll back the canary (its replicas back to the stable), or, without one, the stable.

    With an active canary (``to_checkpoint_id`` None or the stable's): the canary ends
    ``rolled_back`` first (no new session reaches it), then its replicas are swapped back to
    the stable. Without a canary: every replica, one at a time, to ``to_checkpoint_id`` or
    the previous stable, under a new stable row (``pending`` until all swapped, then
    ``active``; the old one ``superseded``). A failed swap raises ``failed``; a failed stable
    rollback returns the replicas already moved to the current stable.
    """
    fleet = settings.serving.fleet
    info = {"to_checkpoint_id": to_checkpoint_id, **(details or {})}
    with _audited(engine, actor, "deploy.rollback", fleet, info) as record, fleet_lock(engine, fleet):
        record.before = _snapshot(engine, fleet)
        with Session(engine, expire_on_commit=False) as session:
            stable = _require_stable(session, fleet)
            canary = active_deployment(session, fleet, "canary")
        if canary is not None:
            _check_rollback_with_canary(fleet, stable, canary, to_checkpoint_id)
            return _rollback_canary(
                engine, settings, record, stable, canary, actor, verify, (details or {}).get("reason")
            )
        return _rollback_stable(engine, settings, record, stable, to_checkpoint_id, actor, verify)


def _rollback_canary(
    engine: Engine,
    settings: Settings,
    record: _Audit,
    stable: Deployment,
    canary: Deployment,
    actor: str,
    verify: Verifier | None,
    reason: str | None,
) -> dict[str, Any]:
    fleet = settings.serving.fleet
    record.details.update(canary_id=canary.id, stable_id=stable.id, from_checkpoint_id=canary.checkpoint_id)
    with Session(engine, expire_on_commit=False) as session:
        _end(session, session.get(Deployment, canary.id), "rolled_back", reason or f"rolled back by {actor}", record)
        session.commit()
        checkpoint = session.get(Checkpoint, stable.checkpoint_id)
        replicas = fleet_replicas(session, fleet)
    urls = [
        r.url
        for r in replicas
        if r.state != "failed" and (r.deployment_id == canary.id or r.checkpoint_id == canary.checkpoint_id)
    ]
    swaps = _rollout(engine, settings, urls, checkpoint, stable.id, verify, actor)
    record.details["swaps"] = [s.to_dict() for s in swaps]
    failed = _failure(swaps)
    if failed is not None:
        _answer(engine, fleet, record, swaps)
        raise DeployError(
            "failed", f"canary rolled back, but a replica did not return to the stable: {_describe(failed)}"
        )
    return _answer(engine, fleet, record, swaps)


def _previous_stable(session: Session, fleet: str, current: Deployment) -> str | None:
    query = (
        select(Deployment.checkpoint_id)
        .where(
            Deployment.fleet == fleet,
            Deployment.role == "stable",
            Deployment.status == "superseded",
            Deployment.checkpoint_id != current.checkpoint_id,
        )
        .order_by(Deployment.id.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def _rollback_stable(
    engine: Engine,
    settings: Settings,
    record: _Audit,
    stable: Deployment,
    to_checkpoint_id: str | None,
    actor: str,
    verify: Verifier | None,
) -> dict[str, Any]:
    fleet = settings.serving.fleet
    with Session(engine, expire_on_commit=False) as session:
        checkpoint = _stable_target(session, settings, stable, to_checkpoint_id)
        target_id = checkpoint.id
        new = Deployment(
            fleet=fleet,
            checkpoint_id=target_id,
            role="stable",
            weight=1.0,
            strategy=settings.serving.strategy,
            status="pending",
            reason=f"rollback from {stable.checkpoint_id} by {actor}",
            created_by=actor,
        )
        session.add(new)
        session.commit()
        current_checkpoint = session.get(Checkpoint, stable.checkpoint_id)
        urls = _live_urls(without_pins(session, fleet, fleet_replicas(session, fleet)))
    record.details.update(
        stable_id=stable.id, new_stable_id=new.id, from_checkpoint_id=stable.checkpoint_id, to_checkpoint_id=target_id
    )
    swaps = _rollout(engine, settings, urls, checkpoint, new.id, verify, actor)
    failed = _failure(swaps)
    if failed is not None:
        back = _swap_back(engine, settings, swaps, current_checkpoint, stable.id, verify, actor)
        reason = _describe(failed)
        with Session(engine) as session:
            _end(session, session.get(Deployment, new.id), "failed", reason, record)
            session.commit()
        record.details["swaps"] = [s.to_dict() for s in swaps + back]
        _answer(engine, fleet, record, swaps + back)
        raise DeployError("failed", f"rollback stopped, the stable is unchanged: {reason}")
    with Session(engine) as session:
        _end(
            session, session.get(Deployment, stable.id), "superseded", f"rolled back to {target_id} by {actor}", record
        )
        row = session.get(Deployment, new.id)
        row.status, row.updated_at = "active", func.now()
        _mark_deployed(session, target_id, f"stable of fleet {fleet} after a rollback by {actor}")
        session.commit()
    record.details["swaps"] = [s.to_dict() for s in swaps]
    return _answer(engine, fleet, record, swaps)


# --------------------------------------------------------------------------- reconcile


def _desired(session: Session, replica: Replica, stable: Deployment) -> Deployment:
    """The deployment a replica should serve: its own when that is active (or pending), else the stable."""
    if replica.deployment_id is not None:
        row = session.get(Deployment, replica.deployment_id)
        if row is not None and row.status == "active":
            return row
    return stable


def reconcile(
    engine: Engine, settings: Settings, actor: str = "reconciler", *, verify: Verifier | None = None
) -> list[SwapResult]:
    """Bring every healthy replica back to what its deployment says it should serve.

    A replica restarted by its supervisor comes back with the base weights (and version):
    it is swapped, one replica at a time, to its active deployment's checkpoint (else the
    stable's). A replica left paused by a crashed swap is resumed first; one that does not
    answer ``/health`` is marked ``failed``. A deployment still ``pending`` (an operation's
    process stopped mid-way: no operation runs while the lock is free) ends ``failed`` first,
    and its replicas go back to what they should serve. Holds the fleet lock (``conflict``
    when taken); writes an audit row only when it changed something.
    """
    fleet = settings.serving.fleet
    swaps: list[SwapResult] = []
    marked: list[dict[str, Any]] = []
    with try_fleet_lock(engine, fleet) as held:
        if not held:
            raise DeployError("conflict", f"another deployment operation is running on fleet {fleet!r}")
        before = _snapshot(engine, fleet)
        orphans = _end_orphaned(engine, fleet, actor)
        with Session(engine, expire_on_commit=False) as session:
            stable = active_deployment(session, fleet, "stable")
            if stable is None:
                return []
            plan = []
            for replica in fleet_replicas(session, fleet):
                desired = _desired(session, replica, stable)
                plan.append((replica, desired, session.get(Checkpoint, desired.checkpoint_id)))
        for replica, desired, checkpoint in plan:
            if not vllm_admin.health(replica.url):
                if replica.state != "failed":
                    set_replica(
                        engine, replica.url, state="failed", reason="unreachable: /health did not answer (reconcile)"
                    )
                    marked.append({"url": replica.url, "state": "failed"})
                continue
            if _needs_swap(settings, replica, desired, checkpoint):
                swaps.append(
                    swap_replica(engine, settings, replica.url, checkpoint.id, desired.id, verify=verify, actor=actor)
                )
        if swaps or marked or orphans:
            details = {"swaps": [s.to_dict() for s in swaps], "marked": marked, "ended": orphans}
            record = _Audit(actor, "deploy.reconcile", f"fleet:{fleet}", details)
            record.before, record.after = before, _snapshot(engine, fleet)
            _write_audit(engine, record, success=all(s.ok for s in swaps))
    return swaps


def _end_orphaned(engine: Engine, fleet: str, actor: str) -> list[dict[str, Any]]:
    """End the fleet's ``pending`` deployments (``failed``): called with the fleet lock held, so no operation
    is running, and every operation finishes its pending row before it lets the lock go. A pending row now
    was left by an operation whose process stopped mid-way; its replicas return to the stable after it."""
    ended: list[dict[str, Any]] = []
    with Session(engine) as session:
        query = select(Deployment).where(Deployment.fleet == fleet, Deployment.status == "pending")
        for row in session.scalars(query.order_by(Deployment.id)):
            reason = f"left pending by an operation that stopped mid-way (its process ended); ended by {actor}"
            row.status, row.reason = "failed", reason
            row.ended_at = row.updated_at = func.now()
            ended.append({"id": row.id, "checkpoint_id": row.checkpoint_id, "role": row.role, "status": "failed"})
            log.warning("fleet %s: deployment %d (%s %s) %s", fleet, row.id, row.role, row.checkpoint_id, reason)
        session.commit()
    return ended


def _needs_swap(settings: Settings, replica: Replica, desired: Deployment, checkpoint: Checkpoint) -> bool:
    """Whether a healthy replica differs from ``desired`` (resuming it first if a crashed swap left it paused)."""
    if vllm_admin.is_paused(replica.url):
        vllm_admin.resume(replica.url)
        return True
    if settings.serving.strategy == "lora":
        if checkpoint.format == "full":
            return replica.state != "serving"
        adapter = get_strategy(settings.serving.strategy)
        return not adapter.reports(replica.url, _target_of(checkpoint)) or replica.state != "serving"
    in_sync = (
        replica.state == "serving" and replica.checkpoint_id == checkpoint.id and replica.deployment_id == desired.id
    )
    return not in_sync or vllm_admin.weight_info(replica.url) != checkpoint.policy_version


def _target_of(checkpoint: Checkpoint) -> Target:
    return Target(checkpoint.id, checkpoint.policy_version, checkpoint.path, checkpoint.format)
