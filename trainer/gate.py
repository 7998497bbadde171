"""The eval gate: a new checkpoint serves only if it does not regress against its parent.

Both policies run the same held-out evaluation with the same settings: the eval suite
named by ``trainer.gate.suite``, a plug-in of the ``flywheel.eval_suites`` entry-point
group (:mod:`trainer.evals`; the default ``arith`` runs held-out problems of the calculator
task, whole episodes with tool calls, sampled as the fleet samples). The candidate passes
when

    candidate_success >= parent_success - margin

and is otherwise ``rejected`` with both numbers in the reason. A parent's result is
cached in its registry row (``checkpoints.eval``) under :func:`eval_key`, so each
policy is evaluated once per gate configuration. Results and the decision are the core's
:class:`~flywheel.core.contracts.checkpoint.HeldoutResult` and
:class:`~flywheel.core.contracts.checkpoint.GateRecord`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from flywheel.core import plugins
from flywheel.core.contracts.checkpoint import GateRecord, HeldoutResult
from flywheel.core.settings.trainer import TrainerSettings
from trainer.evals.base import EvalSuite

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

GROUP = "flywheel.eval_suites"


def suite_of(t: TrainerSettings) -> tuple[EvalSuite, BaseModel]:
    """The gate's eval suite and its settings (``trainer.gate.suites.<name>``, validated by the suite's model).

    Raises :class:`flywheel.core.plugins.PluginError` for an unknown suite or invalid settings.
    """
    name = t.gate.suite
    suite_class = plugins.load(GROUP, name)
    if not (isinstance(suite_class, type) and issubclass(suite_class, EvalSuite)):
        raise plugins.PluginError(f"plug-in {name!r} of {GROUP!r} is not an EvalSuite: {suite_class!r}")
    settings = plugins.plugin_settings(suite_class.Settings, t.gate.suites.get(name), f"trainer.gate.suites.{name}")
    return suite_class(), settings


def eval_key(t: TrainerSettings) -> str:
    """Cache key of one evaluation setup, e.g. ``arith-v1/heldout/n200/s1234/t1.0/m24``."""
    suite, settings = suite_of(t)
    return suite.key(settings, t.step.sampling_temperature)


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, t: TrainerSettings) -> HeldoutResult:
    """The gate's evaluation of a loaded policy under ``t``."""
    suite, settings = suite_of(t)
    return HeldoutResult.model_validate(suite.evaluate(model, tokenizer, settings, t.step.sampling_temperature))


def decide(
    candidate: HeldoutResult | Mapping[str, Any], parent: HeldoutResult | Mapping[str, Any], t: TrainerSettings
) -> GateRecord:
    """Pass or reject from two evaluations (nothing is evaluated here)."""
    candidate, parent = HeldoutResult.model_validate(candidate), HeldoutResult.model_validate(parent)
    margin = t.gate.margin
    cand, par = float(candidate.success_rate), float(parent.success_rate)
    delta = cand - par
    passed = cand >= par - margin
    verdict = "passed" if passed else "regressed"
    reason = (
        f"{verdict}: held-out success {cand:.3f} vs parent {par:.3f} "
        f"(delta {delta:+.3f}, margin {margin:.3f}, n={candidate.n})"
    )
    return GateRecord(
        passed=passed,
        reason=reason,
        candidate=candidate,
        parent=parent,
        margin=margin,
        delta=delta,
        key=eval_key(t),
    )
