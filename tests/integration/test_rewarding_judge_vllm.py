"""The GRM extractor against the project's real vLLM server (the plumbing, not the tiny model's taste).

The base model is a calculator agent, so asked to grade it answers garbage: without
constrained decoding that must be a recorded failure (and the reward must leave the GRM
out, not count it as zero); with vLLM's structured outputs the answer has the rubric's
format and parses. Also: the content-hash cache, the concurrency limit and timeouts.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from flywheel.core.db import migrate
from flywheel.core.db.engine import get_engine
from flywheel.core.settings import RewardingSettings
from rewarding.scorer import Scorer
from rewarding.session_state import Session
from rewarding.store import RewardStore
from rewarding.synthetic import SessionBuilder

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

RUBRICS = [
    {"name": "correct", "prompt": "Grade it.\n{transcript}\nSCORE 1-5:", "pattern": r"SCORE: ([1-5])"},
    {"name": "concise", "prompt": "Is it short?\n{transcript}\nSCORE 1-5:", "pattern": r"SCORE: ([1-5])"},
]


def settings(replica, **grm) -> RewardingSettings:
    judge = {
        "enabled": True,
        "base_url": replica.url,
        "model": replica.model,
        "rubrics": RUBRICS,
        "max_transcript_chars": 80,
        "max_tokens": 8,
        "timeout_s": 60.0,
        **grm,
    }
    return RewardingSettings.model_validate({"scoring": {"extractors": {"grm": judge}}})


def session(question: str = "What is 12+30?", answer: str = "answer: 42") -> Session:
    b = SessionBuilder(project="rw-grm", at=datetime.now(UTC) - timedelta(minutes=1))
    b.start(task="arith")
    b.completion(answer, prompt=[{"role": "user", "content": question}])
    b.outcome("task_solved", True)
    b.end()
    return Session.from_events(b.project, b.session_id, b.events)


def no_stack() -> str:
    raise AssertionError("the judge URL comes from the settings")


def test_judge_answering_garbage_is_a_recorded_failure_not_a_zero(vllm_replica, pg_url) -> None:
    scorer = Scorer.from_settings(settings(vllm_replica, structured_output=False), no_stack)
    view = session()

    async def go():
        try:
            return await scorer.score(view)
        finally:
            await scorer.aclose()

    scored = asyncio.run(go())
    grm = scored.components["grm"]
    assert grm["value"] is None and grm["weighted"] is None
    assert len(grm["failures"]) == 2 and all(": unparsable: " in f for f in grm["failures"]), grm
    assert set(grm["details"]["answers"]) == {"correct", "concise"}
    assert scored.reward == pytest.approx(1.0)  # the outcome alone: the failed judge is left out
    assert scored.components["_meta"]["stats"]["grm_scored"] == 0.0

    migrate.upgrade(pg_url)
    (result,) = RewardStore(pg_url).write([(scored, "finalized")], "stream")
    with get_engine(pg_url).connect() as conn:
        query = text("SELECT components FROM rewards WHERE id = :i")
        stored = conn.execute(query, {"i": result.reward_id}).scalar_one()
    assert stored["grm"]["failures"] == grm["failures"]


def test_constrained_judge_parses_caches_and_bounds_concurrency(vllm_replica) -> None:
    scorer = Scorer.from_settings(settings(vllm_replica, structured_output=True, concurrency=2), no_stack)
    client = scorer.extractors["grm"].client
    views = [session(f"What is {a}+{a}?", f"answer: {2 * a}") for a in range(11, 17)]

    async def go():
        try:
            first = await asyncio.gather(*(scorer.score(v) for v in views))
            calls = client.calls
            again = await scorer.score(views[0])
            return first, calls, again
        finally:
            await scorer.aclose()

    first, calls, again = asyncio.run(go())
    for scored in first:
        grm = scored.components["grm"]
        assert grm.get("failures") is None, grm
        assert set(grm["terms"]) == {"correct", "concise"} and 0.0 <= grm["value"] <= 1.0
        assert grm["metrics"]["disagreement"] in (0.0, 1.0)
        assert scored.reward == pytest.approx(1.0 + 0.5 * grm["value"])
    assert calls == 2 * len(views)
    assert client.calls == calls  # the repeat was answered from the content-hash cache
    assert again.components["grm"] == first[0].components["grm"]


def test_judge_timeout_is_a_recorded_retryable_failure(vllm_replica) -> None:
    scorer = Scorer.from_settings(
        settings(vllm_replica, structured_output=False, timeout_s=0.001, retries=1, retry_backoff_s=0.01), no_stack
    )

    async def go():
        try:
            return await scorer.score(session(f"What is {uuid.uuid4().int % 50}+1?"))
        finally:
            await scorer.aclose()

    grm = asyncio.run(go()).components["grm"]
    assert grm["value"] is None
    assert all("judge unavailable" in f and "after 2 attempts" in f for f in grm["failures"]), grm
