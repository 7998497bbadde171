"""The calculator task's held-out problems (:mod:`flywheel.task.arith`), the demo's eval suite.

Whole episodes with tool calls, run through the gate's engine as the fleet serves them:
:func:`flywheel.task.arith.run_episode` with the engine as its chat backend, one episode per
problem, ``trainer.gate.concurrency`` at a time, and summarized by
:func:`flywheel.model.eval.summarize`. Every request carries a seed derived from the suite's
seed, the problem and the turn, so a parent and its candidate draw the same random numbers.
The cache key is :func:`flywheel.model.eval.heldout_key` plus the engine's kind
(``arith-v1/heldout/n200/s1234/t1.0/m24/vllm``).
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from flywheel.model.eval import DEFAULT_EVAL_N, DEFAULT_EVAL_SEED, DEFAULT_MAX_NEW_TOKENS, heldout_key, summarize
from flywheel.task import arith
from trainer.evals.base import EvalContext, EvalSuite, Prepared

if TYPE_CHECKING:
    from trainer.engine import ServedPolicy


class ArithSettings(BaseModel):
    """``trainer.gate.suites.arith``."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(DEFAULT_EVAL_N, ge=1, le=100_000)
    """Held-out problems the eval gate runs (the same ones for candidate and parent)."""
    seed: int = Field(DEFAULT_EVAL_SEED, ge=0)
    """Seed of the gate's problems and of its requests' sampling seeds."""
    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1, le=4096)
    """Longest turn the gate generates."""


def request_seed(*parts: object) -> int:
    """A sampling seed (31 bits) derived from ``parts``: stable across processes and machines."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class ArithSuite(EvalSuite):
    """Held-out success on the calculator task."""

    name: ClassVar[str] = "arith"
    version: ClassVar[str] = arith.TASK_VERSION
    Settings: ClassVar[type[BaseModel]] = ArithSettings

    def prepare(self, settings: ArithSettings, context: EvalContext) -> Prepared:
        """The held-out problems of ``settings.seed``; key e.g. ``arith-v1/heldout/n200/s1234/t1.0/m24/vllm``."""
        base = heldout_key(settings.n, settings.seed, context.sampling.temperature, settings.max_new_tokens)
        problems = arith.sample_problems("heldout", settings.n, settings.seed)
        return Prepared(key=f"{base}/{context.engine_kind}", items=problems, settings=settings)

    def evaluate(self, policy: ServedPolicy, prepared: Prepared, context: EvalContext) -> dict[str, Any]:
        """Held-out success of a served policy (:class:`flywheel.model.eval.EvalResult` as a dict)."""
        settings: ArithSettings = prepared.settings
        started = time.perf_counter()
        sampling = context.sampling
        base = type(sampling)(sampling.temperature, settings.max_new_tokens, sampling.top_p, sampling.top_k)

        def episode(problem: arith.Problem) -> arith.Episode:
            turns = 0

            def generate(messages: list[arith.Message]) -> str:
                nonlocal turns
                turns += 1
                return policy.chat(messages, base.with_seed(request_seed(settings.seed, problem.id, turns)))

            return arith.run_episode(problem, generate)

        episodes = policy.map(episode, prepared.items)
        result = summarize(episodes, "heldout", settings.seed, sampling.temperature, settings.max_new_tokens)
        result.seconds = round(time.perf_counter() - started, 3)
        return result.to_dict() | {"engine": policy.engine_kind}
