"""``make bench-reliability``: faults, bad input, intruders and a soak, with figures.

1. **Scenarios.** The fault and bad-input tests of ``make test`` (:data:`SCENARIOS`: broker
   outage, SIGKILLed consumer / faust worker / Celery worker / router, a replica killed
   mid-stream, Postgres restarted, a hot swap interrupted between pause and resume, corrupt
   checkpoints, generated bad events and requests) run once more, in a child pytest with
   ``$FLYWHEEL_FAULT_REPORT`` set: each writes what it sent and what it found at the end,
   so ``events_lost`` (sent, never found) and ``events_duplicated`` (found twice) are counted
   by the scenarios themselves, against real services. Pass or fail comes from the JUnit XML.
2. **Routes.** Every route of the admin API and of the ingest gateway, enumerated from the
   apps, is called without credentials, with a malformed header and with an unknown token;
   ``unauthenticated_routes`` counts those that answered anything but 401 (only the
   liveness probes are public: ``/health``, ``/healthz``).
3. **Soak** (``--soak-minutes``, 10 by default; 0 skips it). The demo's whole loop runs
   (agent traffic through the router, rewarding, training, canaries) while a second SDK
   client, in its own process, logs sessions that end (start, a ~850-character user turn,
   an outcome, end) at ``--rate`` events per second (by default ``capacity``, below; a
   number soaks at that rate). The rewarding workers keep scored
   states for ``SOAK_RETENTION_S`` (120 s) instead of 7 days, so that their memory reaches
   its steady state (rate x retention) inside the soak. Every 15 s it samples each
   service's resident memory (its whole process tree) and two backlogs: soak events sent
   but not yet in Postgres (ingest) and soak sessions sent but without a reward yet
   (rewarding), counted from the client's progress and Postgres (Tansu's end offsets are
   not the end of the log, so Kafka consumer lag means nothing on it). At the end every
   soak event must be in Postgres exactly once, except those the SDK itself dropped and counted
   (``soak_sdk_dropped``: its queue and its disk spool were both full, which it logs);
   ``soak_events_lost`` counts the rest that are missing, a silent loss, which must be 0;
   and every soak session must have a reward. Memory growth compares each service's peak
   in the last third with its peak in the second third (the first third is warm-up:
   models load, caches fill); a backlog is bounded when its peak in the last third is
   at most 1.25 x its peak in the middle third + 1,000. ``soak_ok`` is all of it.
   docs/reliability.md gives the figures measured on the project's two-core machine.

``--rate capacity`` (the default) measures the whole loop's sustained rate first (``make
bench-capacity``'s in-loop phase, in the same run) and soaks at 80 % of it, at no less than
500 events/s; its figures join the line as ``capacity_*``. ``soak_error_lines`` counts the
lines logged at ERROR or CRITICAL in every log of the soak's run (services and stack), and
must be 0. ``--vllm-nice N`` runs the loop's vLLM replicas at niceness N in both.

Last line: one JSON object (``scenarios``, ``scenarios_passed``, ``events_sent``,
``events_lost``, ``events_duplicated``, ``bad_inputs_tried``, ``server_errors``,
``unauthenticated_routes``, and the soak's figures).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

T = "tests/integration/"
SCENARIOS: dict[str, str] = {
    "broker stopped and restarted under traffic": T + "test_sdk_kafka.py::test_broker_outage_spools_then_replays_everything_in_order",
    "ingest consumer SIGKILLed mid-stream": T + "test_ingest_consumer.py::test_consumer_killed_mid_stream_then_restarted_writes_every_event_exactly_once",
    "Postgres restarted under traffic": T + "test_ingest_consumer.py::test_postgres_restarted_under_traffic_the_consumer_reconnects_and_loses_nothing",
    "database connections cut": T + "test_ingest_consumer.py::test_a_lost_database_connection_is_retried_without_losing_events",
    "faust worker SIGKILLed": T + "test_rewarding_restart.py::test_killed_and_restarted_worker_scores_every_session_exactly_once",
    "faust worker joining and leaving (two rebalances)": T + "test_rewarding_restart.py::test_a_worker_joining_and_leaving_mid_stream_loses_and_doubles_nothing",
    "Celery worker SIGKILLed mid-cycle": T + "test_trainer_cycle.py::test_worker_killed_mid_cycle_leaves_nothing_and_next_cycle_succeeds",
    "router SIGKILLed under load": T + "test_serving_router.py::test_a_router_killed_under_load_restarts_and_no_request_or_session_is_lost",
    "vLLM replica killed mid-stream": T + "test_serving_router.py::test_a_killed_replica_is_ejected_its_requests_retried_and_it_rejoins",
    "hot swap interrupted between pause and resume": T + "test_serving_swap.py::test_a_replica_killed_between_pause_and_resume_ends_failed_and_the_admin_api_says_so",
    "truncated checkpoint refused before the replica": T + "test_serving_swap.py::test_truncated_checkpoint_is_refused_before_the_replica_is_touched",
    "NaN checkpoint refused before the replica": T + "test_serving_swap.py::test_a_checkpoint_with_nan_weights_is_refused_before_the_replica_is_touched",
    "damaged checkpoint rejected by the gate": T + "test_trainer_cycle.py::test_gate_rejects_a_damaged_checkpoint",
    "bad records become dead letters": T + "test_ingest_consumer.py::test_valid_events_land_once_and_bad_records_become_dead_letters",
    "generated bad events at the gateway": T + "test_ingest_gateway.py::test_generated_bad_input_never_gets_a_5xx_and_valid_events_in_the_batch_are_kept",
    "generated requests to the admin API": T + "test_serving_admin.py::test_generated_requests_to_every_operation_never_get_a_5xx_and_refusals_say_why",
    "schemathesis against the gateway": T + "test_ingest_gateway.py::test_schemathesis_on_the_gateway_finds_no_5xx_and_every_refusal_says_why",
    "schemathesis against the admin API": T + "test_serving_admin.py::test_schemathesis_on_the_admin_api_finds_no_5xx_and_every_refusal_says_why",
    "a write key cannot write to another project": T + "test_ingest_gateway.py::test_only_foreign_events_is_403",
}  # fmt: skip


# --------------------------------------------------------------------------- 1. scenarios


def run_scenarios(work: Path) -> dict[str, Any]:
    """Run every scenario test once; their pass/fail and the figures they recorded."""
    report, junit = work / "faults.jsonl", work / "junit.xml"
    env = {**os.environ, "FLYWHEEL_FAULT_REPORT": str(report)}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *SCENARIOS.values()]
    done = subprocess.run(argv, cwd=ROOT, env=env, check=False)
    outcome = _junit_outcomes(junit) if junit.exists() else {}
    figures = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    by_name = {name: outcome.get(nodeid.rsplit("::", 1)[1], "not run") for name, nodeid in SCENARIOS.items()}
    events = [f for f in figures if f["unit"] in ("events", "sessions scored")]
    return {
        "scenarios": len(SCENARIOS),
        "scenarios_passed": sum(1 for v in by_name.values() if v == "passed"),
        "scenario_results": by_name,
        "events_sent": sum(f["sent"] for f in events),
        "events_lost": sum(f["lost"] for f in events),
        "events_duplicated": sum(f["duplicated"] for f in events),
        "requests_sent": sum(f["sent"] for f in figures if f["unit"] == "requests"),
        "requests_lost": sum(f["lost"] for f in figures if f["unit"] == "requests"),
        "bad_inputs_tried": sum(f.get("bad_inputs", 0) for f in figures),
        "server_errors": sum(f.get("server_errors", 0) for f in figures),
        "pytest_exit_code": done.returncode,
    }


def _junit_outcomes(path: Path) -> dict[str, str]:
    """Test function name → passed / failed / skipped, from pytest's JUnit XML."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        out[case.get("name", "")] = (
            "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        )
    return out


# --------------------------------------------------------------------------- 2. routes


def unauthenticated_routes() -> dict[str, Any]:
    """Call every admin and gateway route without valid credentials; count what is not refused."""
    import re

    from fastapi.testclient import TestClient
    from sqlalchemy import create_engine

    from flywheel.core.settings import Settings
    from ingest.gateway import PUBLIC_PATHS as GATEWAY_PUBLIC
    from ingest.gateway import create_app as gateway_app
    from serving.admin.app import PUBLIC_PATHS as ADMIN_PUBLIC
    from serving.admin.app import create_app as admin_app

    no_db = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # refusals must not need the database
    settings = Settings(environment="test")
    apps = {
        "admin": (admin_app(settings, engine=create_engine(no_db)), ADMIN_PUBLIC),
        "gateway": (gateway_app(settings, producer=object(), db_url=no_db), GATEWAY_PUBLIC),
    }
    open_routes: list[str] = []
    checked = 0
    logging.disable(logging.ERROR)  # each refusal's audit row cannot be written without a database: expected here
    for name, (app, public) in apps.items():
        client = TestClient(app)
        for route in app.routes:
            for method in sorted(getattr(route, "methods", None) or {"GET"}):
                if method == "HEAD" or route.path in public:
                    continue
                checked += 1
                path = re.sub(r"\{[^}]+\}", "1", route.path)
                for headers in ({}, {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": "Bearer"}):
                    status = client.request(method, path, headers=headers, json={}).status_code
                    if status != 401:
                        open_routes.append(f"{name} {method} {route.path} -> {status} with {headers or 'no header'}")
                        break
    logging.disable(logging.NOTSET)
    return {"routes_checked": checked, "unauthenticated_routes": len(open_routes), "open_routes": open_routes}


# --------------------------------------------------------------------------- 3. soak


SOAK_EVENTS_PER_SESSION = 4
"""start, a user turn (~850 characters), an outcome, end: sessions that end, get scored and leave."""
SOAK_RETENTION_S = 120.0
"""The rewarding workers' ``state_retention_s`` in the soak (7 days by default): memory holds
rate x retention states, so only a retention shorter than the soak shows a steady state."""


def soak_client(bootstrap: str, prefix: str, project: str, rate: float, out: Path, spool: Path) -> None:
    """The soak's SDK client, in its own process (``--soak-client``): ended sessions at ``rate``
    events/s until SIGTERM, then flush, close and write what was sent and dropped to ``out``."""
    import signal

    from flywheel.sdk import Flywheel

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    fw = Flywheel(project=project, transport="kafka", kafka_bootstrap=bootstrap, topic_prefix=prefix, spool_dir=spool)
    text = ("lorem ipsum dolor sit amet " * 40)[:850]
    started, sent, n = time.monotonic(), 0, 0
    progress, next_progress = out.with_name("soak-progress.json"), 0.0
    while not stop.is_set():
        if time.monotonic() >= next_progress:  # what was sent so far, for the sampler's backlog figures
            next_progress = time.monotonic() + 1.0
            progress.with_suffix(".tmp").write_text(json.dumps({"sent": sent, "sessions": n}))
            progress.with_suffix(".tmp").replace(progress)
        due = int((time.monotonic() - started) * rate)
        while sent + SOAK_EVENTS_PER_SESSION <= due and not stop.is_set():
            session = fw.session(f"soak-{n}", user_id=f"user-{n % 50}", task="soak")
            session.turn([{"role": "user", "content": text}])
            session.outcome("task_solved", n % 2 == 0)
            session.end()
            sent, n = sent + SOAK_EVENTS_PER_SESSION, n + 1
        time.sleep(0.005)
    seconds = time.monotonic() - started
    fw.flush(120)
    fw.close(30)
    out.write_text(json.dumps({"sent": sent, "sessions": n, "dropped": fw.stats.dropped, "seconds": seconds}))


class Soak:
    """The soak client (its own process), memory and lag sampling, while the demo's loop runs
    (its on_start/on_finish hooks)."""

    def __init__(self, rate: float, work: Path, interval_s: float = 15.0):
        self.rate, self.work, self.interval_s = rate, work, interval_s
        self.stop = threading.Event()
        self.samples: list[dict[str, Any]] = []
        self.project = f"soak-{uuid.uuid4().hex[:6]}"
        self.result: dict[str, Any] = {}
        self.errors: list[str] = []
        self.client: subprocess.Popen[bytes] | None = None

    def on_start(self, engine: Any, settings: Any, group: Any) -> None:
        from flywheel.stack.endpoints import kafka_bootstrap

        args = [kafka_bootstrap(settings), settings.kafka.topic_prefix, self.project, str(self.rate),
                str(self.work / "soak-client.json"), str(Path(settings.run_dir) / "soak-spool")]  # fmt: skip
        with open(self.work / "soak-client.log", "ab") as log:
            self.client = subprocess.Popen([sys.executable, __file__, "--soak-client", *args], cwd=ROOT,
                                           stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        self.sampler = threading.Thread(target=self._sample, args=(settings, group, engine), name="soak-sampler",
                                        daemon=True)  # fmt: skip
        self.sampler.start()

    def _sample(self, settings: Any, group: Any, engine: Any) -> None:
        import psutil

        started = time.monotonic()
        while not self.stop.wait(self.interval_s if self.samples else 5.0):
            rss = {}
            for service in group:
                try:
                    root = psutil.Process(service.pid)
                    rss[service.name] = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                except (psutil.Error, TypeError) as err:
                    self.errors.append(f"{service.name}: {err!r}")
            self.samples.append({"t": round(time.monotonic() - started, 1), "rss": rss, "lag": self._backlog(engine)})

    def _backlog(self, engine: Any) -> dict[str, int | None]:
        """End-to-end backlogs: soak events sent but not yet in Postgres (ingest), soak sessions
        sent but without a reward yet (rewarding; the 3 s feedback window is part of it).

        Counted from the client's progress file and Postgres, not from Kafka: Tansu answers
        ListOffsets(latest) with 1 + the last batch's base offset, not the end of the log
        (measured: 31 records in a partition, end offset 1), so consumer-group lag read from
        it means nothing here.
        """
        from sqlalchemy import text

        try:
            progress = json.loads((self.work / "soak-progress.json").read_text())
            with engine.connect() as conn:
                stored = conn.execute(
                    text("SELECT count(*) FROM raw_events WHERE project = :p"), {"p": self.project}
                ).scalar_one()
                scored = conn.execute(
                    text("SELECT count(DISTINCT session_id) FROM rewards WHERE project = :p"), {"p": self.project}
                ).scalar_one()
        except Exception as err:  # noqa: BLE001 - a sample without figures, said why
            self.errors.append(f"backlog: {err!r}")
            return {"ingest": None, "rewarding": None}
        return {"ingest": progress["sent"] - stored, "rewarding": progress["sessions"] - scored}

    def on_finish(self, engine: Any, settings: Any, summary: dict[str, Any]) -> None:
        from sqlalchemy import text

        self.stop.set()
        self.sampler.join(60)
        assert self.client is not None
        self.client.terminate()
        self.client.wait(300)
        client = json.loads((self.work / "soak-client.json").read_text())
        sent, dropped = client["sent"], client["dropped"]
        deadline = time.monotonic() + 300
        stored = distinct = scored = 0
        while time.monotonic() < deadline:  # the backlog, if any, drains; then every session is scored
            with engine.connect() as conn:
                stored, distinct = conn.execute(
                    text("SELECT count(*), count(DISTINCT event_id) FROM raw_events WHERE project = :p"),
                    {"p": self.project},
                ).one()
                scored = conn.execute(
                    text("SELECT count(DISTINCT session_id) FROM rewards WHERE project = :p"), {"p": self.project}
                ).scalar_one()
            if distinct >= sent - dropped and scored >= client["sessions"]:
                break
            time.sleep(2.0)
        self.result = {"soak_events_sent": sent, "soak_events_per_s_sent": round(sent / client["seconds"], 1),
                       "soak_sessions_sent": client["sessions"], "soak_sessions_scored": scored,
                       "soak_sdk_dropped": dropped,  # the SDK's counted, logged drop when queue and spool are full
                       "soak_events_lost": sent - dropped - distinct,  # lost without being counted: must be 0
                       "soak_events_duplicated": stored - distinct, **_growth(self.samples),
                       "soak_sampling_errors": self.errors[:5]}  # fmt: skip


def _growth(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per service: peak RSS in the last third over the peak in the middle third; lag figures."""
    if len(samples) < 6:
        return {"soak_samples": len(samples)}
    third = len(samples) // 3
    middle, last = samples[third : 2 * third], samples[2 * third :]
    growth = {}
    for name in samples[-1]["rss"]:
        before = max(s["rss"].get(name, 0) for s in middle)
        after = max(s["rss"].get(name, 0) for s in last)
        growth[name] = round(100.0 * (after - before) / before, 1) if before else None
    lag: dict[str, dict[str, Any]] = {}
    for group in samples[-1]["lag"]:

        def peak(part: list[dict[str, Any]], g: str = group) -> int | None:
            return max((s["lag"][g] for s in part if s["lag"].get(g) is not None), default=None)

        mid, end = peak(middle), peak(last)
        lag[group] = {"max": peak(samples), "middle_third_max": mid, "last_third_max": end,
                      "end": samples[-1]["lag"].get(group),
                      # bounded: the last third's peak no higher than the middle third's by more than
                      # a quarter plus 1,000 (events or sessions: a sampling interval's burst)
                      "bounded": mid is not None and end is not None and end <= 1.25 * mid + 1000}  # fmt: skip
    return {
        "soak_samples": len(samples),
        "soak_rss_growth_pct": growth,
        "soak_max_rss_growth_pct": max((g for g in growth.values() if g is not None), default=None),
        "soak_rss_mb_end": {k: round(v / 2**20) for k, v in samples[-1]["rss"].items()},
        "soak_backlog": lag,
        "soak_backlog_bounded": bool(lag) and all(v["bounded"] for v in lag.values()),
    }


def error_lines(logs: Path) -> dict[str, int]:
    """Lines logged at ERROR (or CRITICAL) level, per log file of the run (the services' and the stack's)."""
    import re

    level = re.compile(r"\b(ERROR|CRITICAL)\b")
    counts = {}
    for path in sorted(logs.glob("*.log")):
        with open(path, errors="replace") as f:
            n = sum(1 for line in f if level.search(line))
        if n:
            counts[path.name] = n
    return counts


def run_soak(minutes: float, rate: float, work: Path, vllm_nice: int = 0, rewarding_workers: int = 1) -> dict[str, Any]:
    from flywheel.core.settings import Settings
    from flywheel.demo import DemoConfig, run_demo

    soak = Soak(rate, work)
    base = random.Random().randrange(21000, 30000, 100)
    settings = Settings(
        run_dir=work / "run", kafka={"local_port": base},
        vllm={"base_port": base + 10, "replicas": 2, "nice": vllm_nice},
        serving={"router_port": base + 20, "admin_port": base + 21},
    )  # fmt: skip
    config = DemoConfig(budget_minutes=minutes, target_gain_points=1000.0, target_promotions=1000, live=False,
                        report_dir=work / "report", on_start=soak.on_start, on_finish=soak.on_finish,
                        service_settings={"rewarding": {"state_retention_s": SOAK_RETENTION_S}},
                        service_counts={"rewarding": rewarding_workers})  # fmt: skip
    summary = run_demo(config, settings)
    errors = error_lines(Path(settings.run_dir) / "logs")
    out = {"soak_minutes": minutes, "soak_rate_per_s": rate, "soak_vllm_nice": vllm_nice,
           "soak_rewarding_workers": rewarding_workers, **soak.result,
           "soak_events_per_s": soak.result.get("soak_events_per_s_sent"),
           "soak_backlogs_bounded": soak.result.get("soak_backlog_bounded"),
           "soak_error_lines": sum(errors.values()), "soak_error_lines_by_log": errors,
           "soak_failed_requests": summary["failed_requests"], "soak_agent_sessions": summary["sessions"],
           "soak_promotions": summary["promotions"], "soak_rollbacks": summary["rollbacks"]}  # fmt: skip
    growth = out.get("soak_max_rss_growth_pct")
    out["soak_ok"] = bool(
        out.get("soak_events_lost") == 0 and out.get("soak_events_duplicated") == 0
        and out.get("soak_sdk_dropped") == 0 and out["soak_failed_requests"] == 0
        and growth is not None and growth < 10.0
        and out.get("soak_backlog_bounded") and out.get("soak_sessions_scored") == out.get("soak_sessions_sent")
        and out["soak_error_lines"] == 0
    )  # fmt: skip
    return out


SOAK_CAPACITY_SHARE = 0.8
"""``--rate capacity``: the soak's share of the sustained rate measured in the same run."""
SOAK_MIN_EVENTS_PER_S = 500.0
"""``--rate capacity``: the soak's lowest rate, whatever the capacity measured."""


def soak_rate(rate: str, work: Path, figures: dict[str, Any], vllm_nice: int = 0, rewarding_workers: int = 1) -> float:
    """The soak's events/s: ``rate`` as a number, or ``capacity`` (measured first; its figures join ``figures``)."""
    if rate != "capacity":
        return float(rate)
    import capacity

    measured = capacity.in_loop(
        capacity.parse_args(["--vllm-nice", str(vllm_nice), "--rewarding-workers", str(rewarding_workers)]),
        work / "capacity",
    )
    figures.update({f"capacity_{k}": v for k, v in measured.items() if not k.startswith("steps")})
    return max(SOAK_CAPACITY_SHARE * measured["sustained_events_per_s"], SOAK_MIN_EVENTS_PER_S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--soak-minutes", type=float, default=10.0, help="0 skips the soak")
    parser.add_argument("--rate", default="capacity",
                        help="soak events per second, or 'capacity': first measure the whole loop's sustained rate "
                             "(bench/capacity.py, in-loop phase) and soak at 80 %% of it, at least 500 events/s")  # fmt: skip
    parser.add_argument("--skip-scenarios", action="store_true")
    parser.add_argument("--soak-client", nargs=6, metavar=("BOOTSTRAP", "PREFIX", "PROJECT", "RATE", "OUT", "SPOOL"),
                        help=argparse.SUPPRESS)  # fmt: skip
    import capacity  # bench/capacity.py: the loop's layout options, as its capacity ramp takes them

    capacity.add_loop_arguments(parser)
    args = parser.parse_args()
    if args.soak_client:
        bootstrap, prefix, project, rate, out, spool = args.soak_client
        soak_client(bootstrap, prefix, project, float(rate), Path(out), Path(spool))
        return 0

    if args.rate != "capacity":
        try:
            float(args.rate)
        except ValueError:
            parser.error(f"--rate must be events per second or 'capacity', not {args.rate!r}")
    work = Path(tempfile.mkdtemp(prefix="flywheel-reliability-"))
    figures: dict[str, Any] = {}
    if not args.skip_scenarios:
        figures |= run_scenarios(work)
    figures |= unauthenticated_routes()
    if args.soak_minutes > 0:
        rate = soak_rate(args.rate, work, figures, args.vllm_nice, args.rewarding_workers)
        figures |= run_soak(args.soak_minutes, rate, work, args.vllm_nice, args.rewarding_workers)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
