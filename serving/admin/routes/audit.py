"""The audit log: ``GET /v1/audit`` (viewer), newest first, with filters."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BeforeValidator
from sqlalchemy import select

from flywheel.core.db.models import AuditLog
from serving.admin.deps import DbSession, Viewer
from serving.admin.errors import ERROR_RESPONSES
from serving.admin.schemas import TEXT_PATTERN, AuditPage, AuditPublic

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


def _iso_8601(value: object) -> object:
    """A query's time must be an ISO 8601 date-time, as the schema says (pydantic alone also takes Unix seconds)."""
    if isinstance(value, str) and not _ISO_DATE.match(value):
        raise ValueError("expected an ISO 8601 date-time, e.g. 2026-12-04T18:00:00Z")
    return value


_ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")
Iso8601 = Annotated[datetime, BeforeValidator(_iso_8601)]


@router.get("/audit", response_model=AuditPage, name="audit.list")
def audit(
    viewer: Viewer,
    session: DbSession,
    limit: int = Query(50, ge=1, le=500, description="Page size."),
    offset: int = Query(0, ge=0, le=2**31 - 1, description="Entries to skip (newest first)."),
    action: str | None = Query(
        None, max_length=64, pattern=TEXT_PATTERN, description="Only this action (e.g. `deploy.promote`)."
    ),
    action_prefix: str | None = Query(
        None, max_length=64, pattern=TEXT_PATTERN, description="Only actions starting with this (e.g. `token.`)."
    ),
    actor: str | None = Query(
        None, max_length=128, pattern=TEXT_PATTERN, description="Only this actor (e.g. `token:alice`)."
    ),
    target: str | None = Query(None, max_length=256, pattern=TEXT_PATTERN, description="Only this target."),
    success: bool | None = Query(None, description="Only successful (true) or failed (false) calls."),
    since: Iso8601 | None = Query(None, description="Only entries at or after this time."),
    until: Iso8601 | None = Query(None, description="Only entries before this time."),
) -> AuditPage:
    """Recent audit-log entries, newest first, with filters."""
    query = select(AuditLog)
    if action is not None:
        query = query.where(AuditLog.action == action)
    if action_prefix is not None:
        query = query.where(AuditLog.action.startswith(action_prefix, autoescape=True))
    if actor is not None:
        query = query.where(AuditLog.actor == actor)
    if target is not None:
        query = query.where(AuditLog.target == target)
    if success is not None:
        query = query.where(AuditLog.success.is_(success))
    if since is not None:
        query = query.where(AuditLog.at >= since)
    if until is not None:
        query = query.where(AuditLog.at < until)
    query = query.order_by(AuditLog.id.desc()).limit(limit).offset(offset)
    items = [AuditPublic.model_validate(row, from_attributes=True) for row in session.scalars(query)]
    return AuditPage(items=items, limit=limit, offset=offset)
