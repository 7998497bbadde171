"""Loss math: CISPO truncation keeps gradients, PPO clip zeroes them, KL is k3 and only with a coefficient."""

from __future__ import annotations

import math

import pytest

from flywheel.core.settings.trainer import LossSettings
from trainer.loss import token_loss

torch = pytest.importorskip("torch")


def grads(config: LossSettings, logp: list[float], behaviour: list[float], adv: list[float]):
    x = torch.tensor(logp, requires_grad=True)
    terms = token_loss(x, torch.tensor(behaviour), torch.tensor(adv), config)
    terms.loss.sum().backward()
    return terms, x.grad


def test_on_policy_cispo_is_the_policy_gradient():
    terms, g = grads(LossSettings(kind="cispo"), [-1.0, -2.0], [-1.0, -2.0], [1.0, -0.5])
    assert terms.ratio.tolist() == pytest.approx([1.0, 1.0])
    assert g.tolist() == pytest.approx([-1.0, 0.5])  # d(-A logp)/dlogp = -A
    assert not terms.clipped.any()


def test_cispo_truncates_the_weight_but_keeps_the_gradient():
    # ratio e^2 ~ 7.39 is truncated to 2.0; the token still gets gradient -2.0 * A.
    terms, g = grads(LossSettings(kind="cispo", is_ratio_max=2.0), [0.0], [-2.0], [1.0])
    assert terms.clipped.tolist() == [True]
    assert g.tolist() == pytest.approx([-2.0])


def test_cispo_lower_truncation():
    terms, g = grads(LossSettings(kind="cispo", is_ratio_min=0.5), [-3.0], [0.0], [1.0])
    assert terms.clipped.tolist() == [True]
    assert g.tolist() == pytest.approx([-0.5])


def test_ppo_clip_zeroes_the_gradient_past_the_clip():
    # Positive advantage, ratio e^1 > 1.28: the clipped branch is active, no gradient.
    terms, g = grads(LossSettings(kind="ppo", ppo_clip_high=0.28), [0.0], [-1.0], [1.0])
    assert terms.clipped.tolist() == [True]
    assert g.tolist() == pytest.approx([0.0])
    assert float(terms.loss.detach()) == pytest.approx(-1.28)


def test_ppo_inside_the_clip_is_ratio_times_advantage():
    terms, g = grads(LossSettings(kind="ppo"), [-1.0], [-1.1], [2.0])
    ratio = math.exp(0.1)
    assert float(terms.loss.detach()) == pytest.approx(-ratio * 2.0)
    assert g.tolist() == pytest.approx([-ratio * 2.0])  # d(r A)/dlogp = r A
    assert terms.clipped.tolist() == [False]


def test_ppo_negative_advantage_clips_low():
    terms, g = grads(LossSettings(kind="ppo", ppo_clip_low=0.2), [-2.0], [-1.0], [-1.0])
    assert terms.clipped.tolist() == [True]  # ratio e^-1 < 0.8 with A < 0
    assert g.tolist() == pytest.approx([0.0])


def test_kl_k3_is_zero_at_the_reference_and_positive_elsewhere():
    config = LossSettings(kind="cispo", kl_coef=0.5)
    x = torch.tensor([-1.0, -1.0])
    same = token_loss(x, x, torch.zeros(2), config, ref_logp=x)
    assert same.kl.tolist() == pytest.approx([0.0, 0.0])
    off = token_loss(x, x, torch.zeros(2), config, ref_logp=torch.tensor([-0.5, -2.0]))
    assert (off.kl > 0).all()
    assert off.loss.tolist() == pytest.approx((0.5 * off.kl).tolist())


def test_kl_needs_reference_logprobs():
    with pytest.raises(ValueError, match="reference"):
        token_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), LossSettings(kl_coef=0.1))


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="unknown loss"):
        token_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), LossSettings.model_construct(kind="reinforce"))
