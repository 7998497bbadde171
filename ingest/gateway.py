"""The HTTP gateway: ``POST /v1/events`` for clients that cannot reach Kafka.

A request carries ``Authorization: Bearer <write key>`` and ``{"events": [...]}``. Each event
is validated against the contracts on its own; the valid ones are produced to the events
topic (keyed by session id, or by completion id for feedback that names no session;
``acks=all``) and the answer comes only after Kafka acknowledged them:

- 202 ``{"accepted": [event ids], "rejected": []}``: every event was accepted;
- 422, same shape: some events were rejected (``{"index", "event_id", "field", "reason"}``
  each) and the others were still accepted;
- 403, same shape: every event belongs to another project than the key's;
- 401: missing, unknown or revoked key (403 for a token that is not a write key);
- 413: a body over ``max_body_bytes`` or more than ``max_batch_events`` events
  (an event over ``ingest.max_event_bytes``, or a completion over
  ``ingest.max_completion_tokens``, is rejected alone, in the 422 answer, its reason naming
  the setting and its value);
- 400: a body that is not ``{"events": [...]}``; 503: Kafka did not acknowledge (retry:
  event ids make a retry harmless).

``POST /v1/traces`` takes OpenTelemetry (OTLP/HTTP) trace exports with the same key
(:mod:`ingest.otlp_route`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from kafka.errors import KafkaError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from flywheel.core import kafka_clients
from flywheel.core.auth import KeyInfo, bearer_token, find_key, hash_token
from flywheel.core.contracts.events import ContractError, EventBase, dump_event, parse_event, unknown_fields
from flywheel.core.contracts.topics import events_topic
from flywheel.core.db.engine import session_factory
from flywheel.core.endpoints import kafka_bootstrap, postgres_url
from flywheel.core.settings import Settings
from ingest import feedback, metrics
from ingest.limits import Limits, check_record_limit
from ingest.otlp_route import register as register_otlp

log = logging.getLogger(__name__)

PRODUCE_TIMEOUT_S = 10.0
PUBLIC_PATHS = frozenset({"/healthz", feedback.PATH})
"""The only paths the gateway serves without a key: liveness, and browser feedback (a feedback token instead)."""
"""How long the gateway waits for Kafka's acknowledgement before answering 503."""


class Rejection(BaseModel):
    """One event of the batch that was not accepted, and why."""

    index: int = Field(description="Position of the event in the request's `events` list.")
    event_id: str | None = Field(None, description="The event's id, when it could be read.")
    field: str = Field(description="Dotted path of the offending field ('' for the event itself).")
    reason: str = Field(description="What is wrong with it.")


class IngestResponse(BaseModel):
    """The answer to a batch: the ids accepted (produced and acknowledged by Kafka) and the rejections."""

    accepted: list[str] = Field(default_factory=list, description="Event ids accepted, in request order.")
    rejected: list[Rejection] = Field(default_factory=list, description="Events not accepted, with the reason.")


class ErrorResponse(BaseModel):
    """An error that concerns the whole request."""

    detail: str


class ProducerLike(Protocol):
    """What the gateway needs of a producer (``kafka.KafkaProducer``)."""

    def send(self, topic: str, value: bytes | None = None, key: bytes | None = None) -> Any: ...

    def close(self, timeout: float | None = None) -> None: ...


@dataclass
class BatchVerdict:
    """Validation of one request's events against the contracts and the key's project."""

    accepted: list[EventBase]
    rejected: list[Rejection]
    foreign: int
    """Rejections because the event belongs to another project."""

    @property
    def status(self) -> int:
        """202 when all were accepted, 403 when all were foreign, else 422."""
        if not self.rejected:
            return 202
        if not self.accepted and self.foreign == len(self.rejected):
            return 403
        return 422


def validate_batch(items: Sequence[Any], project: str, limits: Limits | int) -> BatchVerdict:
    """Check each event of a batch on its own: size, contract, configured limits, project scope.

    ``limits`` may be the event byte limit alone (the completion token limit is then its default).
    """
    if isinstance(limits, int):
        limits = Limits(max_event_bytes=limits)
    accepted: list[EventBase] = []
    rejected: list[Rejection] = []
    foreign = 0
    for index, item in enumerate(items):
        event_id = _readable_id(item)
        too_big = limits.size_problem(_size(item))
        if too_big:
            rejected.append(Rejection(index=index, event_id=event_id, field="", reason=too_big))
            continue
        if not isinstance(item, dict):
            reason = f"an event must be a JSON object, got {type(item).__name__}"
            rejected.append(Rejection(index=index, event_id=None, field="", reason=reason))
            continue
        try:
            event = parse_event(item)
        except ContractError as err:
            rejected.append(Rejection(index=index, event_id=event_id, field=err.field, reason=err.reason))
            continue
        over = limits.event_problem(event)
        if over is not None:
            rejected.append(Rejection(index=index, event_id=str(event.event_id), field=over[0], reason=over[1]))
            continue
        if event.project != project:
            foreign += 1
            reason = f"write key is scoped to project {project}"
            rejected.append(Rejection(index=index, event_id=str(event.event_id), field="project", reason=reason))
            continue
        accepted.append(event)
    return BatchVerdict(accepted, rejected, foreign)


def _readable_id(item: Any) -> str | None:
    value = item.get("event_id") if isinstance(item, dict) else None
    return value[:64] if isinstance(value, str) else None


def _size(item: Any) -> int:
    return len(json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))


class KeyStore:
    """Write-key lookups by token hash, cached briefly (a revocation takes effect within ``ttl_s``)."""

    MAX_ENTRIES = 10_000

    def __init__(self, db_url: str, *, ttl_s: float = 10.0, negative_ttl_s: float = 2.0):
        self.db_url = db_url
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self._cache: dict[str, tuple[float, KeyInfo | None]] = {}
        self._lock = threading.Lock()

    def lookup(self, token: str) -> KeyInfo | None:
        """The key ``token`` is (revoked or not), or None; from the cache when fresh."""
        digest = hash_token(token)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        info = self._load(token)
        ttl = self.ttl_s if info is not None else self.negative_ttl_s
        with self._lock:
            if len(self._cache) >= self.MAX_ENTRIES:
                self._cache.clear()
            self._cache[digest] = (now + ttl, info)
        return info

    def _load(self, token: str) -> KeyInfo | None:
        with session_factory(self.db_url)() as session:
            info = find_key(session, token, touch=True)
            session.commit()
        return info

    def active_key(self, authorization: str | None) -> KeyInfo:
        """The active key (write key or ops token) of an ``Authorization`` header, else raise 401."""
        token = bearer_token(authorization)
        if token is None:
            raise _unauthorized("missing key: send 'Authorization: Bearer <key>'")
        info = self.lookup(token)
        if info is None:
            raise _unauthorized("unknown key")
        if not info.active:
            raise _unauthorized("this key has been revoked")
        return info

    def authenticate(self, authorization: str | None) -> KeyInfo:
        """The active write key of an ``Authorization`` header, else raise 401 (or 403 for a non-writer)."""
        info = self.active_key(authorization)
        if info.role != "writer" or not info.project:
            raise HTTPException(403, f"a {info.role} token cannot write events; use a project's write key")
        return info


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})


def too_large(declared: str | None, limit: int) -> HTTPException:
    """The 413 of a body over ``ingest.max_body_bytes``: ``declared`` is its Content-Length, ``None`` when
    the streamed body ran past ``limit``."""
    if declared is None:
        return HTTPException(413, f"body is over the limit ingest.max_body_bytes = {limit}")
    return HTTPException(413, f"body of {declared} bytes is over the limit ingest.max_body_bytes = {limit}")


async def read_body(
    request: Request,
    limit: int,
    refuse: Callable[[str | None, int], HTTPException] = too_large,
    *,
    check_length: bool = True,
) -> bytes:
    """The request body, raising ``refuse(declared, limit)`` for a declared (``declared``: the Content-Length)
    or streamed (``None``) size over ``limit`` bytes; a Content-Length that is not a number is refused
    (400) when ``check_length``, else left to the streamed size."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            if check_length:
                raise HTTPException(400, "invalid Content-Length header")
        elif int(declared) > limit:
            raise refuse(declared, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise refuse(None, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def decode_batch(body: bytes, max_events: int) -> list[Any]:
    """The ``events`` list of a body, or raise 400 (not ``{"events": [...]}``) / 413 (too many events)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise HTTPException(400, f"body is not valid JSON: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("events"), list):
        raise HTTPException(400, 'body must be a JSON object {"events": [...]}')
    extra = sorted(set(data) - {"events"})
    if extra:
        raise HTTPException(400, f"unknown body field(s): {', '.join(extra)}")
    events = data["events"]
    if len(events) > max_events:
        raise HTTPException(
            413, f"{len(events)} events in one request, over the limit ingest.max_batch_events = {max_events}"
        )
    return events


def produce(producer: ProducerLike, topic: str, events: Sequence[EventBase]) -> None:
    """Produce events keyed by session id and wait for every acknowledgement (503 if Kafka does not ack).

    Feedback by completion id alone (no session) is keyed by its completion id; the consumer attaches it.
    """
    try:
        futures = [producer.send(topic, key=e.kafka_key.encode("utf-8"), value=dump_event(e)) for e in events]
        for future in futures:
            future.get(timeout=PRODUCE_TIMEOUT_S)
    except KafkaError as err:
        log.warning("Kafka did not acknowledge %d events: %s", len(events), err)
        raise HTTPException(
            503, f"the event broker did not acknowledge the batch ({err}); retry it", headers={"Retry-After": "1"}
        ) from None
    metrics.PRODUCED.labels(topic=topic).inc(len(events))


def make_producer(settings: Settings) -> ProducerLike:
    """A KafkaProducer for the gateway: ``acks=all``, sized for the largest event (``kafka.max_record_bytes``)."""
    return kafka_clients.producer(
        kafka_bootstrap(settings),
        security=settings.kafka.security(),
        client_id="flywheel-ingest-gateway",
        acks="all",
        linger_ms=2,
        max_request_size=check_record_limit(settings),
    )


REQUEST_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["events"],
                "additionalProperties": False,
                "properties": {
                    "events": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "description": "One event (schema: docs/schema/events.schema.json, "
                            "`flywheel contracts export`).",
                        },
                    }
                },
            }
        }
    },
}


def create_app(
    settings: Settings,
    producer: ProducerLike | None = None,
    db_url: str | None = None,
    *,
    key_cache_ttl_s: float = 10.0,
) -> FastAPI:
    """The gateway app. ``producer`` and ``db_url`` default to the configured broker and database.

    A producer passed in is left open; one the app makes is closed at shutdown. Key lookups
    are cached for ``key_cache_ttl_s`` (so a revocation takes effect within it).
    """
    ingest = settings.ingest
    check_record_limit(settings)
    limits = Limits.from_settings(settings)
    topic = events_topic(settings.kafka.topic_prefix)
    state: dict[str, Any] = {"producer": producer}
    if db_url is None:
        db_url = postgres_url(settings)
    keys = KeyStore(db_url, ttl_s=key_cache_ttl_s, negative_ttl_s=min(2.0, key_cache_ttl_s))

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        owned = state["producer"] is None
        if owned:
            state["producer"] = await run_in_threadpool(make_producer, settings)
        try:
            yield
        finally:
            if owned:
                await run_in_threadpool(state["producer"].close, 10)

    app = FastAPI(
        title="Flywheel ingest gateway",
        version="1",
        description="Send session events over HTTP with a project's write key.",
        lifespan=lifespan,
        openapi_url=None,  # served below, behind a key like every route but /healthz
        docs_url=None,
        redoc_url=None,
    )
    app.state.keys = keys
    register_otlp(app, settings=settings, keys=keys, producer=lambda: state["producer"], topic=topic, limits=limits)

    @app.post(
        "/v1/events",
        status_code=202,
        response_model=IngestResponse,
        responses={
            400: {"model": ErrorResponse, "description": 'Body is not `{"events": [...]}`.'},
            401: {"model": ErrorResponse, "description": "Missing, unknown or revoked write key."},
            403: {"model": IngestResponse, "description": "Every event belongs to another project than the key's."},
            413: {"model": ErrorResponse, "description": "Body or batch over the size limits."},
            422: {"model": IngestResponse, "description": "Some events rejected; the valid ones were accepted."},
            503: {"model": ErrorResponse, "description": "Kafka did not acknowledge; retry."},
        },
        openapi_extra={"requestBody": REQUEST_BODY},
    )
    async def post_events(request: Request) -> JSONResponse:
        """Accept a batch of events: each is validated alone; the valid ones go to Kafka."""
        key = await run_in_threadpool(keys.authenticate, request.headers.get("authorization"))
        body = await read_body(request, ingest.max_body_bytes)
        items = decode_batch(body, ingest.max_batch_events)
        verdict = await run_in_threadpool(validate_batch, items, key.project, limits)
        if verdict.accepted:
            await run_in_threadpool(produce, state["producer"], topic, verdict.accepted)
        _count(key, verdict)
        answer = IngestResponse(accepted=[str(e.event_id) for e in verdict.accepted], rejected=verdict.rejected)
        return JSONResponse(status_code=verdict.status, content=answer.model_dump())

    feedback.register(app, settings, lambda: state["producer"], db_url, key_cache_ttl_s=key_cache_ttl_s)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        metrics.GATEWAY_REQUESTS.labels(status=str(exc.status_code)).inc()
        return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail}, headers=exc.headers)

    @app.get("/metrics", include_in_schema=False)
    def prometheus(request: Request) -> Response:
        """Prometheus metrics, for an ops token (``viewer`` and up; Prometheus sends it as a bearer credential)."""
        info = keys.active_key(request.headers.get("authorization"))
        if info.role == "writer":
            raise HTTPException(403, "a write key cannot read metrics; use an ops token (viewer or above)")
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(request: Request) -> JSONResponse:
        """The OpenAPI schema, for any active key."""
        keys.active_key(request.headers.get("authorization"))
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    def docs(request: Request) -> Response:
        """Swagger UI over /openapi.json, for any active key."""
        keys.active_key(request.headers.get("authorization"))
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @app.get("/healthz")  # the only route without a key: PUBLIC_PATHS
    def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    return app


def _count(key: KeyInfo, verdict: BatchVerdict) -> None:
    metrics.GATEWAY_REQUESTS.labels(status=str(verdict.status)).inc()
    if verdict.accepted:
        metrics.GATEWAY_ACCEPTED.labels(project=key.project).inc(len(verdict.accepted))
    if verdict.foreign:
        metrics.GATEWAY_REJECTED.labels(kind="project").inc(verdict.foreign)
    if len(verdict.rejected) > verdict.foreign:
        metrics.GATEWAY_REJECTED.labels(kind="contract").inc(len(verdict.rejected) - verdict.foreign)
    for event in verdict.accepted:
        unknown = unknown_fields(event)
        if unknown:  # a newer SDK's fields: forwarded as they came (docs/contracts.md)
            metrics.UNKNOWN_FIELDS.labels(stage="gateway").inc()
            log.debug("event %s (%s) has fields this reader does not know: %s", event.event_id, key.project, unknown)
