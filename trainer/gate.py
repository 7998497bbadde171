"""The eval gate: a new checkpoint serves only if it does not regress against its parent.

Both policies run the same held-out problems of the calculator task
(:func:`flywheel.model.eval.heldout_success`, whole episodes with tool calls, sampled as
the fleet samples) with the same seed. The candidate passes when

    candidate_success >= parent_success - margin

and is otherwise ``rejected`` with both numbers in the reason. A parent's result is
cached in its registry row (``checkpoints.eval``) under :func:`eval_key`, so each
policy is evaluated once per gate configuration.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from flywheel.model.eval import heldout_key

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class GateConfig:
    """What the gate measures and how much regression it tolerates."""

    n: int = 200
    seed: int = 1234
    margin: float = 0.05
    max_new_tokens: int = 24
    batch_size: int = 200
    temperature: float = 1.0


@dataclass(frozen=True)
class GateDecision:
    """The gate's verdict with both measurements."""

    passed: bool
    reason: str
    candidate: dict[str, Any]
    parent: dict[str, Any]
    margin: float
    delta: float
    key: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record (sidecar, checkpoint row)."""
        return asdict(self)


def eval_key(config: GateConfig) -> str:
    """Cache key of one evaluation setup, e.g. ``arith-v1/heldout/n200/s1234/t1.0/m24``."""
    return heldout_key(config.n, config.seed, config.temperature, config.max_new_tokens)


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: GateConfig) -> dict[str, Any]:
    """Held-out success of a loaded policy under ``config``."""
    from flywheel.model.eval import heldout_success

    result = heldout_success(
        model,
        n=config.n,
        seed=config.seed,
        temperature=config.temperature,
        max_new_tokens=config.max_new_tokens,
        tokenizer=tokenizer,
        batch_size=config.batch_size,
    )
    return result.to_dict()


def decide(candidate: dict[str, Any], parent: dict[str, Any], config: GateConfig) -> GateDecision:
    """Pass or reject from two evaluations (pure)."""
    cand, par = float(candidate["success_rate"]), float(parent["success_rate"])
    delta = cand - par
    passed = cand >= par - config.margin
    verdict = "passed" if passed else "regressed"
    reason = (
        f"{verdict}: held-out success {cand:.3f} vs parent {par:.3f} "
        f"(delta {delta:+.3f}, margin {config.margin:.3f}, n={candidate.get('n')})"
    )
    return GateDecision(passed, reason, candidate, parent, config.margin, delta, eval_key(config))
