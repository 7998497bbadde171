"""The confidence sequences of serving.canary.stats: coverage under continuous monitoring, decisions."""

from __future__ import annotations

import random

import pytest

from serving.canary.stats import ArmStats, compare, interval, radius, rho_for

ALPHA = 0.05


def test_arm_stats_rejects_values_outside_the_unit_interval() -> None:
    with pytest.raises(ValueError, match="outside"):
        ArmStats.of([0.5, 1.5])
    stats = ArmStats.of([0.0, 1.0, 1.0])
    assert (stats.n, stats.mean) == (3, pytest.approx(2 / 3))
    assert stats.add(1.0) == ArmStats(4, 3.0, 3.0)


def test_rho_for_makes_the_boundary_tightest_at_the_target() -> None:
    rho = rho_for(1000, ALPHA)
    at_target = radius(1000, ALPHA, rho)
    assert at_target < radius(1000, ALPHA, rho * 2) and at_target < radius(1000, ALPHA, rho / 2)


def test_interval_without_observations_is_the_whole_range() -> None:
    empty = interval(ArmStats(), ALPHA, rho_for(100, ALPHA))
    assert (empty.lower, empty.upper, empty.mean) == (0.0, 1.0, None)


def _ever_misses(rng: random.Random, p: float, n: int, variance: str, look_every: int = 5) -> bool:
    rho = rho_for(500, ALPHA)
    stats = ArmStats()
    for i in range(1, n + 1):
        x = 1.0 if rng.random() < p else 0.0
        stats = stats.add(x)
        if i % look_every == 0:
            ci = interval(stats, ALPHA, rho, variance)  # type: ignore[arg-type]
            if not ci.lower <= p <= ci.upper:
                return True
    return False


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_one_arm_coverage_holds_at_every_look(p: float) -> None:
    """Under continuous monitoring the chance of *ever* missing the mean stays below alpha."""
    rng = random.Random(12345)
    runs = 300
    misses = sum(_ever_misses(rng, p, 1500, "bound") for _ in range(runs))
    # Hoeffding's bound is conservative: the true rate is well under alpha; 0.05 leaves room.
    assert misses / runs <= ALPHA


def test_empirical_variance_coverage_near_alpha() -> None:
    rng = random.Random(7)
    runs = 300
    misses = sum(_ever_misses(rng, 0.3, 1500, "empirical") for _ in range(runs))
    assert misses / runs <= 2 * ALPHA  # asymptotic: slack for the early looks


def test_naive_repeated_confidence_intervals_would_fail_where_the_sequence_holds() -> None:
    """The reason for the construction: a 95 % fixed-n interval checked at every look misses far more often."""
    rng = random.Random(99)
    runs, misses = 200, 0
    for _ in range(runs):
        s = ArmStats()
        for i in range(1, 1501):
            s = s.add(1.0 if rng.random() < 0.5 else 0.0)
            if i % 5 == 0 and abs(s.mean - 0.5) > 1.96 * (0.25 / i) ** 0.5:
                misses += 1
                break
    assert misses / runs > 3 * ALPHA


def test_aa_comparison_rarely_declares_a_regression() -> None:
    """Equal arms, unequal allocation, 1500 canary sessions looked at every 10: regressions <= alpha / 2."""
    rng = random.Random(2024)
    runs, regressions = 200, 0
    for _ in range(runs):
        c, s = ArmStats(), ArmStats()
        for i in range(1, 6001):
            x = 1.0 if rng.random() < 0.5 else 0.0
            if rng.random() < 0.25:
                c = c.add(x)
            else:
                s = s.add(x)
            if i % 10 == 0 and compare(c, s, ALPHA, 1000).regression():
                regressions += 1
                break
    assert regressions / runs <= ALPHA / 2


def test_decisions_on_clear_data() -> None:
    stable = ArmStats(4000, 2000.0, 2000.0)
    worse = compare(ArmStats(1000, 300.0, 300.0), stable, ALPHA, 1000)
    assert worse.regression() and worse.verdict(0.04) == "regression"
    assert worse.estimate == pytest.approx(-0.2) and worse.upper < 0 < 0.5
    equal = compare(ArmStats(10000, 5000.0, 5000.0), ArmStats(10000, 5000.0, 5000.0), ALPHA, 1000)
    assert equal.verdict(0.04) == "non_inferior" and equal.lower < 0 < equal.upper
    assert equal.verdict(0.0) == "inconclusive"
    few = compare(ArmStats(20, 10.0, 10.0), stable, ALPHA, 1000)
    assert few.verdict(0.04) == "inconclusive"


def test_guard_direction_is_higher_is_worse() -> None:
    stable = ArmStats(4000, 200.0, 200.0)  # 5 % failed
    bad = compare(ArmStats(1000, 300.0, 300.0), stable, 0.01, 1000)  # 30 % failed
    assert bad.worse_by_more_than(0.05)
    assert not compare(ArmStats(1000, 60.0, 60.0), stable, 0.01, 1000).worse_by_more_than(0.05)


def test_comparison_json_holds_the_numbers() -> None:
    out = compare(ArmStats(10, 5.0, 5.0), ArmStats(30, 12.0, 12.0), ALPHA, 100).to_json()
    assert out["n_canary"] == 10 and out["n_stable"] == 30
    assert out["mean_canary"] == 0.5 and out["mean_stable"] == 0.4
    assert out["lower"] < out["estimate"] < out["upper"] and out["alpha"] == ALPHA
