"""Ops tokens (admin): ``GET /v1/tokens``, ``POST /v1/tokens``, ``DELETE /v1/tokens/{id}``."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Path, Query, Request

from flywheel.core.auth import list_keys
from flywheel.core.db.models import ROLES
from serving.admin import tokens
from serving.admin.audit import mark_audited
from serving.admin.deps import Admin, DbSession
from serving.admin.errors import ERROR_RESPONSES
from serving.admin.schemas import ErrorPublic, TokenCreate, TokenCreated, TokenList, TokenPublic

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.get("/tokens", response_model=TokenList, name="token.list")
def list_tokens(
    admin: Admin,
    session: DbSession,
    role: Literal[ROLES] | None = Query(None, description="Only tokens of this role."),  # type: ignore[valid-type]
) -> TokenList:
    """Every token (ops tokens and gateway write keys), newest first; never the tokens themselves."""
    return TokenList(items=[tokens.token_public(k) for k in list_keys(session, role=role)])


@router.post(
    "/tokens",
    response_model=TokenCreated,
    status_code=201,
    name="token.create",
    responses={409: {"model": ErrorPublic, "description": "An active token has that name."}},
)
def create_token(admin: Admin, session: DbSession, request: Request, body: TokenCreate) -> TokenCreated:
    """Create an ops token; the token is in this answer only (the database keeps its hash)."""
    created = tokens.create_token(session, body.name, body.role, admin.actor, admin.details())
    mark_audited(request)
    return created


@router.delete(
    "/tokens/{token_id}",
    response_model=TokenPublic,
    name="token.revoke",
    responses={404: {"model": ErrorPublic, "description": "No token with that id."}},
)
def revoke_token(
    admin: Admin, session: DbSession, request: Request, token_id: int = Path(ge=1, le=2**63 - 1)
) -> TokenPublic:
    """Revoke a token (immediately: the admin API does not cache tokens). Idempotent."""
    public = tokens.revoke_token(session, token_id, admin.actor, admin.details())
    mark_audited(request)
    return public
