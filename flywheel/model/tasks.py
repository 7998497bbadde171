"""What the base-model builder needs of each synthetic task (``model.task``).

A task brings its demonstrations (a mixture of behaviours on TRAIN problems), the context it
needs (``max_positions``), the longest turn it generates and a held-out evaluation with
transformers for the build's calibration and sidecar. ``arith`` is the calculator agent of
the demo (docs/task.md); ``parl`` the orchestrator with frozen sub-agents
(docs/scenarios.md).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flywheel.task import arith, parl

if TYPE_CHECKING:
    from flywheel.model.eval import EvalResult

Message = dict[str, str]


@dataclass(frozen=True)
class BuildTask:
    """One task the builder can pre-train a base model on."""

    name: str
    version: str
    mixture: dict[str, float]
    """Share of each demonstration behaviour (recorded in the sidecar)."""
    demonstrations: Callable[[int, random.Random], list[list[Message]]]
    max_positions: int
    max_new_tokens: int
    """Longest turn the model generates (its ``generation_config.max_new_tokens``)."""
    evaluate: Callable[..., EvalResult]
    """``evaluate(model, tokenizer, n=, seed=, temperature=)``: held-out success with transformers."""


def _arith_demonstrations(n: int, rng: random.Random) -> list[list[Message]]:
    from flywheel.model.build import MIXTURE

    pool = arith.all_problems("train")
    behaviours = list(MIXTURE)
    weights = [MIXTURE[b] for b in behaviours]
    chats = []
    for _ in range(n):
        problem = pool[rng.randrange(len(pool))]
        behaviour = rng.choices(behaviours, weights)[0]
        chats.append(arith.demonstration(problem, behaviour, rng))
    return chats


def _arith_evaluate(model: Any, tokenizer: Any, *, n: int, seed: int, temperature: float) -> EvalResult:
    from flywheel.model.eval import heldout_success

    return heldout_success(model, n=n, seed=seed, temperature=temperature, tokenizer=tokenizer)


PARL_MAX_NEW_TOKENS = 64
"""Five ``<assign>a*b</assign>`` calls in one turn, with room to spare."""
PARL_SUBAGENT_MAX_NEW_TOKENS = 24
PARL_SUBAGENT_TEMPERATURE = 0.0
"""The frozen sub-agents decode greedily (their sampling is the product's choice: they are never trained)."""


def parl_summary(episodes: list[parl.Episode], seed: int, temperature: float, max_new_tokens: int) -> EvalResult:
    """An :class:`EvalResult` of orchestrator episodes, with PARL's own figures in ``metrics``."""
    from flywheel.model.eval import EvalResult

    n = len(episodes)
    kinds = Counter(e.problem.kind for e in episodes)
    wins = Counter(e.problem.kind for e in episodes if e.success)
    spawned = [e for e in episodes if e.subagents]
    return EvalResult(
        success_rate=sum(e.success for e in episodes) / n if n else 0.0,
        n=n,
        successes=sum(e.success for e in episodes),
        split="heldout",
        seed=seed,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        by_kind={k: wins[k] / kinds[k] for k in sorted(kinds)},
        finish_reasons=dict(Counter(e.finish_reason for e in episodes)),
        tool_call_rate=len(spawned) / n if n else 0.0,
        metrics={
            "critical_steps": round(sum(e.critical_steps for e in episodes) / n, 4) if n else 0.0,
            "parallel_rate": round(sum(e.parallel for e in episodes) / n, 4) if n else 0.0,
            "subagents_per_episode": round(sum(e.subagents for e in episodes) / n, 4) if n else 0.0,
        },
    )


def _parl_evaluate(model: Any, tokenizer: Any, *, n: int, seed: int, temperature: float) -> EvalResult:
    import torch

    from flywheel.model.eval import make_generate_batch

    started = time.perf_counter()
    problems = parl.sample_problems("heldout", n, seed)
    orchestrate = make_generate_batch(model, tokenizer, temperature, PARL_MAX_NEW_TOKENS)
    subagents = make_generate_batch(model, tokenizer, PARL_SUBAGENT_TEMPERATURE, PARL_SUBAGENT_MAX_NEW_TOKENS)
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            episodes: list[parl.Episode] = []
            for start in range(0, len(problems), 100):
                episodes += parl.run_episodes(problems[start : start + 100], orchestrate, subagents)
    finally:
        model.train(was_training)
    result = parl_summary(episodes, seed, temperature, PARL_MAX_NEW_TOKENS)
    result.seconds = round(time.perf_counter() - started, 3)
    return result


TASKS: dict[str, BuildTask] = {
    "arith": BuildTask("arith", arith.TASK_VERSION, {}, _arith_demonstrations, 256, 32, _arith_evaluate),
    "parl": BuildTask(
        "parl", parl.TASK_VERSION, {b.value: w for b, w in parl.MIXTURE.items()}, parl.demonstrations, 384,
        PARL_MAX_NEW_TOKENS, _parl_evaluate,
    ),
}  # fmt: skip


def build_task(name: str) -> BuildTask:
    """The task ``name`` (``model.task``); ValueError naming the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown model.task {name!r}; known: {', '.join(TASKS)}") from None
