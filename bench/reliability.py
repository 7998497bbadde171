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
   client logs ~1 KB events at ``--rate`` per second (by default half the end-to-end rate
   that ``make bench-ingest`` measured here, 7,279/s). Every 15 s it samples each
   service's resident memory (its whole process group) and the ingest consumer group's
   lag on the events topic. At the end every soak event must be in Postgres exactly once,
   except those the SDK itself dropped and counted (``soak_sdk_dropped``: its queue and its
   disk spool were both full, which it logs); ``soak_events_lost`` counts the rest that are
   missing, a silent loss, which must be 0. On this two-core machine the whole loop (two
   busy vLLM replicas and the trainer) leaves too little CPU for the soak client's sender at
   3,640 events/s: its spool filled and it dropped events (counted) within minutes; the
   figures in the closing notes say which ``--rate`` a run used.
   Memory growth compares each service's peak in the last third with its peak in the
   second third (the first third is warm-up: models load, caches fill).

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
    "a write key cannot write to another project": T + "test_ingest_gateway.py::test_only_foreign_events_is_403",
}  # fmt: skip
BENCH_INGEST_E2E_RATE = 7279.0
"""End-to-end events/s measured by ``make bench-ingest`` on this machine (the soak runs at half)."""


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

    from flywheel.config import Settings
    from ingest.gateway import PUBLIC_PATHS as GATEWAY_PUBLIC
    from ingest.gateway import create_app as gateway_app
    from serving.admin import PUBLIC_PATHS as ADMIN_PUBLIC
    from serving.admin import create_app as admin_app

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


class Soak:
    """Extra SDK traffic, memory and lag sampling, while the demo's loop runs (its on_start/on_finish hooks)."""

    def __init__(self, rate: float, interval_s: float = 15.0):
        self.rate, self.interval_s = rate, interval_s
        self.stop = threading.Event()
        self.samples: list[dict[str, Any]] = []
        self.sent = 0
        self.project = f"soak-{uuid.uuid4().hex[:6]}"
        self.result: dict[str, Any] = {}
        self.errors: list[str] = []

    def on_start(self, engine: Any, settings: Any, group: Any) -> None:
        from flywheel.sdk import Flywheel
        from flywheel.stack.endpoints import kafka_bootstrap

        self.fw = Flywheel(project=self.project, transport="kafka", kafka_bootstrap=kafka_bootstrap(settings),
                           topic_prefix=settings.kafka.topic_prefix,
                           spool_dir=Path(settings.run_dir) / "soak-spool")  # fmt: skip
        self.threads = [
            threading.Thread(target=self._traffic, name="soak-traffic", daemon=True),
            threading.Thread(target=self._sample, args=(settings, group), name="soak-sampler", daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _traffic(self) -> None:
        text = ("lorem ipsum dolor sit amet " * 40)[:850]
        started, sessions = time.monotonic(), {}
        while not self.stop.is_set():
            due = int((time.monotonic() - started) * self.rate)
            while self.sent < due and not self.stop.is_set():
                sid = f"soak-{self.sent % 200}"
                if sid not in sessions:
                    sessions[sid] = self.fw.session(sid, user_id="soak")
                    self.sent += 1
                sessions[sid].turn([{"role": "user", "content": text}])
                self.sent += 1
            time.sleep(0.01)

    def _sample(self, settings: Any, group: Any) -> None:
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
            self.samples.append({"t": round(time.monotonic() - started, 1), "rss": rss, "lag": _ingest_lag(settings),
                                 "sent": self.sent})  # fmt: skip

    def on_finish(self, engine: Any, settings: Any, summary: dict[str, Any]) -> None:
        from sqlalchemy import text

        self.stop.set()
        for t in self.threads:
            t.join(30)
        self.fw.flush(120)
        self.fw.close(30)
        deadline = time.monotonic() + 300
        stored = distinct = 0
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                stored, distinct = conn.execute(
                    text("SELECT count(*), count(DISTINCT event_id) FROM raw_events WHERE project = :p"), {"p": self.project}
                ).one()
            if distinct >= self.sent - self.fw.stats.dropped:
                break
            time.sleep(2.0)
        dropped = self.fw.stats.dropped  # the SDK's counted, logged drop when queue and spool are full
        self.result = {"soak_events_sent": self.sent, "soak_sdk_dropped": dropped,
                       "soak_events_lost": self.sent - dropped - distinct,  # lost without being counted: must be 0
                       "soak_events_duplicated": stored - distinct, **_growth(self.samples),
                       "soak_sampling_errors": self.errors[:5]}  # fmt: skip


def _ingest_lag(settings: Any) -> int | None:
    """Records on the events topic the ingest consumer group has not committed yet."""
    from kafka import KafkaAdminClient, KafkaConsumer

    from flywheel.contracts.topics import events_topic
    from flywheel.stack.endpoints import kafka_bootstrap

    bootstrap = kafka_bootstrap(settings)
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        committed = admin.list_consumer_group_offsets(settings.ingest.group_id)
        admin.close()
        consumer = KafkaConsumer(bootstrap_servers=bootstrap)
        topic = events_topic(settings.kafka.topic_prefix)
        ends = consumer.end_offsets([tp for tp in committed if tp.topic == topic])
        consumer.close()
    except Exception:  # the broker is busy: this sample has no lag figure
        return None
    return int(sum(end - committed[tp].offset for tp, end in ends.items()))


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
    lags = [s["lag"] for s in samples if s["lag"] is not None]
    return {
        "soak_samples": len(samples),
        "soak_rss_growth_pct": growth,
        "soak_max_rss_growth_pct": max((g for g in growth.values() if g is not None), default=None),
        "soak_rss_mb_end": {k: round(v / 2**20) for k, v in samples[-1]["rss"].items()},
        "soak_lag_max": max(lags, default=None),
        "soak_lag_end": lags[-1] if lags else None,
        "soak_lag_middle_max": max((s["lag"] for s in middle if s["lag"] is not None), default=None),
    }


def run_soak(minutes: float, rate: float, work: Path) -> dict[str, Any]:
    from flywheel.config import Settings
    from flywheel.demo import DemoConfig, run_demo

    soak = Soak(rate)
    base = random.Random().randrange(21000, 30000, 100)
    settings = Settings(
        run_dir=work / "run", kafka={"local_port": base}, vllm={"base_port": base + 10, "replicas": 2},
        serving={"router_port": base + 20, "admin_port": base + 21},
    )  # fmt: skip
    config = DemoConfig(budget_minutes=minutes, target_gain_points=1000.0, target_promotions=1000, live=False,
                        report_dir=work / "report", on_start=soak.on_start, on_finish=soak.on_finish)  # fmt: skip
    summary = run_demo(config, settings)
    out = {"soak_minutes": minutes, "soak_rate_per_s": rate, **soak.result,
           "soak_failed_requests": summary["failed_requests"], "soak_agent_sessions": summary["sessions"],
           "soak_promotions": summary["promotions"], "soak_rollbacks": summary["rollbacks"]}  # fmt: skip
    growth = out.get("soak_max_rss_growth_pct")
    out["soak_ok"] = bool(
        out.get("soak_events_lost") == 0 and out.get("soak_events_duplicated") == 0
        and out.get("soak_sdk_dropped") == 0 and out["soak_failed_requests"] == 0 and growth is not None and growth < 10.0
    )  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--soak-minutes", type=float, default=10.0, help="0 skips the soak")
    parser.add_argument("--rate", type=float, default=BENCH_INGEST_E2E_RATE / 2, help="soak events per second")
    parser.add_argument("--skip-scenarios", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="flywheel-reliability-"))
    figures: dict[str, Any] = {}
    if not args.skip_scenarios:
        figures |= run_scenarios(work)
    figures |= unauthenticated_routes()
    if args.soak_minutes > 0:
        figures |= run_soak(args.soak_minutes, args.rate, work)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
