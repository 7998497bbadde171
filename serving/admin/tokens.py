"""Ops tokens: creation (the first admin token straight into Postgres, every later one by an admin), revocation.

A token is shown once, when created; Postgres keeps only its digest (``flywheel.core.auth``
hashes and checks it). Creation is serialised by an advisory lock, so two requests cannot
both take a name or both bootstrap the first admin. Each creation and revocation writes its
audit row (``token.create``, ``token.revoke``) in the same transaction.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session

from flywheel.core.auth import KeyInfo, KeyNotFound, create_key, revoke_key
from flywheel.core.db.models import ApiKey, AuditLog
from serving.admin.errors import AdminError
from serving.admin.schemas import TokenCreated, TokenPublic

TOKEN_LOCK_KEY = 0x466C_544B
"""Advisory lock serialising token creation ('FlTK'): name uniqueness and the first-admin bootstrap."""


class BootstrapRefused(Exception):
    """The first-admin bootstrap does not apply (an admin token exists, or the request is not for one)."""


def token_public(info: KeyInfo) -> TokenPublic:
    """A key as listed (never the token or its hash)."""
    return TokenPublic(
        id=info.id,
        name=info.name,
        role=info.role,
        project=info.project,
        token_prefix=info.token_prefix,
        created_at=info.created_at,
        revoked_at=info.revoked_at,
        last_used_at=info.last_used_at,
        active=info.active,
    )


def active_token_named(session: Session, name: str) -> bool:
    """Whether an unrevoked token has ``name``."""
    query = select(func.count()).select_from(ApiKey).where(ApiKey.name == name, ApiKey.revoked_at.is_(None))
    return (session.scalar(query) or 0) > 0


def _lock(session: Session) -> None:
    session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": TOKEN_LOCK_KEY})


def bootstrap_admin_token(engine: Engine, name: str, actor: str) -> tuple[KeyInfo, str]:
    """Create the first admin token directly in Postgres, when no active admin token exists.

    This is how ``flywheel tokens create`` starts a fresh deployment: every later token is
    created through the API by an admin. The creation is audited (``token.create``,
    ``details.bootstrap``). Raises :class:`BootstrapRefused` when an active admin token exists
    or an active token already has ``name``.
    """
    with Session(engine) as session:
        _lock(session)
        admin = session.scalars(
            select(ApiKey).where(ApiKey.role == "admin", ApiKey.revoked_at.is_(None)).order_by(ApiKey.id).limit(1)
        ).first()
        if admin is not None:
            raise BootstrapRefused(
                f"an active admin token exists ({admin.name!r}, {admin.token_prefix}…); "
                "create tokens through the admin API with an admin token (--token or FLYWHEEL_TOKEN)"
            )
        if active_token_named(session, name):
            raise BootstrapRefused(f"an active token is already named {name!r}; pick another name")
        info, token = create_key(session, name=name, role="admin", created_by=actor)
        session.add(
            AuditLog(
                actor=actor[:128],
                action="token.create",
                target=f"api_key:{info.id}",
                before=None,
                after=token_public(info).model_dump(mode="json"),
                details={"bootstrap": True},
                success=True,
            )
        )
        session.commit()
    return info, token


def create_token(session: Session, name: str, role: str, actor: str, details: dict[str, Any]) -> TokenCreated:
    """Create an ops token and its audit row, and commit; 409 :class:`AdminError` when an active token has ``name``."""
    _lock(session)
    if active_token_named(session, name):
        raise AdminError(409, f"an active token is already named {name!r}; revoke it or pick another name")
    info, token = create_key(session, name=name, role=role, created_by=actor)
    public = token_public(info)
    session.add(
        AuditLog(
            actor=actor,
            action="token.create",
            target=f"api_key:{info.id}",
            before=None,
            after=public.model_dump(mode="json"),
            details=details,
            success=True,
        )
    )
    session.commit()
    return TokenCreated(**public.model_dump(), token=token)


def revoke_token(session: Session, token_id: int, actor: str, details: dict[str, Any]) -> TokenPublic:
    """Revoke a token (idempotent) with its audit row, and commit; 404 :class:`AdminError` when there is none."""
    row = session.get(ApiKey, token_id)
    if row is None:
        raise AdminError(404, f"no token with id {token_id}")
    before = {"active": row.revoked_at is None, "name": row.name, "role": row.role}
    try:
        info = revoke_key(session, token_id)
    except KeyNotFound as err:  # deleted between the two reads
        raise AdminError(404, str(err)) from None
    public = token_public(info)
    session.add(
        AuditLog(
            actor=actor,
            action="token.revoke",
            target=f"api_key:{token_id}",
            before=before,
            after={
                "active": False,
                "name": info.name,
                "role": info.role,
                "revoked_at": public.revoked_at.isoformat() if public.revoked_at else None,
            },
            details=details,
            success=True,
        )
    )
    session.commit()
    return public
