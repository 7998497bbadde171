"""Joining after a stop (issue 21): a consumer started by hand after its group's service stopped.

The ingest consumer is started as the demo starts it (its service spec, the stack's settings
through the environment), stopped (SIGTERM: it leaves its group; SIGKILL: it cannot), and a new
one is started by hand in the same group. It must join and write new events within a bound
derived from the configured group timeouts (see docs/reliability.md, "Joining after a stop").
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from kafka import KafkaProducer

from flywheel.core.contracts import Completion, SessionEnd, SessionStart, dump_event
from flywheel.core.contracts.topics import events_topic
from flywheel.core.db.migrate import upgrade
from flywheel.core.settings import Settings
from flywheel.stack.endpoints import libpq_conninfo
from flywheel.stack.services import Service, pipeline_specs, settings_env
from ingest.consumer import group_timeouts_ms
from ingest.topics import ensure_topics

pytestmark = pytest.mark.integration

SESSION_TIMEOUT_MS = 6000
"""Small group timeouts, as the other consumer tests use (Tansu holds every join for half of it)."""
STARTED_MARK = "as group"
"""What the consumer logs once, just before it first polls (``consuming <topic> as group <id>``)."""


def rejoin_bound_s(settings: Settings, how: str) -> float:
    """Longest a new consumer may take from its first poll to a written event.

    Tansu holds every JoinGroup for about half the session timeout. After a clean stop the old
    member has left: one join, within the session timeout. After a kill the old member stays
    until Tansu expires it (measured: about 1.35 session timeouts after its last heartbeat; 1.5
    allowed), the join that still counted it elected it leader, and one more join follows: 0.5 +
    1.5 + 0.5 session timeouts. Plus one batch wait for the write.
    """
    session_ms, _ = group_timeouts_ms(settings.ingest)
    joins_ms = session_ms if how == "sigterm" else 2.5 * session_ms
    return (joins_ms + settings.ingest.batch_max_wait_ms) / 1000


@pytest.fixture
def settings(kafka_bootstrap: str, pg_url: str, stack_settings: Settings) -> Settings:
    upgrade(pg_url)
    tag = uuid.uuid4().hex[:8]
    settings = stack_settings.model_copy(
        update={
            "kafka": stack_settings.kafka.model_copy(update={"topic_prefix": f"r{tag}"}),
            "postgres": stack_settings.postgres.model_copy(update={"url": pg_url}),
            "ingest": stack_settings.ingest.model_copy(
                update={"group_id": f"rejoin-{tag}", "partitions": 3, "session_timeout_ms": SESSION_TIMEOUT_MS}
            ),
        }
    )
    ensure_topics(settings, kafka_bootstrap)
    return settings


def ingest_service(settings: Settings, log_dir: Path) -> Service:
    """The demo's ingest service (``python -m ingest.main consume``) with ``settings`` in its environment."""
    overrides = {
        "kafka": {"topic_prefix": settings.kafka.topic_prefix},
        "postgres": {"url": settings.postgres.url},
        "ingest": {
            "group_id": settings.ingest.group_id,
            "partitions": settings.ingest.partitions,
            "session_timeout_ms": settings.ingest.session_timeout_ms,
        },
    }
    return Service(pipeline_specs(settings, ["ingest"])[0], settings_env(settings, overrides), log_dir)


def produce_session(bootstrap: str, settings: Settings, project: str) -> None:
    """One session (start, completion, end) on the events topic, acknowledged."""
    session_id = f"s-{uuid.uuid4().hex[:12]}"
    t0 = datetime.now(UTC)
    env = {"project": project, "session_id": session_id}
    events = [
        SessionStart(**env, occurred_at=t0),
        Completion(**env, occurred_at=t0 + timedelta(seconds=1), model="m", policy_version="v1", completion_text="6"),
        SessionEnd(**env, occurred_at=t0 + timedelta(seconds=2), status="completed"),
    ]
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        topic = events_topic(settings.kafka.topic_prefix)
        for future in [producer.send(topic, key=session_id.encode(), value=dump_event(e)) for e in events]:
            future.get(timeout=30)
    finally:
        producer.close()


def count_events(settings: Settings, project: str) -> int:
    with psycopg.connect(libpq_conninfo(str(settings.postgres.url))) as conn:
        return conn.execute("SELECT count(*) FROM raw_events WHERE project = %s", (project,)).fetchone()[0]


def wait_until(condition, timeout_s: float, what: str, service: Service) -> float:
    """Poll ``condition`` until true; the seconds it took. Fails naming ``what`` and the log's tail."""
    started = time.monotonic()
    while not condition():
        assert service.alive, f"{service.name} exited while waiting for {what}: {service.tail()}"
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not {what} after {timeout_s:.1f} s; log: {service.tail()}")
        time.sleep(0.1)
    return time.monotonic() - started


def started_polling(service: Service) -> bool:
    return service.log_path.exists() and STARTED_MARK in service.log_path.read_text(errors="replace")


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_consumer_started_after_its_group_stopped_joins_and_writes_new_events(
    how: str, settings: Settings, kafka_bootstrap: str, tmp_path: Path
) -> None:
    bound_s = rejoin_bound_s(settings, how)
    project = f"rejoin-{how}-{uuid.uuid4().hex[:6]}"
    first = ingest_service(settings, tmp_path / "first")
    by_hand = ingest_service(settings, tmp_path / "by-hand")
    try:
        first.start()
        produce_session(kafka_bootstrap, settings, project)
        wait_until(lambda: count_events(settings, project) == 3, 120, "the first consumer writing", first)

        if how == "sigterm":
            first.stop()  # SIGTERM: it finishes its batch, commits, and leaves the group
        else:
            first.kill()  # SIGKILL: it stays a member until its session times out
        assert not first.alive

        by_hand.start()
        wait_until(lambda: started_polling(by_hand), 120, "the new consumer polling", by_hand)
        produce_session(kafka_bootstrap, settings, project)
        took_s = wait_until(lambda: count_events(settings, project) == 6, bound_s, "the new events written", by_hand)
        print(f"after {how}: new events written {took_s:.1f} s after the new consumer's first poll (bound {bound_s} s)")
        assert count_events(settings, project) == 6  # nothing doubled
    finally:
        by_hand.stop()
        first.stop()
