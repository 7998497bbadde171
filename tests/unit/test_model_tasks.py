"""The builder's task registry (``model.task``) and the PARL eval suite's scoring, without a model."""

from __future__ import annotations

import random

import pytest

from flywheel.core.settings import ModelSettings
from flywheel.model.build import build_key
from flywheel.model.tasks import TASKS, build_task
from flywheel.task import arith, parl
from trainer.engine import Sampling
from trainer.evals.base import EvalContext
from trainer.evals.parl import ParlSuite, ParlSuiteSettings


def test_each_task_has_its_own_build_key_and_unknown_tasks_are_named() -> None:
    keys = {name: build_key(ModelSettings(task=name)) for name in TASKS}
    assert len(set(keys.values())) == len(TASKS)
    assert build_key(ModelSettings()) == keys["arith"]
    with pytest.raises(ValueError, match="unknown model.task 'nope'; known: arith, parl"):
        build_task("nope")


def test_demonstrations_fit_the_task_context() -> None:
    from flywheel.model.build import tokenize_corpus
    from flywheel.model.tokenizer import train_tokenizer

    for task in TASKS.values():
        chats = task.demonstrations(400, random.Random(0))
        tokenizer = train_tokenizer((m["content"] for c in chats for m in c), 512)
        corpus = tokenize_corpus(tokenizer, chats, task.max_positions)  # raises beyond max_positions
        longest_turn = max(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
                           for c in chats for m in c if m["role"] == "assistant")  # fmt: skip
        assert longest_turn < task.max_new_tokens, task.name
        assert len(corpus.ids) == 400


class _ScriptedPolicy:
    """Plays the scripted parallel orchestrator and correct sub-agents through ``chat``."""

    engine_kind = "scripted"

    def __init__(self) -> None:
        self.sub = parl.scripted_subagent(parl.SubagentBehaviour.CORRECT, random.Random(0))

    def chat(self, messages: list[arith.Message], sampling: Sampling) -> str:
        if messages[0]["content"] == parl.SUBAGENT_PROMPT:
            assert sampling.temperature == 0.0  # frozen sub-agents decode greedily
            return self.sub(messages)
        problem = parl.problem_from_text(messages[1]["content"])
        assert problem is not None
        return parl.scripted(problem, parl.Behaviour.PARALLEL, random.Random(0))(messages)

    def map(self, fn, items):  # noqa: ANN001, ANN201
        return [fn(i) for i in items]


def test_parl_suite_reports_success_and_critical_steps() -> None:
    from flywheel.core.settings import Settings

    suite = ParlSuite()
    context = EvalContext(settings=Settings(), sampling=Sampling(temperature=1.0), engine_kind="scripted")
    prepared = suite.prepare(ParlSuiteSettings(n=20), context)
    assert prepared.key == "parl-v2/heldout/n20/s1234/t1.0/m64/sub-t0.0/scripted"
    result = suite.evaluate(_ScriptedPolicy(), prepared, context)  # type: ignore[arg-type]
    assert result["success_rate"] == 1.0 and result["n"] == 20
    assert result["metrics"]["critical_steps"] == 5.0
    assert result["metrics"]["parallel_rate"] == 1.0
    assert result["subagent_success"] == 1.0
