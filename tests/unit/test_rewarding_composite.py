"""Composite reward, config hash, samples and the store's write decision."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from flywheel.core.contracts.events import ToolCall
from flywheel.core.settings import RewardingSettings, ScoringSettings
from rewarding.composite import combine, config_hash, effective_weights
from rewarding.extractors import ExtractorError, build_extractors
from rewarding.extractors.base import Components
from rewarding.samples import build_samples, group_key
from rewarding.scorer import Scorer
from rewarding.session_state import Session
from rewarding.store import StoredReward, decide, version_reason
from rewarding.synthetic import SessionBuilder

T0 = datetime.now(UTC) - timedelta(hours=1)


def no_judge() -> str:
    raise AssertionError("no judge in unit tests")


def view(b: SessionBuilder) -> Session:
    return Session.from_events(b.project, b.session_id, b.events)


def test_weighted_sum_leaves_out_missing_values_and_adds_per_completion_terms() -> None:
    results = {
        "outcome": Components(value=1.0, terms={"task_solved": 1.0}),
        "user_signal": Components(value=-1.0, terms={"revert": -1.0}),
        "grm": Components(value=None, failures=("r: unparsable",)),
        "summary": Components(value=None, per_completion={"c1": {"summary_credit": 0.25}}),
    }
    weights = {"outcome": 1.0, "user_signal": 0.5, "grm": 0.5, "summary": 2.0}
    out = combine(results, weights)
    assert out.reward == pytest.approx(0.5)
    assert out.components["grm"]["weighted"] is None and out.components["grm"]["failures"] == ["r: unparsable"]
    assert out.components["user_signal"] == {"value": -1.0, "terms": {"revert": -1.0}, "weight": 0.5, "weighted": -0.5}
    assert out.per_completion == {"c1": 0.5} and out.per_completion_terms == {"c1": {"summary.summary_credit": 0.5}}


def test_task_weights_override_defaults_and_zero_disables() -> None:
    scoring = ScoringSettings(task_weights={"parl": {"outcome": 0.0, "parl": 1.0}})
    assert "parl" not in effective_weights(scoring, "arith")
    weights = effective_weights(scoring, "parl")
    assert weights["parl"] == 1.0 and "outcome" not in weights


def test_config_hash_covers_numbers_not_operations() -> None:
    base = ScoringSettings()
    h = config_hash(base, {"outcome": "1"})
    assert len(h) == 64 and h == config_hash(ScoringSettings(), {"outcome": "1"})
    assert h != config_hash(base, {"outcome": "2"})
    assert h != config_hash(base.model_copy(update={"weights": {"outcome": 2.0}}), {"outcome": "1"})
    timeouts = base.model_copy(update={"extractors": {"grm": {"timeout_s": 1.0, "base_url": "http://x"}}})
    assert h == config_hash(timeouts, {"outcome": "1"})


def test_unknown_extractor_or_disabled_judge_is_refused() -> None:
    with pytest.raises(ExtractorError):
        build_extractors(RewardingSettings(scoring={"weights": {"nonsense": 1.0}}), no_judge)
    assert "grm" not in build_extractors(RewardingSettings(), no_judge)  # weighted, but disabled


def test_samples_mask_roles_and_skip_completions_without_tokens() -> None:
    b = SessionBuilder(at=T0)
    b.start(task="t", group_key="problem-7")
    trained = b.completion(role="agent", completion_ids=[5, 6, 7], logprobs=[-1.0, -0.5, -0.1])
    frozen = b.completion(role="critic", completion_ids=[8], logprobs=[-0.2])
    b.completion(role="agent", completion_ids=[], logprobs=[])
    b.completion(role="agent", with_logprobs=False)
    b.outcome("task_solved", True)
    credit = Components(None, per_completion={str(trained.completion_id): {"x": 0.5}})
    results = {"outcome": Components(value=1.0), "summary": credit}
    composite = combine(results, {"outcome": 1.0, "summary": 1.0})
    rows, skipped = build_samples(view(b), composite, ["agent", "orchestrator"])
    assert [r.completion_id for r in rows] == [trained.completion_id, frozen.completion_id]
    assert rows[0].loss_mask == [1, 1, 1] and rows[1].loss_mask == [0]
    assert rows[0].behaviour_logprobs == [-1.0, -0.5, -0.1] and rows[0].prompt_token_ids == [1, 2, 3]
    assert rows[0].reward == 1.5 and rows[1].reward == 1.0
    assert rows[0].group_key == "problem-7" and rows[0].task == "t" and rows[1].agent_role == "critic"
    assert skipped == {"no_completion_token_ids": 1, "no_logprobs": 1}


def test_group_key_falls_back_to_the_prompt() -> None:
    a, b = SessionBuilder(at=T0), SessionBuilder(at=T0)
    a.completion(prompt_ids=[4, 5])
    b.completion(prompt_ids=[4, 5])
    assert group_key(view(a)) == group_key(view(b)) and group_key(view(a)).startswith("prompt:")


def test_scorer_records_components_meta_and_stats() -> None:
    b = SessionBuilder(at=T0)
    b.start(task="arith")
    b.completion("<calc>2+</calc>", tool_calls=[ToolCall(id="c", name="calc")])
    b.tool_result("c", "error: bad", error=True)
    b.completion("Did you mean 2+2?")
    b.outcome("task_solved", False)
    b.feedback("edit", edit_ratio=0.5)
    b.end()
    scorer = Scorer.from_settings(RewardingSettings(), no_judge)
    scored = scorer.score_sync(view(b))
    assert scored.reward == pytest.approx(0.0 + 0.5 * (-0.25))
    assert scored.extractor_versions == {
        "outcome": "1",
        "scores": "1",
        "shaping": "1",
        "summary": "1",
        "user_signal": "1",
    }
    meta = scored.components["_meta"]
    assert meta["n_events"] == 7 and meta["input_hash"] == view(b).input_hash()
    assert meta["stats"] == {
        "completions": 2.0,
        "completion_tokens": 4.0,
        "clarifying": 1.0,
        "tool_results": 1.0,
        "tool_errors": 1.0,
        "edited": 1.0,
        "grm_scored": 0.0,
        "grm_disagree": 0.0,
    }
    assert len(scored.samples) == 2 and scored.config_hash == scorer.config_hash


def _stored(scored, **kw) -> StoredReward:
    meta = {**scored.components["_meta"], **kw}
    components = {**scored.components, "_meta": meta}
    return StoredReward(1, 10, scored.reward, components, scored.extractor_versions, scored.config_hash)


def test_store_decision_rules() -> None:
    b = SessionBuilder(at=T0)
    b.start()
    b.completion()
    b.end()
    scorer = Scorer.from_settings(RewardingSettings(), no_judge)
    first = scorer.score_sync(view(b))
    b.feedback("revert")
    later = scorer.score_sync(view(b))
    assert decide(first, None, "stream") == "write"
    assert decide(first, _stored(first), "stream") == "covered"  # re-finalised after a crash: no new version
    assert decide(later, _stored(first), "stream") == "write"  # late feedback: a new version
    assert decide(first, _stored(later), "stream") == "covered"  # a stale copy never overwrites a newer view
    assert decide(later, _stored(first, event_ids=["someone-else"]), "stream") == "diverged"
    assert decide(first, _stored(first), "recompute") == "unchanged"
    assert decide(first, _stored(first), "recompute", force=True) == "write"
    changed = StoredReward(1, 10, 0.0, first.components, {}, "other-hash")
    assert decide(first, changed, "recompute") == "write"
    assert version_reason("finalized", None, "stream") == "finalized"
    assert version_reason("finalized", _stored(first), "stream") == "late_feedback"
    assert version_reason("finalized", None, "recompute") == "recompute"
