"""The Kafka → Postgres consumer against a real broker and a real Postgres.

Every test has its own topic prefix, consumer group and project, so tests share the
session's broker and database without seeing each other's rows.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from flywheel.core.contracts import (
    Completion,
    Feedback,
    Message,
    Outcome,
    SessionEnd,
    SessionStart,
    Turn,
    dump_event,
    parse_event,
    uuid7,
)
from flywheel.core.contracts.topics import dead_letter_topic, events_topic
from flywheel.core.db.migrate import upgrade
from flywheel.core.settings import Settings
from flywheel.sdk import Flywheel
from flywheel.stack.endpoints import libpq_conninfo
from ingest import metrics
from ingest.consumer import IngestConsumer
from ingest.report import build_report
from ingest.topics import ensure_topics

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def db(pg_url: str) -> str:
    """libpq conninfo of the migrated test database."""
    upgrade(pg_url)
    return libpq_conninfo(pg_url)


@pytest.fixture
def ingest_settings(kafka_bootstrap: str, pg_url: str) -> Settings:
    """Settings with a private topic prefix and group, small group timeouts, topics created."""
    tag = uuid.uuid4().hex[:8]
    settings = Settings(
        environment="test",
        kafka={"bootstrap_servers": kafka_bootstrap, "topic_prefix": f"t{tag}"},
        postgres={"url": pg_url},
        ingest={"max_poll_interval_ms": 6000, "group_id": f"g{tag}", "partitions": 3, "batch_max_events": 500},
    )
    ensure_topics(settings, kafka_bootstrap)
    return settings


@pytest.fixture
def producer(kafka_bootstrap: str) -> Iterator[KafkaProducer]:
    p = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=5)
    yield p
    p.close()


def send(producer: KafkaProducer, settings: Settings, records: list[tuple[bytes | None, bytes | None]]) -> None:
    """Produce (key, value) pairs to the events topic and wait for the acks."""
    topic = events_topic(settings.kafka.topic_prefix)
    for future in [producer.send(topic, key=k, value=v) for k, v in records]:
        future.get(timeout=30)


def keyed(*events) -> list[tuple[bytes, bytes]]:
    return [(e.session_id.encode(), dump_event(e)) for e in events]


@contextmanager
def running_consumer(settings: Settings, db: str) -> Iterator[threading.Event]:
    """An IngestConsumer in a background thread, stopped (and joined) at exit."""
    stop = threading.Event()
    consumer = IngestConsumer(settings, bootstrap=settings.kafka.bootstrap_servers, conninfo=db, stop_event=stop)
    thread = threading.Thread(target=consumer.run, name="test-ingest-consumer")
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the consumer did not stop"


def scalar(db: str, sql: str, *params):
    with psycopg.connect(db) as conn:
        return conn.execute(sql, params).fetchone()[0]


def wait_for(condition: Callable[[], bool], timeout_s: float = 90.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def count_events(db: str, project: str) -> int:
    return scalar(db, "SELECT count(*) FROM raw_events WHERE project = %s", project)


def count_dead(db: str, topic: str) -> int:
    return scalar(db, "SELECT count(*) FROM dead_letters WHERE topic = %s", topic)


def read_topic(bootstrap: str, topic: str, want: int, timeout_s: float = 30.0) -> list:
    """Every record of ``topic`` from the start (manual assignment, no group)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        got: list = []
        deadline = time.monotonic() + timeout_s
        while len(got) < want and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                got.extend(records)
        return got
    finally:
        consumer.close()


def session_events(project: str, session_id: str, t0: datetime) -> list:
    env = {"project": project, "session_id": session_id}
    return [
        SessionStart(**env, occurred_at=t0, user_id="u1", task="mul", group_key="q1", metadata={"plan": "pro"}),
        Turn(**env, occurred_at=t0 + timedelta(seconds=1), messages=[Message(role="user", content="2*3?")]),
        Completion(**env, occurred_at=t0 + timedelta(seconds=2), model="m", policy_version="v7", completion_text="6"),
        Completion(**env, occurred_at=t0 + timedelta(seconds=3), model="m", policy_version="v8", completion_text="6"),
        SessionEnd(**env, occurred_at=t0 + timedelta(seconds=4), status="completed"),
    ]


def test_valid_events_land_once_and_bad_records_become_dead_letters(ingest_settings, db, producer, kafka_bootstrap):
    project = ingest_settings.kafka.topic_prefix
    t0 = datetime.now(UTC) - timedelta(minutes=1)
    good = session_events(project, "s1", t0)
    bad_turn = b'{"schema_version": 1, "type": "turn", "project": "%s", "session_id": "s1"}' % project.encode()
    records = [
        *keyed(*good),
        *keyed(good[1]),  # a retry of the same event: a no-op
        (b"someone-else", dump_event(good[2].model_copy(update={"event_id": uuid.uuid4()}))),  # not UUIDv7
        (b"s2", dump_event(good[1].model_copy(update={"session_id": "s1"}))),  # key mismatch
        (b"s1", b"{not json"),
        (b"s1", bad_turn),
        (b"s1", None),
    ]
    send(producer, ingest_settings, records)
    topic = events_topic(ingest_settings.kafka.topic_prefix)
    with running_consumer(ingest_settings, db):
        wait_for(lambda: count_dead(db, topic) == 5, what="dead letters")
        wait_for(lambda: count_events(db, project) == 5, what="events")

    with psycopg.connect(db) as conn:
        rows = conn.execute(
            "SELECT event_id, type, payload, source, kafka_partition IS NOT NULL FROM raw_events WHERE project = %s",
            (project,),
        ).fetchall()
        assert sorted(r[0] for r in rows) == sorted(e.event_id for e in good)
        assert {r[3] for r in rows} == {"kafka"} and all(r[4] for r in rows)
        by_type = {r[1]: r[2] for r in rows}
        assert by_type["session_start"]["user_id"] == "u1"
        session = conn.execute(
            "SELECT user_id, task, group_key, metadata, started_at, ended_at, status, policy_versions, n_events,"
            " last_event_at FROM sessions WHERE project = %s AND session_id = 's1'",
            (project,),
        ).fetchone()
        assert session[:4] == ("u1", "mul", "q1", {"plan": "pro"})
        assert session[4] == t0 and session[5] == t0 + timedelta(seconds=4) and session[6] == "completed"
        assert session[7] == ["v7", "v8"] and session[8] == 5 and session[9] == t0 + timedelta(seconds=4)
        dead = conn.execute(
            "SELECT field, reason, key FROM dead_letters WHERE topic = %s ORDER BY kafka_offset", (topic,)
        ).fetchall()
    fields = [d[0] for d in dead]
    assert "event_id" in fields and "session_id" in fields and "messages" not in fields
    assert any("not valid JSON" in d[1] for d in dead) and any("no value" in d[1] for d in dead)
    assert any("at least one of messages" in d[1] for d in dead)

    dlq = read_topic(kafka_bootstrap, dead_letter_topic(ingest_settings.kafka.topic_prefix), want=5)
    assert len(dlq) == 5
    for record in dlq:
        headers = dict(record.headers)
        assert headers["reason"] and headers["source_topic"] == topic.encode()
        assert {"field", "source_partition", "source_offset"} <= set(headers)

    # A new group replays the whole topic: nothing is inserted or counted twice.
    group = f"{ingest_settings.ingest.group_id}-replay"
    replay = ingest_settings.model_copy(
        update={"ingest": ingest_settings.ingest.model_copy(update={"group_id": group})}
    )
    before = metrics.DUPLICATES._value.get()
    with running_consumer(replay, db):
        wait_for(lambda: metrics.DUPLICATES._value.get() - before >= 6, what="replayed duplicates")
    assert count_events(db, project) == 5
    assert scalar(db, "SELECT n_events FROM sessions WHERE project = %s AND session_id = 's1'", project) == 5
    assert count_dead(db, topic) == 5


def test_feedback_before_its_session_and_for_unknown_sessions_is_kept_and_reported(ingest_settings, db, producer):
    project = ingest_settings.kafka.topic_prefix
    t0 = datetime.now(UTC) - timedelta(minutes=10)
    lost = Feedback(project=project, session_id="never-seen", kind="accept")
    lost_outcome = Outcome(project=project, session_id="never-seen", name="tests_passed", value=True)
    waiting = Feedback(project=project, session_id="no-start", kind="score", score=0.5)
    early = Feedback(project=project, session_id="late-start", kind="revert")
    with running_consumer(ingest_settings, db):
        send(producer, ingest_settings, keyed(lost, lost_outcome, waiting, early))
        wait_for(lambda: count_events(db, project) == 4, what="feedback rows")
        send(producer, ingest_settings, keyed(
            Turn(project=project, session_id="no-start", messages=[Message(role="user", content="hi")]),
            *session_events(project, "late-start", t0),
        ))  # fmt: skip
        wait_for(lambda: count_events(db, project) == 10, what="the late sessions")

    report = build_report(db, project=project)
    unknown = sorted(o.event_id for o in report.unknown_sessions)
    assert unknown == sorted([str(lost.event_id), str(lost_outcome.event_id)])
    assert [o.event_id for o in report.awaiting_start] == [str(waiting.event_id)]
    assert report.early_feedback_sessions == 1
    with psycopg.connect(db) as conn:
        sessions = dict(
            conn.execute(
                "SELECT session_id, (started_at IS NOT NULL, n_events)::text FROM sessions WHERE project = %s",
                (project,),
            ).fetchall()
        )
    assert sessions == {"never-seen": "(f,2)", "no-start": "(f,2)", "late-start": "(t,6)"}


def test_a_lost_database_connection_is_retried_without_losing_events(ingest_settings, db, producer):
    project = ingest_settings.kafka.topic_prefix
    t0 = datetime.now(UTC) - timedelta(minutes=1)
    first, second = session_events(project, "a", t0), session_events(project, "b", t0)
    retries = metrics.DB_RETRIES._value.get()
    with running_consumer(ingest_settings, db):
        send(producer, ingest_settings, keyed(*first))
        wait_for(lambda: count_events(db, project) == 5, what="first session")
        with psycopg.connect(db, autocommit=True) as conn:  # what a Postgres restart does to the consumer
            killed = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = 'flywheel-ingest' AND datname = current_database()"
            ).fetchone()[0]
        assert killed >= 1
        send(producer, ingest_settings, keyed(*second))
        wait_for(lambda: count_events(db, project) == 10, what="second session after the reconnect")
    assert metrics.DB_RETRIES._value.get() > retries


def _consumer_process(settings: Settings, pg_url: str, tmp_path: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "FLYWHEEL_ENVIRONMENT": "test",
        "FLYWHEEL_RUN_DIR": str(tmp_path / "run"),
        "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "FLYWHEEL_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FLYWHEEL_POSTGRES__URL": pg_url,
        "FLYWHEEL_INGEST__GROUP_ID": settings.ingest.group_id,
        "FLYWHEEL_INGEST__PARTITIONS": str(settings.ingest.partitions),
        "FLYWHEEL_INGEST__MAX_POLL_INTERVAL_MS": "6000",
        "FLYWHEEL_INGEST__BATCH_MAX_EVENTS": "200",
        "FLYWHEEL_INGEST__BATCH_MAX_WAIT_MS": "50",
    }
    log = open(tmp_path / "consumer.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "ingest.main", "consume", "--log-level", "warning"],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def test_consumer_killed_mid_stream_then_restarted_writes_every_event_exactly_once(
    ingest_settings, db, producer, pg_url, tmp_path, fault_figures
):
    project = ingest_settings.kafka.topic_prefix
    t0 = datetime.now(UTC) - timedelta(minutes=5)
    events = []
    for s in range(60):
        sid = f"s{s}"
        events.append(SessionStart(project=project, session_id=sid, occurred_at=t0))
        for i in range(99):
            events.append(Turn(
                project=project, session_id=sid, occurred_at=t0 + timedelta(milliseconds=i + 1),
                messages=[Message(role="user", content="x" * 900)],
            ))  # fmt: skip
    junk = [(f"s{i}".encode(), b"\x00junk") for i in range(20)]
    send(producer, ingest_settings, [*keyed(*events), *junk, *keyed(*events[:300])])  # 300 resent: duplicates
    total = len(events)
    topic = events_topic(ingest_settings.kafka.topic_prefix)

    first = _consumer_process(ingest_settings, pg_url, tmp_path)
    try:
        wait_for(lambda: count_events(db, project) > 0, timeout_s=120, what="the first commit")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        at_kill = count_events(db, project)
    finally:
        if first.poll() is None:
            first.kill()
    assert 0 < at_kill < total, f"the kill did not land mid-stream ({at_kill} of {total} written)"

    second = _consumer_process(ingest_settings, pg_url, tmp_path)
    try:
        wait_for(lambda: count_events(db, project) == total, timeout_s=180, what="every event after the restart")
        wait_for(lambda: count_dead(db, topic) == 20, what="junk")
        time.sleep(1.0)  # let anything that would double-write do so
    finally:
        second.send_signal(signal.SIGTERM)
        rc = second.wait(timeout=60)
    assert rc == 0, (tmp_path / "consumer.log").read_text()[-3000:]

    with psycopg.connect(db) as conn:
        n, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT event_id) FROM raw_events WHERE project = %s", (project,)
        ).fetchone()
        (counted,) = conn.execute("SELECT sum(n_events) FROM sessions WHERE project = %s", (project,)).fetchone()
        (n_dead,) = conn.execute(
            "SELECT count(DISTINCT (kafka_partition, kafka_offset)) FROM dead_letters WHERE topic = %s", (topic,)
        ).fetchone()
    fault_figures(sent=total, stored=n, distinct=distinct)
    assert n == distinct == total
    assert counted == total  # replayed events were not counted again
    assert n_dead == 20


# -- feedback by completion id alone ------------------------------------------------------------


def fast_feedback(settings: Settings, **fields) -> Settings:
    """``settings`` with pending feedback retried every 0.2 s (and ``fields`` on top)."""
    ingest = settings.ingest.model_copy(update={"feedback_retry_s": 0.2, "feedback_retry_max_s": 0.5, **fields})
    return settings.model_copy(update={"ingest": ingest})


def sdk(settings: Settings, spool: Path) -> Flywheel:
    """A fresh SDK client (no memory of earlier completions) producing to the test's topic."""
    return Flywheel(project=settings.kafka.topic_prefix, kafka_bootstrap=settings.kafka.bootstrap_servers,
                    topic_prefix=settings.kafka.topic_prefix, spool_dir=spool)  # fmt: skip


def stored_feedback(db: str, event_id: uuid.UUID) -> list[tuple]:
    with psycopg.connect(db) as conn:
        return conn.execute(
            "SELECT session_id, payload ->> 'session_id', payload ->> 'kind' FROM raw_events WHERE event_id = %s",
            (event_id,),
        ).fetchall()


def pending_row(db: str, event_id: uuid.UUID) -> tuple | None:
    with psycopg.connect(db) as conn:
        return conn.execute(
            "SELECT session_id, published_at IS NOT NULL, reported_at IS NOT NULL, attempts FROM pending_feedback"
            " WHERE event_id = %s",
            (event_id,),
        ).fetchone()


def records_of(bootstrap: str, topic: str, event_id: uuid.UUID, want: int, timeout_s: float = 30.0) -> list:
    """The records of ``topic`` that carry ``event_id``: (key, session_id or None)."""
    found: list = []
    deadline = time.monotonic() + timeout_s
    while len(found) < want and time.monotonic() < deadline:
        found = [
            (r.key, parse_event(r.value).session_id)
            for r in read_topic(bootstrap, topic, want=10**9, timeout_s=3)
            if parse_event(r.value).event_id == event_id
        ]
    return found


def test_feedback_by_completion_id_from_another_client_is_attached_to_its_session_once(
    ingest_settings, db, kafka_bootstrap, tmp_path
):
    settings = fast_feedback(ingest_settings)
    project = settings.kafka.topic_prefix
    topic = events_topic(project)
    with running_consumer(settings, db):
        agent = sdk(settings, tmp_path / "agent")
        with agent.session(user_id="u1") as s:
            s.message("user", "fix the bug")
            cid = s.completion(model="m", policy_version="v3", completion_text="patch")
        assert cid is not None and agent.close(30)
        wait_for(lambda: count_events(db, project) == 4, what="the session")

        later = sdk(settings, tmp_path / "later")  # another process in spirit: a new client, no memory of cid
        feedback_id = later.feedback(cid, "revert")
        assert feedback_id is not None and later.close(30)
        wait_for(lambda: len(stored_feedback(db, feedback_id)) == 1, what="the attached feedback")
        wait_for(lambda: (pending_row(db, feedback_id) or (None, False))[1], what="the resolved copy marked published")

    assert stored_feedback(db, feedback_id) == [(s.session_id, s.session_id, "revert")]
    assert pending_row(db, feedback_id)[0] == s.session_id
    assert scalar(db, "SELECT n_events FROM sessions WHERE project = %s AND session_id = %s",
                  project, s.session_id) == 5  # fmt: skip
    assert scalar(db, "SELECT count(*) FROM sessions WHERE project = %s", project) == 1  # no session named after cid
    # On the topic: the unattached original keyed by the completion id, and the resolved copy keyed by the session.
    copies = records_of(kafka_bootstrap, topic, feedback_id, want=2)
    resolved, original = sorted(copies, key=lambda c: c[1] is None)
    assert resolved == (s.session_id.encode(), s.session_id) and original == (str(cid).encode(), None)

    # A new group replays the whole topic: the feedback is neither stored nor published again.
    replay = settings.model_copy(
        update={"ingest": settings.ingest.model_copy(update={"group_id": f"{settings.ingest.group_id}-replay"})}
    )
    before = metrics.DUPLICATES._value.get()
    with running_consumer(replay, db):
        wait_for(lambda: metrics.DUPLICATES._value.get() - before >= 5, what="replayed duplicates")
        time.sleep(1.0)  # a few resolver rounds
    assert len(stored_feedback(db, feedback_id)) == 1
    assert len(records_of(kafka_bootstrap, topic, feedback_id, want=3, timeout_s=4)) == 2
    assert count_events(db, project) == 5


def test_feedback_before_its_completion_waits_and_for_a_missing_one_is_reported(
    ingest_settings, db, kafka_bootstrap, tmp_path
):
    settings = fast_feedback(ingest_settings, feedback_report_after_s=2.0)
    project = settings.kafka.topic_prefix
    early_cid, never_cid = uuid7(), uuid7()
    unknown_before = metrics.UNKNOWN_COMPLETION._value.get()
    with running_consumer(settings, db):
        later = sdk(settings, tmp_path / "feedback")
        early = later.feedback(early_cid, "accept")
        lost = later.feedback(never_cid, "reject")
        assert later.close(30)
        wait_for(lambda: pending_row(db, early) is not None and pending_row(db, lost) is not None, what="pending rows")
        assert pending_row(db, early)[:2] == (None, False) and stored_feedback(db, early) == []
        waiting = build_report(db, project=project, report_after_s=60)
        assert sorted(o.event_id for o in waiting.awaiting_completion) == sorted([str(early), str(lost)])

        agent = sdk(settings, tmp_path / "agent")  # the completion arrives after its feedback
        with agent.session() as s:
            s.completion(model="m", completion_text="done", completion_id=early_cid)
        assert agent.close(30)
        wait_for(lambda: stored_feedback(db, early) == [(s.session_id, s.session_id, "accept")], what="late attach")
        wait_for(lambda: (pending_row(db, lost) or (None, False, False))[2], what="the missing completion reported")
        assert pending_row(db, lost)[0] is None and pending_row(db, lost)[3] >= 2  # kept, and retried

    report = build_report(db, project=project, report_after_s=2.0)
    [unknown] = report.unknown_completions
    assert (unknown.event_id, unknown.completion_id, unknown.session_id) == (str(lost), str(never_cid), None)
    assert report.awaiting_completion == [] and report.to_dict()["unknown_completion_events"] == 1
    assert metrics.UNKNOWN_COMPLETION._value.get() - unknown_before == 1
    assert stored_feedback(db, lost) == []  # never attached, never dropped: still pending


# -- Postgres restarted under traffic -----------------------------------------------------------


def test_postgres_restarted_under_traffic_the_consumer_reconnects_and_loses_nothing(
    settings_factory, unused_port, kafka_bootstrap, tmp_path, fault_figures
):
    """A private embedded Postgres is stopped and started again while events stream in.

    The consumer process is never restarted: it must retry the batch it was writing,
    reconnect by itself once the server is back, and in the end every event is in
    ``raw_events`` exactly once and counted once in ``sessions``.
    """
    from flywheel.stack import down, endpoints, up

    stack = settings_factory(postgres={"port": unused_port()})  # no machine server there: an embedded one
    assert up(stack, ["postgres"]).components["postgres"].source == "embedded"
    url = endpoints.postgres_url(stack, database="restart_under_traffic")
    endpoints.ensure_database(url)
    upgrade(url)
    db = libpq_conninfo(url)
    tag = uuid.uuid4().hex[:8]
    settings = Settings(
        environment="test",
        kafka={"bootstrap_servers": kafka_bootstrap, "topic_prefix": f"t{tag}"},
        postgres={"url": url},
        ingest={"group_id": f"g{tag}", "partitions": 3},
    )
    ensure_topics(settings, kafka_bootstrap)
    project = settings.kafka.topic_prefix
    t0 = datetime.now(UTC) - timedelta(minutes=5)
    sessions = [session_events(project, f"s{i}", t0) for i in range(240)]
    total = sum(len(s) for s in sessions)

    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=5)
    sent = threading.Event()

    def stream() -> None:  # steady traffic: 240 sessions over ~12 s
        for events in sessions:
            send(producer, settings, keyed(*events))
            time.sleep(0.05)
        sent.set()

    consumer = _consumer_process(settings, url, tmp_path)
    streamer = threading.Thread(target=stream, name="test-traffic")
    try:
        streamer.start()
        wait_for(lambda: count_events(db, project) >= 200, timeout_s=120, what="the first writes")
        assert down(stack, ["postgres"]) == ["postgres"]  # fast shutdown: open connections are cut
        time.sleep(4.0)  # traffic keeps coming while the database is away
        assert consumer.poll() is None, "the consumer died while Postgres was down"
        up(stack, ["postgres"])
        streamer.join(timeout=120)
        assert sent.is_set()
        wait_for(lambda: count_events(db, project) == total, timeout_s=180, what="every event after the restart")
        time.sleep(1.0)  # let anything that would double-write do so
        assert consumer.poll() is None, "the consumer had to be restarted"
    finally:
        producer.close()
        consumer.send_signal(signal.SIGTERM)
        rc = consumer.wait(timeout=60)
        down(stack)
    log_text = (tmp_path / "consumer.log").read_text()
    assert rc == 0, log_text[-3000:]
    assert "retrying" in log_text, "the outage never reached the consumer"
    up(stack, ["postgres"])  # the data survived: check it
    try:
        with psycopg.connect(db) as conn:
            n, distinct = conn.execute(
                "SELECT count(*), count(DISTINCT event_id) FROM raw_events WHERE project = %s", (project,)
            ).fetchone()
            (counted,) = conn.execute("SELECT sum(n_events) FROM sessions WHERE project = %s", (project,)).fetchone()
    finally:
        down(stack)
    fault_figures(sent=total, stored=n, distinct=distinct)
    assert n == distinct == total
    assert counted == total
