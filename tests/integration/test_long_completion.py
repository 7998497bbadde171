"""A 131,072-token completion with logprobs, end to end, at the default limits.

One SDK session (Kafka transport) and one gateway request each log a completion of
131,072 tokens with a logprob per token (about 4 MB of JSON each). Both must land in
``raw_events`` through the ingest consumer, and the rewarding worker must write a training
sample with every token id and logprob, and publish it on the scored topic. One token more is
refused at the SDK (counted invalid, logged naming ``FLYWHEEL_MAX_COMPLETION_TOKENS``) and at
the gateway (422 naming ``ingest.max_completion_tokens``); such a record produced straight to
Kafka is dead-lettered with that reason while its neighbours are stored.

The figures of each hop are printed (``pytest -s``) for docs/ingest.md.
"""

from __future__ import annotations

import json
import logging
import math
import random
import resource
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import pytest
import uvicorn
from conftest import free_port, fresh_database
from kafka import KafkaConsumer, KafkaProducer

from flywheel.core.auth import create_key
from flywheel.core.contracts import Completion, Message, SessionEnd, SessionStart, Turn, dump_event
from flywheel.core.contracts.topics import dead_letter_topic, scored_topic
from flywheel.core.db.engine import session_factory
from flywheel.core.settings import Settings
from flywheel.sdk import Flywheel
from flywheel.stack.endpoints import libpq_conninfo
from ingest.consumer import IngestConsumer
from ingest.gateway import create_app
from ingest.topics import ensure_topics
from rewarding.harness import WorkerProcess, settings_env, wait_until
from rewarding.records import ScoredReward

pytestmark = pytest.mark.integration

N = 131_072
"""Completion tokens: the default ``ingest.max_completion_tokens``."""
REWARDING = {
    "feedback_window_s": 1.0,
    "session_timeout_s": 30.0,
    "rescore_delay_s": 0.3,
    "timer_interval_s": 0.1,
    "session_timeout_broker_s": 6,
    "rebalance_timeout_s": 6,
}


def long_completion(n: int, seed: int) -> dict:
    """Token ids, logprobs and text of an ``n``-token completion (realistic magnitudes: 6-digit ids, full floats)."""
    rng = random.Random(seed)
    ids = [rng.randrange(0, 200_000) for _ in range(n)]
    return {
        "prompt_token_ids": [rng.randrange(0, 200_000) for _ in range(512)],
        "completion_token_ids": ids,
        "logprobs": [math.log(rng.uniform(1e-6, 1.0)) for _ in range(n)],
        "completion_text": "".join(rng.choice(" abcdefghij") for _ in range(4 * n)),
    }


@dataclass
class Hops:
    settings: Settings
    db: str
    conninfo: str
    project: str
    gateway_url: str
    key: str
    worker: WorkerProcess
    figures: dict[str, float] = field(default_factory=dict)

    def scalar(self, sql: str, *params):
        with psycopg.connect(self.conninfo) as conn:
            row = conn.execute(sql, params).fetchone()
            return row[0] if row else None

    def sample(self, session_id: str) -> tuple[list[int], list[float]] | None:
        with psycopg.connect(self.conninfo) as conn:
            row = conn.execute(
                "SELECT completion_token_ids, behaviour_logprobs FROM training_samples "
                "WHERE project = %s AND session_id = %s",
                (self.project, session_id),
            ).fetchone()
        return (list(row[0]), list(row[1])) if row else None


def _gateway(settings: Settings, db: str) -> Iterator[str]:
    app = create_app(settings, db_url=db, key_cache_ttl_s=1.0)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True, name="test-gateway")
    thread.start()
    wait_until(lambda: server.started, 30, "the gateway")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def path(kafka_bootstrap: str, pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hops]:
    tag = uuid.uuid4().hex[:8]
    with fresh_database(pg_url, "longcompletion") as db:
        settings = Settings(
            environment="test",
            kafka={"bootstrap_servers": kafka_bootstrap, "topic_prefix": f"lc{tag}"},
            postgres={"url": db},
            ingest={"partitions": 2, "max_poll_interval_ms": 6000, "group_id": f"lc{tag}"},
        )
        ensure_topics(settings, kafka_bootstrap)
        env = settings_env(
            {
                "run_dir": str(tmp_path_factory.mktemp("lc-run")),
                "kafka": {"bootstrap_servers": kafka_bootstrap, "topic_prefix": settings.kafka.topic_prefix},
                "postgres": {"url": db},
                "ingest": {"partitions": 2},
                "rewarding": {**REWARDING, "group_id": f"lc-rw-{tag}"},
            }
        )
        worker = WorkerProcess(env, tmp_path_factory.mktemp("lc") / "worker.log").start()
        stop = threading.Event()
        conninfo = libpq_conninfo(db)
        consumer = IngestConsumer(settings, bootstrap=kafka_bootstrap, conninfo=conninfo, stop_event=stop)
        consuming = threading.Thread(target=consumer.run, name="test-ingest-consumer")
        consuming.start()
        gateway = _gateway(settings, db)
        try:
            project = f"lc{tag}"
            with session_factory(db)() as s:
                _, token = create_key(s, name="lc", role="writer", project=project)
                s.commit()
            yield Hops(settings, db, conninfo, project, next(gateway), token, worker)
        finally:
            gateway.close()
            stop.set()
            consuming.join(timeout=60)
            worker.stop()
            assert not consuming.is_alive(), "the consumer did not stop"


def _sdk(path: Hops, spool: Path) -> Flywheel:
    s = path.settings
    return Flywheel(project=path.project, kafka_bootstrap=s.kafka.bootstrap_servers,
                    topic_prefix=s.kafka.topic_prefix, spool_dir=spool)  # fmt: skip


def _check_sample(path: Hops, session_id: str, sent: dict, since: float, what: str) -> None:
    stored = wait_until(lambda: path.sample(session_id), 120, f"the training sample of the {what} session")
    path.figures[f"{what}: logged -> training sample row (s)"] = time.monotonic() - since
    ids, logprobs = stored
    assert len(ids) == N and len(logprobs) == N
    assert ids == sent["completion_token_ids"]
    assert logprobs == sent["logprobs"]  # float8 round-trips every JSON float exactly


def test_an_sdk_session_with_a_131072_token_completion_reaches_the_training_samples(path: Hops, tmp_path, caplog):
    sent = long_completion(N, seed=1)
    session_id = f"sdk-{uuid.uuid4().hex[:8]}"
    fw = _sdk(path, tmp_path / "spool")
    try:
        t0 = time.monotonic()
        with fw.session(session_id, task="long") as session:
            cid = session.completion(model="m", policy_version="pv-long", **sent)
            session.outcome("task_solved", True)
        assert fw.flush(timeout_s=60)
        path.figures["sdk: log + build + produce (flush) (s)"] = time.monotonic() - t0
        assert fw.stats.sent == 4 and fw.stats.invalid == 0

        stored = wait_until(
            lambda: path.scalar(
                "SELECT jsonb_array_length(payload -> 'completion_token_ids') FROM raw_events "
                "WHERE type = 'completion' AND payload ->> 'completion_id' = %s",
                str(cid),
            ),
            60,
            "the completion row in raw_events",
        )
        path.figures["sdk: logged -> raw_events row (s)"] = time.monotonic() - t0
        assert stored == N
        _check_sample(path, session_id, sent, t0, "sdk")

        scored = read_scored(path, session_id)
        (sample,) = scored.samples
        assert len(sample.completion_token_ids) == N and sample.behaviour_logprobs == sent["logprobs"]

        with caplog.at_level(logging.WARNING, logger="flywheel.sdk"):
            over = long_completion(N + 1, seed=2)
            with fw.session(f"{session_id}-over") as session:
                session.completion(model="m", policy_version="pv-long", **over)
            assert fw.flush(timeout_s=60)
        assert fw.stats.invalid == 1 and fw.stats.sent == 6  # the session's start and end only
        refusal = [r.getMessage() for r in caplog.records if "FLYWHEEL_MAX_COMPLETION_TOKENS" in r.getMessage()]
        assert refusal and f"{N + 1} tokens, over the limit FLYWHEEL_MAX_COMPLETION_TOKENS" in refusal[0]
    finally:
        fw.close()


def read_scored(path: Hops, session_id: str) -> ScoredReward:
    """The session's record on the scored topic."""
    consumer = KafkaConsumer(
        scored_topic(path.settings.kafka.topic_prefix),
        bootstrap_servers=path.settings.kafka.bootstrap_servers,
        auto_offset_reset="earliest",
        consumer_timeout_ms=2000,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for message in consumer:
                if message.key == session_id.encode():
                    return ScoredReward.model_validate_json(message.value)
        raise AssertionError(f"no scored record of {session_id}")
    finally:
        consumer.close()


def test_a_gateway_request_with_a_131072_token_completion_reaches_the_training_samples(path: Hops):
    sent = long_completion(N, seed=3)
    session_id = f"gw-{uuid.uuid4().hex[:8]}"
    completion = Completion(project=path.project, session_id=session_id, model="m", policy_version="pv-long", **sent)
    events = [
        SessionStart(project=path.project, session_id=session_id, task="long"),
        completion,
        SessionEnd(project=path.project, session_id=session_id),
    ]
    body = b'{"events":[' + b",".join(dump_event(e) for e in events) + b"]}"
    headers = {"Authorization": f"Bearer {path.key}", "Content-Type": "application/json"}
    t0 = time.monotonic()
    response = httpx.post(f"{path.gateway_url}/v1/events", content=body, headers=headers, timeout=120)
    path.figures[f"gateway: POST of {len(body) / 1e6:.1f} MB answered (s)"] = time.monotonic() - t0
    assert response.status_code == 202, response.text
    stored = wait_until(
        lambda: path.scalar(
            "SELECT jsonb_array_length(payload -> 'logprobs') FROM raw_events WHERE event_id = %s",
            str(completion.event_id),
        ),
        60,
        "the completion row in raw_events",
    )
    path.figures["gateway: posted -> raw_events row (s)"] = time.monotonic() - t0
    assert stored == N
    _check_sample(path, session_id, sent, t0, "gateway")

    over = Completion(project=path.project, session_id=session_id, model="m", policy_version="pv-long",
                      **long_completion(N + 1, seed=4))  # fmt: skip
    refused = httpx.post(f"{path.gateway_url}/v1/events", json={"events": [json.loads(dump_event(over))]},
                         headers=headers, timeout=120)  # fmt: skip
    assert refused.status_code == 422
    (rejection,) = refused.json()["rejected"]
    assert rejection["field"] == "completion_token_ids"
    assert rejection["reason"] == f"{N + 1} tokens, over the limit ingest.max_completion_tokens = {N}"


def test_an_over_limit_record_on_kafka_is_dead_lettered_naming_the_limit_and_its_neighbours_stored(path: Hops):
    session_id = f"raw-{uuid.uuid4().hex[:8]}"
    over = Completion(project=path.project, session_id=session_id, model="m", policy_version="pv-long",
                      **long_completion(N + 1, seed=5))  # fmt: skip
    before, after = (
        Turn(project=path.project, session_id=session_id, messages=[Message(role="user", content=text)])
        for text in ("before", "after")
    )
    producer = KafkaProducer(bootstrap_servers=path.settings.kafka.bootstrap_servers, acks="all", linger_ms=50,
                             max_request_size=path.settings.kafka.max_record_bytes)  # fmt: skip
    topic = f"{path.settings.kafka.topic_prefix}.events"
    try:
        for event in (before, over, after):  # one produce batch: the big one between two valid ones
            producer.send(topic, key=session_id.encode(), value=dump_event(event))
        producer.flush(60)
    finally:
        producer.close()
    reason = wait_until(
        lambda: path.scalar(
            "SELECT reason FROM dead_letters WHERE project = %s AND field = %s AND topic = %s",
            path.project,
            "completion_token_ids",
            topic,
        ),  # fmt: skip
        60,
        "the dead letter",
    )
    assert reason == f"{N + 1} tokens, over the limit ingest.max_completion_tokens = {N}"
    stored = wait_until(
        lambda: path.scalar("SELECT count(*) FROM raw_events WHERE session_id = %s", session_id) == 2 or None,
        60,
        "both neighbours",
    )
    assert stored
    dlq = KafkaConsumer(dead_letter_topic(path.settings.kafka.topic_prefix),
                        bootstrap_servers=path.settings.kafka.bootstrap_servers,
                        auto_offset_reset="earliest", consumer_timeout_ms=3000)  # fmt: skip
    try:
        headers = [dict(m.headers) for m in dlq if m.key == session_id.encode()]
    finally:
        dlq.close()
    assert [h["reason"].decode() for h in headers] == [reason]


def test_figures(path: Hops) -> None:
    """Print the measured figures (run last in this module)."""
    path.figures["test process max RSS (MB): SDK + gateway + ingest consumer"] = (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    if path.worker.proc is not None:
        status = Path(f"/proc/{path.worker.proc.pid}/status").read_text()
        hwm = next(line for line in status.splitlines() if line.startswith("VmHWM"))
        path.figures["rewarding worker max RSS (MB)"] = int(hwm.split()[1]) / 1024
        path.figures["rewarding worker CPU (s)"] = path.worker.cpu_seconds()
    for name, value in path.figures.items():
        print(f"{name}: {value:.2f}")
    assert path.figures
