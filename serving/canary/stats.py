"""Always-valid confidence sequences for comparing a canary with the stable policy.

The controller looks at the live data every few seconds and may act at any look, so a
fixed-sample test (a t-test repeated at every look) would be wrong: with continuous
monitoring its false-alarm rate goes to one. A *confidence sequence* (CS) is a sequence of
intervals ``C_n`` with ``P(for all n: mu in C_n) >= 1 - alpha``, so every decision taken
at any (data-dependent) look keeps the error guarantee.

One arm: the Robbins normal mixture
-----------------------------------
Observations ``X_1, X_2, ...`` of one arm lie in ``[0, 1]`` (a success indicator, or a
bounded reward rescaled to ``[0, 1]``), i.i.d. with mean ``mu``. By Hoeffding's lemma the
centred sum ``S_n = sum(X_i - mu)`` is sub-Gaussian with variance process
``V_n = n * sigma2``, ``sigma2 = 1/4``, so ``exp(lambda * S_n - lambda^2 V_n / 2)`` is a
non-negative supermartingale for every ``lambda``. Mixing ``lambda ~ N(0, 1/rho)`` gives
the supermartingale ``sqrt(rho / (V_n + rho)) * exp(S_n^2 / (2 (V_n + rho)))`` (Robbins
1970), and Ville's inequality bounds the chance that it ever exceeds ``1/alpha``:

    P(exists n: |S_n| >= sqrt((V_n + rho) * (log((V_n + rho) / rho) + 2 log(1/alpha)))) <= alpha

(Howard, Ramdas, McAuliffe, Sekhon 2021, "Time-uniform, nonparametric, nonasymptotic
confidence sequences", Ann. Statist. 49(2), eq. (14), the two-sided normal mixture). The
CS for ``mu`` is ``mean_n +/- radius_n / n``, valid at every ``n`` simultaneously and
without any assumption beyond boundedness (``variance="bound"``). ``rho`` only moves where
the boundary is tightest: :func:`rho_for` picks the ``rho`` that minimises it at a target
sample size (``CanarySettings.cs_target_sessions``).

``variance="empirical"`` plugs the running sample variance into ``V_n`` instead of the
worst case 1/4. That is the asymptotic confidence sequence of Waudby-Smith, Arbour, Sinha,
Kennedy and Ramdas ("Time-uniform central limit theory and asymptotic confidence
sequences", Ann. Statist. 2024, Thm 2.2): tighter for success rates far from 1/2, but
valid only asymptotically (the variance estimate must have converged).

Two arms: the difference canary - stable
----------------------------------------
Each arm gets its own CS at level ``alpha / 2``; by the union bound, with probability at
least ``1 - alpha`` both cover at every look, and then the difference ``delta = mu_c -
mu_s`` lies in ``[L_c - U_s, U_c - L_s]`` at every look. Per-arm sequences stay valid
however the traffic weight moves (each arm's own observations are i.i.d. whatever share
of sessions it gets), which is why they are used rather than one pooled sequence. They
assume the arms are stationary while the canary runs (a daily traffic-mix cycle that
changes both means alike is not cancelled, because the canary's sample is weighted to the
later, higher-weight steps).

Decisions (for a metric where higher is better; :meth:`Comparison.worse_by_more_than`
is the mirror for guard metrics where higher is worse):

- ``regression``: ``upper < -regression_margin``. An equal canary (A/A) is declared a
  regression only if the CS misses, probability ``<= alpha`` (about ``alpha / 2``: one
  side of each arm's two-sided sequence).
- ``non_inferior``: ``lower > -margin``. A canary worse by ``margin`` or more is declared
  non-inferior only if the CS misses, again ``<= alpha`` over all looks.
- otherwise ``inconclusive``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

Variance = Literal["bound", "empirical"]
Verdict = Literal["regression", "non_inferior", "inconclusive"]

BOUND_VARIANCE = 0.25
"""Hoeffding's sub-Gaussian variance of a [0, 1]-valued observation: ((1 - 0) / 2) ** 2."""
MIN_EMPIRICAL_VARIANCE = 1e-3
"""Floor of the plug-in variance, so a run of identical observations does not collapse the CS."""


@dataclass(frozen=True)
class ArmStats:
    """Sufficient statistics of one arm's observations in [0, 1]: count, sum, sum of squares."""

    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    @classmethod
    def of(cls, values: Iterable[float]) -> ArmStats:
        """Statistics of ``values`` (each must lie in [0, 1])."""
        n, total, total_sq = 0, 0.0, 0.0
        for value in values:
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"observation {value!r} outside [0, 1]: rescale or clip it first")
            n, total, total_sq = n + 1, total + value, total_sq + value * value
        return cls(n, total, total_sq)

    def add(self, value: float) -> ArmStats:
        """These statistics with one more observation."""
        return ArmStats(self.n + 1, self.total + value, self.total_sq + value * value)

    @property
    def mean(self) -> float | None:
        """Sample mean (None without observations)."""
        return self.total / self.n if self.n else None

    def variance(self) -> float | None:
        """Sample variance (population form; None without observations)."""
        if not self.n:
            return None
        mean = self.total / self.n
        return max(self.total_sq / self.n - mean * mean, 0.0)


@dataclass(frozen=True)
class Interval:
    """An always-valid interval for one arm's mean."""

    n: int
    mean: float | None
    lower: float
    upper: float


@dataclass(frozen=True)
class Comparison:
    """The always-valid interval for ``delta = mean(canary) - mean(stable)`` at level ``alpha``."""

    canary: Interval
    stable: Interval
    alpha: float

    @property
    def estimate(self) -> float | None:
        """Point estimate of the difference (None while an arm has no observation)."""
        if self.canary.mean is None or self.stable.mean is None:
            return None
        return self.canary.mean - self.stable.mean

    @property
    def lower(self) -> float:
        """Lower bound of the difference: ``L_canary - U_stable``."""
        return self.canary.lower - self.stable.upper

    @property
    def upper(self) -> float:
        """Upper bound of the difference: ``U_canary - L_stable``."""
        return self.canary.upper - self.stable.lower

    def regression(self, margin: float = 0.0) -> bool:
        """Higher is better: the canary is significantly worse (upper bound below ``-margin``)."""
        return self.upper < -margin

    def non_inferior(self, margin: float) -> bool:
        """Higher is better: the canary is at most ``margin`` worse (lower bound above ``-margin``)."""
        return self.lower > -margin

    def worse_by_more_than(self, margin: float) -> bool:
        """Higher is worse (error rates): the canary is significantly more than ``margin`` worse."""
        return self.lower > margin

    def verdict(self, margin: float, regression_margin: float = 0.0) -> Verdict:
        """``regression``, ``non_inferior`` or ``inconclusive`` (higher is better)."""
        if self.regression(regression_margin):
            return "regression"
        if self.non_inferior(margin):
            return "non_inferior"
        return "inconclusive"

    def to_json(self) -> dict[str, float | int | None]:
        """The numbers, for the audit log."""
        return {
            "n_canary": self.canary.n,
            "n_stable": self.stable.n,
            "mean_canary": _round(self.canary.mean),
            "mean_stable": _round(self.stable.mean),
            "estimate": _round(self.estimate),
            "lower": _round(self.lower),
            "upper": _round(self.upper),
            "alpha": self.alpha,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _excess(r: float, log_term: float) -> float:
    """d/dr of (1 + r) * (log(1 + 1/r) + log_term); zero at the optimal rho / V ratio."""
    return math.log1p(1.0 / r) + log_term - 1.0 / r


@lru_cache(maxsize=256)
def rho_for(target_n: int, alpha: float, sigma2: float = BOUND_VARIANCE) -> float:
    """The mixture precision ``rho`` that makes the boundary tightest at ``target_n`` observations.

    With ``V = target_n * sigma2`` and ``r = rho / V`` the radius squared is
    ``V (1 + r) (log(1 + 1/r) + 2 log(1/alpha))``; its minimum solves
    ``log(1 + 1/r) + 2 log(1/alpha) = 1/r`` (bisection, the left side minus the right is
    increasing in ``r``).
    """
    if target_n < 1:
        raise ValueError(f"target_n must be >= 1, got {target_n}")
    log_term = 2.0 * math.log(1.0 / alpha)
    lo, hi = 1e-9, 1e3
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if _excess(mid, log_term) < 0.0:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi) * target_n * sigma2


def radius(n: int, alpha: float, rho: float, sigma2: float = BOUND_VARIANCE) -> float:
    """Half-width of the two-sided normal-mixture CS for the *sum* of ``n`` centred observations."""
    v = n * sigma2
    return math.sqrt((v + rho) * (math.log((v + rho) / rho) + 2.0 * math.log(1.0 / alpha)))


def interval(stats: ArmStats, alpha: float, rho: float, variance: Variance = "bound") -> Interval:
    """The level-``alpha`` CS for one arm's mean, clipped to [0, 1]."""
    if stats.n == 0:
        return Interval(0, None, 0.0, 1.0)
    if variance == "bound":
        sigma2 = BOUND_VARIANCE
    else:
        sigma2 = max(stats.variance() or 0.0, MIN_EMPIRICAL_VARIANCE)
    mean = stats.total / stats.n
    half = radius(stats.n, alpha, rho, sigma2) / stats.n
    return Interval(stats.n, mean, max(mean - half, 0.0), min(mean + half, 1.0))


def compare(
    canary: ArmStats,
    stable: ArmStats,
    alpha: float,
    target_n: int,
    variance: Variance = "bound",
) -> Comparison:
    """The level-``alpha`` CS for ``mean(canary) - mean(stable)``: each arm's CS at ``alpha / 2``.

    ``target_n`` is the canary sample size where the canary's boundary is made tightest; the
    stable arm's is tuned to the same variance scale (it usually has more observations, where
    the normal-mixture boundary is only a log factor away from its own optimum).
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    half_alpha = alpha / 2.0
    rho = rho_for(target_n, half_alpha)
    return Comparison(
        interval(canary, half_alpha, rho, variance),
        interval(stable, half_alpha, rho, variance),
        alpha,
    )
