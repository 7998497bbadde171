"""Feedback tokens: signed, expiring permissions to send one session's (or completion's) feedback
from a browser, which must never hold the write key.

A product's backend mints one with the SDK (``fw.feedback_token(session_id=...)``) and hands it
to its page; the page posts feedback with it to the gateway's ``POST /v1/feedback``. The token
is ``fwf1.<payload>.<signature>``, both parts base64url without padding:

- the payload is compact JSON: ``k`` key id, ``p`` project, ``s`` session id, ``c`` completion
  id, ``u`` user id, ``f`` allowed feedback kinds (absent: every kind), ``i`` issued at and
  ``e`` expiry (Unix seconds), ``n`` a random nonce;
- the signature is HMAC-SHA256 over ``fwf1.<payload>`` with the *signing secret*.

The database keeps only the SHA-256 of a write key (:mod:`flywheel.core.auth`), so the secret is
derived from that digest, which both sides can compute: the SDK from the key it holds, the
gateway from ``api_keys.token_hash``. ``signing_secret = HMAC-SHA256(sha256(key), "flywheel-
feedback-v1")`` and ``key id = HMAC-SHA256(sha256(key), "flywheel-feedback-kid-v1")[:8]`` (hex):
the key id names the key without revealing any part of it or of its digest. A token is only as
valid as its key: the gateway refuses it once the key is revoked.

Standard library only: the SDK mints, the gateway verifies, with this one module.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import re
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

TOKEN_PREFIX = "fwf1."
"""What every feedback token starts with (format version 1)."""
SECRET_LABEL = b"flywheel-feedback-v1"
KID_LABEL = b"flywheel-feedback-kid-v1"
MAX_TTL_S = 30 * 86400
"""Longest lifetime of a token (30 days)."""
MAX_TOKEN_CHARS = 2048
"""Longest token the gateway reads."""
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")
"""A session or user id (the contracts' ``Name``)."""
KINDS = ("accept", "reject", "revert", "edit", "persisted", "follow_up", "score")
"""Feedback kinds (:class:`flywheel.core.contracts.events.FeedbackKind`'s values)."""


class TokenError(ValueError):
    """A token that cannot be used; ``expired`` tells an expired one from a forged or malformed one."""

    def __init__(self, reason: str, *, expired: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.expired = expired


@dataclass(frozen=True)
class FeedbackGrant:
    """What a valid token allows: feedback on this session or completion, of these kinds, until ``expires_at``."""

    key_id: str
    project: str
    session_id: str | None
    completion_id: uuid.UUID | None
    user_id: str | None
    kinds: frozenset[str] | None
    """Allowed kinds; None: every kind."""
    issued_at: int
    expires_at: int
    nonce: str

    def allows(self, kind: str) -> bool:
        """Whether feedback of ``kind`` may be sent with the token."""
        return self.kinds is None or kind in self.kinds


def key_digest(write_key: str) -> str:
    """SHA-256 hex digest of a write key (what ``api_keys.token_hash`` holds)."""
    return hashlib.sha256(write_key.encode("utf-8")).hexdigest()


def signing_secret(token_hash: str) -> bytes:
    """The signing secret of the key whose SHA-256 hex digest is ``token_hash``."""
    return hmac.new(bytes.fromhex(token_hash), SECRET_LABEL, hashlib.sha256).digest()


def key_id(token_hash: str) -> str:
    """The public id a token carries for the key whose SHA-256 hex digest is ``token_hash`` (16 hex)."""
    return hmac.new(bytes.fromhex(token_hash), KID_LABEL, hashlib.sha256).hexdigest()[:16]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    if not text or any(c not in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_" for c in text):
        raise TokenError("feedback token is malformed (not base64url)")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise TokenError("feedback token is malformed (not base64url)") from None


def _check_kinds(kinds: Iterable[str] | None) -> list[str] | None:
    if kinds is None:
        return None
    chosen = sorted({str(getattr(k, "value", k)) for k in kinds})
    unknown = [k for k in chosen if k not in KINDS]
    if unknown:
        raise ValueError(f"kinds: unknown feedback kind(s) {', '.join(unknown)}; one of {', '.join(KINDS)}")
    if not chosen:
        raise ValueError("kinds: give at least one kind, or None for every kind")
    return chosen


def mint(
    write_key: str,
    project: str,
    *,
    session_id: str | None = None,
    completion_id: uuid.UUID | str | None = None,
    user_id: str | None = None,
    ttl_s: float = 3600,
    kinds: Iterable[str] | None = None,
    now: float | None = None,
) -> str:
    """A feedback token for ``project``'s session ``session_id`` and/or completion ``completion_id``.

    Without ``session_id`` the completion id must be a UUIDv7 (the gateway then sends the feedback
    by completion id alone, and ingest attaches it). Raises ``ValueError`` naming the bad argument.
    """
    if not write_key:
        raise ValueError("write_key: a feedback token is signed with the project's write key; none is set")
    if not project:
        raise ValueError("project: required")
    if session_id is None and completion_id is None:
        raise ValueError("session_id: give a session id, a completion id or both")
    for name, value in (("session_id", session_id), ("user_id", user_id)):
        if value is not None and not (isinstance(value, str) and NAME.fullmatch(value)):
            raise ValueError(
                f"{name}: {value!r} is not an id (1-128 of A-Z a-z 0-9 . _ : @ / -, not starting with one of ._:@/-)"
            )
    cid: uuid.UUID | None = None
    if completion_id is not None:
        try:
            cid = completion_id if isinstance(completion_id, uuid.UUID) else uuid.UUID(str(completion_id))
        except ValueError:
            raise ValueError(f"completion_id: not a UUID ({completion_id!r})") from None
        if session_id is None and cid.version != 7:
            raise ValueError("completion_id: must be a UUIDv7 when no session_id is given")
    if not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"ttl_s: must be above 0 and at most {MAX_TTL_S} (30 days), got {ttl_s}")
    issued = int(time.time() if now is None else now)
    token_hash = key_digest(write_key)
    payload: dict[str, object] = {"k": key_id(token_hash), "p": project}
    if session_id is not None:
        payload["s"] = session_id
    if cid is not None:
        payload["c"] = str(cid)
    if user_id is not None:
        payload["u"] = user_id
    chosen = _check_kinds(kinds)
    if chosen is not None:
        payload["f"] = chosen
    payload.update({"i": issued, "e": issued + max(1, int(ttl_s)), "n": _b64(os.urandom(9))})
    body = TOKEN_PREFIX + _b64(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    signature = hmac.new(signing_secret(token_hash), body.encode("ascii"), hashlib.sha256).digest()
    return f"{body}.{_b64(signature)}"


def read_key_id(token: object) -> str:
    """The key id a token claims (unverified), or raise :class:`TokenError` for a malformed token."""
    return _split(token)[2]["k"]  # type: ignore[return-value]


def _split(token: object) -> tuple[str, bytes, dict[str, object]]:
    if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX):
        raise TokenError(f"not a feedback token (it starts with {TOKEN_PREFIX!r})")
    if len(token) > MAX_TOKEN_CHARS:
        raise TokenError(f"feedback token is over {MAX_TOKEN_CHARS} characters")
    body, dot, signature = token.rpartition(".")
    if not dot or len(body) <= len(TOKEN_PREFIX) or "." in body[len(TOKEN_PREFIX) :]:
        raise TokenError("feedback token is malformed (fwf1.<payload>.<signature>)")
    raw = _unb64(body[len(TOKEN_PREFIX) :])
    try:
        payload = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise TokenError("feedback token is malformed (payload is not JSON)") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("k"), str):
        raise TokenError("feedback token is malformed (payload has no key id)")
    return body, _unb64(signature), payload


def verify(token: object, token_hash: str, *, now: float | None = None) -> FeedbackGrant:
    """The grant of ``token`` if it is signed by the key whose digest is ``token_hash`` and not expired.

    Raises :class:`TokenError`: malformed, bad signature, or expired (``expired=True``, checked
    only after the signature, so an expiry is never reported for a forged token).
    """
    body, signature, payload = _split(token)
    expected = hmac.new(signing_secret(token_hash), body.encode("ascii"), hashlib.sha256).digest()
    if payload["k"] != key_id(token_hash) or not hmac.compare_digest(signature, expected):
        raise TokenError("feedback token signature is invalid")
    try:
        grant = _grant(payload)
    except (KeyError, TypeError, ValueError):
        raise TokenError("feedback token is malformed (payload fields)") from None
    if grant.expires_at <= (time.time() if now is None else now):
        raise TokenError("feedback token expired", expired=True)
    return grant


def _grant(payload: dict[str, object]) -> FeedbackGrant:
    def text(name: str) -> str | None:
        value = payload.get(name)
        if value is not None and not isinstance(value, str):
            raise TypeError(name)
        return value

    def stamp(name: str) -> int:
        value = payload[name]
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(name)
        return value

    kinds = payload.get("f")
    if kinds is not None and not (isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)):
        raise TypeError("f")
    completion = text("c")
    project = text("p")
    if not project:
        raise ValueError("p")
    return FeedbackGrant(
        key_id=str(payload["k"]),
        project=project,
        session_id=text("s"),
        completion_id=uuid.UUID(completion) if completion is not None else None,
        user_id=text("u"),
        kinds=frozenset(kinds) if kinds is not None else None,
        issued_at=stamp("i"),
        expires_at=stamp("e"),
        nonce=text("n") or "",
    )
