"""``make bench-ingest``: SDK → Kafka → ingest → Postgres against raw kafka-python, in one run.

Measured on the same broker, with the same ~1 KB events:

1. baseline: raw kafka-python produce (acks=all, linger 5 ms) and consume (kafka-python
   defaults, partitions assigned directly so no group-join wait is timed) rates; the
   consume rates are measured before and again right after phase 3, and the faster of
   the two is the baseline (the machine's load drifts; this keeps the ratio conservative);
2. the SDK call's latency on the agent's thread (p50/p99, microseconds) while the
   background sender runs;
3. the sustained end-to-end rate: N events logged through the SDK, until all N rows are
   in Postgres, written by a real `flywheel-ingest consume` process;
4. the end-to-end latency (Postgres ``received_at`` − SDK ``occurred_at``) while the
   agent logs at half the measured end-to-end rate;
5. the HTTP gateway (``flywheel-ingest gateway``, one process): OTLP chat spans per second
   through ``POST /v1/traces`` against ~1 KB events per second through ``POST /v1/events``,
   both acknowledged by Kafka, from 4 client threads (``otlp_vs_events``).

The ingest consumer runs with its production default ``check_crcs=False`` (librdkafka's
default too); the raw baseline is reported both with kafka-python's default CRC check
(the figure the ratio uses) and without it, so neither side is flattered. Without the
``crc32c`` C extension kafka-python checks CRCs in pure Python, which dominates the
default consumer's time; the output says whether the extension was there
(``crc32c_extension``) and which settings each baseline used (``baseline_settings``).

While the end-to-end phase runs, the CPU time of the SDK's process and of the consumer's
process is divided by the events (``sdk_cpu_us_per_event``, ``consumer_cpu_us_per_event``):
on a machine of two cores, they say which side bounds the rate.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAYLOAD_CHARS = 850  # + envelope ≈ 1 KB serialized


def _payload() -> str:
    """The ~850-character message every benchmark event carries."""
    return ("lorem ipsum dolor sit amet " * 40)[:PAYLOAD_CHARS]


def _settings(run_dir: Path):
    from flywheel.core.settings import Settings

    base = Settings()
    return base.model_copy(
        update={
            "run_dir": run_dir,
            "environment": "test",
            "kafka": base.kafka.model_copy(
                update={"local_port": 19592, "topic_prefix": f"bench{uuid.uuid4().hex[:6]}"}
            ),
            "postgres": base.postgres.model_copy(update={"embedded_port": 19593}),
            "ingest": base.ingest.model_copy(update={"max_poll_interval_ms": 6000}),
        }
    )


def _events(n: int, sessions: int) -> list[tuple[bytes, bytes]]:
    from flywheel.core.contracts import Message, Turn, dump_event

    text = _payload()
    out = []
    for i in range(n):
        sid = f"raw-{i % sessions}"
        ev = Turn(project="bench", session_id=sid, messages=[Message(role="user", content=text)])
        out.append((sid.encode(), dump_event(ev)))
    return out


def raw_produce(bootstrap: str, n: int) -> tuple[str, dict[str, float]]:
    """Produce n events with kafka-python to a fresh topic; (topic, its rate and event size)."""
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    topic = f"bench.raw.{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)])
    admin.close()
    events = _events(n, sessions=500)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    t0 = time.perf_counter()
    for key, value in events:
        producer.send(topic, key=key, value=value)
    producer.flush()
    produce_s = time.perf_counter() - t0
    producer.close()
    return topic, {"raw_produce_events_per_s": n / produce_s, "event_bytes": sum(len(v) for _, v in events) / n}


def raw_consume(bootstrap: str, topic: str, n: int, check_crcs: bool) -> float:
    """Rate of reading the n events of ``topic`` back with a plain kafka-python consumer."""
    from kafka import KafkaConsumer, TopicPartition

    # Partitions are assigned directly, so the clock measures fetching alone, from the first
    # poll on (a group join would add the broker's rebalance wait, which is not throughput).
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, check_crcs=check_crcs)
    partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
    consumer.assign(partitions)
    consumer.seek_to_beginning(*partitions)
    got = 0
    start = time.perf_counter()
    deadline = time.monotonic() + 300
    while got < n and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=1000, max_records=5000).values():
            got += len(records)
    took = time.perf_counter() - start
    consumer.close()
    if got < n:
        raise RuntimeError(f"raw consumer read {got}/{n}")
    return n / took


def raw_consume_rates(bootstrap: str, topic: str, n: int, when: str) -> dict[str, float]:
    """Both raw consume rates (CRC check on, as kafka-python defaults, and off), labelled ``when``."""
    return {
        f"raw_consume_{when}_events_per_s": raw_consume(bootstrap, topic, n, check_crcs=True),
        f"raw_consume_nocrc_{when}_events_per_s": raw_consume(bootstrap, topic, n, check_crcs=False),
    }


def bracketed_baseline(raw: dict[str, float]) -> dict[str, float]:
    """The baseline rates: the better of the runs before and after the end-to-end phase.

    On a shared machine the load drifts between phases; measuring the baseline on both sides
    of the end-to-end phase and keeping the faster one makes the ratio conservative.
    """
    return {
        "raw_consume_events_per_s": max(raw["raw_consume_before_events_per_s"], raw["raw_consume_after_events_per_s"]),
        "raw_consume_nocrc_events_per_s": max(
            raw["raw_consume_nocrc_before_events_per_s"], raw["raw_consume_nocrc_after_events_per_s"]
        ),
    }


def _crc32c_extension() -> bool:
    """Whether kafka-python found the ``crc32c`` C extension (else it checks CRCs in pure Python)."""
    from kafka.record import util

    return getattr(util, "crc32c_c", None) is not None


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


BASELINE_SETTINGS = {
    "raw_produce": "KafkaProducer(acks='all', linger_ms=5), no compression, default partitioner, 4 partitions",
    "raw_consume": "KafkaConsumer defaults (check_crcs=True), partitions assigned directly, poll(max_records=5000)",
    "raw_consume_nocrc": "as raw_consume with check_crcs=False (the ingest consumer's setting)",
    "raw_consume_events_per_s": "the faster of raw_consume_before/after (measured either side of the e2e phase)",
    "e2e_vs_raw_ratio": "e2e_events_per_s / raw_consume_events_per_s (the CRC-checking default consumer)",
    "otlp_vs_events": "otlp_spans_per_s (POST /v1/traces, protobuf, chat spans) / events_per_s_same_run (POST"
    " /v1/events, ~1 KB turns; the faster of before/after), one gateway process, 4 client threads",
}


def _wait_http(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


def _count(conninfo: str, project: str) -> int:
    import psycopg

    with psycopg.connect(conninfo) as conn:
        return conn.execute("SELECT count(*) FROM raw_events WHERE project = %s", (project,)).fetchone()[0]


def _wait_count(conninfo: str, project: str, n: int, timeout_s: float) -> float:
    """Wait until ``n`` rows of ``project`` are in Postgres; returns the perf_counter time it was seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _count(conninfo, project) >= n:
            return time.perf_counter()
        time.sleep(0.02)
    raise RuntimeError(f"only {_count(conninfo, project)}/{n} events of {project} reached Postgres")


def _start_consumer(settings, bootstrap: str, db_url: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        {
            "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
            "FLYWHEEL_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
            "FLYWHEEL_POSTGRES__URL": db_url,
            "FLYWHEEL_INGEST__MAX_POLL_INTERVAL_MS": "6000",
            "FLYWHEEL_INGEST__GROUP_ID": f"bench-ingest-{uuid.uuid4().hex[:6]}",
        }
    )
    return subprocess.Popen(
        [sys.executable, "-m", "ingest.main", "consume", "--log-level", "warning"],
        env=env,
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def _sdk(settings, bootstrap: str, project: str, **overrides):
    """An SDK client on the Kafka transport, with its own spool folder per project."""
    from flywheel.sdk import Flywheel

    return Flywheel(
        project=project,
        transport="kafka",
        kafka_bootstrap=bootstrap,
        topic_prefix=settings.kafka.topic_prefix,
        spool_dir=settings.run_dir / f"spool-{project}",
        **overrides,
    )


def sdk_end_to_end(settings, bootstrap: str, conninfo: str, n: int, consumer_pid: int) -> dict[str, float]:
    """Log n ~1 KB events through the SDK as fast as an agent could; time calls and the drain into Postgres."""
    text = _payload()
    fw = _sdk(settings, bootstrap, "e2e", queue_size=max(200_000, 2 * n))
    sessions = [fw.session(user_id=f"u{i}") for i in range(200)]
    calls_ns: list[int] = []
    clock = time.perf_counter_ns
    base = len(sessions)  # each session_start is one event
    sdk_cpu0, consumer_cpu0 = time.process_time(), _cpu_s(consumer_pid)
    t0 = time.perf_counter()
    for i in range(n - base):
        s = sessions[i % len(sessions)]
        a = clock()
        s.message("user", text)
        calls_ns.append(clock() - a)
    logged_s = time.perf_counter() - t0
    done = _wait_count(conninfo, "e2e", n, timeout_s=600)
    sdk_cpu, consumer_cpu = time.process_time() - sdk_cpu0, _cpu_s(consumer_pid) - consumer_cpu0
    fw.close()
    calls_ns.sort()
    q = statistics.quantiles(calls_ns, n=1000)
    return {
        "sdk_call_p50_us": statistics.median(calls_ns) / 1000,
        "sdk_call_p99_us": q[989] / 1000,
        "sdk_call_max_us": calls_ns[-1] / 1000,
        "sdk_logging_s": logged_s,
        "e2e_events": n,
        "e2e_events_per_s": n / (done - t0),
        "sdk_cpu_us_per_event": sdk_cpu / n * 1e6,
        "consumer_cpu_us_per_event": consumer_cpu / n * 1e6,
    }


def sdk_latency(settings, bootstrap: str, conninfo: str, rate: float, seconds: float) -> dict[str, float]:
    """Log at a steady ``rate``; p50/p99 of received_at − occurred_at in Postgres."""
    import psycopg

    text = _payload()
    fw = _sdk(settings, bootstrap, "lat", linger_ms=5)
    sessions = [fw.session(user_id=f"u{i}") for i in range(50)]
    total = int(rate * seconds)
    t0 = time.perf_counter()
    for i in range(total):
        sessions[i % len(sessions)].message("user", text)
        target = t0 + (i + 1) / rate
        pause = target - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    _wait_count(conninfo, "lat", total + len(sessions), timeout_s=120)
    fw.close()
    with psycopg.connect(conninfo) as conn:
        p50, p99, worst = conn.execute(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY x), percentile_cont(0.99) WITHIN GROUP (ORDER BY x),"
            " max(x) FROM (SELECT extract(epoch FROM received_at - occurred_at) AS x FROM raw_events"
            " WHERE project = 'lat' AND type = 'turn') t"
        ).fetchone()
    return {
        "latency_rate_events_per_s": rate,
        "e2e_latency_p50_s": float(p50),
        "e2e_latency_p99_s": float(p99),
        "e2e_latency_max_s": float(worst),
    }


def _start_gateway(settings, bootstrap: str, db_url: str, port: int, log: Path) -> subprocess.Popen:
    """``flywheel-ingest gateway`` on ``port``, against the bench's broker and database."""
    env = dict(os.environ)
    env.update(
        {
            "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
            "FLYWHEEL_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
            "FLYWHEEL_POSTGRES__URL": db_url,
        }
    )
    command = [sys.executable, "-m", "ingest.main", "gateway", "--port", str(port), "--log-level", "warning"]
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _write_key(db_url: str, project: str) -> str:
    from flywheel.core.auth import create_key
    from flywheel.core.db.engine import session_factory

    with session_factory(db_url)() as session:
        _, token = create_key(session, name=f"bench-{project}", role="writer", project=project)
        session.commit()
    return token


def _events_body(project: str, request: int, batch: int) -> bytes:
    """One /v1/events request: ``batch`` ~1 KB turns of one session."""
    from flywheel.core.contracts import Message, Turn, dump_event

    text = _payload()
    events = [
        dump_event(Turn(project=project, session_id=f"gw-{request}", messages=[Message(role="user", content=text)]))
        for _ in range(batch)
    ]
    return b'{"events":[' + b",".join(events) + b"]}"


def _otlp_body(request: int, batch: int) -> bytes:
    """One /v1/traces export (protobuf): one trace of ``batch`` GenAI chat spans, each with the
    ~850-character user message (a span event) and a short answer: each becomes a ~1.3 KB completion."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    def kv(key: str, value: object) -> KeyValue:
        if isinstance(value, float):
            return KeyValue(key=key, value=AnyValue(double_value=value))
        if isinstance(value, int):
            return KeyValue(key=key, value=AnyValue(int_value=value))
        return KeyValue(key=key, value=AnyValue(string_value=str(value)))

    text, now = _payload(), time.time_ns()
    trace = uuid.uuid4().bytes
    attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "policy-v1", "gen_ai.request.temperature": 0.7}
    attrs |= {"gen_ai.request.max_tokens": 256, "gen_ai.response.finish_reasons": "stop"}
    spans = [
        Span(
            trace_id=trace,
            span_id=(i + 1).to_bytes(8, "big"),
            name="chat policy-v1",
            start_time_unix_nano=now + i * 1000,
            end_time_unix_nano=now + i * 1000 + 500_000_000,
            attributes=[kv(k, v) for k, v in attrs.items()],
            events=[
                Span.Event(name="gen_ai.user.message", time_unix_nano=now, attributes=[kv("content", text)]),
                Span.Event(name="gen_ai.choice", time_unix_nano=now, attributes=[kv("message", '{"content": "ok"}')]),
            ],
        )
        for i in range(batch)
    ]
    export = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])])
    return export.SerializeToString()


def _post_all(url: str, key: str, content_type: str, bodies: list[bytes], clients: int, ok: int) -> float:
    """Post ``bodies`` from ``clients`` threads (one HTTP connection each); seconds until all were answered ``ok``."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    headers = {"Authorization": f"Bearer {key}", "Content-Type": content_type}

    def worker(mine: list[bytes]) -> None:
        with httpx.Client(headers=headers, timeout=60) as client:
            for body in mine:
                response = client.post(url, content=body)
                if response.status_code != ok or (ok == 200 and response.content not in (b"", b"{}")):
                    raise RuntimeError(f"{url}: {response.status_code} {response.content[:300]!r}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(worker, [bodies[i::clients] for i in range(clients)]))
    return time.perf_counter() - t0


def gateway_rates(url: str, key: str, project: str, requests: int, batch: int, clients: int) -> dict[str, float]:
    """Spans per second through ``POST /v1/traces`` against events per second through ``POST /v1/events``,
    in the same gateway: each acknowledged by Kafka before the answer. The events rate is measured before
    and after the OTLP one and the faster kept (as the raw baseline is: the ratio stays conservative)."""
    _post_all(f"{url}/v1/events", key, "application/json", [_events_body(project, -1, batch)], 1, 202)  # warm up
    _post_all(f"{url}/v1/traces", key, "application/x-protobuf", [_otlp_body(-1, batch)], 1, 200)
    n = requests * batch
    events = [_events_body(project, i, batch) for i in range(requests)]
    before = n / _post_all(f"{url}/v1/events", key, "application/json", events, clients, 202)
    exports = [_otlp_body(i, batch) for i in range(requests)]
    otlp = n / _post_all(f"{url}/v1/traces", key, "application/x-protobuf", exports, clients, 200)
    events = [_events_body(project, requests + i, batch) for i in range(requests)]
    after = n / _post_all(f"{url}/v1/events", key, "application/json", events, clients, 202)
    best = max(before, after)
    return {
        "gateway_events_per_s_before": before,
        "gateway_events_per_s_after": after,
        "events_per_s_same_run": best,
        "otlp_spans_per_s": otlp,
        "otlp_vs_events": otlp / best,
        "gateway_batch": batch,
        "gateway_clients": clients,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=30_000, help="events per throughput phase")
    parser.add_argument("--latency-seconds", type=float, default=15.0)
    parser.add_argument("--gateway-requests", type=int, default=60, help="requests per gateway phase")
    parser.add_argument("--gateway-batch", type=int, default=100, help="events or spans per gateway request")
    args = parser.parse_args()

    from flywheel.core.db.migrate import upgrade
    from flywheel.stack.endpoints import drop_database, ensure_database, libpq_conninfo, postgres_url
    from flywheel.stack.stack import down, up

    run_dir = Path(tempfile.mkdtemp(prefix="flywheel-bench-ingest-"))
    settings = _settings(run_dir)
    up(settings, components=["broker", "postgres"])
    consumer = gateway = None
    db_url = postgres_url(settings, database=f"bench_ingest_{uuid.uuid4().hex[:8]}")
    try:
        ensure_database(db_url)
        upgrade(db_url)
        conninfo = libpq_conninfo(db_url)
        from flywheel.stack.endpoints import kafka_bootstrap

        bootstrap = kafka_bootstrap(settings)
        print(f"broker {bootstrap}, database {db_url.rsplit('/', 1)[-1]}", flush=True)

        raw_topic, raw = raw_produce(bootstrap, args.events)
        raw.update(raw_consume_rates(bootstrap, raw_topic, args.events, "before"))
        print(f"raw: {json.dumps({k: round(v) for k, v in raw.items()})}", flush=True)

        consumer = _start_consumer(settings, bootstrap, db_url, run_dir / "ingest.log")
        warm = _sdk(settings, bootstrap, "warmup", queue_size=200_000)
        warm.session(user_id="warm").message("user", "hello")
        warm.close()
        _wait_count(conninfo, "warmup", 2, timeout_s=120)  # consumer joined its group

        e2e = sdk_end_to_end(settings, bootstrap, conninfo, args.events, consumer.pid)
        print(f"e2e: {json.dumps({k: round(v, 2) for k, v in e2e.items()})}", flush=True)
        raw.update(raw_consume_rates(bootstrap, raw_topic, args.events, "after"))
        raw.update(bracketed_baseline(raw))
        print(f"raw after: {json.dumps({k: round(v) for k, v in raw.items()})}", flush=True)
        lat = sdk_latency(settings, bootstrap, conninfo, rate=e2e["e2e_events_per_s"] / 2, seconds=args.latency_seconds)
        print(f"latency: {json.dumps({k: round(v, 3) for k, v in lat.items()})}", flush=True)

        port = 19594
        gateway = _start_gateway(settings, bootstrap, db_url, port, run_dir / "gateway.log")
        _wait_http(f"http://127.0.0.1:{port}/healthz", timeout_s=60)
        key = _write_key(db_url, "gw")
        gw = gateway_rates(f"http://127.0.0.1:{port}", key, "gw", args.gateway_requests, args.gateway_batch, clients=4)
        print(f"gateway: {json.dumps({k: round(v, 3) for k, v in gw.items()})}", flush=True)
    finally:
        for process in (consumer, gateway):
            if process is not None:
                process.terminate()
                process.wait(30)
        try:
            drop_database(db_url)
        finally:
            down(settings)

    result = {
        **{k: round(v, 1) for k, v in raw.items()},
        **{k: round(v, 2) for k, v in e2e.items()},
        **{k: round(v, 3) for k, v in lat.items()},
        **{k: round(v, 3) for k, v in gw.items()},
        "e2e_vs_raw_ratio": round(e2e["e2e_events_per_s"] / raw["raw_consume_events_per_s"], 3),
        "e2e_vs_raw_nocrc_ratio": round(e2e["e2e_events_per_s"] / raw["raw_consume_nocrc_events_per_s"], 3),
        "crc32c_extension": _crc32c_extension(),
        "baseline_settings": BASELINE_SETTINGS,
        "targets": {"sdk_call_p99_us": 50, "e2e_vs_raw_ratio": 0.8, "e2e_latency_p99_s": 2},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
