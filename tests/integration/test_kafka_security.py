"""Managed-Kafka security end to end: TLS and SASL (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512).

A real broker (Tansu, started here) behind :mod:`kafka_auth_front`, which asks for TLS and
SASL the way a managed Kafka does (Tansu 0.6.0 cannot: see that module). Everything a
deployment runs connects through it with its settings alone: the SDK produces sessions,
ingest's admin creates the topics and its consumer writes them to Postgres, the rewarding
worker (faust on aiokafka) scores them, the dashboard measures the lag. Wrong credentials, an
untrusted certificate and a plaintext client fail, each with an error naming what to check.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest
from conftest import free_port
from kafka.admin import NewTopic
from kafka_auth_front import AuthFront, Certificates, make_certificates

from flywheel.core import kafka_clients
from flywheel.core.contracts.topics import events_topic
from flywheel.core.db.migrate import upgrade
from flywheel.core.kafka_security import KafkaSecurity, service_setting_name
from flywheel.core.settings import Settings
from flywheel.sdk import Flywheel
from flywheel.sdk.settings import SdkSettings
from flywheel.sdk.transports import Envelope, make_transport
from flywheel.stack.base import port_open
from flywheel.stack.broker import probe_kafka, tansu_binary
from flywheel.stack.endpoints import libpq_conninfo
from ingest.consumer import IngestConsumer
from ingest.topics import ensure_topics
from rewarding.harness import WorkerProcess, make_producer, produce, settings_env, wait_until
from rewarding.synthetic import SessionBuilder
from serving.dashboard.api import measure_kafka_lag

pytestmark = pytest.mark.integration

USER, PASSWORD = "flywheel-svc", "s3cret-Pa55"


@dataclass
class Secured:
    """A broker reachable only through the front, and the settings that reach it."""

    bootstrap: str
    front: AuthFront
    certs: Certificates
    protocol: str
    mechanism: str | None

    def kafka(self, **changes: object) -> dict[str, object]:
        """``kafka`` settings (the services') for this broker; ``changes`` override fields."""
        fields: dict[str, object] = {"bootstrap_servers": self.bootstrap, "security_protocol": self.protocol}
        if self.protocol.startswith("SASL_"):
            fields |= {"sasl_mechanism": self.mechanism, "sasl_username": USER, "sasl_password": PASSWORD}
        if self.protocol in ("SSL", "SASL_SSL"):
            fields["ssl_cafile"] = self.certs.ca
        return fields | changes

    def security(self, **changes: object) -> KafkaSecurity:
        fields = {k: v for k, v in self.kafka(**changes).items() if k != "bootstrap_servers"}
        fields["protocol"] = fields.pop("security_protocol")
        return KafkaSecurity(**fields, name=service_setting_name)

    def sdk(self, **changes: object) -> dict[str, object]:
        """The same settings as the SDK's keyword arguments (``kafka_bootstrap``, ``kafka_<setting>``)."""
        kafka = self.kafka(**changes)
        return {"kafka_bootstrap": kafka.pop("bootstrap_servers")} | {f"kafka_{k}": v for k, v in kafka.items()}


@contextmanager
def secured_broker(folder: Path, protocol: str, mechanism: str | None, mutual: bool = False) -> Iterator[Secured]:
    """Tansu on a private port, advertising the front (``localhost``, which its certificate names);
    with ``mutual`` the front wants a client certificate."""
    certs = make_certificates(str(folder))
    broker_port, front_port = free_port(), free_port()
    tansu = subprocess.Popen(
        [
            tansu_binary(),
            "broker",
            "--listener-url", f"tcp://127.0.0.1:{broker_port}",
            "--advertised-listener-url", f"tcp://localhost:{front_port}",
            "--storage-engine", "memory://tansu/",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    users = {USER: PASSWORD} if protocol.startswith("SASL_") else None
    tls = certs.server_context(mutual) if protocol in ("SSL", "SASL_SSL") else None
    front = AuthFront(("127.0.0.1", broker_port), front_port, users=users, tls=tls).start()
    try:
        wait_until(lambda: port_open("127.0.0.1", broker_port), 30, "Tansu's port")
        yield Secured(f"localhost:{front_port}", front, certs, protocol, mechanism)
    finally:
        front.stop()
        tansu.terminate()
        tansu.wait(30)


@pytest.fixture(scope="module")
def sasl_ssl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """The managed-Kafka case: SASL/SCRAM-SHA-512 over TLS."""
    with secured_broker(tmp_path_factory.mktemp("sasl-ssl"), "SASL_SSL", "SCRAM-SHA-512") as secured:
        yield secured


@pytest.fixture(scope="module")
def db(pg_url: str) -> str:
    upgrade(pg_url)
    return libpq_conninfo(pg_url)


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    wait_until(condition, timeout_s, what, interval_s=0.2)


def scalar(db: str, sql: str, *params: object) -> object:
    with psycopg.connect(db) as conn:
        return conn.execute(sql, params).fetchone()[0]


def test_sdk_to_ingest_to_postgres_over_sasl_scram_and_tls(sasl_ssl: Secured, db: str, pg_url: str, tmp_path) -> None:
    tag = uuid.uuid4().hex[:8]
    settings = Settings(
        environment="test",
        kafka=sasl_ssl.kafka(topic_prefix=f"sec{tag}"),
        postgres={"url": pg_url},
        ingest={"max_poll_interval_ms": 6000, "group_id": f"sec{tag}", "partitions": 2},
    )
    statuses = ensure_topics(settings, sasl_ssl.bootstrap)  # ingest's admin client, through the front
    assert all(s.ok for s in statuses), [s.problems for s in statuses]

    project = f"sec-{tag}"
    fw = Flywheel(project=project, spool_dir=tmp_path / "spool", topic_prefix=f"sec{tag}", **sasl_ssl.sdk())
    try:
        assert fw.transport.security == sasl_ssl.security()
        for i in range(5):
            with fw.session(f"s{i}-{tag}") as s:
                s.message("user", f"question {i}")
                s.outcome("task_solved", True)
        assert fw.flush(30), fw.stats
        sent = fw.stats.sent
    finally:
        fw.close()
    assert sent >= 20

    stop = threading.Event()
    consumer = IngestConsumer(settings, bootstrap=sasl_ssl.bootstrap, conninfo=db, stop_event=stop)
    thread = threading.Thread(target=consumer.run, name="secured-ingest")
    thread.start()
    try:
        wait_for(
            lambda: scalar(db, "SELECT count(*) FROM raw_events WHERE project = %s", project) == sent, 60, "ingest"
        )
        lag = measure_kafka_lag(settings, timeout_s=20.0)  # the dashboard's admin and consumer
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    assert lag["value"] is not None and lag["reason"] is None, lag
    assert set(sasl_ssl.front.authenticated) == {"SCRAM-SHA-512"} and not sasl_ssl.front.failures


def test_rewarding_worker_scores_over_sasl_scram_and_tls(sasl_ssl: Secured, pg_url: str, tmp_path: Path) -> None:
    """faust's aiokafka consumer, producer and changelog reads, and kafka-python's topic admin, all authenticated."""
    upgrade(pg_url)
    tag = uuid.uuid4().hex[:8]
    prefix = f"rws{tag}"
    env = settings_env(
        {
            "run_dir": str(tmp_path / "run"),
            "kafka": sasl_ssl.kafka(topic_prefix=prefix),
            "postgres": {"url": pg_url},
            "ingest": {"partitions": 2},
            "rewarding": {
                "group_id": f"rws-{tag}",
                "feedback_window_s": 0.5,
                "session_timeout_s": 4.0,
                "timer_interval_s": 0.1,
                "session_timeout_broker_s": 6,
                "rebalance_timeout_s": 6,
            },
        }
    )
    before = len(sasl_ssl.front.authenticated)
    worker = WorkerProcess(env, tmp_path / "worker.log").start()
    producer = make_producer(sasl_ssl.bootstrap, sasl_ssl.security())
    sessions = [SessionBuilder(f"rws-{i}-{tag}", project=f"rws-{tag}", at=datetime.now(UTC)) for i in range(3)]
    try:
        for b in sessions:
            b.start(task="arith")
            b.completion("answer: 4")
            b.outcome("task_solved", True)
            b.end()
            produce(producer, events_topic(prefix), b.events)

        def scored() -> bool:
            with psycopg.connect(libpq_conninfo(pg_url)) as conn:
                n = conn.execute("SELECT count(DISTINCT session_id) FROM rewards WHERE project = %s", (f"rws-{tag}",))
                return n.fetchone()[0] == len(sessions)

        wait_for(scored, 90, f"the secured worker's rewards (log {worker.log_path})")
    finally:
        producer.close()
        worker.stop()
    assert len(sasl_ssl.front.authenticated) - before >= 3  # the worker's own connections authenticated too
    assert not sasl_ssl.front.failures


@pytest.mark.parametrize(
    ("protocol", "mechanism"),
    [("SASL_PLAINTEXT", "PLAIN"), ("SASL_SSL", "SCRAM-SHA-256"), ("SASL_SSL", "PLAIN"), ("SSL", None)],
)
def test_every_mechanism_and_protocol_round_trips(tmp_path: Path, protocol: str, mechanism: str | None) -> None:
    with secured_broker(tmp_path, protocol, mechanism) as secured:
        security, topic = secured.security(), f"rt-{uuid.uuid4().hex[:8]}"
        admin = kafka_clients.admin(secured.bootstrap, security=security)
        try:
            admin.create_topics([NewTopic(topic, 1, 1)])
        finally:
            admin.close()
        producer = kafka_clients.producer(secured.bootstrap, security=security, acks="all")
        producer.send(topic, key=b"k", value=b"over " + protocol.encode()).get(30)
        producer.close()
        consumer = kafka_clients.consumer(
            secured.bootstrap, topic, security=security, auto_offset_reset="earliest", consumer_timeout_ms=5000
        )
        try:
            values = [m.value for m in consumer]
        finally:
            consumer.close()
        assert values == [b"over " + protocol.encode()]
        assert probe_kafka(secured.bootstrap, security=security).ok
        expected = [] if mechanism is None else [mechanism]
        assert set(secured.front.authenticated) == set(expected) and not secured.front.failures


def test_mutual_tls_with_a_client_certificate(tmp_path: Path) -> None:
    with secured_broker(tmp_path, "SSL", None, mutual=True) as secured:
        certs, topic = secured.certs, f"mtls-{uuid.uuid4().hex[:8]}"
        security = secured.security(ssl_certfile=certs.client_cert, ssl_keyfile=certs.client_key)
        producer = kafka_clients.producer(secured.bootstrap, security=security, acks="all")
        producer.send(topic, value=b"signed").get(30)
        producer.close()
        consumer = kafka_clients.consumer(
            secured.bootstrap, topic, security=security, auto_offset_reset="earliest", consumer_timeout_ms=5000
        )
        try:
            assert [m.value for m in consumer] == [b"signed"]
        finally:
            consumer.close()
        with pytest.raises(kafka_clients.BrokerUnreachable):  # the same without a client certificate
            kafka_clients.producer(secured.bootstrap, security=secured.security(), bootstrap_timeout_ms=3000)


def test_wrong_password_fails_naming_the_credentials(sasl_ssl: Secured) -> None:
    started = time.monotonic()
    with pytest.raises(kafka_clients.BrokerUnreachable) as caught:
        kafka_clients.producer(
            sasl_ssl.bootstrap, security=sasl_ssl.security(sasl_password="wrong"), bootstrap_timeout_ms=3000
        )
    said = str(caught.value)
    assert "SaslAuthenticationFailedError" in said and "invalid credentials" in said, said
    assert "check kafka.sasl_username, kafka.sasl_password and kafka.sasl_mechanism" in said
    assert "wrong" not in said and PASSWORD not in said
    assert caught.value.misconfigured and time.monotonic() - started < 15
    assert any("SCRAM-SHA-512" in f for f in sasl_ssl.front.failures)
    sasl_ssl.front.failures.clear()


def test_sdk_with_a_wrong_password_reports_it_for_an_operator(sasl_ssl: Secured) -> None:
    transport = make_transport(SdkSettings(**sasl_ssl.sdk(sasl_password="wrong"), kafka_connect_timeout_s=3))
    try:
        result = transport.send([Envelope(key=b"s", value=b"{}")])
    finally:
        transport.close()
    assert result.sent == 0 and result.needs_operator, result
    assert "SaslAuthenticationFailedError" in result.error and "check kafka_sasl_username" in result.error
    sasl_ssl.front.failures.clear()


def test_untrusted_certificate_fails_naming_the_ca_setting(sasl_ssl: Secured) -> None:
    authenticated = len(sasl_ssl.front.authenticated)
    with pytest.raises(kafka_clients.BrokerUnreachable) as caught:
        kafka_clients.admin(
            sasl_ssl.bootstrap,
            security=sasl_ssl.security(ssl_cafile=sasl_ssl.certs.other_ca),
            bootstrap_timeout_ms=3000,
        )
    said = str(caught.value)
    assert "CERTIFICATE_VERIFY_FAILED" in said and "check kafka.ssl_cafile" in said, said
    assert len(sasl_ssl.front.authenticated) == authenticated and not sasl_ssl.front.failures  # no SASL was tried


def test_a_plaintext_client_is_not_let_in(sasl_ssl: Secured) -> None:
    health = probe_kafka(sasl_ssl.bootstrap, timeout_s=3.0)  # PLAINTEXT against the TLS front
    assert not health.ok and "no Kafka answer from" in health.detail, health
