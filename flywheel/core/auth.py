"""Hashed API tokens: gateway write keys (role ``writer``) and ops tokens (viewer/operator/admin).

A token is shown once, when it is created; the database keeps only its SHA-256 hex digest
(``api_keys.token_hash``) and a short display prefix. A presented token is hashed and looked
up by that digest, and the match is confirmed with a constant-time comparison.

A token carries 192 random bits, so a plain (unsalted) SHA-256 cannot be reversed by guessing;
the digest is what makes a leaked table useless, and the lookup by digest stays one index probe.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from flywheel.core.db.models import ApiKey

WRITE_KEY_PREFIX = "fwk_"
"""Prefix of gateway write keys."""
OPS_TOKEN_PREFIX = "fwo_"
"""Prefix of ops (admin API) tokens."""
TOKEN_RANDOM_CHARS = 32
"""URL-safe random characters after the prefix (6 bits each)."""
DISPLAY_CHARS = 8
"""Random characters kept (with the prefix) to recognise a token in listings."""
ROLES = ("viewer", "operator", "admin", "writer")
"""Roles a token can have (the same as the ``api_keys`` check constraint)."""


class KeyNotFound(LookupError):
    """No key with that id exists (not recoverable by retrying)."""


def new_token(prefix: str = WRITE_KEY_PREFIX) -> tuple[str, str, str]:
    """A fresh random token: ``(token, token_hash, display_prefix)``.

    ``token`` is ``prefix`` followed by 32 URL-safe characters; only ``token_hash`` and
    ``display_prefix`` may be stored.
    """
    body = secrets.token_urlsafe(TOKEN_RANDOM_CHARS)[:TOKEN_RANDOM_CHARS]
    token = f"{prefix}{body}"
    return token, hash_token(token), token[: len(prefix) + DISPLAY_CHARS]


def hash_token(token: str) -> str:
    """SHA-256 hex digest of ``token`` (what ``api_keys.token_hash`` holds)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def verify(token: str, token_hash: str) -> bool:
    """Whether ``token`` hashes to ``token_hash``, compared in constant time."""
    return hmac.compare_digest(hash_token(token), token_hash)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None if absent or malformed."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


@dataclass(frozen=True)
class KeyInfo:
    """What a valid token grants: who it is, its role and (for a writer) its project."""

    id: int
    name: str
    role: str
    project: str | None
    token_prefix: str
    created_at: datetime | None = None
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None

    @property
    def active(self) -> bool:
        """Not revoked."""
        return self.revoked_at is None


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(
        id=row.id,
        name=row.name,
        role=row.role,
        project=row.project,
        token_prefix=row.token_prefix,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        last_used_at=row.last_used_at,
    )


def create_key(
    session: Session,
    *,
    name: str,
    role: str,
    project: str | None = None,
    created_by: str | None = None,
) -> tuple[KeyInfo, str]:
    """Insert a new key and return ``(info, token)``; the token is not retrievable afterwards.

    Writers get the ``fwk_`` prefix and need a project; other roles get ``fwo_``.
    The caller commits the session.
    """
    if role not in ROLES:
        raise ValueError(f"role: must be one of {', '.join(ROLES)} (got {role!r})")
    if role == "writer" and not project:
        raise ValueError("project: a write key must be scoped to a project")
    token, token_hash, display = new_token(WRITE_KEY_PREFIX if role == "writer" else OPS_TOKEN_PREFIX)
    row = ApiKey(
        name=name, role=role, project=project, token_prefix=display, token_hash=token_hash, created_by=created_by
    )
    session.add(row)
    session.flush()
    session.refresh(row)
    return _info(row), token


def find_key(session: Session, token: str, *, touch: bool = False) -> KeyInfo | None:
    """The key that ``token`` is, revoked or not, or None if no stored hash matches.

    ``touch`` records the use in ``last_used_at`` (the caller commits).
    """
    token_hash = hash_token(token)
    row = session.scalars(select(ApiKey).where(ApiKey.token_hash == token_hash)).one_or_none()
    if row is None or not verify(token, row.token_hash):
        return None
    if touch:
        row.last_used_at = datetime.now(UTC)
    return _info(row)


def list_keys(session: Session, *, role: str | None = None, project: str | None = None) -> list[KeyInfo]:
    """Every key (newest first), optionally of one role and/or project; never the tokens."""
    query = select(ApiKey).order_by(ApiKey.id.desc())
    if role is not None:
        query = query.where(ApiKey.role == role)
    if project is not None:
        query = query.where(ApiKey.project == project)
    return [_info(row) for row in session.scalars(query)]


def revoke_key(session: Session, key_id: int) -> KeyInfo:
    """Mark key ``key_id`` revoked (idempotent: a revoked key keeps its first revocation time)."""
    row = session.get(ApiKey, key_id)
    if row is None:
        raise KeyNotFound(f"no API key with id {key_id}")
    if row.revoked_at is None:
        row.revoked_at = datetime.now(UTC)
        session.flush()
    return _info(row)
