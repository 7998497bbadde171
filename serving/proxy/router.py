"""The router: the fleet's only public ingress, an OpenAI-compatible proxy in front of the vLLM replicas.

Routes (an allow-list; every other path answers 404 with a JSON reason, so vLLM's
development endpoints — ``/pause``, ``/collective_rpc``, ``/weight_info``, ... — are never
reachable through it):

- ``POST /v1/chat/completions``, ``POST /v1/completions``: proxied, streaming (SSE) or not;
- ``GET /v1/models``: the policy versions served now;
- ``GET /health`` (the router is alive), ``GET /ready`` (at least one routable replica).

The completion routes and ``/v1/models`` need a product key (``Authorization: Bearer fwp_…``,
the ``api_key`` of the official ``openai`` client): 401 without one or with an unknown or
revoked one, 403 for another kind of key or a project not served, 429 with ``Retry-After``
past the key's rate limit, 413 past ``serving.max_request_bytes`` (:mod:`serving.proxy.access`).
The keys' digests are re-read with the routing table, so no request touches the database.

The router's Prometheus counters are not on the public port: ``GET /metrics`` on
``serving.router_metrics_host:router_metrics_port`` (loopback by default; off unless a port is
set). Their ``replica`` label is the replica's id in the ``replicas`` table, never its URL.

No answer to a client names a replica's internal URL: headers, bodies, ``/ready`` and error
messages name a replica by the same id (:meth:`Router.replica_name`), and error details taken
from a failed connection or an upstream body are redacted of network addresses
(:func:`redact`). The router's own log keeps the URLs.

Every ``refresh_s`` the routing table (active deployments of ``serving.fleet`` and their
``replicas`` rows) is read from Postgres in a worker thread; every ``health_interval_s``
each replica is probed (``/health``, ``/weight_info``, ``/v1/models``). No request touches
the database. The decisions (split, stickiness, ejection, least outstanding) are the pure
functions of :mod:`serving.proxy.routing`.

A proxied response carries ``x-flywheel-policy-version`` and ``x-flywheel-replica`` (the
replica's id) headers; a non-streamed JSON body also gets a
``"flywheel": {"policy_version", "replica"}`` member (spliced into the bytes, not
re-serialised). SSE chunks are passed through as they arrive. A request that fails before
its first byte reached the client (connection error, 5xx, replica gone) is retried on
another replica of the same version, up to ``max_attempts``; a stream that breaks after it
started ends with an SSE ``error`` event.

The server is a plain ASGI app (no framework on the hot path) run by uvicorn with uvloop
and httptools; upstream calls share one ``aiohttp`` session with a keep-alive pool.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import uvicorn
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from flywheel.core import auth
from flywheel.core.auth import KeyInfo, bearer_token, hash_token
from flywheel.core.contracts import headers
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import Checkpoint, Deployment, Replica
from flywheel.core.endpoints import postgres_url
from flywheel.core.redact import Redactor
from flywheel.core.settings import ServingSettings, Settings, get_settings
from serving.proxy import routing
from serving.proxy.access import AccessDenied, RateLimiter, check_key, retry_after_header
from serving.proxy.capture import Capture, CaptureSink
from serving.proxy.routing import Decision, ReplicaHealth, ReplicaRow, RoutingTable, StickyTable

log = logging.getLogger("flywheel.serving.router")

SESSION_HEADER = headers.SESSION_ID
"""Request header naming the agent's session (sticky routing); else the body's ``user``."""
POLICY_VERSION_HEADER = headers.POLICY_VERSION.encode()
REPLICA_HEADER = headers.REPLICA.encode()
_SESSION_HEADER_BYTES = SESSION_HEADER.encode()
_SPAN_HEADER_BYTES = headers.SPAN_ID.encode()
_ROLE_HEADER_BYTES = headers.AGENT_ROLE.encode()
SSE_DONE = b"data: [DONE]"
"""The event that ends a complete OpenAI stream; a stream that ends without it broke."""
PROXIED = {"/v1/chat/completions", "/v1/completions"}
"""Paths proxied to a replica (POST only)."""
LOCAL_GET = {"/health", "/ready", "/v1/models"}
"""Paths the router answers itself (GET only)."""
KEYED = PROXIED | {"/v1/models"}
"""Paths that need a product key."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_UPSTREAM_HEADERS = {"Content-Type": "application/json"}


class RouterError(Exception):
    """An answer the router gives itself (status, OpenAI-style error body); recoverable by the client."""

    def __init__(self, status: int, message: str, code: str, headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = headers or []

    @classmethod
    def denied(cls, err: AccessDenied) -> RouterError:
        """The answer to a refused key or an exceeded rate limit."""
        extra = [(b"www-authenticate", b"Bearer")] if err.status == 401 else []
        if err.retry_after_s is not None:
            extra.append((b"retry-after", retry_after_header(err.retry_after_s)))
        return cls(err.status, err.reason, err.code, extra)

    def body(self) -> bytes:
        """The OpenAI-style error JSON."""
        return json.dumps({"error": {"message": self.message, "type": self.code, "code": self.status}}).encode()


class UpstreamFailed(Exception):
    """A replica failed before the response started (connection error or 5xx): retry elsewhere.

    ``url`` is for the router's log; what a client sees goes through :func:`redact`.
    """

    def __init__(self, url: str, kind: str, detail: str):
        super().__init__(f"{url}: {kind}: {detail}")
        self.url, self.kind, self.detail = url, kind, detail


# -- the routing table from Postgres ---------------------------------------------------------


def read_table(engine: Engine, fleet: str) -> RoutingTable:
    """The fleet's active deployments (with their checkpoints' policy versions) and replica rows."""
    deployments = (
        select(Deployment.role, Deployment.agent_role, Deployment.weight, Deployment.id, Checkpoint.policy_version)
        .join(Checkpoint, Checkpoint.id == Deployment.checkpoint_id)
        .where(Deployment.fleet == fleet, Deployment.status == "active")
        .order_by(Deployment.id)
    )
    replicas = (
        select(Replica.id, Replica.url, Replica.state, Replica.policy_version)
        .where(Replica.fleet == fleet)
        .order_by(Replica.id)
    )
    entries: dict[routing.Role, routing.DeploymentEntry] = {}
    pins: dict[str, routing.PinEntry] = {}
    with engine.connect() as conn:
        for row in conn.execute(deployments):
            if row.role == "pinned":
                pins[row.agent_role] = routing.PinEntry(row.agent_role, row.policy_version, int(row.id))
            else:
                entries[row.role] = routing.DeploymentEntry(
                    row.role, row.policy_version, float(row.weight), int(row.id)
                )
        rows = tuple(
            ReplicaRow(r.url.rstrip("/"), r.state, r.policy_version, int(r.id)) for r in conn.execute(replicas)
        )
    return RoutingTable(deployments=entries, replicas=rows, pins=pins)


def read_keys(engine: Engine, used: set[int]) -> dict[str, KeyInfo]:
    """Record the use of the keys ``used`` since the last read; every key by its token digest."""
    with Session(engine) as session:
        auth.touch_keys(session, used)
        keys = auth.key_index(session)
        session.commit()
    return keys


# -- metrics ---------------------------------------------------------------------------------


class _LiveGauges:
    """Scrape-time gauges: outstanding requests and routability per replica."""

    def __init__(self, router: Router):
        self.router = router

    def collect(self) -> Any:
        outstanding = GaugeMetricFamily(
            "flywheel_router_outstanding_requests", "Requests in flight per replica", labels=["replica"]
        )
        up = GaugeMetricFamily(
            "flywheel_router_replica_routable",
            "1 when the replica gets new requests",
            labels=["replica", "policy_version"],
        )
        routable = {v.url for views in self.router.routes.by_version.values() for v in views}
        for row in self.router.table.replicas:
            name = self.router.replica_name(row.url)
            outstanding.add_metric([name], self.router.outstanding.get(row.url, 0))
            up.add_metric([name, row.policy_version or ""], 1.0 if row.url in routable else 0.0)
        yield outstanding
        yield up


class Metrics:
    """The router's Prometheus counters, in a registry of its own.

    ``replica`` labels are the replicas' ids in the ``replicas`` table (:meth:`Router.replica_name`).
    """

    def __init__(self, router: Router):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "flywheel_router_requests", "Proxied requests answered, by version, replica and status",
            ["policy_version", "replica", "status"], registry=self.registry,
        )  # fmt: skip
        self.failures = Counter(
            "flywheel_router_upstream_failures", "Failed upstream attempts and probes, by replica and kind",
            ["replica", "kind"], registry=self.registry,
        )  # fmt: skip

        def counter(name: str, doc: str, label: str) -> Counter:
            return Counter(name, doc, [label], registry=self.registry)

        self.retries = counter("flywheel_router_retries", "Requests retried on another replica", "policy_version")
        self.pinned = counter(
            "flywheel_router_pinned_requests",
            "Requests of a pinned agent role sent to its pinned version",
            "agent_role",
        )
        self.ejections = counter("flywheel_router_ejections", "Replicas ejected", "replica")
        self.rejoins = counter("flywheel_router_rejoins", "Ejected replicas back after a passing probe", "replica")
        self.rejected = counter(
            "flywheel_router_rejected", "Requests the router answered itself with an error", "status"
        )
        self.stream_errors = counter("flywheel_router_stream_errors", "Streams ended by an upstream failure", "replica")
        self.refused = counter(
            "flywheel_router_refused", "Requests refused for their key or rate (401, 403, 429), by reason", "code"
        )
        self.captured = Counter(
            "flywheel_router_captured", "Completions captured as events and acknowledged by Kafka",
            registry=self.registry,
        )  # fmt: skip
        self.capture_redacted = Counter(
            "flywheel_router_capture_token_data_redacted",
            "Captured completions sent without the token data of a text redaction changed",
            registry=self.registry,
        )  # fmt: skip
        self.capture_dropped = counter(
            "flywheel_router_capture_dropped",
            "Captured completions not sent (buffer_full, too_large, kafka_error, invalid, unparsable, stream_failed)",
            "reason",
        )
        self.registry.register(_LiveGauges(router))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total: the router's own CPU
        self._request_children: dict[tuple[str, str, int], Any] = {}

    def answered(self, version: str, replica: str, status: int) -> None:
        """Count one proxied answer (label children cached: this runs per request)."""
        key = (version, replica, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(version, replica, str(status))
        child.inc()


# -- the router ------------------------------------------------------------------------------


@dataclass
class _Attempt:
    """The replica a request goes to, and what the router tells the client about it."""

    url: str
    version: str
    name: str
    """The replica as metrics name it (its id)."""
    headers: list[tuple[bytes, bytes]]
    tag: bytes
    """``,"flywheel":{...}}`` spliced into a JSON body's closing brace."""


class Router:
    """State shared by every request: the table, the probes' verdicts, stickiness and counters."""

    def __init__(self, settings: Settings, engine: Engine | None = None):
        self.settings = settings
        self.cfg: ServingSettings = settings.serving
        self._engine = engine
        self.table: RoutingTable = routing.EMPTY_TABLE
        self.health: dict[str, ReplicaHealth] = {}
        self.models: dict[str, list[str]] = {}
        """Model ids each replica's ``/v1/models`` lists (its served name first)."""
        self.outstanding: dict[str, int] = {}
        self.routes = routing.Routes(table=self.table)
        self.accepted: set[str] = set()
        """Model names a request may name (recomputed with the routes)."""
        self.sticky = StickyTable(self.cfg.sticky_ttl_s, self.cfg.sticky_max_sessions)
        self.metrics = Metrics(self)
        self.keys: dict[str, KeyInfo] = {}
        """Every key by its token digest (re-read with the table)."""
        self.keys_loaded = False
        self.used_keys: set[int] = set()
        """Keys used since the last read (their ``last_used_at`` is written with the next read)."""
        self.limiter = RateLimiter(self.cfg.key_rate_per_s, self.cfg.key_burst)
        self.capture: CaptureSink | None = None
        self._redactor = Redactor() if self.cfg.capture.redact else None
        if self.cfg.capture.projects:
            self.capture = CaptureSink(
                settings,
                on_drop=lambda reason, n: self.metrics.capture_dropped.labels(reason).inc(n),
                on_sent=self.metrics.captured.inc,
            )
        self._keys_changed = asyncio.Event()
        self._metrics_runner: web.AppRunner | None = None
        self.rng = random.Random()
        self.table_loaded = False
        self.last_refresh_error: str | None = None
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._probing: set[str] = set()
        self._attempts: dict[tuple[str, str], _Attempt] = {}
        self.session: aiohttp.ClientSession | None = None
        self._probe_session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s, sock_connect=self.cfg.health_timeout_s)
        self.wait_s = self.cfg.refresh_s + self.cfg.health_timeout_s
        """How long a request waits for a routable replica when there is none (e.g. mid-swap)."""

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The database engine (from the settings' Postgres URL unless one was given)."""
        if self._engine is None:
            self._engine = get_engine(postgres_url(self.settings))
        return self._engine

    async def start(self) -> None:
        """Open the upstream pools, read the table, probe every replica once, start the loops."""
        keepalive = self.cfg.upstream_keepalive_s  # below the replicas' own, so none is closed under a request
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding")
        )
        self._probe_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive)
        )
        try:
            await self.refresh()
        except Exception as err:  # the loop keeps retrying; the router starts and says it is not ready
            log.error("router: first routing-table read failed: %r", err)
        await self.probe_all()
        if self.capture is not None:
            self.capture.start()
        self._tasks = [
            asyncio.create_task(self._loop(self.cfg.refresh_s, self.refresh), name="router-refresh"),
            asyncio.create_task(self._loop(self.cfg.health_interval_s, self.probe_all), name="router-health"),
        ]
        if self.cfg.router_metrics_port is not None:
            await self.serve_metrics(self.cfg.router_metrics_host, self.cfg.router_metrics_port)

    async def serve_metrics(self, host: str, port: int) -> None:
        """Serve ``GET /metrics`` on ``host:port`` (a listener of its own, never the public port)."""

        async def metrics(_request: web.Request) -> web.Response:
            body = generate_latest(self.metrics.registry)
            return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._metrics_runner = web.AppRunner(app, access_log=None)
        await self._metrics_runner.setup()
        await web.TCPSite(self._metrics_runner, host, port).start()
        log.info("router metrics on http://%s:%d/metrics", host, port)

    async def stop(self) -> None:
        """Stop the loops and close the pools."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        for session in (self.session, self._probe_session):
            if session is not None:
                await session.close()
        if self.capture is not None:
            await asyncio.to_thread(self.capture.close)

    async def _loop(self, every_s: float, step: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a failed refresh keeps the last table; logged, counted, retried next tick
                # Clients read this (/ready, 503s): the error's kind only. Its text (a database error names
                # the database's host, port and user) goes to the router's log.
                self.last_refresh_error = f"{step.__name__} failed with {type(err).__name__}; the router's log has why"
                self.metrics.failures.labels("router", step.__name__).inc()
                log.warning("router: %s failed: %r", step.__name__, err)

    # -- table and probes --------------------------------------------------------------------

    async def refresh(self) -> None:
        """Re-read the routing table and the keys; probe at once any replica whose row changed."""
        used, self.used_keys = self.used_keys, set()
        try:
            table = await asyncio.to_thread(read_table, self.engine, self.cfg.fleet)
            keys = await asyncio.to_thread(read_keys, self.engine, used)
        except BaseException:
            self.used_keys |= used  # written with the next read that works
            raise
        self.last_refresh_error = None
        self.table_loaded = True
        self.apply_keys(keys)
        self.apply_table(table)

    def apply_keys(self, keys: dict[str, KeyInfo]) -> None:
        """Take a new key index; wake requests waiting for a key not seen before."""
        self.keys = keys
        self.keys_loaded = True
        self.limiter.forget({k.id for k in keys.values() if k.active})
        self._keys_changed.set()
        self._keys_changed = asyncio.Event()

    def replica_name(self, url: str) -> str:
        """The replica at ``url`` as metrics and clients know it: its id in the ``replicas`` table.

        The one name a replica has outside the router (headers, bodies, ``/ready``, error
        messages, metric labels); its URL is internal.
        """
        for row in self.table.replicas:
            if row.url == url and row.id is not None:
                return str(row.id)
        return "unknown"

    async def authorize(self, authorization: str | None) -> KeyInfo:
        """The request's product key (taking one request from its rate limit), else a 401/403/429/503 error.

        A key not in the index may have been created a moment ago: the request waits for the
        next read of the keys (at most ``wait_s``) before it is called unknown.
        """
        token = bearer_token(authorization)
        if token is not None and (not self.keys_loaded or hash_token(token) not in self.keys):
            await self._wait_for_keys(time.monotonic() + self.wait_s)
            if not self.keys_loaded:
                raise RouterError(
                    503,
                    "cannot check product keys: the key table was never read "
                    f"({self.last_refresh_error or 'no refresh yet'})",
                    "service_unavailable",
                )
        try:
            key = check_key(authorization, self.keys, self.cfg.projects)
            self.limiter.admit(key, time.monotonic())
        except AccessDenied as err:
            self.metrics.refused.labels(err.code).inc()
            raise RouterError.denied(err) from None
        self.used_keys.add(key.id)
        return key

    async def _wait_for_keys(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining > 0:
            try:
                await asyncio.wait_for(self._keys_changed.wait(), remaining)
            except TimeoutError:
                pass

    def apply_table(self, table: RoutingTable) -> None:
        """Take a new table: track new replicas, forget removed ones, re-probe changed ones."""
        before = {r.url: r for r in self.table.replicas}
        if {(r.url, r.id) for r in table.replicas} != {(r.url, r.id) for r in before.values()}:
            self._attempts.clear()  # their metric names (replica ids) may have changed
        self.table = table
        urls = {r.url for r in table.replicas}
        for url in list(self.health):
            if url not in urls:
                del self.health[url]
                self.models.pop(url, None)
        for row in table.replicas:
            if row.url not in self.health:
                self.health[row.url] = ReplicaHealth(self.cfg.eject_after_failures)
            old = before.get(row.url)
            if old != row and self._tasks:
                self.probe_soon(row.url)  # e.g. a swap just finished: do not wait for the next round
        self.rebuild()

    def rebuild(self) -> None:
        """Recompute the routable replicas and the accepted model names; wake requests waiting for a replica."""
        self.routes = routing.build_routes(self.table, self.health)
        self.accepted = self.accepted_models()
        self._changed.set()
        self._changed = asyncio.Event()

    def probe_soon(self, url: str) -> None:
        """Probe ``url`` now (once at a time), outside the regular health interval."""
        if url in self._probing or self._probe_session is None:
            return
        asyncio.get_running_loop().create_task(self._probe_and_rebuild(url))

    async def _probe_and_rebuild(self, url: str) -> None:
        await self.probe(url)
        self.rebuild()

    async def probe_all(self) -> None:
        """Probe every replica of the table concurrently."""
        urls = [r.url for r in self.table.replicas]
        if urls:
            await asyncio.gather(*(self.probe(u) for u in urls))
        self.rebuild()

    async def probe(self, url: str) -> None:
        """``GET /health``, ``/weight_info`` and ``/v1/models`` of one replica; update its health."""
        health = self.health.get(url)
        if health is None or self._probe_session is None or url in self._probing:
            return
        self._probing.add(url)
        timeout = aiohttp.ClientTimeout(total=self.cfg.health_timeout_s)
        try:
            session = self._probe_session
            async with session.get(url + "/health", timeout=timeout) as resp:
                if resp.status != 200:
                    raise UpstreamFailed(url, "probe", f"/health answered HTTP {resp.status}")
            async with session.get(url + "/weight_info", timeout=timeout) as resp:
                if resp.status != 200:
                    raise UpstreamFailed(url, "probe", f"/weight_info answered HTTP {resp.status}")
                version = (await resp.json(content_type=None)).get("weight_version")
            async with session.get(url + "/v1/models", timeout=timeout) as resp:
                if resp.status != 200:
                    raise UpstreamFailed(url, "probe", f"/v1/models answered HTTP {resp.status}")
                ids = [str(m["id"]) for m in (await resp.json(content_type=None)).get("data", [])]
        except (TimeoutError, aiohttp.ClientError, UpstreamFailed, ValueError, KeyError, AttributeError) as err:
            self._failure(url, "probe", f"{type(err).__name__}: {err}")
        else:
            self.models[url] = ids
            if health.probe_ok(None if version is None else str(version), ids):
                self.metrics.rejoins.labels(self.replica_name(url)).inc()
                log.warning("router: replica %s answers again (weight version %s): back in rotation", url, version)
        finally:
            self._probing.discard(url)

    def _failure(self, url: str, kind: str, detail: str) -> None:
        self.metrics.failures.labels(self.replica_name(url), kind).inc()
        health = self.health.get(url)
        if health is not None and health.failure(detail):
            self.metrics.ejections.labels(self.replica_name(url)).inc()
            log.warning("router: replica %s ejected after %d failures (last: %s)", url, health.failures, detail)
            self.rebuild()

    # -- decisions ---------------------------------------------------------------------------

    def accepted_models(self) -> set[str]:
        """Model names a request may name: the fleet's alias, the replicas' served names and every
        version in the table."""
        names = {self.settings.serving.model_alias, *(e.policy_version for e in self.table.deployments.values())}
        names.update(pin.policy_version for pin in self.table.pins.values())
        names.update(r.policy_version for r in self.table.replicas if r.policy_version)
        for ids in self.models.values():
            names.update(ids)
        return names

    async def decide(self, session_id: str | None, agent_role: str | None = None) -> Decision:
        """The request's policy version, waiting up to ``wait_s`` for a routable replica (of the pinned
        version, for a request of a pinned agent role)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            decision = routing.decide(self.routes, session_id, self.sticky, time.monotonic(), self.rng, agent_role)
            if decision is not None and decision.pin is not None:
                if self.routes.by_version.get(decision.policy_version):
                    self.metrics.pinned.labels(decision.pin.agent_role).inc()
                    return decision
                if not await self._wait_for_change(deadline):
                    pin = decision.pin
                    raise RouterError(
                        503,
                        f"agent role {pin.agent_role!r} is pinned to policy version {pin.policy_version!r} "
                        f"(deployment {pin.deployment_id}), which no routable replica serves: {self.why_unroutable()}",
                        "service_unavailable",
                    )
                continue
            if decision is not None:
                return decision
            if not await self._wait_for_change(deadline):
                raise RouterError(
                    503,
                    f"no routable replica in fleet {self.cfg.fleet!r}: {self.why_unroutable()}",
                    "service_unavailable",
                )

    async def pick(self, version: str, tried: set[str]) -> _Attempt | None:
        """A routable replica of ``version`` not yet ``tried`` (waits up to ``wait_s`` for a first one)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            view = routing.least_outstanding(self.routes.by_version.get(version, ()), self.outstanding, tried, self.rng)
            if view is not None:
                return self._attempt(view.url, version)
            if tried or not await self._wait_for_change(deadline):
                return None

    async def _wait_for_change(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            await asyncio.wait_for(self._changed.wait(), remaining)
        except TimeoutError:
            return False
        return True

    def _attempt(self, url: str, version: str) -> _Attempt:
        key = (url, version)
        attempt = self._attempts.get(key)
        if attempt is None:
            name = self.replica_name(url)
            meta = json.dumps({"policy_version": version, "replica": name}).encode()
            headers = [(POLICY_VERSION_HEADER, version.encode()), (REPLICA_HEADER, name.encode())]
            tag = b',"flywheel":' + meta + b"}"
            attempt = self._attempts[key] = _Attempt(url, version, name, headers, tag)
        return attempt

    def why_unroutable(self) -> str:
        """A readable account of why no replica takes requests (replicas by id: clients read it)."""
        if not self.table_loaded:
            return f"the routing table was never read ({self.last_refresh_error or 'no refresh yet'})"
        if not self.table.replicas:
            return f"the replicas table lists no replica of fleet {self.cfg.fleet!r}"
        parts = []
        for row in self.table.replicas:
            health = self.health.get(row.url)
            name = f"replica {self.replica_name(row.url)}"
            if row.state != "serving":
                parts.append(f"{name} is {row.state}")
            elif health is not None and health.ejected:  # also one that never passed a probe: say why
                parts.append(f"{name} ejected ({redact(health.last_error or 'no error recorded', row.url, name)})")
            elif health is None or not health.probed:
                parts.append(f"{name} not probed yet")
            elif health.weight_version != row.policy_version and row.policy_version not in health.models[1:]:
                parts.append(
                    f"{name} reports weight version {health.weight_version!r} and no adapter of that name, "
                    f"its row says {row.policy_version!r}"
                )
            else:
                parts.append(f"{name} tried already")
        return "; ".join(parts)

    # -- proxying ----------------------------------------------------------------------------

    async def proxy(
        self,
        path: str,
        payload: dict[str, Any],
        session_id: str | None,
        receive: Receive,
        send: Send,
        project: str | None = None,
        span: tuple[str | None, str | None] = (None, None),
    ) -> None:
        """Send one completion request to a replica (retrying before the first byte), answer the client;
        captured as events when ``project`` has capture on (:mod:`serving.proxy.capture`), in the agent
        span ``span`` (span id and role from the request's headers)."""
        capture = None
        if self.capture is not None and self.cfg.capture.covers(project):
            assert project is not None
            capture = Capture.begin(path, payload, project, session_id, span)
        decision = await self.decide(session_id, span[1])
        version = decision.policy_version
        stream = payload.get("stream") is True
        tried: set[str] = set()
        last: UpstreamFailed | None = None
        last_name = ""
        body: bytes | None = None
        for attempt_no in range(self.cfg.max_attempts):
            attempt = await self.pick(version, tried)
            if attempt is None:
                break
            if attempt_no:
                self.metrics.retries.labels(version).inc()
            tried.add(attempt.url)
            served = routing.served_model_name(self.models.get(attempt.url), version) or version
            if body is None or payload.get("model") != served:
                payload["model"] = served
                body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
            try:
                await self._forward(attempt, path, body, stream, receive, send, capture)
                return
            except UpstreamFailed as err:
                last, last_name = err, f"replica {attempt.name}"
                log.info("router: attempt %d of a request to %s failed: %s", attempt_no + 1, version, err)
        if last is not None:
            reason = f"{last.kind} from {last_name} ({redact(last.detail, last.url, last_name)})"
        else:
            reason = "no replica of it left to try"
        detail = f"policy version {version!r}: {reason}; tried {len(tried)} replica(s)"
        if last is None and not tried:
            detail += f"; {self.why_unroutable()}"
        raise RouterError(503, detail, "service_unavailable")

    async def _forward(
        self,
        attempt: _Attempt,
        path: str,
        body: bytes,
        stream: bool,
        receive: Receive,
        send: Send,
        capture: Capture | None = None,
    ) -> None:
        """One attempt; raises :class:`UpstreamFailed` only while nothing has been sent to the client.

        The response goes to the client with the replica's id (``attempt.headers``, ``attempt.tag``),
        never its URL.
        """
        assert self.session is not None
        url = attempt.url
        self.outstanding[url] = self.outstanding.get(url, 0) + 1
        try:
            try:
                resp = await self.session.post(url + path, data=body, headers=_UPSTREAM_HEADERS, timeout=self._timeout)
            except TimeoutError as err:
                self._failure(url, "timeout", "no response headers in time")
                raise UpstreamFailed(url, "timeout", str(err) or "timed out") from err
            except aiohttp.ClientError as err:
                self._failure(url, "connect", f"{type(err).__name__}: {err}")
                raise UpstreamFailed(url, "connection error", f"{type(err).__name__}: {err}") from err
            async with resp:
                if resp.status >= 500:
                    text = await _read_quietly(resp)
                    self.metrics.failures.labels(attempt.name, f"http_{resp.status}").inc()
                    raise UpstreamFailed(url, f"HTTP {resp.status}", text[:300].decode("utf-8", "replace"))
                health = self.health.get(url)
                if health is not None:
                    health.request_ok()
                content_type = resp.headers.get("Content-Type", "application/json").encode()
                if stream and resp.status == 200 and content_type.startswith(b"text/event-stream"):
                    await self._stream(attempt, resp, content_type, receive, send, capture)
                else:
                    await self._whole(attempt, resp, content_type, send, capture)
        finally:
            self.outstanding[url] -= 1

    async def _whole(
        self,
        attempt: _Attempt,
        resp: aiohttp.ClientResponse,
        content_type: bytes,
        send: Send,
        capture: Capture | None = None,
    ) -> None:
        try:
            data = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as err:
            self._failure(attempt.url, "read", f"{type(err).__name__}: {err}")
            raise UpstreamFailed(attempt.url, "connection lost", f"{type(err).__name__}: {err}") from err
        extra: list[tuple[bytes, bytes]] = []
        if resp.status == 200 and content_type.startswith(b"application/json"):
            if capture is not None:
                data = self._capture_whole(capture, attempt, data)
                extra.append(capture.header)
            data = splice_tag(data, attempt.tag)
        headers = [
            (b"content-type", content_type), (b"content-length", str(len(data)).encode()), *attempt.headers, *extra,
        ]  # fmt: skip
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})
        self.metrics.answered(attempt.version, attempt.name, resp.status)

    def _capture_whole(self, capture: Capture, attempt: _Attempt, data: bytes) -> bytes:
        """The answer the client gets (what it did not ask for taken out); its choices offered as events."""
        try:
            body, results = capture.whole(data)
        except ValueError as err:  # vLLM's answer is not the JSON expected: pass it on as it came
            log.warning("router: cannot capture an answer from %s: %s", attempt.name, err)
            self.metrics.capture_dropped.labels("unparsable").inc(capture.n)
            return data
        self._offer(capture, lambda: capture.events(results, attempt.version, None, attempt.name, self._redactor))
        return body

    def _offer(self, capture: Capture, make: Callable[[], list[Any]]) -> None:
        assert self.capture is not None
        try:
            events = make()
        except ValueError as err:  # the contract refused the fields (pydantic's ValidationError is a ValueError)
            log.warning("router: a captured completion is not a valid event: %s", err)
            self.metrics.capture_dropped.labels("invalid").inc(capture.n)
            return
        if capture.redacted:
            self.metrics.capture_redacted.inc(capture.redacted)
        self.capture.offer(events)

    async def _stream(
        self,
        attempt: _Attempt,
        resp: aiohttp.ClientResponse,
        content_type: bytes,
        receive: Receive,
        send: Send,
        capture: Capture | None = None,
    ) -> None:
        """Pass SSE chunks through as they arrive; an upstream failure ends the stream with an error event."""
        content = resp.content
        try:
            first = await content.readany()
        except (TimeoutError, aiohttp.ClientError) as err:
            self._failure(attempt.url, "read", f"{type(err).__name__}: {err}")
            raise UpstreamFailed(attempt.url, "connection lost", f"{type(err).__name__}: {err}") from err
        headers = [(b"content-type", content_type), (b"cache-control", b"no-cache"), *attempt.headers]
        if capture is not None:
            headers.append(capture.header)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        disconnected = asyncio.ensure_future(_until_disconnect(receive))
        tail = b""
        try:
            chunk = first
            while chunk:
                out = capture.stream_chunk(chunk) if capture is not None else chunk
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if disconnected.done():
                    resp.close()  # the client left: vLLM sees the disconnect and aborts the request
                    if capture is not None:
                        self.metrics.capture_dropped.labels("stream_failed").inc(capture.n)
                    return
                tail = (tail + chunk)[-len(SSE_DONE) - 4 :]
                chunk = await content.readany()
            if SSE_DONE not in tail:
                raise aiohttp.ClientPayloadError("the replica ended the stream without its final [DONE] event")
            if capture is not None:
                rest = capture.stream_rest()
                if rest:
                    await send({"type": "http.response.body", "body": rest, "more_body": True})
                self._offer(capture, lambda: capture.stream_events(attempt.version, attempt.name, self._redactor))
        except (TimeoutError, aiohttp.ClientError) as err:
            self._failure(attempt.url, "stream", f"{type(err).__name__}: {err}")
            self.metrics.stream_errors.labels(attempt.name).inc()
            if capture is not None:
                capture.stream_rest()  # the events already complete went out; a partial one is cut here
                self.metrics.capture_dropped.labels("stream_failed").inc(capture.n)
            await send({"type": "http.response.body", "body": sse_error(attempt, err), "more_body": True})
        finally:
            disconnected.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.metrics.answered(attempt.version, attempt.name, 200)

    # -- local answers -----------------------------------------------------------------------

    def models_body(self) -> bytes:
        """``/v1/models``: the policy versions routable now, with their role and weight."""
        data = []
        for version in sorted(self.routes.served_versions()):
            role = self.routes.role_of(version)
            entry = self.table.deployments.get(role) if role else None
            data.append(
                {
                    "id": version,
                    "object": "model",
                    "created": 0,
                    "owned_by": "flywheel",
                    "flywheel": {
                        "role": role,
                        "weight": self.table.canary_weight
                        if role == "canary"
                        else (1.0 - self.table.canary_weight if role else None),
                        "replicas": len(self.routes.by_version[version]),
                        "deployment_id": entry.deployment_id if entry else None,
                        "pinned_roles": sorted(
                            p.agent_role for p in self.table.pins.values() if p.policy_version == version
                        ),
                    },
                }
            )
        return json.dumps({"object": "list", "data": data}).encode()

    def ready_body(self) -> tuple[int, bytes]:
        """``/ready``: 200 with the routable replicas' ids by policy version, else 503 with the reason."""
        routable = {
            v: [self.replica_name(r.url) for r in views] for v, views in self.routes.by_version.items() if views
        }
        if routable:
            return 200, json.dumps({"status": "ready", "routable": routable}).encode()
        return 503, json.dumps({"status": "not ready", "reason": self.why_unroutable()}).encode()


def splice_tag(data: bytes, tag: bytes) -> bytes:
    """``data`` (a JSON object) with ``tag`` (``,"flywheel":{...}}``) replacing its closing brace."""
    end = data.rstrip()
    if not end.endswith(b"}") or not data.lstrip().startswith(b"{"):
        return data
    head = end[:-1]
    if head.rstrip().endswith(b"{"):
        return head + tag[1:]
    return head + tag


_ADDRESS = re.compile(
    r"\[[0-9A-Fa-f.%]*:[0-9A-Fa-f:.%]*\](?::\d+)?"  # [IPv6]:port
    r"|(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?(?![\w.])"  # IPv4[:port]
    r"|\('[^'\n]*', \d+(?:, \d+)*\)"  # a socket address as Python prints it: ('host', port[, ...])
)


def redact(text: str, url: str, name: str) -> str:
    """``text`` fit for a client: the replica's ``url``, host:port and host become ``name``, and any
    other network address (an IP, a resolved socket address) ``<address>``.

    Error details come from aiohttp (``Cannot connect to host vllm-0:8000 ssl:default [Connect
    call failed ('10.0.0.5', 8000)]``) or from an upstream body; neither may tell a client where
    the replicas are.
    """
    parts = urlsplit(url)
    for known in (url, url.rstrip("/"), parts.netloc):
        if known:
            text = text.replace(known, name)
    if parts.hostname:
        text = re.sub(rf"(?<![\w.-]){re.escape(parts.hostname)}(?![\w-])", name, text)
    return _ADDRESS.sub("<address>", text)


def sse_error(attempt: _Attempt, err: BaseException) -> bytes:
    """An SSE ``error`` event (what the openai client raises as an APIError) ending a broken stream."""
    name = f"replica {attempt.name}"
    message = redact(
        f"the {name} serving policy version {attempt.version} failed mid-stream: {type(err).__name__}: {err}",
        attempt.url,
        name,
    )
    return (
        b"data: "
        + json.dumps({"error": {"message": message, "type": "upstream_error", "code": 502}}).encode()
        + b"\n\n"
    )


async def _read_quietly(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except (TimeoutError, aiohttp.ClientError):
        return b""


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# -- the ASGI app ----------------------------------------------------------------------------


class RouterApp:
    """The ASGI application: request parsing, the allow-list, local routes, and the proxy."""

    def __init__(self, router: Router):
        self.router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.router.start()
                except Exception as err:  # reported to the server, which exits
                    await send({"type": "lifespan.startup.failed", "message": repr(err)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.router.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        try:
            if path in PROXIED:
                if method != "POST":
                    raise RouterError(405, f"{path} takes POST, not {method}", "method_not_allowed")
                key = await self.router.authorize(_header(scope, b"authorization"))
                await self._completion(scope, path, receive, send, key.project)
            elif path in LOCAL_GET:
                if method not in ("GET", "HEAD"):
                    raise RouterError(405, f"{path} takes GET, not {method}", "method_not_allowed")
                if path in KEYED:
                    await self.router.authorize(_header(scope, b"authorization"))
                await self._local(path, send)
            else:
                raise RouterError(
                    404, f"no route {path}: the router serves only {sorted(PROXIED | LOCAL_GET)}", "not_found"
                )
        except RouterError as err:
            self.router.metrics.rejected.labels(str(err.status)).inc()
            await _respond(send, err.status, err.body(), extra=err.headers)

    async def _local(self, path: str, send: Send) -> None:
        router = self.router
        if path == "/health":
            await _respond(send, 200, b'{"status":"ok"}')
        elif path == "/ready":
            await _respond(send, *router.ready_body())
        else:
            await _respond(send, 200, router.models_body())

    async def _completion(
        self, scope: Scope, path: str, receive: Receive, send: Send, project: str | None = None
    ) -> None:
        session_id = span_id = role = None
        limit = self.router.cfg.max_request_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit():
                    raise RouterError(400, "content-length is not a number", "invalid_request_error")
                if int(value) > limit:
                    raise RouterError(413, _too_large(limit, int(value)), "request_too_large")
            elif name == _SESSION_HEADER_BYTES:
                session_id = value.decode("latin-1") or None
            elif name == _SPAN_HEADER_BYTES:
                span_id = value.decode("latin-1") or None
            elif name == _ROLE_HEADER_BYTES:
                role = value.decode("latin-1") or None
        raw = await _read_body(receive, limit)
        try:
            payload = json.loads(raw)
        except ValueError as err:
            raise RouterError(400, f"the request body is not valid JSON: {err}", "invalid_request_error") from None
        if not isinstance(payload, dict):
            raise RouterError(400, "the request body must be a JSON object", "invalid_request_error")
        model = payload.get("model")
        if model is not None and (not isinstance(model, str) or model not in self.router.accepted):
            served = sorted(self.router.accepted)
            raise RouterError(404, f"the model {model!r} is not served here; served names: {served}", "model_not_found")
        if session_id is None:
            user = payload.get("user")
            session_id = user if isinstance(user, str) and user else None
        await self.router.proxy(path, payload, session_id, receive, send, project, (span_id, role))


def _header(scope: Scope, wanted: bytes) -> str | None:
    """The first value of the request header ``wanted`` (lower case), or None."""
    for name, value in scope["headers"]:
        if name == wanted:
            return value.decode("latin-1")
    return None


def _too_large(limit: int, size: int | None) -> str:
    of = f" of {size} bytes" if size is not None else ""
    return f"request body{of} exceeds the limit of {limit} bytes (serving.max_request_bytes)"


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RouterError(400, "the client went away before sending its whole body", "invalid_request_error")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RouterError(413, _too_large(limit, None), "request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def create_app(settings: Settings, engine: Engine | None = None) -> RouterApp:
    """The router's ASGI app for ``settings.serving.fleet`` (the routing table from ``engine``'s database).

    Its lifespan opens the upstream pools, reads the table, probes the replicas and starts
    the refresh and health loops; run it under a server with lifespan support (uvicorn).
    """
    return RouterApp(Router(settings, engine))


def uvicorn_config(app: RouterApp, host: str, port: int) -> uvicorn.Config:
    """A uvicorn config for the router: uvloop and httptools when installed, no access log."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return uvicorn.Config(
        app, host=host, port=port, loop=loop, http=http, lifespan="on", access_log=False,
        log_level="warning", timeout_keep_alive=75, backlog=4096,
    )  # fmt: skip


def serve(settings: Settings) -> None:
    """Run the router on ``serving.router_host:router_port`` until interrupted."""
    cfg = settings.serving
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    log.info("router for fleet %r on http://%s:%d", cfg.fleet, cfg.router_host, cfg.router_port)
    uvicorn.Server(uvicorn_config(app, cfg.router_host, cfg.router_port)).run()


if __name__ == "__main__":
    serve(get_settings())
