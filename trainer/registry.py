"""The trainer's registry in Postgres: cycles, checkpoints, lineage, the pause flag, retention.

Tables (``flywheel.core.db.models``): ``training_cycles`` (one row per cycle, whatever its
result), ``checkpoints`` (one row per *complete* checkpoint folder), ``deployments``
(read: what serves now) and ``audit_log`` (the pause flag, see :func:`set_paused`).

One cycle at a time: :func:`cycle_lock` holds a session-level Postgres advisory lock on a
dedicated connection for the whole cycle. Postgres releases it when that connection ends,
so a killed worker never leaves the lock behind; its ``running`` row is then marked
``failed: worker lost`` by the next cycle (:func:`fail_stale_cycles`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Set
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import bindparam, func, or_, select, text, update
from sqlalchemy.dialects.postgresql import JSONB

from flywheel.core import pause
from flywheel.core.contracts.checkpoint import CheckpointEval, HeldoutResult
from flywheel.core.db.models import Checkpoint, Deployment, TrainingCycle
from flywheel.core.pause import PauseState
from trainer import ckpt

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

LOCK_KEY = 0x466C_5754
"""Advisory lock id of the training cycle ('FlWT')."""
ACTOR = "trainer"
WORKER_LOST = "worker lost"


# --------------------------------------------------------------------------- lock


@contextmanager
def cycle_lock(engine: Engine) -> Iterator[bool]:
    """Try the cycle lock without waiting; yields whether it is held, releases it on exit."""
    conn = engine.connect()
    held = False
    try:
        held = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOCK_KEY}).scalar())
        conn.commit()
        yield held
    finally:
        try:
            if held:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": LOCK_KEY})
                conn.commit()
        finally:
            conn.close()


# --------------------------------------------------------------------------- base and lineage


def lineage(session: Session) -> dict[str, tuple[str | None, str]]:
    """Every checkpoint id mapped to ``(parent_id, policy_version)``."""
    return {
        r.id: (r.parent_id, r.policy_version)
        for r in session.execute(select(Checkpoint.id, Checkpoint.parent_id, Checkpoint.policy_version))
    }


def serving_checkpoint_ids(session: Session) -> list[str]:
    """Checkpoints of active deployments (stable and canary, every fleet)."""
    return list(session.scalars(select(Deployment.checkpoint_id).where(Deployment.status == "active").distinct()))


def stable_checkpoint_id(session: Session) -> str | None:
    """The checkpoint of the newest active stable deployment, if any."""
    query = (
        select(Deployment.checkpoint_id)
        .where(Deployment.status == "active", Deployment.role == "stable")
        .order_by(Deployment.created_at.desc(), Deployment.id.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def latest_trained_id(session: Session) -> str | None:
    """The newest candidate or deployed checkpoint that has a parent (not a root)."""
    query = (
        select(Checkpoint.id)
        .where(Checkpoint.parent_id.is_not(None), Checkpoint.status.in_(("candidate", "deployed")))
        .order_by(Checkpoint.created_at.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def pending_lineage_tip(
    stable_id: str,
    checkpoints: list[tuple[str, str | None, str]],
    active_canaries: Set[str],
    tried: Set[str] = frozenset(),
) -> str:
    """The newest checkpoint that descends from the stable through checkpoints still on trial.

    ``checkpoints``: ``(id, parent_id, status)``, oldest first; ``tried``: every checkpoint that
    ever had a deployment (any role, any end). A checkpoint is *on trial* when it passed the gate
    and was never deployed (``candidate`` and not in ``tried``) or is an active canary now (a
    canary keeps its ``candidate`` status until promoted, so a rolled-back one is in ``tried``
    and no longer on trial). The
    tip is the newest on-trial checkpoint whose every ancestor up to ``stable_id`` is on trial
    too; without one, the stable itself. So training continues from the newest checkpoint
    not yet judged by live traffic, and a lineage whose member was rolled back (or rejected)
    is abandoned at once: nothing below it is ever trained from again.
    """
    parents = {cid: parent for cid, parent, _ in checkpoints}
    on_trial = {cid for cid, _, status in checkpoints if status == "candidate" and cid not in tried} | active_canaries
    for cid, _, _ in reversed(checkpoints):
        node, seen = cid, set()
        while node in on_trial and node not in seen:
            seen.add(node)
            node = parents.get(node)
        if node == stable_id and cid != stable_id:
            return cid
    return stable_id


def lineage_tip_id(session: Session, stable_id: str) -> str:
    """:func:`pending_lineage_tip` over the registry (``trainer.parent = "lineage"``)."""
    rows = session.execute(
        select(Checkpoint.id, Checkpoint.parent_id, Checkpoint.status).order_by(Checkpoint.created_at, Checkpoint.id)
    ).all()
    deployments = session.execute(select(Deployment.checkpoint_id, Deployment.role, Deployment.status)).all()
    # A canary being deployed (pending) is on trial as much as an active one.
    canaries = {cid for cid, role, status in deployments if role == "canary" and status in ("active", "pending")}
    tried = {cid for cid, _, _ in deployments}
    return pending_lineage_tip(stable_id, [tuple(r) for r in rows], canaries, tried)


def get_checkpoint(session: Session, checkpoint_id: str) -> Checkpoint:
    """One checkpoint row (raises ``LookupError`` when absent)."""
    row = session.get(Checkpoint, checkpoint_id)
    if row is None:
        raise LookupError(f"no checkpoint {checkpoint_id!r} in the registry")
    return row


def last_window_end(session: Session) -> datetime | None:
    """End of the newest data window any checkpoint was trained on."""
    return session.scalar(select(func.max(Checkpoint.data_window_end)))


def latest_baseline_state(session: Session) -> dict[str, Any]:
    """The running-mean baseline state of the newest checkpoint that has one."""
    query = (
        select(Checkpoint.metrics)
        .where(Checkpoint.metrics.has_key("baseline_state"))
        .order_by(Checkpoint.created_at.desc())
        .limit(1)
    )
    metrics = session.scalars(query).first()
    return dict(metrics["baseline_state"]) if metrics else {}


def db_now(session: Session) -> datetime:
    """The database clock (window bounds use it, never the worker's clock)."""
    return session.scalar(select(func.now()))


# --------------------------------------------------------------------------- cycles


def cycle_by_key(session: Session, key: str) -> TrainingCycle | None:
    """The cycle started for an idempotency key, if any."""
    return session.scalars(select(TrainingCycle).where(TrainingCycle.idempotency_key == key)).first()


def insert_cycle(
    session: Session,
    key: str | None,
    trigger: str,
    status: str,
    reason: str | None = None,
    metrics: dict[str, Any] | None = None,
    parent_id: str | None = None,
) -> int:
    """A new cycle row (committed); ``finished_at`` is set unless it is ``running``."""
    row = TrainingCycle(
        trigger=trigger,
        idempotency_key=key,
        status=status,
        reason=reason,
        parent_checkpoint_id=parent_id,
        metrics=metrics or {},
    )
    if status != "running":
        row.finished_at = func.now()
    session.add(row)
    session.commit()
    return row.id


def update_cycle(session: Session, cycle_id: int, commit: bool = True, **values: Any) -> None:
    """Set columns of a cycle row; a terminal status also sets ``finished_at``."""
    if values.get("status") not in (None, "running"):
        values["finished_at"] = func.now()
    session.execute(update(TrainingCycle).where(TrainingCycle.id == cycle_id).values(**values))
    if commit:
        session.commit()


def merge_cycle_metrics(session: Session, cycle_id: int, metrics: dict[str, Any]) -> None:
    """Merge ``metrics`` into a cycle row's JSONB metrics (progress while it runs)."""
    session.execute(
        update(TrainingCycle)
        .where(TrainingCycle.id == cycle_id)
        .values(metrics=TrainingCycle.metrics.op("||")(bindparam("merge", metrics, type_=JSONB)))
    )
    session.commit()


def fail_stale_cycles(session: Session) -> list[int]:
    """Mark every ``running`` cycle ``failed: worker lost``; call only while holding the cycle lock."""
    ids = list(
        session.scalars(
            update(TrainingCycle)
            .where(TrainingCycle.status == "running")
            .values(status="failed", reason=WORKER_LOST, finished_at=func.now())
            .returning(TrainingCycle.id)
        )
    )
    session.commit()
    return ids


def recent_cycles(session: Session, limit: int = 10) -> list[TrainingCycle]:
    """The newest cycles."""
    return list(session.scalars(select(TrainingCycle).order_by(TrainingCycle.id.desc()).limit(limit)))


def recent_checkpoints(session: Session, limit: int = 10) -> list[Checkpoint]:
    """The newest checkpoints."""
    return list(session.scalars(select(Checkpoint).order_by(Checkpoint.created_at.desc()).limit(limit)))


def cycle_counts(session: Session) -> dict[str, int]:
    """Number of cycles by status."""
    query = select(TrainingCycle.status, func.count()).group_by(TrainingCycle.status)
    return {status: count for status, count in session.execute(query)}


# --------------------------------------------------------------------------- checkpoints


def add_checkpoint(
    session: Session,
    sidecar: ckpt.CheckpointSidecar,
    path: Path,
    status_reason: str,
    eval_: CheckpointEval,
) -> None:
    """Stage the registry row of a complete checkpoint (the caller commits with its cycle row)."""
    session.add(
        Checkpoint(
            id=sidecar.checkpoint_id,
            policy_version=sidecar.policy_version,
            parent_id=sidecar.parent_id,
            base_model=sidecar.base_model,
            path=str(path),
            format=sidecar.format,
            status=sidecar.status,
            status_reason=status_reason,
            data_window_start=sidecar.data_window_start,
            data_window_end=sidecar.data_window_end,
            n_samples=sidecar.n_samples,
            sample_ids_hash=sidecar.sample_ids_hash,
            config_hash=sidecar.config_hash,
            metrics={**sidecar.metrics, "steps": sidecar.steps, "baseline_state": sidecar.baseline_state},
            eval=eval_.to_dict(),
        )
    )


def cached_eval(row: Checkpoint, key: str) -> HeldoutResult | None:
    """A checkpoint's held-out evaluation under ``key``, if one is cached."""
    return CheckpointEval.parse(row.eval).cached(key)


def cache_eval(session: Session, checkpoint_id: str, key: str, result: HeldoutResult) -> None:
    """Store a held-out evaluation in a checkpoint's ``eval`` column (everything else in it kept)."""
    row = get_checkpoint(session, checkpoint_id)
    row.eval = CheckpointEval.parse(row.eval).with_heldout(key, result).to_dict()
    session.commit()


# --------------------------------------------------------------------------- pause


def pause_state(session: Session) -> PauseState:
    """The trainer's pause flag (:mod:`flywheel.core.pause`)."""
    return pause.pause_state(session, "trainer")


def set_paused(session: Session, paused: bool, actor: str, reason: str | None = None) -> PauseState:
    """Pause or resume the trainer: one append-only audit entry (before/after); returns the new state."""
    return pause.set_paused(session, "trainer", paused, actor, reason)


# --------------------------------------------------------------------------- retention


@dataclass(frozen=True)
class RetentionInfo:
    """What retention needs to know of a checkpoint."""

    id: str
    created_at: datetime
    status: str
    format: str
    path: str
    base_model: str
    is_root: bool
    score: float | None
    """Held-out success measured by its gate, if any."""


def retained(rows: Iterable[RetentionInfo], recently_deployed: set[str], keep_latest: int) -> set[str]:
    """Ids to keep: roots, the newest ``keep_latest``, the best, every recently deployed one, and LoRA bases."""
    live = [r for r in rows if r.status != "deleted"]
    keep = {r.id for r in live if r.is_root or r.id in recently_deployed}
    keep |= {r.id for r in sorted(live, key=lambda r: r.created_at, reverse=True)[:keep_latest]}
    scored = [r for r in live if r.score is not None and r.status != "rejected"]
    if scored:
        keep.add(max(scored, key=lambda r: (r.score, r.created_at)).id)
    by_path = {r.path: r.id for r in live}
    for r in live:
        if r.id in keep and r.format == "lora" and r.base_model in by_path:
            keep.add(by_path[r.base_model])
    return keep


def recently_deployed(session: Session, now: datetime, days: float) -> set[str]:
    """Checkpoints deployed now, or whose deployment ended (or which were last deployed) within ``days``."""
    since = now - timedelta(days=days)
    ids = set(
        session.scalars(
            select(Deployment.checkpoint_id).where(
                or_(Deployment.status == "active", Deployment.ended_at.is_(None), Deployment.ended_at > since)
            )
        )
    )
    ids |= set(
        session.scalars(
            select(Checkpoint.id).where(or_(Checkpoint.status == "deployed", Checkpoint.last_deployed_at > since))
        )
    )
    return ids


def apply_retention(session: Session, root: Path, keep_latest: int, deployed_days: float) -> list[str]:
    """Delete the files of checkpoints retention does not keep (only under ``root``); mark them ``deleted``."""
    rows = list(session.scalars(select(Checkpoint)))
    infos = [
        RetentionInfo(
            id=r.id,
            created_at=r.created_at,
            status=r.status,
            format=r.format,
            path=r.path,
            base_model=r.base_model,
            is_root=r.parent_id is None,
            score=CheckpointEval.parse(r.eval).gated_success,
        )
        for r in rows
    ]
    keep = retained(infos, recently_deployed(session, db_now(session), deployed_days), keep_latest)
    root = root.resolve()
    deleted = []
    for r in rows:
        path = Path(r.path).resolve()
        if r.id in keep or r.status == "deleted" or r.parent_id is None or root not in path.parents:
            continue
        ckpt.delete(path)
        r.status, r.status_reason = "deleted", "retention"
        deleted.append(r.id)
    session.commit()
    return deleted
