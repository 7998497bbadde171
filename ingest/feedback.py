"""``POST /v1/feedback``: feedback from a browser, with a feedback token instead of the write key.

A product's backend mints the token with the SDK (:mod:`flywheel.core.feedback_tokens`); its page
posts ``{"token", "kind", ...}`` as JSON. The gateway checks the token's signature against the
key it names (write keys held in memory, re-read every ``key_cache_ttl_s``: no database round
trip per request, and a revoked key's tokens stop within that time), then builds the same
``feedback`` event the SDK would, bound to the token's project, session, completion and user
(the body cannot change them), and produces it to the events topic like ``/v1/events``.

Cross-origin access is for the origins in ``ingest.feedback_cors_origins`` only, and only on this
route: the preflight (``OPTIONS``) is answered here, and a request that carries another
``Origin`` is refused (403) before anything is produced.

The event id is a UUIDv7 made from the token and the request (its time part is the token's
issue time), so a retried request is the same event and stored once downstream.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from sqlalchemy import select

from flywheel.core import feedback_tokens
from flywheel.core.contracts.events import SCHEMA_VERSION, ContractError, Feedback, parse_event
from flywheel.core.contracts.topics import events_topic
from flywheel.core.db.engine import session_factory
from flywheel.core.db.models import ApiKey
from flywheel.core.ratelimit import KeyedBuckets
from flywheel.core.settings import IngestSettings, Settings
from ingest import metrics

log = logging.getLogger(__name__)

PATH = "/v1/feedback"
SDK_ID = "flywheel-browser/1"
"""The ``sdk`` field of feedback that came through this route (``/1``: feedback token format 1)."""
FIELDS = ("score", "edit_ratio", "persisted_minutes", "dissatisfied", "text", "name", "value", "data_type", "comment")
"""What a body may set beside ``token``, ``kind`` and ``id``: the contract's value fields (``name``, ``value``,
``data_type`` and ``comment`` make a named score, kind ``score``)."""
MAX_BODY_BYTES = 64 * 1024
MAX_ID_CHARS = 128
PREFLIGHT_MAX_AGE_S = 600

REQUEST_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["token", "kind"],
                "additionalProperties": False,
                "properties": {
                    "token": {"type": "string", "description": "A feedback token (`fw.feedback_token(...)`)."},
                    "kind": {"type": "string", "enum": list(feedback_tokens.KINDS)},
                    "score": {"type": "number"},
                    "edit_ratio": {"type": "number", "minimum": 0, "maximum": 1},
                    "persisted_minutes": {"type": "number", "minimum": 0},
                    "dissatisfied": {"type": "boolean"},
                    "text": {"type": "string"},
                    "name": {"type": "string", "description": "A named score's name (kind `score`)."},
                    "value": {
                        "type": ["number", "boolean", "string"],
                        "description": "A named score's value: a number, true/false, or a category.",
                    },
                    "data_type": {"type": "string", "enum": ["numeric", "boolean", "categorical"]},
                    "comment": {"type": "string", "maxLength": 4096},
                    "id": {"type": "string", "description": "Idempotency key: the same id on a retry."},
                },
            }
        }
    },
}


@dataclass(frozen=True)
class SigningKey:
    """A write key as the feedback route needs it: its project, digest and whether it is revoked."""

    id: int
    project: str
    token_hash: str
    revoked: bool


class SigningKeys:
    """Every write key by its feedback key id, held in memory and re-read every ``ttl_s`` (and on an
    unknown key id, at most every ``miss_s``), so a request needs no database round trip."""

    def __init__(self, db_url: str, *, ttl_s: float = 10.0, miss_s: float = 2.0):
        self.db_url = db_url
        self.ttl_s = ttl_s
        self.miss_s = miss_s
        self._index: dict[str, list[SigningKey]] = {}
        self._loaded_at = float("-inf")
        self._lock = threading.Lock()

    def candidates(self, kid: str) -> list[SigningKey]:
        """The write keys whose key id is ``kid`` (almost always one, or none)."""
        now = time.monotonic()
        if now - self._loaded_at > self.ttl_s or (kid not in self._index and now - self._loaded_at > self.miss_s):
            self._reload(now)
        return self._index.get(kid, [])

    def _reload(self, now: float) -> None:
        with self._lock:
            if now < self._loaded_at:  # another thread reloaded meanwhile
                return
            query = select(ApiKey.id, ApiKey.project, ApiKey.token_hash, ApiKey.revoked_at).where(
                ApiKey.role == "writer", ApiKey.project.is_not(None)
            )
            with session_factory(self.db_url)() as session:
                rows = session.execute(query).all()
            index: dict[str, list[SigningKey]] = {}
            for row in rows:
                key = SigningKey(row.id, row.project, row.token_hash, row.revoked_at is not None)
                index.setdefault(feedback_tokens.key_id(row.token_hash), []).append(key)
            self._index = index
            self._loaded_at = time.monotonic()


class FeedbackError(HTTPException):
    """A refusal of a feedback request; ``field`` names the body field at fault, if one is."""

    def __init__(self, status: int, detail: str, field: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(status, detail, headers=headers)
        self.field = field


def authorize(keys: SigningKeys, token: object, now: float | None = None) -> tuple[feedback_tokens.FeedbackGrant, str]:
    """The grant of a token and the digest of its key, or raise :class:`FeedbackError` (401/403)."""
    try:
        kid = feedback_tokens.read_key_id(token)
    except feedback_tokens.TokenError as err:
        raise FeedbackError(401, err.reason, "token") from None
    found = keys.candidates(kid)
    if not found:
        raise FeedbackError(401, "feedback token is signed by an unknown key", "token")
    error: feedback_tokens.TokenError | None = None
    for key in found:
        try:
            grant = feedback_tokens.verify(token, key.token_hash, now=now)
        except feedback_tokens.TokenError as err:
            error = err
            continue
        if key.revoked:
            raise FeedbackError(401, "the write key this feedback token is signed with has been revoked", "token")
        if grant.project != key.project:
            raise FeedbackError(
                403, f"feedback token is for project {grant.project} but its key is scoped to {key.project}", "token"
            )
        return grant, key.token_hash
    assert error is not None
    raise FeedbackError(401, error.reason, "token")


def decode_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object with only known fields, or raise :class:`FeedbackError` (400/422)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise FeedbackError(400, f"body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise FeedbackError(400, 'body must be a JSON object {"token": ..., "kind": ...}')
    unknown = sorted(set(data) - {"token", "kind", "id", *FIELDS})
    if unknown:
        raise FeedbackError(422, f"unknown field(s): {', '.join(unknown)}", unknown[0])
    for name in ("token", "kind"):
        if not isinstance(data.get(name), str) or not data[name]:
            raise FeedbackError(422, f"{name}: required, a string", name)
    request_id = data.get("id")
    if request_id is not None and not (isinstance(request_id, str) and 0 < len(request_id) <= MAX_ID_CHARS):
        raise FeedbackError(422, f"id: a non-empty string of at most {MAX_ID_CHARS} characters", "id")
    return data


def event_id(token: str, data: dict[str, Any], issued_at: int) -> uuid.UUID:
    """A UUIDv7 that is the same for the same token and request: the token's issue time (ms), then 74
    bits of SHA-256 over the token and the request's ``id`` (or, without one, its kind and values)."""
    what = {"id": data["id"]} if data.get("id") is not None else {k: v for k, v in data.items() if k != "token"}
    digest = hashlib.sha256((token + "\n" + json.dumps(what, sort_keys=True)).encode("utf-8")).digest()
    rand = int.from_bytes(digest[:10], "big")
    value = ((issued_at * 1000) & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= ((rand >> 62) & 0xFFF) << 64
    value |= 0b10 << 62
    value |= rand & ((1 << 62) - 1)
    return uuid.UUID(int=value)


def build_event(grant: feedback_tokens.FeedbackGrant, data: dict[str, Any], now: datetime | None = None) -> Feedback:
    """The feedback event of a request under ``grant``, or raise :class:`FeedbackError` (403/422)."""
    kind = data["kind"]
    if kind not in feedback_tokens.KINDS:
        raise FeedbackError(422, f"kind: {kind!r} is not a feedback kind; one of {', '.join(feedback_tokens.KINDS)}",
                            "kind")  # fmt: skip
    if not grant.allows(kind):
        allowed = ", ".join(sorted(grant.kinds or ()))
        raise FeedbackError(403, f"kind: {kind!r} is not allowed by this feedback token (allowed: {allowed})", "kind")
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "type": "feedback",
        "event_id": str(event_id(data["token"], data, grant.issued_at)),
        "project": grant.project,
        "kind": kind,
        "sdk": SDK_ID,
        **{name: data[name] for name in FIELDS if data.get(name) is not None},
    }
    if now is not None:
        record["occurred_at"] = now.isoformat()
    for name, value in (("session_id", grant.session_id), ("completion_id", grant.completion_id),
                        ("user_id", grant.user_id)):  # fmt: skip
        if value is not None:
            record[name] = str(value)
    try:
        event = parse_event(record)
    except ContractError as err:
        field = err.field or err.reason.partition(":")[0]  # a rule over several fields names the one at fault
        detail = f"{err.field}: {err.reason}" if err.field else err.reason
        raise FeedbackError(422, detail, field if field in (*FIELDS, "kind") else None) from None
    assert isinstance(event, Feedback)
    return event


class FeedbackLimits:
    """Token buckets of ``POST /v1/feedback`` in one gateway process: one per feedback token
    (``ingest.feedback_token_rate_per_s`` / ``feedback_token_burst``) and one per signing write key
    (``ingest.feedback_key_rate_per_s`` / ``feedback_key_burst``). Checked after the token is verified,
    so a forged token takes no one's budget."""

    MAX_TOKENS = 100_000
    """Feedback tokens remembered at most (least recently used forgotten: it starts with a full bucket)."""

    def __init__(self, cfg: IngestSettings):
        self.per_token = KeyedBuckets(cfg.feedback_token_rate_per_s, cfg.feedback_token_burst, self.MAX_TOKENS)
        self.per_key = KeyedBuckets(cfg.feedback_key_rate_per_s, cfg.feedback_key_burst, self.MAX_TOKENS)

    def admit(self, token: str, key_hash: str, now: float) -> None:
        """Take from both buckets, or raise 429 naming the limit and the wait (``Retry-After``)."""
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        for buckets, what, setting in (
            (self.per_token, "this feedback token", "ingest.feedback_token_rate_per_s"),
            (self.per_key, "the write key that signed this token", "ingest.feedback_key_rate_per_s"),
        ):
            wait_s = buckets.take(digest if buckets is self.per_token else key_hash, now)
            if wait_s > 0:
                raise FeedbackError(
                    429,
                    f"rate limit of {what} exceeded: {buckets.rate_per_s:g} requests/s, burst {buckets.burst} "
                    f"({setting}); retry in {wait_s:.2f} s",
                    headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
                )


def too_large(declared: str | None, limit: int) -> FeedbackError:
    """The 413 of a body over the feedback route's ``limit``: ``declared`` is its Content-Length, ``None``
    when the streamed body ran past it."""
    if declared is None:
        return FeedbackError(413, f"body is over the feedback route's limit of {limit} bytes")
    return FeedbackError(413, f"body of {declared} bytes is over the feedback route's limit of {limit}")


def cors_headers(origin: str | None, allowed: frozenset[str]) -> dict[str, str]:
    """The CORS answer headers for a request from ``origin`` (none for a missing or other origin)."""
    if origin is None or origin.lower() not in allowed:
        return {"Vary": "Origin"}
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}


def register(
    app: FastAPI,
    settings: Settings,
    producer: Callable[[], Any],
    db_url: str,
    *,
    key_cache_ttl_s: float = 10.0,
) -> None:
    """Add ``OPTIONS`` and ``POST /v1/feedback`` to the gateway ``app``; ``producer()`` gives its producer."""
    from ingest.gateway import produce, read_body  # the gateway module registers this one

    keys = SigningKeys(db_url, ttl_s=key_cache_ttl_s, miss_s=min(2.0, key_cache_ttl_s))
    allowed = frozenset(origin.lower() for origin in settings.ingest.feedback_cors_origins)
    topic = events_topic(settings.kafka.topic_prefix)
    body_limit = min(MAX_BODY_BYTES, settings.ingest.max_body_bytes)
    app.state.feedback_keys = keys
    limits = FeedbackLimits(settings.ingest)

    @app.options(PATH, include_in_schema=False)
    def preflight(request: Request) -> Response:
        """The CORS preflight: allowed for the configured origins, for a JSON POST."""
        origin = request.headers.get("origin")
        headers = cors_headers(origin, allowed)
        if "Access-Control-Allow-Origin" not in headers:
            return JSONResponse(
                status_code=403,
                content={"detail": f"origin {origin} is not allowed to send feedback (ingest.feedback_cors_origins)"},
                headers=headers,
            )
        method = request.headers.get("access-control-request-method", "POST")
        if method != "POST":
            return JSONResponse(
                status_code=405, content={"detail": f"{method} is not allowed; use POST"}, headers=headers
            )
        headers |= {
            "Access-Control-Allow-Methods": "POST",
            "Access-Control-Allow-Headers": "content-type",
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        }
        return Response(status_code=204, headers=headers)

    @app.post(
        PATH,
        status_code=202,
        summary="Post feedback with a feedback token (from a browser)",
        responses={
            400: {"description": "Body is not a JSON object."},
            401: {"description": "Feedback token malformed, forged, expired, or its key unknown or revoked."},
            403: {"description": "Origin not allowed, or the kind not allowed by the token."},
            413: {"description": "Body over 64 KiB."},
            415: {"description": "Not application/json."},
            422: {"description": "A field is wrong; `field` names it."},
            429: {"description": "The token's or its write key's rate limit; retry after Retry-After seconds."},
            503: {"description": "Kafka did not acknowledge; retry (the same request is the same event)."},
        },
        openapi_extra={"requestBody": REQUEST_BODY},
    )
    async def post_feedback(request: Request) -> JSONResponse:
        """Accept one feedback under a feedback token; answers 202 ``{"event_id": ...}`` once Kafka acknowledged it."""
        origin = request.headers.get("origin")
        headers = cors_headers(origin, allowed)
        try:
            if origin is not None and "Access-Control-Allow-Origin" not in headers:
                raise FeedbackError(
                    403, f"origin {origin} is not allowed to send feedback (ingest.feedback_cors_origins)"
                )
            media = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                raise FeedbackError(415, f"content-type must be application/json (got {media or 'none'})")
            data = decode_body(await read_body(request, body_limit, too_large, check_length=False))
            grant, key_hash = await run_in_threadpool(authorize, keys, data["token"])
            limits.admit(data["token"], key_hash, time.monotonic())
            event = build_event(grant, data)
            await run_in_threadpool(produce, producer(), topic, [event])
        except HTTPException as exc:
            metrics.FEEDBACK_REQUESTS.labels(status=str(exc.status_code)).inc()
            content: dict[str, Any] = {"detail": exc.detail}
            if isinstance(exc, FeedbackError) and exc.field:
                content["field"] = exc.field
            if exc.status_code == 401:
                log.debug("feedback refused: %s", exc.detail)
            return JSONResponse(
                status_code=exc.status_code, content=content, headers={**(exc.headers or {}), **headers}
            )
        metrics.FEEDBACK_REQUESTS.labels(status="202").inc()
        metrics.GATEWAY_ACCEPTED.labels(project=event.project).inc()
        return JSONResponse(status_code=202, content={"event_id": str(event.event_id)}, headers=headers)
