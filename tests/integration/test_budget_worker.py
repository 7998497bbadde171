"""Token budgets through the real path: the SDK's ``session.budget`` over the Kafka protocol to a real
rewarding worker process, whose rewards and samples land in a real Postgres.

A retrieval session under a ``prune`` budget passes the warn line and the budget, has a search
refused, and prunes back under it: the retrieval reward carries the prune's credit and the
refusal's penalty. A long session under a ``summary`` budget has a tool call refused and then
summarises: the summary's writer gets the "asked" credit on top of its downstream credit, and the
refused completion its penalty, on their own samples.
"""

from __future__ import annotations

import uuid

import pytest
from conftest import rewarding_worker, session_rows

from flywheel.sdk import BudgetExceeded, Flywheel, Session
from rewarding.harness import wait_until

pytestmark = pytest.mark.integration

REWARDING = {
    "feedback_window_s": 2.0,
    "session_timeout_s": 6.0,
    "rescore_delay_s": 0.3,
    "timer_interval_s": 0.1,
    "session_timeout_broker_s": 6,
    "rebalance_timeout_s": 6,
    "scoring": {
        "weights": {"outcome": 1.0, "summary": 1.0},
        "task_weights": {"retrieval": {"outcome": 0.0, "summary": 0.0, "retrieval": 1.0}},
    },
}
TOKENS = {"prompt_token_ids": [1, 2, 3], "completion_token_ids": [7, 8], "logprobs": [-0.5, -0.5]}
"""Token data for a completion, so that it becomes a training sample."""


def words(text: str) -> list[str]:
    """The harness's tokenizer: one token per word."""
    return text.split()


def search(s: Session, call_id: str) -> uuid.UUID | None:
    return s.completion(model="m", policy_version="pv-1", completion_text=f"search {call_id}",
                        tool_calls=[{"id": call_id, "name": "search", "arguments": call_id}])  # fmt: skip


def retrieval_agent(fw: Flywheel) -> tuple[str, list[str]]:
    """A retrieval harness under a prune budget of 100 tokens; returns the session id and the nudges it showed."""
    nudges: list[str] = []
    with fw.session(task="retrieval") as s, s.budget(max_tokens=100, warn_at=0.8, action="prune", tokenizer=words) as b:
        search(s, "s1")
        b.check("search", tool_call_id="s1")
        s.tool_result("s1", "doc " * 85, document_ids=["d1", "d2", "d4"])
        b.add("doc " * 85)  # 85 of 100: near
        nudges.append(b.nudge or "")
        search(s, "s2")
        b.check("search", tool_call_id="s2")  # near is still allowed
        s.tool_result("s2", "doc " * 30, document_ids=["d5"])
        b.add("doc " * 30)  # 115: over
        search(s, "s3")
        with pytest.raises(BudgetExceeded):
            b.check("search", tool_call_id="s3")
        nudges.append(b.nudge or "")
        assert b.allows("prune")
        s.prune(["d2", "d4"], tokens_after=40)  # back under: ok
        assert b.state == "ok"
        s.completion(model="m", policy_version="pv-1", completion_text="final: d1 d5")
        s.outcome("retrieval_returned", 1.0, document_ids=["d1", "d5"])
        s.outcome("retrieval_gold", 3.0, document_ids=["d1", "d2", "d3"])
    return s.session_id, nudges


def summary_agent(fw: Flywheel) -> tuple[str, dict[str, str]]:
    """A long task under a summary budget of 50 tokens; returns the session id and completion ids by role."""
    with fw.session(task="long") as s, s.budget(max_tokens=50, action="summary", tokenizer=words) as b:
        s.completion(model="m", policy_version="pv-1", completion_text="<calc>2+2</calc>",
                     tool_calls=[{"id": "t1", "name": "calc", "arguments": "2+2"}], **TOKENS)  # fmt: skip
        s.tool_result("t1", "4 " * 60)
        b.add("4 " * 60)  # over
        refused = s.completion(model="m", policy_version="pv-1", completion_text="<calc>3+3</calc>",
                               tool_calls=[{"id": "t2", "name": "calc", "arguments": "3+3"}], **TOKENS)  # fmt: skip
        with pytest.raises(BudgetExceeded):
            b.check("calc", tool_call_id="t2")
        writer = s.completion(model="m", policy_version="pv-1", completion_text="summary: 2+2 is 4", **TOKENS)
        s.summary("2+2 is 4", completion_id=writer, tokens_after=b.count("2+2 is 4"))
        assert b.state == "ok"
        s.completion(model="m", policy_version="pv-1", completion_text="answer: 4", **TOKENS)
        s.outcome("task_solved", True)
    return s.session_id, {"refused": str(refused), "writer": str(writer)}


def test_budget_events_reach_the_retrieval_and_summary_rewards(kafka_bootstrap: str, pg_url: str, tmp_path) -> None:
    with rewarding_worker(kafka_bootstrap, pg_url, tmp_path, "bu", REWARDING) as run:
        project = run.project
        with Flywheel(project=project, kafka_bootstrap=kafka_bootstrap, topic_prefix=run.prefix,
                      spool_dir=tmp_path / "spool") as fw:  # fmt: skip
            retrieval, nudges = retrieval_agent(fw)
            long, ids = summary_agent(fw)
            assert fw.flush(30) and fw.stats.invalid == 0
        wait_until(
            lambda: (
                session_rows(pg_url, "rewards", project, retrieval) and session_rows(pg_url, "rewards", project, long)
            ),
            90,
            "both sessions scored",
        )
        tail = run.log_tail()

    assert nudges[0].startswith("Your context holds 85 of 100 tokens (85%): prune")
    assert nudges[1].startswith("Your context is over its budget (115 of 100 tokens)")

    (row,) = session_rows(pg_url, "rewards", project, retrieval)
    terms = row["components"]["retrieval"]["terms"]
    assert terms == {
        "f_beta": pytest.approx(0.34),
        "encountered_recall": pytest.approx(0.2 * 2 / 3),
        "prune_penalty": 0.0,
        "search_turn_penalty": 0.0,
        "budget_prune_credit": pytest.approx(0.05),
        "budget_refusal_penalty": pytest.approx(-0.1),
    }, tail
    metrics = row["components"]["retrieval"]["metrics"]
    assert (metrics["budget_near"], metrics["budget_over"], metrics["budget_refused"]) == (1.0, 1.0, 1.0)
    assert metrics["budget_reductions"] == 1.0
    assert row["reward"] == pytest.approx(0.34 + 0.4 / 3 + 0.05 - 0.1)

    (row,) = session_rows(pg_url, "rewards", project, long)
    assert row["reward"] == pytest.approx(1.0), tail  # the summary's terms go to its completions only
    assert row["components"]["summary"]["metrics"]["budget_refused"] == 1.0
    samples = {str(s["completion_id"]): s for s in session_rows(pg_url, "training_samples", project, long)}
    assert len(samples) == 4
    writer, refused = samples.pop(ids["writer"]), samples.pop(ids["refused"])
    # downstream credit (1 - 0.5, nothing redone after the summary) plus the summary made when asked
    assert writer["components"]["completion"] == {
        "summary.summary_credit": pytest.approx(0.5),
        "summary.budget_asked": pytest.approx(0.1),
    }
    assert writer["reward"] == pytest.approx(1.6)
    assert refused["components"]["completion"] == {"summary.budget_refused": pytest.approx(-0.1)}
    assert refused["reward"] == pytest.approx(0.9)
    assert [s["reward"] for s in samples.values()] == pytest.approx([1.0, 1.0])
