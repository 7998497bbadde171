"""``make bench-rewarding``: sessions scored per second through the faust app, against the raw
consume rate of the same events in the same run, and finalisation-to-sample latency.

A private broker (Tansu) and a throw-away database on the machine's Postgres (or an
embedded one) are started for the run and removed afterwards.

1. **Backlog.** ``--sessions`` (default 10,000: with 3,000 the catch-up took ~2.5 s and the
   rate swung 0.47-0.67 of raw between runs on this machine; ~7 s amortises the first fetch
   and the last poll) calculator-agent sessions (6 events each, like the demo's:
   start, tool-call completion, tool result, answer completion, outcome, end; ended long
   ago, so every one is due at once) are produced first, with no worker running
   (``produce_sessions_per_s``). Then ``--workers`` rewarding workers (one consumer group,
   default 2: this machine has two cores; workers scale out by partitions) are launched
   together and catch up:
   - ``group_join_s``: from the launch to the moment the last worker holds its partitions
     with its tables recovered (process start, faust start, group join and sync, changelog
     recovery; Tansu holds a first join for the rebalance timeout). Not counted in the rate.
   - faust: sessions / (the first worker holding its partitions -> the first database poll
     that sees the last reward row). "Holding" is faust's ``on_rebalance_complete``: the
     assignment is in place and recovered, the worker seeks to its committed offsets and
     starts fetching (``rewarding.app.HOLDING_LOG``). Every session is parsed, kept in the
     table with its changelog, scored, written with its samples to Postgres and published
     on ``rewards.scored``. A rebalance during the catch-up (a worker that joined late)
     stays in the time and is counted in ``rebalances_during_catch_up``.
   - raw: one kafka-python consumer (the client ingest uses), partitions assigned,
     reads every record of the same topic, no parsing, counting sessions by their
     ``session_end``, timed the same way: from its first ``poll()`` (which resets the offsets
     to the beginning and fetches) to its last record; twice, the mean is the baseline.
   ``ratio`` is faust over raw. ``worker_cpu_ms_per_session`` (every thread of every
   worker, holding to done) and ``raw_consume_cpu_ms_per_session`` are the CPU each side
   spent per session: steadier than the rates on a shared machine. The same two figures
   timed from the first records instead
   (the agent's first batch; the raw consumer's first non-empty poll) are in
   ``sessions_per_s_from_first_event`` and ``raw_consume_sessions_per_s_from_first_record``.
2. **While producing** (the figure this benchmark reported until it measured a catch-up).
   With the workers running and settled, another ``--sessions`` sessions are produced and
   timed from the first send to the last reward row: ``producer_bound_sessions_per_s``
   can never exceed the producer's own rate while the workers compete with it for the
   CPU (``producer_bound_produce_sessions_per_s``, ``producer_bound_ratio_cap``).
3. **Live latency.** With the workers running, ``--live`` sessions are produced in real
   time (``--rate`` per second) with a ``--window`` second feedback window; a session is
   final when its window closes (its end time + window); the latency is from then until
   its sample row is visible to a reader polling ``training_samples``.

For scale, a faust agent that does nothing but count the backlog's events (its own group,
timed from its ``on_rebalance_complete`` like the workers) is timed too:
``ratio_vs_faust_noop`` is what rewarding costs on top of faust itself.

``--profile`` runs the workers under cProfile (main thread: the event loop) and leaves
``worker-N.prof`` in the run folder it prints.

The last line is JSON: ``sessions_per_s``, ``raw_consume_sessions_per_s``, ``ratio``,
``finalize_to_sample_p99_s`` (targets: ratio >= 0.5, p99 <= 2 s), and more.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kafka import KafkaConsumer, TopicPartition  # noqa: E402
from kafka.admin import KafkaAdminClient, NewTopic  # noqa: E402
from sqlalchemy import text  # noqa: E402

from flywheel.core.db import migrate  # noqa: E402
from flywheel.core.db.engine import get_engine  # noqa: E402
from flywheel.core.settings import Settings  # noqa: E402
from flywheel.stack import endpoints  # noqa: E402
from flywheel.stack.stack import down, up  # noqa: E402
from rewarding.harness import (  # noqa: E402
    FIRST_EVENTS_MARK,
    HOLDING_CPU_MARK,
    HOLDING_MARK,
    WORKER_COMMAND,
    WorkerProcess,
    free_port,
    make_producer,
    produce,
    settings_env,
    wait_until,
)
from rewarding.synthetic import arith_session  # noqa: E402

PARTITIONS = 4
EVENTS_PER_SESSION = 6
SESSION_END = b'"type":"session_end"'
SETTLE_S = 3.0


def private_stack(run_dir: Path) -> tuple[Settings, str, str]:
    """Settings of a private broker and database, the bootstrap servers and the database URL."""
    base = Settings()
    settings = base.model_copy(
        update={
            "run_dir": run_dir,
            "environment": "test",
            "kafka": base.kafka.model_copy(update={"local_port": free_port(), "bootstrap_servers": None}),
            "postgres": base.postgres.model_copy(update={"embedded_port": free_port()}),
        }
    )
    up(settings, ["broker", "postgres"])
    bootstrap = endpoints.kafka_bootstrap(settings)
    db_url = endpoints.postgres_url(settings, database=f"rewarding_bench_{uuid.uuid4().hex[:10]}")
    endpoints.ensure_database(db_url)
    migrate.upgrade(db_url)
    return settings, bootstrap, db_url


def create_topic(bootstrap: str, name: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(name, PARTITIONS, 1)])
    finally:
        admin.close()


def produce_backlog(producer, topic: str, backlog: list[list]) -> float:
    """Send every session's events and flush; sessions per second (first send to flush)."""
    started = time.perf_counter()
    for events in backlog:
        produce(producer, topic, events, flush=False)
    producer.flush()
    return len(backlog) / (time.perf_counter() - started)


def raw_consume(bootstrap: str, topic: str, sessions: int) -> tuple[float, float, float]:
    """Sessions per second a plain kafka-python consumer reads the topic's ``sessions`` sessions.

    Timed from its first poll with the partitions assigned to its last record, and (second
    figure) from its first record to its last; third, the CPU milliseconds per session this
    process used meanwhile. The topic must hold exactly those sessions.
    """
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
    consumer.seek_to_beginning()
    records = ended = 0
    first_record = None
    started, cpu = time.perf_counter(), time.process_time()
    deadline = started + 120
    while records < sessions * EVENTS_PER_SESSION:
        for batch in consumer.poll(timeout_ms=500).values():
            first_record = first_record or time.perf_counter()
            records += len(batch)
            ended += sum(1 for r in batch if SESSION_END in r.value)
        if time.perf_counter() > deadline:
            break
    finished, cpu = time.perf_counter(), time.process_time() - cpu
    consumer.close()
    if ended != sessions or records != sessions * EVENTS_PER_SESSION:
        raise RuntimeError(f"raw consumer saw {records} records and {ended} of {sessions} sessions")
    return sessions / (finished - started), sessions / (finished - (first_record or started)), 1000 * cpu / sessions


def noop_faust(bootstrap: str, topic: str, sessions: int, run_dir: Path) -> float:
    """Sessions per second a faust agent that does nothing but count reads (same topic, own group)."""
    out = run_dir / "noop.json"
    proc = subprocess.run(
        [sys.executable, __file__, "--noop", bootstrap, topic, str(sessions), str(out)],
        cwd=run_dir,
        capture_output=True,
        timeout=600,
    )
    if not out.exists():
        raise RuntimeError(f"the no-op faust agent failed: {proc.stdout[-2000:]!r} {proc.stderr[-2000:]!r}")
    return json.loads(out.read_text())["sessions_per_s"]


def run_noop(bootstrap: str, topic: str, sessions: int, out: Path) -> None:
    """The no-op faust agent: batches like the worker's, count session ends, exit.

    Timed like the workers: from ``on_rebalance_complete`` (partitions held) to the last session end.
    """
    import faust  # only this subprocess runs faust (the benchmark's own process never imports it)
    import mode.loop

    mode.loop.use("uvloop")
    app = faust.App(
        f"noop-{uuid.uuid4().hex[:8]}",
        broker=f"kafka://{bootstrap}",
        store="memory://",
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=6,
        broker_rebalance_timeout=6,
        broker_max_poll_interval=300,
        topic_partitions=PARTITIONS,
        datadir=str(out.parent / "noop-data"),
    )
    source = app.topic(topic, key_serializer="raw", value_serializer="raw", partitions=PARTITIONS)
    seen = {"ended": 0, "started": 0.0}

    @app.on_rebalance_complete.connect
    async def holding(sender, **kwargs) -> None:
        seen["started"] = seen["started"] or time.perf_counter()

    @app.agent(source)
    async def count(stream):
        async for batch in stream.take_events(1000, within=0.2):
            seen["ended"] += sum(1 for e in batch if SESSION_END in e.value)
            if seen["ended"] >= sessions:
                rate = sessions / (time.perf_counter() - seen["started"])
                out.write_text(json.dumps({"sessions_per_s": rate}))
                os.kill(os.getpid(), signal.SIGTERM)

    faust.Worker(app, loglevel="warning", quiet=True).execute_from_commandline()


def scored_sessions(db_url: str, project: str) -> int:
    with get_engine(db_url).connect() as conn:
        return conn.execute(text("SELECT count(*) FROM rewards WHERE project = :p"), {"p": project}).scalar_one()


def sampled_sessions(engine, project: str) -> set[str]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT DISTINCT session_id FROM training_samples WHERE project = :p"), {"p": project})
        return {r[0] for r in rows}


def wait_scored(db_url: str, project: str, sessions: int, what: str) -> float:
    """Poll until ``sessions`` rewards of ``project`` are committed; the Unix time of the poll that saw them."""
    wait_until(lambda: scored_sessions(db_url, project) >= sessions, 600, what, 0.02)
    return time.time()


def live_latency(producer, topic: str, db_url: str, project: str, n: int, rate: float, window: float) -> list[float]:
    """Finalisation (end + window) to visible sample row, per live session, in seconds."""
    rng = random.Random(2)
    engine = get_engine(db_url)
    final_at: dict[str, float] = {}
    seen: dict[str, float] = {}
    next_send = time.monotonic()
    sent = 0
    deadline = None
    while len(seen) < n:
        now = time.monotonic()
        if sent < n and now >= next_send:
            b = arith_session(rng, project=project, at=datetime.now(UTC), step=timedelta(milliseconds=1))
            produce(producer, topic, b.events)
            final_at[b.session_id] = b.events[-1].occurred_at.timestamp() + window
            sent += 1
            next_send += 1.0 / rate
            if sent == n:
                deadline = time.monotonic() + 60
            continue
        wall = time.time()
        for session_id in sampled_sessions(engine, project) - seen.keys():
            seen[session_id] = wall
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)} of {n} live sessions got samples")
        time.sleep(0.02)
    return [seen[s] - final_at[s] for s in final_at]


def note(message: str) -> None:
    """Progress on stderr (the last stdout line is the JSON result)."""
    print(message, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))]


def backlog_of(rng: random.Random, project: str, sessions: int) -> list[list]:
    """``sessions`` calculator sessions that ended half an hour ago (due at once)."""
    long_ago = datetime.now(UTC) - timedelta(minutes=30)
    return [arith_session(rng, project=project, at=long_ago).events for _ in range(sessions)]


def catch_up(
    workers: list[WorkerProcess], launched: float, done: float, cpu_done: list[float], sessions: int
) -> dict[str, float | int | list[float]]:
    """The catch-up figures from the workers' logs: join times, rates, rebalances, CPU per session."""
    holding = [[t for t in w.log_times(HOLDING_MARK) if t <= done] for w in workers]
    cpu_holding = [w.log_times(HOLDING_CPU_MARK)[:1] for w in workers]
    first_events = [t for w in workers for t in w.log_times(FIRST_EVENTS_MARK)[:1]]
    if not all(holding) or not first_events:
        raise RuntimeError("a worker never logged holding its partitions: " + workers[0].log_tail())
    firsts = [h[0] for h in holding]
    started = min(firsts)
    cpu = sum(end - c[0] for end, c in zip(cpu_done, cpu_holding))
    return {
        "sessions_per_s": sessions / (done - started),
        "sessions_per_s_from_first_event": sessions / (done - min(first_events)),
        "catch_up_s": done - started,
        "group_join_s": max(firsts) - launched,
        "group_join_s_per_worker": [round(t - launched, 3) for t in firsts],
        "rebalances_during_catch_up": sum(len(h) for h in holding) - len(workers),
        "worker_cpu_ms_per_session": 1000 * cpu / sessions,
    }


def worker_command(profile_path: Path | None) -> list[str]:
    """The worker's command line, under cProfile when ``profile_path`` is given."""
    if profile_path is None:
        return WORKER_COMMAND
    return [sys.executable, "-m", "cProfile", "-o", str(profile_path), *WORKER_COMMAND[1:]]


def main() -> int:
    parser = argparse.ArgumentParser(description="rewarding throughput and latency")
    parser.add_argument("--sessions", type=int, default=10_000, help="backlog sessions (see the module doc)")
    parser.add_argument("--live", type=int, default=300, help="live sessions for the latency phase")
    parser.add_argument("--rate", type=float, default=50.0, help="live sessions per second")
    parser.add_argument("--window", type=float, default=1.0, help="feedback window of the live phase, seconds")
    parser.add_argument("--workers", type=int, default=2, help="rewarding worker processes (one group)")
    parser.add_argument("--profile", action="store_true", help="run the workers under cProfile")
    parser.add_argument("--noop", nargs=4, metavar=("BOOTSTRAP", "TOPIC", "SESSIONS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.noop:
        run_noop(args.noop[0], args.noop[1], int(args.noop[2]), Path(args.noop[3]))
        return 0

    run_dir = Path(tempfile.mkdtemp(prefix="rewarding-bench-"))
    settings, bootstrap, db_url = private_stack(run_dir)
    tag = uuid.uuid4().hex[:8]
    prefix, project = f"bench{tag}", f"bench-{tag}"
    topic = f"{prefix}.events"
    workers: list[WorkerProcess] = []
    try:
        create_topic(bootstrap, topic)
        env = settings_env(
            {
                "run_dir": str(run_dir),
                "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix},
                "postgres": {"url": db_url},
                "ingest": {"partitions": PARTITIONS},
                "rewarding": {
                    "group_id": f"bench-{tag}",
                    "feedback_window_s": args.window,
                    "session_timeout_broker_s": 6,
                    "rebalance_timeout_s": 6,
                },
            }
        )
        producer = make_producer(bootstrap)
        rng = random.Random(1)

        # 1. The backlog, produced before any worker runs, then caught up.
        produce_rate = produce_backlog(producer, topic, backlog_of(rng, project, args.sessions))
        note(f"backlog: {args.sessions} sessions produced at {produce_rate:.0f} sessions/s, no worker running")
        launched = time.time()
        workers = [
            WorkerProcess(
                env,
                run_dir / f"worker-{i}.log",
                command=worker_command(run_dir / f"worker-{i}.prof" if args.profile else None),
            ).launch()
            for i in range(args.workers)
        ]
        done = wait_scored(db_url, project, args.sessions, "the backlog scored")
        faust = catch_up(workers, launched, done, [w.cpu_seconds() for w in workers], args.sessions)
        note(
            f"faust app ({args.workers} worker(s)): {faust['sessions_per_s']:.0f} sessions/s "
            f"({faust['catch_up_s']:.2f} s from holding the partitions; group join took {faust['group_join_s']:.2f} s)"
        )
        raws = [raw_consume(bootstrap, topic, args.sessions) for _ in range(2)]
        raw_rate = statistics.fmean(r[0] for r in raws)
        raw_from_record = statistics.fmean(r[1] for r in raws)
        raw_cpu = statistics.fmean(r[2] for r in raws)
        note(f"raw consume: {raws[0][0]:.0f}, {raws[1][0]:.0f} sessions/s")
        noop_rate = noop_faust(bootstrap, topic, args.sessions, run_dir)
        note(f"no-op faust agent: {noop_rate:.0f} sessions/s")

        # 2. The old figure: scored while being produced, the workers settled.
        time.sleep(SETTLE_S)
        bound_project = f"{project}-produced"
        bound_backlog = backlog_of(rng, bound_project, args.sessions)
        started = time.time()
        bound_produce_rate = produce_backlog(producer, topic, bound_backlog)
        bound_rate = args.sessions / (wait_scored(db_url, bound_project, args.sessions, "the second backlog") - started)
        note(f"while producing: {bound_rate:.0f} sessions/s (produced at {bound_produce_rate:.0f})")

        # 3. Live latency.
        latencies = live_latency(producer, topic, db_url, f"{project}-live", args.live, args.rate, args.window)
        producer.close()
    finally:
        for worker in workers:
            worker.stop()
        get_engine(db_url).dispose()
        endpoints.drop_database(db_url)
        down(settings)
    if args.profile:
        note(f"worker profiles: {run_dir}/worker-*.prof")
    faust_rate = faust["sessions_per_s"]
    result = {
        "sessions_per_s": round(faust_rate, 1),
        "raw_consume_sessions_per_s": round(raw_rate, 1),
        "ratio": round(faust_rate / raw_rate, 3),
        "finalize_to_sample_p50_s": round(statistics.median(latencies), 3),
        "finalize_to_sample_p99_s": round(percentile(latencies, 0.99), 3),
        "finalize_to_sample_max_s": round(max(latencies), 3),
        "catch_up_s": round(faust["catch_up_s"], 3),
        "group_join_s": round(faust["group_join_s"], 3),
        "group_join_s_per_worker": faust["group_join_s_per_worker"],
        "rebalances_during_catch_up": faust["rebalances_during_catch_up"],
        "worker_cpu_ms_per_session": round(faust["worker_cpu_ms_per_session"], 3),
        "sessions_per_s_from_first_event": round(faust["sessions_per_s_from_first_event"], 1),
        "raw_consume_sessions_per_s_from_first_record": round(raw_from_record, 1),
        "raw_consume_runs": [round(r[0], 1) for r in raws],
        "raw_consume_cpu_ms_per_session": round(raw_cpu, 3),
        "produce_sessions_per_s": round(produce_rate, 1),
        "faust_noop_sessions_per_s": round(noop_rate, 1),
        "ratio_vs_faust_noop": round(faust_rate / noop_rate, 3),
        "producer_bound_sessions_per_s": round(bound_rate, 1),
        "producer_bound_ratio": round(bound_rate / raw_rate, 3),
        "producer_bound_produce_sessions_per_s": round(bound_produce_rate, 1),
        "producer_bound_ratio_cap": round(bound_produce_rate / raw_rate, 3),
        "backlog_sessions": args.sessions,
        "events_per_session": EVENTS_PER_SESSION,
        "live_sessions": args.live,
        "live_rate_per_s": args.rate,
        "partitions": PARTITIONS,
        "workers": args.workers,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
