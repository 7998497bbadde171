"""Task verifiers and the shared outcome rule: a replay computes what the product reported, scored like production."""

from __future__ import annotations

import pytest

from flywheel.task import arith, verify
from flywheel.task.outcome import OutcomeRule, OutcomeSettings, outcome_reward
from rewarding.extractors.outcome import OutcomeExtractor, OutcomeExtractorSettings


def solver(right: bool):
    def generate(messages: list[dict[str, str]]) -> str:
        if messages[-1]["role"] == "tool":
            return arith.format_answer(messages[-1]["content"] if right else "-1")
        problem = arith.problem_from_text(messages[-1]["content"])
        return arith.format_tool_call(problem.expression)

    return generate


def test_the_arith_verifier_replays_the_sessions_own_prompt_and_reports_task_solved():
    problem = arith.Problem(37, "*", 48)
    case = verify.ReplayCase("arith:mul", problem.id, arith.render_messages(problem))
    verifier = verify.verifier_for(case.task)
    assert isinstance(verifier, verify.ArithVerifier) and verify.family("arith:mul") == "arith"
    assert verifier.replay(case, solver(True)) == {"task_solved": True}
    assert verifier.replay(case, solver(False)) == {"task_solved": False}
    # the same verdict as the episode the demo's agent reports from
    assert arith.run_episode(problem, solver(True)).success is True


def test_the_prompt_decides_the_problem_and_the_group_key_is_the_fallback():
    asked = arith.Problem(12, "+", 30)
    prompt = arith.render_messages(asked)
    verifier = verify.ArithVerifier()
    assert verifier.problem(verify.ReplayCase("arith", arith.Problem(99, "-", 10).id, prompt)) == asked
    keyed = verify.ReplayCase("arith", asked.id, [{"role": "system", "content": arith.SYSTEM_PROMPT}])
    assert verifier.problem(keyed) == asked
    with pytest.raises(verify.VerifyError, match="names a calculator problem"):
        verifier.problem(verify.ReplayCase("arith", "not-a-problem", [{"role": "user", "content": "hello"}]))


def test_a_task_without_a_verifier_has_none():
    assert verify.verifier_for("code-review") is None and verify.verifier_for(None) is None
    assert "arith" in verify.families()


def test_rewarding_and_the_replay_score_outcomes_with_one_rule():
    assert OutcomeExtractorSettings is OutcomeSettings
    settings = OutcomeSettings(rules={"task_solved": OutcomeRule(true_value=1.0, false_value=-0.5)})
    assert outcome_reward({"task_solved": True}, settings) == 1.0
    assert outcome_reward({"task_solved": False}, settings) == -0.5
    assert outcome_reward({"other": True}, settings) is None
    assert OutcomeExtractor(settings).settings is settings
