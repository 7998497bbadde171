"""Hashed API tokens: gateway write keys (role ``writer``), router product keys (role ``product``) and
ops tokens (viewer/operator/admin).

A token is shown once, when it is created; the database keeps only its SHA-256 hex digest
(``api_keys.token_hash``) and a short display prefix. A presented token is hashed and looked
up by that digest, and the match is confirmed with a constant-time comparison.

A token carries 192 random bits, so a plain (unsalted) SHA-256 cannot be reversed by guessing;
the digest is what makes a leaked table useless, and the lookup by digest stays one index probe.
For the same reason no server secret enters the digest: there is nothing a key could add.

The gateway looks a token up by its digest (:func:`find_key`, cached briefly); the router, whose
requests never touch the database, holds every key's digest in memory (:func:`key_index`, re-read
with its routing table) and records their use in batches (:func:`touch_keys`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from flywheel.core.db.models import PROJECT_ROLES, ROLES, ApiKey

WRITE_KEY_PREFIX = "fwk_"
"""Prefix of gateway write keys."""
OPS_TOKEN_PREFIX = "fwo_"
"""Prefix of ops (admin API) tokens."""
PRODUCT_KEY_PREFIX = "fwp_"
"""Prefix of product keys (what an agent product presents to the router)."""
PREFIXES = {"writer": WRITE_KEY_PREFIX, "product": PRODUCT_KEY_PREFIX}
"""Prefix by role (every other role: :data:`OPS_TOKEN_PREFIX`)."""
TOKEN_RANDOM_CHARS = 32
"""URL-safe random characters after the prefix (6 bits each)."""
DISPLAY_CHARS = 8
"""Random characters kept (with the prefix) to recognise a token in listings."""


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
    """What a valid token grants: who it is, its role and (for a writer or product key) its project."""

    id: int
    name: str
    role: str
    project: str | None
    token_prefix: str
    created_at: datetime | None = None
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None
    rate_per_s: float | None = None
    """A product key's own router rate limit (None: the router's default)."""
    burst: int | None = None
    """A product key's own burst (None: the router's default)."""

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
        rate_per_s=row.rate_per_s,
        burst=row.burst,
    )


def create_key(
    session: Session,
    *,
    name: str,
    role: str,
    project: str | None = None,
    created_by: str | None = None,
    rate_per_s: float | None = None,
    burst: int | None = None,
) -> tuple[KeyInfo, str]:
    """Insert a new key and return ``(info, token)``; the token is not retrievable afterwards.

    Writers get the ``fwk_`` prefix, product keys ``fwp_``, and both need a project; other roles
    get ``fwo_``. ``rate_per_s`` and ``burst`` (product keys only) override the router's
    defaults for this key. The caller commits the session.
    """
    if role not in ROLES:
        raise ValueError(f"role: must be one of {', '.join(ROLES)} (got {role!r})")
    if role in PROJECT_ROLES and not project:
        raise ValueError(f"project: a {'write' if role == 'writer' else 'product'} key must be scoped to a project")
    if role != "product" and (rate_per_s is not None or burst is not None):
        raise ValueError("rate_per_s, burst: only a product key has a rate limit of its own")
    if rate_per_s is not None and not rate_per_s > 0:
        raise ValueError(f"rate_per_s: must be above 0 (got {rate_per_s})")
    if burst is not None and burst < 1:
        raise ValueError(f"burst: must be at least 1 (got {burst})")
    token, token_hash, display = new_token(PREFIXES.get(role, OPS_TOKEN_PREFIX))
    row = ApiKey(
        name=name,
        role=role,
        project=project,
        token_prefix=display,
        token_hash=token_hash,
        created_by=created_by,
        rate_per_s=rate_per_s,
        burst=burst,
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


def key_index(session: Session) -> dict[str, KeyInfo]:
    """Every key, revoked or not, by its token digest (what the router holds in memory)."""
    return {row.token_hash: _info(row) for row in session.scalars(select(ApiKey))}


def touch_keys(session: Session, key_ids: set[int], at: datetime | None = None) -> None:
    """Record that the keys ``key_ids`` were used (``last_used_at``); the caller commits."""
    if key_ids:
        at = at or datetime.now(UTC)
        session.execute(update(ApiKey).where(ApiKey.id.in_(sorted(key_ids))).values(last_used_at=at))
