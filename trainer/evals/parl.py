"""PARL's held-out problems (:mod:`flywheel.task.parl`): the ``parl`` scenario's eval suite.

Whole orchestrator episodes through the gate's engine: the policy under evaluation plays the
orchestrator, sampled as the fleet serves it, one episode per problem, ``trainer.gate.concurrency``
at a time. Its sub-agents decode greedily, as the scenario's frozen sub-agents do. Simplified
against the live fleet: the gate's engine serves one policy at a time, so the sub-agents run on
the policy under evaluation rather than on the frozen checkpoint. Their tokens are never trained
(their role is not a trainable one), so they drift only as far as shared weights carry them; the
result's ``subagent_success`` shows it. Besides ``success_rate`` the result reports PARL's own
figures: ``metrics.critical_steps`` (mean longest chain), ``metrics.parallel_rate``,
``metrics.subagents_per_episode``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from flywheel.model.eval import DEFAULT_EVAL_N, DEFAULT_EVAL_SEED
from flywheel.model.tasks import (
    PARL_MAX_NEW_TOKENS,
    PARL_SUBAGENT_MAX_NEW_TOKENS,
    PARL_SUBAGENT_TEMPERATURE,
    parl_summary,
)
from flywheel.task import arith, parl
from trainer.evals.arith import request_seed
from trainer.evals.base import EvalContext, EvalSuite, Prepared

if TYPE_CHECKING:
    from trainer.engine import ServedPolicy


class ParlSuiteSettings(BaseModel):
    """``trainer.gate.suites.parl``."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(DEFAULT_EVAL_N, ge=1, le=100_000)
    """Held-out problems (the same for candidate and parent)."""
    seed: int = Field(DEFAULT_EVAL_SEED, ge=0)
    """Seed of the problems and of the requests' sampling seeds."""
    max_new_tokens: int = Field(PARL_MAX_NEW_TOKENS, ge=1, le=4096)
    """Longest orchestrator turn."""


class ParlSuite(EvalSuite):
    """Held-out success and critical steps of the PARL orchestrator."""

    name: ClassVar[str] = "parl"
    version: ClassVar[str] = parl.TASK_VERSION
    Settings: ClassVar[type[BaseModel]] = ParlSuiteSettings

    def prepare(self, settings: ParlSuiteSettings, context: EvalContext) -> Prepared:
        """Key e.g. ``parl-v2/heldout/n200/s1234/t1.0/m64/sub-t0.0/vllm``."""
        key = (f"{parl.TASK_VERSION}/heldout/n{settings.n}/s{settings.seed}/t{context.sampling.temperature}"
               f"/m{settings.max_new_tokens}/sub-t{PARL_SUBAGENT_TEMPERATURE}/{context.engine_kind}")  # fmt: skip
        return Prepared(key=key, items=parl.sample_problems("heldout", settings.n, settings.seed), settings=settings)

    def evaluate(self, policy: ServedPolicy, prepared: Prepared, context: EvalContext) -> dict[str, Any]:
        settings: ParlSuiteSettings = prepared.settings
        started = time.perf_counter()
        sampling = context.sampling
        main = type(sampling)(sampling.temperature, settings.max_new_tokens, sampling.top_p, sampling.top_k)
        sub = type(sampling)(PARL_SUBAGENT_TEMPERATURE, PARL_SUBAGENT_MAX_NEW_TOKENS, sampling.top_p, sampling.top_k)

        def episode(problem: parl.Problem) -> parl.Episode:
            turns = 0

            def generate(messages: list[arith.Message]) -> str:
                nonlocal turns
                turns += 1
                return policy.chat(messages, main.with_seed(request_seed(settings.seed, problem.id, turns)))

            def run_subagents(assignments: list[str]) -> list[arith.Episode]:
                return [parl.run_subagent(a, lambda m: policy.chat(m, sub)) for a in assignments]

            return parl.run_episode(problem, generate, run_subagents)

        episodes = policy.map(episode, prepared.items)
        result = parl_summary(episodes, settings.seed, sampling.temperature, settings.max_new_tokens).to_dict()
        subs = [s for e in episodes for t in e.turns for s in t.subagents]
        result["subagent_success"] = round(sum(s.success for s in subs) / len(subs), 4) if subs else None
        result["seconds"] = round(time.perf_counter() - started, 3)
        return result | {"engine": policy.engine_kind}
