"""The calculator task's held-out problems (:mod:`flywheel.task.arith`), the default eval suite.

Whole episodes with tool calls, sampled as the fleet samples, by
:func:`flywheel.model.eval.heldout_success`; the cache key is
:func:`flywheel.model.eval.heldout_key` (``arith-v1/heldout/n200/s1234/t1.0/m24``), the
key under which the base model's build-time result is registered too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from flywheel.model.eval import DEFAULT_EVAL_N, DEFAULT_EVAL_SEED, DEFAULT_MAX_NEW_TOKENS, heldout_key, heldout_success
from flywheel.task import arith
from trainer.evals.base import EvalSuite

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class ArithSettings(BaseModel):
    """``trainer.gate.suites.arith``."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(DEFAULT_EVAL_N, ge=1, le=100_000)
    """Held-out problems the eval gate runs (the same ones for candidate and parent)."""
    seed: int = Field(DEFAULT_EVAL_SEED, ge=0)
    """Seed of the gate's problems and sampling."""
    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1, le=4096)
    """Longest turn the gate generates."""
    batch_size: int = Field(200, ge=1, le=100_000)
    """Episodes the gate runs in lock step."""


class ArithSuite(EvalSuite):
    """Held-out success on the calculator task."""

    name: ClassVar[str] = "arith"
    version: ClassVar[str] = arith.TASK_VERSION
    Settings: ClassVar[type[BaseModel]] = ArithSettings

    def key(self, settings: ArithSettings, temperature: float) -> str:
        """E.g. ``arith-v1/heldout/n200/s1234/t1.0/m24``."""
        return heldout_key(settings.n, settings.seed, temperature, settings.max_new_tokens)

    def evaluate(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: ArithSettings, temperature: float
    ) -> dict[str, Any]:
        """Held-out success of a loaded policy (:class:`flywheel.model.eval.EvalResult` as a dict)."""
        result = heldout_success(
            model,
            n=settings.n,
            seed=settings.seed,
            temperature=temperature,
            max_new_tokens=settings.max_new_tokens,
            tokenizer=tokenizer,
            batch_size=settings.batch_size,
        )
        return result.to_dict()
