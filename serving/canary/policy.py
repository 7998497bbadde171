"""The canary decision at one look: hold, step up, promote or roll back (pure logic).

Inputs are the per-arm sufficient statistics of the primary metric and of every guard
metric since the canary deployment started (:class:`Observations`), the canary's current
traffic weight and :class:`~flywheel.core.settings.CanarySettings`. The rule, in order:

1. **Guards.** Each guard metric (higher is worse: failed sessions, sessions slower than
   stable's p95, the reward-hacking detectors) has its own confidence sequence at level
   ``guard_alpha``. A guard *trips* when the lower bound of ``canary - stable`` is above
   the guard's margin: the canary is significantly worse by more than the margin. A
   tripped guard rolls back at once, at any look and any step.
2. **Regression.** The primary metric's always-valid interval for ``canary - stable`` at
   level ``alpha`` (:mod:`serving.canary.stats`); its upper bound below
   ``-regression_margin`` rolls back at once, at any look and any step.
3. **Step up / promote.** The *test steps* are the configured weights below 1.0; a final
   step of 1.0 is the promotion itself (a canary at 100 % would leave no concurrent stable
   traffic to compare with). At a test step, once ``min_samples_per_step`` canary sessions
   were scored since the step began, the canary steps up to the next weight when it is
   non-inferior at the step margin (``lower > -step_margin``), and at the last test step it
   is promoted when non-inferior at ``non_inferiority_margin``. Intermediate steps bound
   the blast radius (a canary must not be clearly worse before it gets more traffic); only
   promotion needs the tight margin.
4. **Maximum duration.** Past ``max_duration_s`` since the deployment (or past
   ``max_canary_sessions`` scored canary sessions), a canary already non-inferior at the
   promotion margin is promoted, any other is rolled back (``inconclusive at max duration``).
5. Otherwise **hold**.

Error guarantees (all looks, all steps together, each arm stationary):

- A canary worse than stable by ``non_inferiority_margin`` or more is promoted only if the
  primary CS misses: probability at most ``alpha / 2`` (one side of it). Margins below the
  smallest drop that must never ship (5 points) keep ``minus5_false_promotion_rate`` there.
- An equal canary (A/A) is rolled back by the regression rule with probability at most
  ``alpha / 2``; by a guard with probability far below ``guard_alpha / 2`` each (a guard
  needs the bound to clear a positive margin); and by the maximum-duration rule when it
  could not show non-inferiority in time. The last term is the trade-off: the promotion
  margin must sit below the drops that must not ship, and an equal canary needs about
  ``(z * sigma / margin)^2`` canary sessions (a few thousand at a 4-point margin and
  success near 0.5) to show it, so ``max_duration_s`` / ``max_canary_sessions`` must leave
  room for that, or an A/A canary would be "falsely" rolled back at the deadline.
  A shorter deadline trades A/A promotions for speed; a wider margin trades the
  protection against small drops for speed.

The deadline is in wall time, so whether it is long enough depends on traffic. Measured by
``make bench-canary`` with the defaults (success 0.5, 200 seeds per scenario, steps 5 ->
25 -> 50 %, 100 sessions per step, alpha 0.05, margins 0.10 / 0.04, Hoeffding variance):
an A/A canary is promoted after a median of ~4,000 canary (~16,000 scored) sessions, 95 %
of them within ~31,000 scored sessions, so the 24 h default deadline needs at least ~0.36
scored sessions per second (``aa_min_rate_per_s_for_max_duration``) before it starts
rolling back equal canaries; with less traffic raise ``max_duration_s``, or accept the
rollbacks (an operator can promote by hand). A canary 20 points worse is rolled back after
a median of ~130 canary sessions, one 10 points better is promoted after ~340, and none of
200 A/A canaries was rolled back nor any of 200 five-points-worse ones promoted (95 %
upper bound 1.9 % each).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from flywheel.core.settings import CanarySettings
from serving.canary.stats import ArmStats, Comparison, compare

Action = Literal["hold", "step_up", "promote", "rollback"]
WEIGHT_EPS = 1e-9


@dataclass(frozen=True)
class GuardInput:
    """One guard metric (higher is worse) per arm, with its margin and descriptive numbers."""

    canary: ArmStats
    stable: ArmStats
    margin: float
    values: dict[str, Any] = field(default_factory=dict)
    """Extra numbers for the audit log (e.g. both arms' p95 latency)."""


@dataclass(frozen=True)
class Observations:
    """What one look knows: primary metric per arm, guards, sample at the step, time elapsed."""

    canary: ArmStats
    stable: ArmStats
    canary_at_step: int
    """Scored canary sessions since the current step began."""
    elapsed_s: float
    """Seconds since the canary deployment was created."""
    guards: dict[str, GuardInput] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """One look's decision with every number it used (written to the audit log as is)."""

    action: Action
    weight: float
    """The canary's weight at the look."""
    new_weight: float
    """The weight after the action (1.0 on promote, 0.0 on rollback)."""
    reason: str
    step: int
    """Index of the current test step (0-based)."""
    margin: float
    """The non-inferiority margin that applied at this step."""
    primary: dict[str, Any]
    """n per arm, means, estimate, lower/upper bounds and alpha of the primary metric."""
    guards: dict[str, dict[str, Any]]
    """Per guard: n per arm, means, bounds, margin, tripped, and its extra values."""
    canary_at_step: int
    elapsed_s: float
    metric: str

    def to_details(self) -> dict[str, Any]:
        """JSON-ready form for the audit log's ``details``."""
        out = asdict(self)
        out["elapsed_s"] = round(self.elapsed_s, 3)
        return out


def weight_steps(steps: list[float]) -> list[float]:
    """The weights at which the canary is tested: every step below 1.0 (a final 1.0 means promotion)."""
    tested = [w for w in steps if w < 1.0 - WEIGHT_EPS]
    return tested or list(steps)


def step_position(weight: float, steps: list[float]) -> tuple[int, float | None]:
    """(index of the current test step, next weight or None at the last test step)."""
    tested = weight_steps(steps)
    index = 0
    for i, w in enumerate(tested):
        if w <= weight + WEIGHT_EPS:
            index = i
    following = [w for w in tested if w > weight + WEIGHT_EPS]
    return index, (following[0] if following else None)


def _guard(name: str, guard: GuardInput, settings: CanarySettings) -> tuple[bool, dict[str, Any]]:
    cmp = compare(guard.canary, guard.stable, settings.guard_alpha, settings.cs_target_sessions, settings.variance)
    tripped = guard.canary.n > 0 and guard.stable.n > 0 and cmp.worse_by_more_than(guard.margin)
    return tripped, {**cmp.to_json(), "margin": guard.margin, "tripped": tripped, **guard.values}


def decide(obs: Observations, weight: float, settings: CanarySettings) -> Decision:
    """The decision at one look (see the module docstring for the rule)."""
    cmp: Comparison = compare(obs.canary, obs.stable, settings.alpha, settings.cs_target_sessions, settings.variance)
    step, next_weight = step_position(weight, settings.steps)
    last = next_weight is None
    margin = settings.non_inferiority_margin if last else settings.step_margin
    guards: dict[str, dict[str, Any]] = {}
    tripped: list[str] = []
    for name, guard in sorted(obs.guards.items()):
        hit, numbers = _guard(name, guard, settings)
        guards[name] = numbers
        if hit:
            tripped.append(name)

    def made(action: Action, new_weight: float, reason: str) -> Decision:
        return Decision(
            action,
            weight,
            new_weight,
            reason,
            step,
            margin,
            cmp.to_json(),
            guards,
            obs.canary_at_step,
            obs.elapsed_s,
            settings.metric,
        )

    has_data = obs.canary.n > 0 and obs.stable.n > 0
    if tripped:
        details = ", ".join(f"{n} lower bound {guards[n]['lower']:.4f} > margin {guards[n]['margin']}" for n in tripped)
        return made("rollback", 0.0, f"guard tripped: {details}")
    if has_data and cmp.regression(settings.regression_margin):
        return made(
            "rollback",
            0.0,
            f"significant regression: upper bound {cmp.upper:.4f} < -{settings.regression_margin}",
        )
    enough = obs.canary_at_step >= settings.min_samples_per_step
    if has_data and enough and cmp.non_inferior(margin):
        if last:
            return made("promote", 1.0, f"non-inferior at the last step: lower bound {cmp.lower:.4f} > -{margin}")
        return made(
            "step_up",
            float(next_weight),
            f"non-inferior at step {step}: lower bound {cmp.lower:.4f} > -{margin}",
        )
    over_time = obs.elapsed_s >= settings.max_duration_s
    over_sessions = settings.max_canary_sessions is not None and obs.canary.n >= settings.max_canary_sessions
    if over_time or over_sessions:
        limit = (
            f"{obs.elapsed_s:.0f} s >= {settings.max_duration_s:.0f} s"
            if over_time
            else (f"{obs.canary.n} canary sessions >= {settings.max_canary_sessions}")
        )
        final = settings.non_inferiority_margin
        if has_data and cmp.non_inferior(final):
            return made("promote", 1.0, f"max duration ({limit}): non-inferior, lower bound {cmp.lower:.4f} > -{final}")
        return made("rollback", 0.0, f"inconclusive at max duration ({limit}): lower bound {cmp.lower:.4f}")
    if not enough:
        progress = f"{obs.canary_at_step}/{settings.min_samples_per_step}"
        return made("hold", weight, f"collecting: {progress} canary sessions at step {step}")
    return made("hold", weight, f"inconclusive: lower bound {cmp.lower:.4f} <= -{margin}, upper {cmp.upper:.4f}")
