"""The pause flags of the trainer and the canary controller, one implementation for both.

A flag is the newest successful ``<target>.pause`` / ``<target>.resume`` entry of the
append-only audit log: pausing and resuming write an entry (with the state before and
after, the actor and the reason), reading takes the newest. Nothing is overwritten, so the
audit log is also the flag's history.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from flywheel.core.db.models import AuditLog

Target = Literal["trainer", "canary"]


@dataclass(frozen=True)
class PauseState:
    """A pause flag: the newest pause/resume entry of the audit log (``paused=False`` without one)."""

    paused: bool
    actor: str | None = None
    at: datetime | None = None
    reason: str | None = None


def actions(target: Target) -> tuple[str, str]:
    """The audit actions that pause and resume ``target``: ``(<target>.pause, <target>.resume)``."""
    return f"{target}.pause", f"{target}.resume"


def pause_state(session: Session, target: Target) -> PauseState:
    """Paused when the newest successful ``<target>.pause``/``<target>.resume`` audit entry is a pause."""
    pause, resume = actions(target)
    row = session.scalars(
        select(AuditLog)
        .where(AuditLog.action.in_((pause, resume)), AuditLog.success.is_(True))
        .order_by(AuditLog.id.desc())
        .limit(1)
    ).first()
    if row is None:
        return PauseState(paused=False)
    return PauseState(row.action == pause, row.actor, row.at, (row.details or {}).get("reason"))


def set_paused(session: Session, target: Target, paused: bool, actor: str, reason: str | None = None) -> PauseState:
    """Pause or resume ``target``: one append-only audit entry (before/after); returns the new state."""
    before = pause_state(session, target)
    pause, resume = actions(target)
    session.add(
        AuditLog(
            actor=actor,
            action=pause if paused else resume,
            target=target,
            before={"paused": before.paused},
            after={"paused": paused},
            details={"reason": reason} if reason else {},
        )
    )
    session.commit()
    return pause_state(session, target)
