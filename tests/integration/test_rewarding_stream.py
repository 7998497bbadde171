"""The rewarding worker against a real broker and a real Postgres: scenarios and recompute.

One worker process (tiny windows) scores every scenario session; each test then checks
the rows it wrote. The recompute tests replay the same events from ``raw_events``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import text

from flywheel.core.contracts.events import ToolCall, dump_event
from flywheel.core.db import migrate
from flywheel.core.db.engine import get_engine
from flywheel.core.settings import DetectorSettings, RewardingSettings
from rewarding.detectors import detector_report
from rewarding.harness import WorkerProcess, free_port, make_producer, produce, settings_env, wait_until
from rewarding.recompute import recompute
from rewarding.records import ScoredReward
from rewarding.scorer import Scorer
from rewarding.synthetic import SessionBuilder

pytestmark = pytest.mark.integration

REWARDING = {
    "feedback_window_s": 1.5,
    "session_timeout_s": 4.0,
    "rescore_delay_s": 0.3,
    "timer_interval_s": 0.1,
    "session_timeout_broker_s": 6,
    "rebalance_timeout_s": 6,
    "scoring": {
        "task_weights": {
            "parl": {"outcome": 0.0, "parl": 1.0},
            "retrieval": {"outcome": 0.0, "retrieval": 1.0},
        }
    },
}


def no_judge() -> str:
    raise AssertionError("these tests run without a judge")


@dataclass
class Scenario:
    """What was produced and where the rows are."""

    db_url: str
    project: str
    prefix: str
    metrics_url: str
    policy: str
    sessions: dict[str, SessionBuilder] = field(default_factory=dict)
    extra: dict[str, object] = field(default_factory=dict)

    def rewards(self, name: str) -> list[dict]:
        with get_engine(self.db_url).connect() as conn:
            rows = conn.execute(
                text("SELECT * FROM rewards WHERE project = :p AND session_id = :s ORDER BY version"),
                {"p": self.project, "s": self.sessions[name].session_id},
            )
            return [dict(r._mapping) for r in rows]

    def samples(self, name: str) -> list[dict]:
        with get_engine(self.db_url).connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT * FROM training_samples WHERE project = :p AND session_id = :s "
                    "ORDER BY reward_version, completion_id"
                ),
                {"p": self.project, "s": self.sessions[name].session_id},
            )
            return [dict(r._mapping) for r in rows]


def parl_session(b: SessionBuilder) -> None:
    b.start(task="parl")
    b.completion("plan", role="orchestrator")
    b.span_start("A")
    b.span_start("B")
    b.completion("a1", span="A", role="subagent")
    b.span_start("A1", parent="A")
    b.completion("x1", span="A1", role="subagent")
    b.completion("x2", span="A1", role="subagent")
    b.span_end("A1")
    b.completion("a2", span="A", role="subagent")
    b.completion("b1", span="B", role="subagent")
    b.span_end("A")
    b.span_end("B", status="failed")
    b.completion("merge", role="orchestrator")
    b.span_start("C")
    b.completion("c1", span="C", role="subagent")
    b.completion("c2", span="C", role="subagent")
    b.span_end("C")
    b.completion("answer", role="orchestrator")
    b.outcome("task_solved", True)
    b.end()


def retrieval_session(b: SessionBuilder) -> None:
    b.start(task="retrieval")
    b.completion("search", tool_calls=[ToolCall(id="s1", name="search", arguments="q1")])
    b.tool_result("s1", "...", documents=["d1", "d2", "d4"])
    b.completion("search", tool_calls=[ToolCall(id="s2", name="search", arguments="q2")])
    b.tool_result("s2", "...", documents=["d5"])
    b.prune(["d2", "d4"])
    b.completion("final")
    b.outcome("retrieval_returned", 1.0, documents=["d1", "d5"])
    b.outcome("retrieval_gold", 3.0, documents=["d1", "d2", "d3"])
    b.end()


def summary_session(b: SessionBuilder) -> str:
    b.start(task="long")
    b.completion("<calc>2+2</calc>", tool_calls=[ToolCall(id="t1", name="calc", arguments="2+2")])
    b.tool_result("t1", "4")
    writer = b.completion("summary: 2+2 is 4")
    b.summary(writer.completion_id, "2+2 is 4")
    b.completion("<calc>2+2</calc>", tool_calls=[ToolCall(id="t2", name="calc", arguments="2+2")])
    b.completion("<calc>3+3</calc>", tool_calls=[ToolCall(id="t3", name="calc", arguments="3+3")])
    b.completion("answer: 10")
    b.outcome("task_solved", True)
    b.end()
    return str(writer.completion_id)


def simple_session(b: SessionBuilder, solved: bool = True) -> None:
    b.start(task="arith", group_key="arith-v1:2+2")
    b.completion("answer: 4")
    b.outcome("task_solved", solved)
    b.end()


def read_scored(bootstrap: str, topic: str, expected: int) -> list[ScoredReward]:
    """Every record on the scored topic (waiting for ``expected`` of them)."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=5000)
    records: list[ScoredReward] = []
    deadline = time.monotonic() + 30
    while len(records) < expected and time.monotonic() < deadline:
        records += [ScoredReward.model_validate_json(m.value) for m in consumer]
    consumer.close()
    return records


@pytest.fixture(scope="module")
def scenario(kafka_bootstrap: str, pg_url: str, tmp_path_factory: pytest.TempPathFactory):
    migrate.upgrade(pg_url)
    tag = uuid.uuid4().hex[:8]
    port = free_port()
    s = Scenario(pg_url, f"rw-{tag}", f"rwt{tag}", f"http://127.0.0.1:{port}/metrics", f"pv-{tag}")
    env = settings_env(
        {
            "run_dir": str(tmp_path_factory.mktemp("rw-run")),
            "kafka": {"bootstrap_servers": kafka_bootstrap, "topic_prefix": s.prefix},
            "postgres": {"url": pg_url},
            "ingest": {"partitions": 2},
            "rewarding": {**REWARDING, "group_id": f"rw-{tag}", "metrics_port": port},
        }
    )
    worker = WorkerProcess(env, tmp_path_factory.mktemp("rw") / "worker.log").start()
    producer = make_producer(kafka_bootstrap)
    topic = f"{s.prefix}.events"
    at = datetime.now(UTC)
    try:
        for name in ("parl", "retrieval", "summary", "accept", "revert", "outcome_only"):
            s.sessions[name] = SessionBuilder(f"{name}-{tag}", project=s.project, at=at, policy_version=s.policy)
        parl_session(s.sessions["parl"])
        retrieval_session(s.sessions["retrieval"])
        s.extra["summary_writer"] = summary_session(s.sessions["summary"])
        simple_session(s.sessions["accept"])
        s.sessions["accept"].feedback("accept")  # inside the feedback window
        simple_session(s.sessions["revert"])
        s.sessions["outcome_only"].outcome("task_solved", True)
        for b in s.sessions.values():
            produce(producer, topic, b.events, flush=False)
        producer.send(topic, key=b"garbage", value=b"{not an event")
        producer.flush()
        wait_until(lambda: len(s.rewards("revert")) == 1, 60, "the revert session's first version")
        s.extra["revert_v1_samples"] = len(s.samples("revert"))
        late = s.sessions["revert"].feedback("revert", at=datetime.now(UTC))
        produce(producer, topic, [late])
        wait_until(lambda: len(s.rewards("revert")) == 2, 60, "the revert session's second version")
        wait_until(lambda: s.rewards("outcome_only"), 60, "the outcome-only session (timeout)")
        wait_until(lambda: all(s.rewards(n) for n in s.sessions), 60, "every session scored")
        s.extra["metrics"] = httpx.get(s.metrics_url, timeout=5).text
        s.extra["scored"] = read_scored(kafka_bootstrap, f"{s.prefix}.rewards.scored", expected=len(s.sessions) + 1)
        s.extra["worker_log"] = worker.log_tail()
        yield s
    finally:
        producer.close()
        worker.stop()


def test_multi_agent_session_scored_with_parl_terms_and_critical_steps(scenario: Scenario) -> None:
    (row,) = scenario.rewards("parl")
    parl = row["components"]["parl"]
    assert parl["terms"] == pytest.approx(
        {"r_perf": 1.0, "r_parallel": 0.1, "r_finish": 0.075, "critical_steps_cost": -0.09}
    )
    assert parl["metrics"]["critical_steps"] == 9 and parl["metrics"]["total_steps"] == 10
    assert "outcome" not in row["components"]  # the task's weights replace the default
    assert row["reward"] == pytest.approx(1.085)
    assert row["extractor_versions"]["parl"] == "1" and len(row["config_hash"]) == 64
    samples = scenario.samples("parl")
    assert len(samples) == 10 and {s["agent_role"] for s in samples} == {"orchestrator", "subagent"}
    # Sub-agent roles are not in the trainable roles: their tokens are masked out.
    assert all(set(s["loss_mask"]) == ({1} if s["agent_role"] == "orchestrator" else {0}) for s in samples)


def test_retrieval_session_scored_by_fbeta_with_a_pruned_relevant_document(scenario: Scenario) -> None:
    (row,) = scenario.rewards("retrieval")
    retrieval = row["components"]["retrieval"]
    assert retrieval["terms"]["f_beta"] == pytest.approx(0.34)
    assert retrieval["terms"]["encountered_recall"] == pytest.approx(0.2 * 2 / 3)
    assert retrieval["metrics"]["pruned_relevant"] == 1
    assert row["reward"] == pytest.approx(0.34 + 0.4 / 3)


def test_summary_receives_the_downstream_credit(scenario: Scenario) -> None:
    (row,) = scenario.rewards("summary")
    assert row["reward"] == pytest.approx(1.0)
    writer = scenario.extra["summary_writer"]
    by_completion = {str(s["completion_id"]): s for s in scenario.samples("summary")}
    assert by_completion[writer]["reward"] == pytest.approx(1.25)
    assert by_completion[writer]["components"]["completion"] == {"summary.summary_credit": pytest.approx(0.25)}
    others = [s["reward"] for cid, s in by_completion.items() if cid != writer]
    assert others == pytest.approx([1.0] * 4)


def test_accept_inside_its_window_is_in_the_only_version(scenario: Scenario) -> None:
    (row,) = scenario.rewards("accept")
    assert row["version"] == 1 and row["reason"] == "finalized"
    assert row["components"]["user_signal"]["terms"] == {"accept": 1.0}
    assert row["reward"] == pytest.approx(1.0 + 0.5)


def test_revert_after_finalisation_makes_a_second_version(scenario: Scenario) -> None:
    v1, v2 = scenario.rewards("revert")
    assert (v1["version"], v1["reason"]) == (1, "finalized")
    assert (v2["version"], v2["reason"]) == (2, "late_feedback")
    assert v1["reward"] == pytest.approx(1.0) and v2["reward"] == pytest.approx(0.5)
    assert v2["components"]["_meta"]["n_events"] == v1["components"]["_meta"]["n_events"] + 1
    samples = scenario.samples("revert")
    assert scenario.extra["revert_v1_samples"] == 1
    assert [(s["reward_version"], s["reward"]) for s in samples] == [(1, pytest.approx(1.0)), (2, pytest.approx(0.5))]


def test_outcome_only_session_is_scored_at_its_timeout(scenario: Scenario) -> None:
    (row,) = scenario.rewards("outcome_only")
    assert row["reason"] == "timeout" and row["reward"] == pytest.approx(1.0)
    assert scenario.samples("outcome_only") == [] and row["policy_version"] is None


def test_invalid_record_is_skipped_and_counted(scenario: Scenario) -> None:
    assert 'flywheel_rewarding_events_total{outcome="invalid"} 1.0' in scenario.extra["metrics"]
    assert "Traceback" not in scenario.extra["worker_log"]


def test_every_version_is_published_on_the_scored_topic(scenario: Scenario) -> None:
    records = scenario.extra["scored"]
    revert = scenario.sessions["revert"].session_id
    versions = sorted((r.reward_version, r.reason, len(r.samples)) for r in records if r.session_id == revert)
    assert versions == [(1, "finalized", 1), (2, "late_feedback", 1)]
    parl = next(r for r in records if r.session_id == scenario.sessions["parl"].session_id)
    assert parl.reward == pytest.approx(1.085) and len(parl.samples) == 10
    assert {r.session_id for r in records} == {b.session_id for b in scenario.sessions.values()}


def test_detectors_report_per_policy_version(scenario: Scenario) -> None:
    since = datetime.now(UTC) - timedelta(hours=1)
    report = detector_report(scenario.db_url, since, DetectorSettings(min_sessions=1))
    (ours,) = [p for p in report.policies if p.policy_version == scenario.policy]
    assert ours.sessions == 5  # the outcome-only session has no completion, so no policy version
    assert ours.metrics() == {
        "tool_error_rate": 0.0,
        "clarifying_rate": 0.0,
        "edit_rate": 0.0,
        "mean_completion_tokens": 2.0,
        "judge_disagreement_rate": None,
    }


def _store_raw_events(scenario: Scenario) -> None:
    """What ingest writes: every event once, payload as received."""
    rows = [
        {
            "event_id": e.event_id,
            "project": e.project,
            "session_id": e.session_id,
            "type": e.type.value,
            "schema_version": e.schema_version,
            "occurred_at": e.occurred_at,
            "payload": dump_event(e).decode(),
        }
        for b in scenario.sessions.values()
        for e in b.events
    ]
    with get_engine(scenario.db_url).begin() as conn:
        conn.execute(
            text(
                "INSERT INTO raw_events (event_id, project, session_id, type, schema_version, occurred_at, payload) "
                "VALUES (:event_id, :project, :session_id, :type, :schema_version, :occurred_at, "
                "CAST(:payload AS jsonb)) ON CONFLICT DO NOTHING"
            ),
            rows,
        )


def test_recompute_reproduces_the_stored_rewards_exactly(scenario: Scenario) -> None:
    _store_raw_events(scenario)
    settings = RewardingSettings.model_validate(REWARDING)
    since = datetime.now(UTC) - timedelta(hours=1)

    async def run(**kw):
        scorer = Scorer.from_settings(settings, no_judge)
        return await recompute(scorer, scenario.db_url, since, project=scenario.project, **kw)

    n = len(scenario.sessions)
    dry = asyncio.run(run(dry_run=True))
    assert (dry.sessions, dry.reproduced, dry.differs, dry.written) == (n, n, [], 0)
    again = asyncio.run(run())
    assert (again.written, again.unchanged) == (0, n)  # same input, same config: no new version
    forced = asyncio.run(run(force=True))
    assert forced.written == n
    v2, v3 = scenario.rewards("revert")[1:]
    assert v3["reason"] == "recompute" and v3["version"] == 3
    assert (v3["reward"], v3["components"], v3["config_hash"]) == (v2["reward"], v2["components"], v2["config_hash"])
    samples = scenario.samples("revert")

    def of(version: int) -> list:
        return [(s["completion_id"], s["reward"], s["loss_mask"]) for s in samples if s["reward_version"] == version]

    old, new = of(2), of(3)
    assert old == new
