"""The eval gate: a new checkpoint serves only if no eval suite regresses beyond its margin against its parent.

The gate runs the suites listed in ``trainer.gate.run`` (plug-ins of the ``flywheel.eval_suites``
entry-point group, :mod:`trainer.evals`: the built-in ``arith``, held-out problems of the
calculator task, and ``replay``, held-out production sessions re-run and scored by their
verifiable outcomes), every one through the gate's inference engine (:mod:`trainer.engine`, a
vLLM replica that loads each policy as serving would). Each suite is prepared once (its
problems or session slice fixed, its cache key computed) and evaluated on the parent and on the
candidate. A suite passes when

    candidate_success >= parent_success - margin

with its own margin (``trainer.gate.suites.<name>.margin``, else ``trainer.gate.margin``), or
when it measured nothing (``n == 0``). The candidate passes only when every suite passes; the
reason names the failing suites first, each with its numbers. A parent's result is cached in
its registry row (``checkpoints.eval``) under the suite's key, so each policy is evaluated once
per evaluation setup. Results and the decision are the core's
:class:`~flywheel.core.contracts.checkpoint.HeldoutResult`,
:class:`~flywheel.core.contracts.checkpoint.SuiteVerdict` and
:class:`~flywheel.core.contracts.checkpoint.GateRecord`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from flywheel.core import plugins
from flywheel.core.contracts.checkpoint import GateRecord, HeldoutResult, SuiteVerdict
from flywheel.core.settings import Settings
from flywheel.core.settings.trainer import TrainerSettings
from trainer.engine import Sampling
from trainer.evals.base import EvalContext, EvalSuite, Prepared

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from trainer.engine import ServedPolicy

GROUP = "flywheel.eval_suites"
MARGIN_KEY = "margin"
"""The key of a suite's section that sets its margin (the gate's, not passed to the suite)."""

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class GateSuite:
    """One suite the gate runs: the plug-in, its validated settings and its margin."""

    name: str
    suite: EvalSuite
    settings: BaseModel
    margin: float


@dataclass(frozen=True)
class PreparedSuite:
    """A suite with its evaluation fixed for one gate decision."""

    gate_suite: GateSuite
    prepared: Prepared

    @property
    def name(self) -> str:
        return self.gate_suite.name

    @property
    def key(self) -> str:
        return self.prepared.key


def suite_class(name: str) -> type[EvalSuite]:
    """The eval suite registered as ``name`` (:class:`~flywheel.core.plugins.PluginError` otherwise)."""
    cls = plugins.load(GROUP, name)
    if not (isinstance(cls, type) and issubclass(cls, EvalSuite)):
        raise plugins.PluginError(f"plug-in {name!r} of {GROUP!r} is not an EvalSuite: {cls!r}")
    return cls


def suite_settings(t: TrainerSettings, name: str, model: type[M]) -> M:
    """``trainer.gate.suites.<name>`` (without its ``margin``) validated by the suite's settings ``model``."""
    raw = {k: v for k, v in (t.gate.suites.get(name) or {}).items() if k != MARGIN_KEY}
    return plugins.plugin_settings(model, raw, f"trainer.gate.suites.{name}")


def suite_margin(t: TrainerSettings, name: str) -> float:
    """The suite's margin: its section's ``margin``, else ``trainer.gate.margin``."""
    raw = (t.gate.suites.get(name) or {}).get(MARGIN_KEY)
    if raw is None:
        return t.gate.margin
    try:
        margin = float(raw)
    except (TypeError, ValueError) as err:
        raise plugins.PluginError(f"trainer.gate.suites.{name}.margin: not a number: {raw!r}") from err
    if not 0.0 <= margin <= 1.0:
        raise plugins.PluginError(f"trainer.gate.suites.{name}.margin: {margin} is outside 0..1")
    return margin


def suites_of(t: TrainerSettings) -> list[GateSuite]:
    """Every suite ``trainer.gate.run`` lists, loaded, with its settings and margin, in order.

    Raises :class:`~flywheel.core.plugins.PluginError` for an unknown suite or invalid settings
    (naming the suite), and for a settings section of a suite the gate does not run (a typo).
    """
    strays = sorted(set(t.gate.suites) - set(t.gate.run))
    if strays:
        raise plugins.PluginError(
            f"trainer.gate.suites has sections {strays} of suites that trainer.gate.run {t.gate.run} does not run"
        )
    out = []
    for name in t.gate.run:
        cls = suite_class(name)
        out.append(GateSuite(name, cls(), suite_settings(t, name, cls.Settings), suite_margin(t, name)))
    return out


def context_of(settings: Settings, session: Session | None = None, engine_kind: str = "vllm") -> EvalContext:
    """The suites' context: the settings, serving's sampling temperature, the database session."""
    sampling = Sampling(temperature=settings.trainer.step.sampling_temperature)
    return EvalContext(settings=settings, sampling=sampling, engine_kind=engine_kind, session=session)


def prepare(settings: Settings, context: EvalContext) -> list[PreparedSuite]:
    """Prepare every suite the gate runs (fix their problems and keys)."""
    return [PreparedSuite(s, s.suite.prepare(s.settings, context)) for s in suites_of(settings.trainer)]


def evaluate(policy: ServedPolicy, prepared: PreparedSuite, context: EvalContext) -> HeldoutResult:
    """One suite's evaluation of a served policy."""
    result = prepared.gate_suite.suite.evaluate(policy, prepared.prepared, context)
    return HeldoutResult.model_validate(result)


def evaluate_all(
    policy: ServedPolicy,
    prepared: Sequence[PreparedSuite],
    context: EvalContext,
    on_result: Callable[[PreparedSuite, HeldoutResult], None] | None = None,
) -> dict[str, HeldoutResult]:
    """Every prepared suite's evaluation of one served policy, by suite name (``on_result`` after each)."""
    results: dict[str, HeldoutResult] = {}
    for p in prepared:
        results[p.name] = evaluate(policy, p, context)
        if on_result is not None:
            on_result(p, results[p.name])
    return results


def verdict(
    name: str,
    key: str,
    candidate: HeldoutResult | Mapping[str, Any],
    parent: HeldoutResult | Mapping[str, Any],
    margin: float,
) -> SuiteVerdict:
    """One suite's verdict from two evaluations."""
    candidate, parent = HeldoutResult.model_validate(candidate), HeldoutResult.model_validate(parent)
    cand, par = float(candidate.success_rate), float(parent.success_rate)
    note = None
    if candidate.n == 0 or parent.n == 0:
        passed, note = True, "nothing measured (n=0)"
    else:
        passed = cand >= par - margin
    return SuiteVerdict(
        suite=name,
        key=key,
        candidate=candidate,
        parent=parent,
        delta=cand - par,
        margin=margin,
        passed=passed,
        **({"note": note} if note else {}),
    )


def describe(v: SuiteVerdict) -> str:
    """A verdict in words, e.g. ``arith 0.420 vs parent 0.400 (delta +0.020, margin 0.050, n=200)``."""
    if v.note:
        return f"{v.suite} {v.note}"
    return (
        f"{v.suite} {v.candidate.success_rate:.3f} vs parent {v.parent.success_rate:.3f} "
        f"(delta {v.delta:+.3f}, margin {v.margin:.3f}, n={v.candidate.n})"
    )


def decide(verdicts: Sequence[SuiteVerdict]) -> GateRecord:
    """Pass or reject from every suite's verdict (nothing is evaluated here): pass only if none regressed."""
    if not verdicts:
        raise ValueError("the gate decides from at least one suite's verdict")
    failing = [v for v in verdicts if not v.passed]
    passing = [v for v in verdicts if v.passed]
    if failing:
        reason = "regressed on " + "; ".join(describe(v) for v in failing)
        if passing:
            reason += "; passed " + "; ".join(describe(v) for v in passing)
    else:
        reason = "passed: " + "; ".join(describe(v) for v in verdicts)
    first = verdicts[0]
    return GateRecord(
        passed=not failing,
        reason=reason,
        candidate=first.candidate,
        parent=first.parent,
        margin=first.margin,
        delta=first.delta,
        key=first.key,
        suites=list(verdicts),
    )


def decide_suites(
    prepared: Sequence[PreparedSuite],
    candidate: Mapping[str, HeldoutResult],
    parent: Mapping[str, HeldoutResult],
) -> GateRecord:
    """The gate's decision over prepared suites, from each suite's candidate and parent results."""
    return decide([verdict(p.name, p.key, candidate[p.name], parent[p.name], p.gate_suite.margin) for p in prepared])
