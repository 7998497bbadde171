"""The plain recomputation of vLLM's processed logprobs that ``make bench-byo`` checks logged logprobs against:
temperature, then top-k, then top-p, renormalised over what is kept (the same masks as vLLM's sampler, which
gave identical numbers on random logits when compared here by hand)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from flywheel.demo.byo import processed_logprobs  # noqa: E402


def test_temperature_alone_is_a_scaled_log_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    out = processed_logprobs(logits, 0.5, None, None)
    assert torch.allclose(out, (logits / 0.5).log_softmax(-1))
    assert torch.allclose(processed_logprobs(logits, 1.0, 0, 1.0), logits.log_softmax(-1))


def test_top_k_keeps_the_k_largest_and_renormalises() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    out = processed_logprobs(logits, 1.0, 2, None)[0]
    assert math.isinf(out[1]) and math.isinf(out[3])
    kept = torch.tensor([3.0, 2.0]).log_softmax(-1)
    assert torch.allclose(out[[0, 2]], kept)


def test_top_p_drops_the_tail_whose_mass_is_at_most_one_minus_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = processed_logprobs(probs.log(), 1.0, None, 0.8)[0]
    # ascending cumulative mass: 0.05, 0.20, 0.50, 1.0; tokens with cumulative <= 0.2 are dropped
    assert math.isinf(out[2]) and math.isinf(out[3])
    assert torch.allclose(out[:2].exp(), torch.tensor([0.5, 0.3]) / 0.8)


def test_the_largest_token_is_always_kept() -> None:
    out = processed_logprobs(torch.tensor([[5.0, -5.0]]), 1.0, None, 0.01)[0]
    assert out[0].item() == pytest.approx(0.0) and math.isinf(out[1])
