"""A worker SIGKILLed mid-stream and restarted loses no session and scores none twice.

This failed about one run in two before ``rewarding.changelog``: Tansu 0.6 reports a changelog
partition's end as its last batch's base offset + 1, faust's recovery stopped there, and the
states in the rest of that batch were lost with their sessions.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from datetime import UTC, datetime

import pytest
from conftest import topic_in_batches
from sqlalchemy import text

from flywheel.core.db import migrate
from flywheel.core.db.engine import get_engine
from rewarding.harness import WorkerProcess, make_producer, produce, settings_env, wait_until
from rewarding.synthetic import arith_session

pytestmark = pytest.mark.integration

SESSIONS = 300
SESSION_TIMEOUT_S = 6
DEAD_MEMBER_EXPIRY_S = SESSION_TIMEOUT_S + 4
PER_SECOND = 60


def worker_env(tmp_path, kafka_bootstrap: str, pg_url: str, name: str) -> dict[str, str]:
    """The environment of a rewarding worker on its own topics and group (``name``), with short
    windows and broker timeouts so that scoring and rebalances happen within a test."""
    return settings_env(
        {
            "run_dir": str(tmp_path),
            "kafka": {"bootstrap_servers": kafka_bootstrap, "topic_prefix": name.replace("-", "")},
            "postgres": {"url": pg_url},
            "ingest": {"partitions": 4},
            "rewarding": {
                "group_id": name,
                "feedback_window_s": 1.0,
                "timer_interval_s": 0.1,
                "commit_interval_s": 1.0,
                "session_timeout_broker_s": SESSION_TIMEOUT_S,
                "rebalance_timeout_s": 6,
            },
        }
    )


def counts(db_url: str, project: str) -> dict[str, int]:
    with get_engine(db_url).connect() as conn:
        row = conn.execute(
            text(
                """
                SELECT count(DISTINCT session_id), count(*), coalesce(max(version), 0),
                       (SELECT count(*) FROM training_samples WHERE project = :p),
                       (SELECT count(DISTINCT completion_id) FROM training_samples WHERE project = :p)
                FROM rewards WHERE project = :p
                """
            ),
            {"p": project},
        ).one()
    return dict(zip(("sessions", "rewards", "max_version", "samples", "completions"), row))


def test_killed_and_restarted_worker_scores_every_session_exactly_once(
    kafka_bootstrap: str, pg_url: str, tmp_path, fault_figures
) -> None:
    migrate.upgrade(pg_url)
    tag = uuid.uuid4().hex[:8]
    project, prefix = f"rwk-{tag}", f"rwk{tag}"
    env = worker_env(tmp_path, kafka_bootstrap, pg_url, project)
    rng = random.Random(7)
    producer = make_producer(kafka_bootstrap)
    topic = f"{prefix}.events"

    def feed() -> None:
        for i in range(SESSIONS):
            b = arith_session(rng, project=project, at=datetime.now(UTC))
            produce(producer, topic, b.events, flush=i % 10 == 9)
            time.sleep(1.0 / PER_SECOND)
        producer.flush()

    first = WorkerProcess(env, tmp_path / "worker-1.log").start()
    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        wait_until(lambda: counts(pg_url, project)["sessions"] >= SESSIONS // 4, 120, "a quarter scored")
        first.kill()
        before = counts(pg_url, project)["sessions"]
        # Let the broker expire the killed member before the restart. Apache Kafka rebalances a
        # live member when a dead one expires; Tansu 0.6 does not always, and a restarted worker
        # that joined next to the stale member can keep an empty assignment (seen in CI).
        time.sleep(DEAD_MEMBER_EXPIRY_S)
        second = WorkerProcess(env, tmp_path / "worker-2.log").start()
        try:
            feeder.join(timeout=120)
            wait_until(lambda: counts(pg_url, project)["sessions"] == SESSIONS, 180, "every session scored")
            time.sleep(3.0)  # anything scored twice would show up now
            final = counts(pg_url, project)
        finally:
            second.stop()
    finally:
        first.kill()
        feeder.join(timeout=120)
        producer.close()
    fault_figures(unit="sessions scored", sent=SESSIONS, stored=final["rewards"], distinct=final["sessions"])
    assert 0 < before < SESSIONS, "the kill must land mid-stream"
    assert final == {
        "sessions": SESSIONS,
        "rewards": SESSIONS,
        "max_version": 1,
        "samples": 2 * SESSIONS,
        "completions": 2 * SESSIONS,
    }


def test_recovery_reads_each_changelog_partition_to_its_last_record(kafka_bootstrap: str) -> None:
    """A partition's end is its last record + 1 even where ListOffsets names the last batch's base (Tansu 0.6)."""
    from faust.types import TP
    from kafka import KafkaConsumer, TopicPartition

    from flywheel.core.kafka_ends import fetched_ends
    from flywheel.core.kafka_security import PLAINTEXT

    topic = f"rwk-ends-{uuid.uuid4().hex[:8]}"
    topic_in_batches(kafka_bootstrap, topic, {0: (1, 3, 5), 1: (1,)})  # partition 0: offsets 0, 1-3, 4-8
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap)
    try:
        listed = consumer.end_offsets([TopicPartition(topic, p) for p in range(3)])
    finally:
        consumer.close()
    reported = {TP(topic, tp.partition): end for tp, end in listed.items()}

    ends = fetched_ends([kafka_bootstrap], reported, timeout_s=10.0, security=PLAINTEXT)

    assert ends == {TP(topic, 0): 9, TP(topic, 1): 1, TP(topic, 2): 0}, f"ListOffsets said {reported}"


def test_a_worker_joining_and_leaving_mid_stream_loses_and_doubles_nothing(
    kafka_bootstrap: str, pg_url: str, tmp_path, fault_figures
) -> None:
    """Two rebalances under steady traffic (a second worker joins, then stops): faust suspends
    the first worker's flow in the middle of a fetched batch each time, and the batch's
    delivery is cancelled there (``rewarding.transport.Consumer._drain_messages``). Every
    session is still scored, exactly once."""
    from rewarding.harness import HOLDING_MARK

    migrate.upgrade(pg_url)
    tag = uuid.uuid4().hex[:8]
    project, prefix = f"rwr-{tag}", f"rwr{tag}"
    env = worker_env(tmp_path, kafka_bootstrap, pg_url, project)
    rng = random.Random(11)
    producer = make_producer(kafka_bootstrap)
    topic = f"{prefix}.events"
    stop = threading.Event()
    sent = [0]
    session_ids: list[str] = []

    def feed() -> None:
        while not stop.is_set():
            b = arith_session(rng, project=project, at=datetime.now(UTC))
            produce(producer, topic, b.events, flush=sent[0] % 5 == 4)
            session_ids.append(b.session_id)
            sent[0] += 1
            time.sleep(1.0 / 40)
        producer.flush()

    def missing() -> str:
        from rewarding.app import partition_of

        with get_engine(pg_url).connect() as conn:
            query = text("SELECT DISTINCT session_id FROM rewards WHERE project = :p")
            scored = {r[0] for r in conn.execute(query, {"p": project})}
        lost = [i for i, s in enumerate(session_ids) if s not in scored]
        where = sorted(partition_of(session_ids[i].encode(), 4) for i in lost)
        ids = [session_ids[i] for i in lost[:6]]
        return f"{len(lost)} of {len(session_ids)} unscored (sent as number {lost}), partitions {where}, ids {ids}"

    first = WorkerProcess(env, tmp_path / "worker-1.log").start()
    feeder = threading.Thread(target=feed)
    feeder.start()
    second = WorkerProcess(env, tmp_path / "worker-2.log")
    try:
        wait_until(lambda: counts(pg_url, project)["sessions"] >= 40, 120, "40 sessions scored")
        second.start()  # the first worker's partitions are revoked while its batches are in flight
        wait_until(lambda: len(first.log_times(HOLDING_MARK)) >= 2, 120, "the first worker reassigned")
        at_join = counts(pg_url, project)["sessions"]
        wait_until(lambda: counts(pg_url, project)["sessions"] >= at_join + 60, 120, "both workers scoring")
        second.stop()  # and again when it leaves
        wait_until(lambda: len(first.log_times(HOLDING_MARK)) >= 3, 120, "the first worker holding everything")
        time.sleep(2.0)
        stop.set()
        feeder.join(timeout=60)
        try:
            wait_until(lambda: counts(pg_url, project)["sessions"] == sent[0], 120, f"all {sent[0]} sessions scored")
        except TimeoutError as err:
            raise AssertionError(f"{err}: {missing()}; logs in {tmp_path}") from err
        time.sleep(3.0)  # anything scored twice would show up now
        final = counts(pg_url, project)
    finally:
        stop.set()
        second.stop()
        first.stop()
        feeder.join(timeout=60)
        producer.close()
    fault_figures(unit="sessions scored", sent=sent[0], stored=final["rewards"], distinct=final["sessions"])
    assert final == {
        "sessions": sent[0],
        "rewards": sent[0],
        "max_version": 1,
        "samples": 2 * sent[0],
        "completions": 2 * sent[0],
    }
