"""The PARL task's protocol, critical steps and demonstrations (pure logic, no model)."""

from __future__ import annotations

import random

import pytest

from flywheel.task import arith, parl


def _subagents(correct: bool = True):
    rng = random.Random(0)
    kind = parl.SubagentBehaviour.CORRECT if correct else parl.SubagentBehaviour.MISCOPY

    def run(assignments: list[str]) -> list[arith.Episode]:
        return [parl.run_subagent(a, parl.scripted_subagent(kind, rng)) for a in assignments]

    return run


def test_problem_ids_splits_and_sampling_are_stable() -> None:
    problems = parl.sample_problems("heldout", 50, seed=3)
    assert problems == parl.sample_problems("heldout", 50, seed=3)
    assert len({p.id for p in problems}) == 50
    assert all(p.split == "heldout" and len(p.parts) in parl.PARTS for p in problems)
    p = parl.Problem(((37, 48), (21, 33), (15, 62)))
    assert p.id == "parl-v2:37*48+21*33+15*62"
    assert p.answer == 37 * 48 + 21 * 33 + 15 * 62
    assert parl.problem_from_text("What is 37*48+21*33+15*62?") == p
    with pytest.raises(ValueError):
        parl.sample_problems("test", 1)  # type: ignore[arg-type]


def test_parallel_orchestration_takes_five_critical_steps_for_any_width() -> None:
    rng = random.Random(1)
    for k in parl.PARTS:
        problem = parl.Problem(tuple((10 + i, 20 + i) for i in range(k)))
        episode = parl.run_episode(problem, parl.scripted(problem, parl.Behaviour.PARALLEL, rng), _subagents())
        assert episode.success and episode.parallel
        assert episode.subagents == k
        assert episode.critical_steps == 1 + parl.SUBAGENT_MAX_TURNS + 1 + 1
        assert episode.turns[0].tool_result == " ".join(str(a * b) for a, b in problem.parts)


def test_serial_orchestration_runs_out_of_critical_steps_on_wide_tasks() -> None:
    rng = random.Random(2)
    outcomes = {}
    for k in parl.PARTS:
        problem = parl.Problem(tuple((10 + i, 20 + i) for i in range(k)))
        episode = parl.run_episode(problem, parl.scripted(problem, parl.Behaviour.SEQUENTIAL, rng), _subagents())
        outcomes[k] = (episode.success, episode.critical_steps, episode.finish_reason)
    assert outcomes == {3: (True, 5, "answer"), 4: (True, 6, "answer"), 5: (False, 6, "max_steps")}


def test_a_miscopying_subagent_fails_the_task_and_reports_its_answer() -> None:
    problem = parl.Problem(((37, 48), (21, 33), (15, 62)))
    rng = random.Random(3)
    episode = parl.run_episode(problem, parl.scripted(problem, parl.Behaviour.PARALLEL, rng), _subagents(False))
    assert not episode.success
    assert [int(x) for x in episode.turns[0].tool_result.split()] != [1776, 693, 930]


def test_calculator_and_bad_turns() -> None:
    assert parl.run_calc("1776+693+930") == "3399"
    assert parl.run_calc("37*48") == "1776"
    assert parl.run_calc("12-3").startswith("error:")
    problem = parl.Problem(((37, 48), (21, 33), (15, 62)))
    episode = parl.start_episode(problem)
    parl.advance_episode(episode, "<calc>37*48", _subagents())
    assert episode.turns[0].tool_result.startswith("error: missing")
    parl.advance_episode(episode, "no idea", _subagents())
    assert episode.finish_reason == "no_answer" and not episode.success
    with pytest.raises(ValueError):
        parl.advance_episode(episode, "answer: 1", _subagents())


def test_lockstep_runner_matches_the_per_episode_runner() -> None:
    problems = parl.sample_problems("train", 12, seed=5)
    behaviours = list(parl.Behaviour)
    scripts = {p.id: parl.scripted(p, behaviours[i % len(behaviours)], random.Random(i))
               for i, p in enumerate(problems)}  # fmt: skip
    by_prompt = {p.expression: p for p in problems}

    def orchestrate(chats: list[list[arith.Message]]) -> list[str]:
        return [scripts[by_prompt[c[1]["content"][8:-1]].id](c) for c in chats]

    sub = parl.scripted_subagent(parl.SubagentBehaviour.CORRECT, random.Random(0))
    episodes = parl.run_episodes(problems, orchestrate, lambda chats: [sub(c) for c in chats])
    expected = [(b in (parl.Behaviour.PARALLEL,) or (b is parl.Behaviour.SEQUENTIAL and len(p.parts) < 5))
                for p, b in zip(problems, [behaviours[i % len(behaviours)] for i in range(12)])]  # fmt: skip
    assert [e.success for e in episodes] == expected


def test_demonstrations_teach_both_roles() -> None:
    chats = parl.demonstrations(300, random.Random(0))
    prompts = {c[0]["content"] for c in chats}
    assert prompts == {parl.SYSTEM_PROMPT, parl.SUBAGENT_PROMPT}
    orchestrators = [c for c in chats if c[0]["content"] == parl.SYSTEM_PROMPT]
    split = sum(parl.ASSIGN_OPEN in c[2]["content"] for c in orchestrators) / len(orchestrators)
    assert 0.15 < split < 0.45  # most demonstrations work alone (MIXTURE: 30 % split)
