"""The canary decision rule: collecting, step up, promote, rollback on regression or guard, max duration."""

from __future__ import annotations

import json

import pytest

from flywheel.core.settings import CanarySettings
from serving.canary.policy import GuardInput, Observations, decide, step_position, weight_steps
from serving.canary.stats import ArmStats

SETTINGS = CanarySettings()  # steps 0.05, 0.25, 0.5, 1.0; min 100 per step


def arm(n: int, rate: float) -> ArmStats:
    successes = round(n * rate)
    return ArmStats(n, float(successes), float(successes))


def obs(
    canary: ArmStats, stable: ArmStats, at_step: int | None = None, elapsed_s: float = 60.0, **guards: GuardInput
) -> Observations:
    return Observations(canary, stable, canary.n if at_step is None else at_step, elapsed_s, guards)


def test_weight_steps_drop_a_final_full_weight() -> None:
    assert weight_steps([0.05, 0.25, 0.5, 1.0]) == [0.05, 0.25, 0.5]
    assert weight_steps([0.1, 0.5]) == [0.1, 0.5]
    assert weight_steps([1.0]) == [1.0]


@pytest.mark.parametrize(
    ("weight", "expected"),
    [(0.05, (0, 0.25)), (0.25, (1, 0.5)), (0.5, (2, None)), (0.1, (0, 0.25)), (0.01, (0, 0.05)), (0.7, (2, None))],
)
def test_step_position(weight: float, expected: tuple[int, float | None]) -> None:
    assert step_position(weight, SETTINGS.steps) == expected


def test_holds_while_collecting_even_when_the_numbers_look_fine() -> None:
    d = decide(obs(arm(10_000, 0.5), arm(10_000, 0.5), at_step=99), 0.05, SETTINGS)
    assert d.action == "hold" and d.new_weight == 0.05 and d.reason.startswith("collecting")
    assert d.canary_at_step == 99


def test_steps_up_when_non_inferior_at_the_step_margin() -> None:
    d = decide(obs(arm(1000, 0.5), arm(19_000, 0.5)), 0.05, SETTINGS)
    assert (d.action, d.new_weight, d.step, d.margin) == ("step_up", 0.25, 0, SETTINGS.step_margin)
    assert d.primary["lower"] > -SETTINGS.step_margin


def test_the_last_test_step_needs_the_tight_margin_then_promotes() -> None:
    loose = decide(obs(arm(1000, 0.5), arm(19_000, 0.5)), 0.5, SETTINGS)
    assert loose.action == "hold" and loose.margin == SETTINGS.non_inferiority_margin
    tight = decide(obs(arm(10_000, 0.5), arm(20_000, 0.5)), 0.5, SETTINGS)
    assert (tight.action, tight.new_weight) == ("promote", 1.0)
    assert tight.reason.startswith("non-inferior at the last step")


def test_a_clear_regression_rolls_back_at_any_step_before_the_minimum() -> None:
    for weight in (0.05, 0.25, 0.5):
        d = decide(obs(arm(80, 0.2), arm(2000, 0.5), at_step=5), weight, SETTINGS)
        assert (d.action, d.new_weight) == ("rollback", 0.0)
        assert d.reason.startswith("significant regression") and d.primary["upper"] < 0


def test_inconclusive_holds() -> None:
    d = decide(obs(arm(300, 0.46), arm(5000, 0.5)), 0.05, SETTINGS)
    assert d.action == "hold" and d.reason.startswith("inconclusive")
    assert d.primary["lower"] <= -SETTINGS.step_margin <= d.primary["upper"] or d.primary["upper"] >= 0


def test_max_duration_rolls_back_an_inconclusive_canary() -> None:
    d = decide(obs(arm(300, 0.46), arm(5000, 0.5), elapsed_s=SETTINGS.max_duration_s + 1), 0.25, SETTINGS)
    assert d.action == "rollback" and d.reason.startswith("inconclusive at max duration")


def test_max_canary_sessions_is_a_max_duration_too() -> None:
    settings = CanarySettings(max_canary_sessions=300)
    d = decide(obs(arm(300, 0.46), arm(5000, 0.5)), 0.25, settings)
    assert d.action == "rollback" and "300 canary sessions" in d.reason


def test_max_duration_promotes_a_canary_already_non_inferior_at_the_promotion_margin() -> None:
    # At an intermediate step but still collecting: the deadline decides with the tight margin.
    d = decide(obs(arm(10_000, 0.5), arm(20_000, 0.5), at_step=3, elapsed_s=1e9), 0.25, SETTINGS)
    assert d.action == "promote" and d.reason.startswith("max duration")


def guard(canary_rate: float, stable_rate: float, margin: float = 0.05, n: int = 1000) -> GuardInput:
    return GuardInput(arm(n, canary_rate), arm(4 * n, stable_rate), margin, {"note": 1})


def test_a_tripped_guard_rolls_back_even_when_the_primary_metric_is_fine() -> None:
    d = decide(
        obs(arm(1000, 0.5), arm(19_000, 0.5), error_rate=guard(0.30, 0.05), edit_rate=guard(0.1, 0.1)),
        0.05,
        SETTINGS,
    )
    assert d.action == "rollback" and d.reason.startswith("guard tripped: error_rate")
    assert d.guards["error_rate"]["tripped"] and not d.guards["edit_rate"]["tripped"]
    assert d.guards["error_rate"]["lower"] > 0.05 and d.guards["error_rate"]["note"] == 1


def test_a_guard_within_its_margin_does_not_trip() -> None:
    d = decide(obs(arm(1000, 0.5), arm(19_000, 0.5), error_rate=guard(0.08, 0.05)), 0.05, SETTINGS)
    assert d.action == "step_up" and not d.guards["error_rate"]["tripped"]


def test_a_guard_without_canary_data_does_not_trip() -> None:
    empty = GuardInput(ArmStats(), arm(4000, 0.05), 0.05)
    d = decide(obs(arm(1000, 0.5), arm(19_000, 0.5), error_rate=empty), 0.05, SETTINGS)
    assert not d.guards["error_rate"]["tripped"]


def test_no_data_holds() -> None:
    d = decide(obs(ArmStats(), ArmStats()), 0.05, SETTINGS)
    assert d.action == "hold" and d.primary["n_canary"] == 0


def test_decision_details_are_json_with_every_number() -> None:
    d = decide(obs(arm(1000, 0.5), arm(19_000, 0.5), error_rate=guard(0.05, 0.05)), 0.05, SETTINGS)
    details = json.loads(json.dumps(d.to_details()))
    assert details["action"] == "step_up" and details["new_weight"] == 0.25
    for key in ("n_canary", "n_stable", "mean_canary", "mean_stable", "estimate", "lower", "upper", "alpha"):
        assert key in details["primary"]
    assert details["guards"]["error_rate"]["margin"] == 0.05
