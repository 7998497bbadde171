"""Advantages: RLOO and GRPO over episodes, baselines for singletons, normalisation, running mean."""

from __future__ import annotations

import math

import pytest

from flywheel.core.settings.trainer import AdvantageSettings
from trainer.advantages import (
    AdvInput,
    BaselineState,
    compute_advantages,
    scale_by_std,
    value_baseline,
)

RAW = AdvantageSettings(norm="none")


def s(episode: str, reward: float, group: str | None = "g", kind: str | None = "add") -> AdvInput:
    return AdvInput(episode=episode, group_key=group, kind=kind, reward=reward)


def test_rloo_uses_the_other_episodes_mean():
    out = compute_advantages([s("a", 1.0), s("b", 0.0), s("c", 0.0)], RAW)
    assert out.advantages == pytest.approx([1.0, -0.5, -0.5])
    assert out.source == ["group"] * 3


def test_grpo_centres_and_scales_by_the_group_std():
    out = compute_advantages([s("a", 1.0), s("b", 0.0)], AdvantageSettings(group="grpo", norm="none"))
    assert out.advantages == pytest.approx([1.0, -1.0], abs=1e-4)


def test_an_episode_with_several_completions_counts_once_in_its_group():
    # Episode a has two turns with reward 1; b and c have one turn each with reward 0.
    samples = [s("a", 1.0), s("a", 1.0), s("b", 0.0), s("c", 0.0)]
    out = compute_advantages(samples, RAW)
    assert out.advantages == pytest.approx([1.0, 1.0, -0.5, -0.5])


def test_a_group_with_one_episode_falls_back_to_the_baseline():
    samples = [s("a", 1.0, group="g1"), s("a", 1.0, group="g1"), s("b", 0.0, group="g2")]
    out = compute_advantages(samples, RAW, BaselineState(means={"add": 0.25}))
    assert out.source == ["baseline"] * 3
    assert out.advantages == pytest.approx([0.75, 0.75, -0.25])


def test_new_kind_uses_leave_one_out_batch_mean():
    samples = [s("a", 1.0, group=None), s("b", 0.0, group=None), s("c", 0.5, group=None, kind="mul")]
    out = compute_advantages(samples, RAW)
    assert out.advantages == pytest.approx([1.0, -1.0, 0.5])  # mul has no other episode: baseline 0


def test_running_mean_state_moves_by_momentum():
    state = BaselineState(means={"add": 0.0}, counts={"add": 10})
    out = compute_advantages([s("a", 1.0, group=None), s("b", 1.0, group=None)], AdvantageSettings(momentum=0.9), state)
    assert out.state.means["add"] == pytest.approx(0.1)
    assert out.state.counts["add"] == 12
    assert BaselineState.from_dict(out.state.to_dict()) == out.state


def test_batch_normalisation_gives_unit_std():
    out = compute_advantages([s("a", 3.0), s("b", 0.0), s("c", 0.0), s("d", 1.0)], AdvantageSettings(norm="batch"))
    mean = sum(out.advantages) / 4
    std = math.sqrt(sum((a - mean) ** 2 for a in out.advantages) / 4)
    assert std == pytest.approx(1.0)


def test_scale_by_std_leaves_constant_values():
    assert scale_by_std([0.0, 0.0]) == [0.0, 0.0]


def test_value_baseline_is_leave_one_out():
    torch = pytest.importorskip("torch")
    # Reward is a linear function of the feature: LOO ridge predicts it closely without seeing the row.
    x = torch.linspace(-1, 1, 20)[:, None]
    y = [float(2 * v + 1) for v in x[:, 0]]
    preds = value_baseline(x, y, l2=1e-6)
    assert preds == pytest.approx(y, abs=1e-3)
    # With a single outlier, its own prediction must not contain its reward.
    y2 = list(y)
    y2[5] = 100.0
    assert value_baseline(x, y2, l2=1e-6)[5] == pytest.approx(y[5], abs=1e-2)


def test_value_baseline_needs_features():
    with pytest.raises(ValueError, match="features"):
        compute_advantages([s("a", 1.0, group=None)], AdvantageSettings(baseline="value"))
