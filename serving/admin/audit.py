"""The admin API's part of the audit log: refused mutating calls.

Every mutating call is in the audit log. The deployment functions (``serving.fleet.deploy``)
and the pause flags (``flywheel.core.pause``) write their own rows with the actor
``token:<name>``, token management writes its rows in :mod:`serving.admin.tokens`; a route
marks the request as audited once the function it called has written its row
(:func:`mark_audited`, :func:`self_audited`). A mutating call refused for any reason (401,
403, 404, 409, 422, 5xx) that did not reach one of those functions is recorded by
:func:`audit_refusal` with ``success = false``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from flywheel.core import pause
from flywheel.core.auth import KeyInfo
from flywheel.core.db.models import AuditLog
from serving.admin.deps import READ_METHODS, app_settings, db_engine
from serving.admin.schemas import ErrorPublic, PauseStatePublic, pause_public
from serving.fleet.registry import DeployError

log = logging.getLogger(__name__)


def write_audit(
    engine: Engine,
    *,
    actor: str,
    action: str,
    target: str | None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    details: dict[str, Any] | None = None,
    success: bool = True,
) -> None:
    """Append one audit-log row (its own transaction)."""
    with Session(engine) as session:
        session.add(
            AuditLog(
                actor=actor[:128],
                action=action[:64],
                target=target[:256] if target else None,
                before=before,
                after=after,
                details=details or {},
                success=success,
            )
        )
        session.commit()


def mark_audited(request: Request) -> None:
    """The call wrote its own audit row: a refusal after this point is not recorded again."""
    request.state.audited = True


@contextmanager
def self_audited(request: Request) -> Iterator[None]:
    """Around a call that writes its own audit row, on success and on a ``DeployError``."""
    try:
        yield
    except DeployError:
        mark_audited(request)
        raise
    mark_audited(request)


def _actor(request: Request) -> str:
    key: KeyInfo | None = getattr(request.state, "key", None)
    return f"token:{key.name}" if key is not None else "anonymous"


def _details(request: Request, **extra: Any) -> dict[str, Any]:
    key: KeyInfo | None = getattr(request.state, "key", None)
    details = {k: v for k, v in extra.items() if v is not None}
    if key is not None:
        details["token_id"] = key.id
    return details


def audit_target(request: Request, route: APIRoute) -> str:
    """The audit target of a route: ``api_key:<id>`` (``api_keys``), ``trainer``, ``canary`` or ``fleet:<name>``."""
    fleet = app_settings(request).serving.fleet
    if route.name.startswith("token."):
        token_id = request.path_params.get("token_id")
        return f"api_key:{token_id}" if token_id is not None else "api_keys"
    if route.name.startswith("trainer."):
        return "trainer"
    if route.name in ("canary.pause", "canary.resume"):
        return "canary"
    return f"fleet:{fleet}"


def audit_refusal(request: Request, status: int, body: ErrorPublic) -> None:
    """Record a refused mutating call, unless the function it reached recorded it already."""
    route = request.scope.get("route")
    if request.method in READ_METHODS or not isinstance(route, APIRoute) or getattr(request.state, "audited", False):
        return
    details = _details(
        request, status=status, error=body.error, reason=body.reason, method=request.method, path=request.url.path
    )
    try:
        write_audit(
            db_engine(request),
            actor=_actor(request),
            action=route.name,
            target=audit_target(request, route),
            details=details,
            success=False,
        )
    except SQLAlchemyError as err:  # the answer must still go out; the log says the row is missing
        log.error(
            "could not write the audit row of a refused %s %s: %s",
            request.method,
            request.url.path,
            str(getattr(err, "orig", None) or err).strip().splitlines()[0],
        )


def set_pause_flag(
    request: Request, session: Session, target: pause.Target, paused: bool, actor: str, reason: str | None
) -> PauseStatePublic:
    """Pause or resume ``target`` (its flag writes its own audit row) and answer the new state."""
    state = pause.set_paused(session, target, paused, actor, reason)
    mark_audited(request)
    return pause_public(state)
