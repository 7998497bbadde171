"""Training-sample contracts: what rewarding builds is what the topic carries and the trainer reads."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from flywheel.core.contracts.events import SamplingParams
from flywheel.core.contracts.samples import ScoredReward, ScoredSample, StoredSample
from flywheel.core.db.models import TrainingSample
from flywheel.core.settings import RewardingSettings
from rewarding.records import scored_record
from rewarding.scorer import Scorer
from rewarding.session_state import Session
from rewarding.store import COPY_SAMPLES
from rewarding.synthetic import SessionBuilder
from trainer.select import SampleError, validate

T0 = datetime(2026, 1, 1, tzinfo=UTC)
ROW_IDENTITY = {"id", "project", "session_id", "reward_id", "reward_version", "created_at"}
SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, max_tokens=16)


def no_judge() -> str:
    raise AssertionError("no judge in these tests")


def scored_session():
    b = SessionBuilder(at=T0)
    b.start(task="arith", group_key="problem-7")
    agent = b.completion(role="agent", completion_ids=[5, 6, 7], logprobs=[-1.0, -0.5, -0.1])
    b.events[b.events.index(agent)] = agent.model_copy(update={"sampling": SAMPLING})
    b.completion(role="critic", completion_ids=[8], logprobs=[-0.2])
    b.outcome("task_solved", True)
    b.end()
    session = Session.from_events(b.project, b.session_id, b.events)
    return Scorer.from_settings(RewardingSettings(), no_judge).score_sync(session)


def test_rewarding_samples_are_the_contract_and_survive_the_topic():
    scored = scored_session()
    assert [type(s) for s in scored.samples] == [ScoredSample, ScoredSample]
    for sample in scored.samples:  # built without validation: they validate all the same
        assert ScoredSample.model_validate(sample.model_dump()) == sample
    record = scored_record(scored, reward_id=10, version=1, reason="finalized", at=T0)
    back = ScoredReward.model_validate_json(record.model_dump_json())
    assert back == record and back.samples == scored.samples
    assert back.samples[0].loss_mask == [1, 1, 1] and back.samples[1].loss_mask == [0]
    assert back.samples[0].sampling == SAMPLING and back.samples[1].sampling == SamplingParams()
    assert back.schema_version == 2


def test_a_version_1_record_still_reads_with_nothing_recorded():
    record = scored_record(scored_session(), reward_id=10, version=1, reason="finalized", at=T0)
    old = record.model_dump(mode="json", exclude={"samples": {"__all__": {"sampling"}}}) | {"schema_version": 1}
    back = ScoredReward.model_validate(old)
    assert back.schema_version == 1 and all(s.sampling == SamplingParams() for s in back.samples)
    with pytest.raises(ValidationError, match="schema_version"):
        ScoredReward.model_validate(old | {"schema_version": 3})


def test_the_table_and_the_store_hold_exactly_the_contract_fields():
    columns = {c.name for c in TrainingSample.__table__.columns}
    assert set(StoredSample.model_fields) == columns
    assert set(StoredSample.model_fields) - set(ScoredSample.model_fields) == ROW_IDENTITY
    copied = re.search(r"training_samples \((.*?)\)", COPY_SAMPLES, re.S).group(1)
    assert {c.strip() for c in copied.split(",")} == columns - {"id", "created_at"}


def stored_row(**overrides) -> TrainingSample:
    """A ``training_samples`` row as rewarding writes it today (an ORM object, as the trainer loads it)."""
    fields = {
        "id": 42,
        "project": "demo",
        "session_id": "sess-1",
        "completion_id": uuid.UUID("0190a0b0-0000-7000-8000-000000000001"),
        "reward_id": 7,
        "reward_version": 2,
        "policy_version": "base-0123abcd",
        "group_key": "problem-7",
        "task": "arith",
        "agent_role": "agent",
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [5, 6, 7],
        "loss_mask": [1, 1, 1],
        "behaviour_logprobs": [-1.0, -0.5, -0.1],
        "reward": 1.5,
        "components": {"session_reward": 1.0, "session": {"outcome": 1.0}, "completion": {"x": 0.5}, "span_id": "s"},
        "created_at": T0,
    }
    return TrainingSample(**(fields | overrides))


def test_a_stored_row_parses_for_the_trainer():
    assert StoredSample.from_row(stored_row()).sampling == SamplingParams()  # an ORM object without the column set
    assert StoredSample.from_row(stored_row(sampling={})).sampling == SamplingParams()  # a row from before 0006
    recorded = StoredSample.from_row(stored_row(sampling=SAMPLING.model_dump(mode="json", exclude_defaults=True)))
    assert recorded.sampling == SAMPLING
    sample = StoredSample.from_row(stored_row())
    assert sample.episode == "demo/sess-1" and sample.reward_version == 2 and sample.reward == 1.5
    assert sample.completion_token_ids == [5, 6, 7] and sample.behaviour_logprobs == [-1.0, -0.5, -0.1]
    validate(sample)
    with pytest.raises(SampleError, match="3 completion tokens but 2 mask entries"):
        validate(StoredSample.from_row(stored_row(loss_mask=[1, 1])))
    with pytest.raises(ValidationError, match="reward"):
        StoredSample.from_row(stored_row(reward=None))
