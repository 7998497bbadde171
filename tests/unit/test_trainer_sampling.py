"""The trainer's processed distribution: temperature, min-p, top-k, top-p as vLLM samples with them.

The reference here is written independently of the code under test, in float64 Python, from
the definitions: min-p keeps tokens at least ``min_p`` times as likely as the most likely one;
top-k keeps tokens whose logit is at least the k-th largest; top-p keeps a token when the
tokens more likely than it hold less than ``top_p`` of the (renormalised) mass.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict

import pytest
import torch

from flywheel.core.contracts.events import SamplingParams, parse_event
from flywheel.core.settings.trainer import StepSettings
from trainer.select import SampleMeta, SelectionRules, choose, sampling_exclusion
from trainer.step import (
    StepSample,
    TokenSampling,
    build_micro_batch,
    micro_batches,
    processed_logprobs,
    truncation_mask,
)


def reference_kept(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[bool]:
    """Kept tokens by the textbook definitions, in float64."""
    z = [x / temperature for x in logits]
    kept = [True] * len(z)

    def probs() -> list[float]:
        top = max(z[i] for i in range(len(z)) if kept[i])
        e = [math.exp(z[i] - top) if kept[i] else 0.0 for i in range(len(z))]
        total = sum(e)
        return [x / total for x in e]

    if min_p > 0:
        p = probs()
        kept = [kept[i] and p[i] >= min_p * max(p) for i in range(len(z))]
    if 0 < top_k < len(z):
        kth = sorted((z[i] for i in range(len(z)) if kept[i]), reverse=True)
        if len(kth) >= top_k:
            kept = [kept[i] and z[i] >= kth[top_k - 1] for i in range(len(z))]
    if top_p < 1:
        p = probs()
        order = sorted((i for i in range(len(z)) if kept[i]), key=lambda i: -p[i])
        above = 0.0
        for i in order:
            kept[i] = above < top_p
            above += p[i]
    return kept


def reference_logprob(logits: list[float], target: int, sampling: tuple[float, int, float, float]) -> float:
    kept = reference_kept(logits, *sampling)
    kept[target] = True
    z = [x / sampling[0] for x in logits]
    top = max(z[i] for i in range(len(z)) if kept[i])
    return z[target] - top - math.log(sum(math.exp(z[i] - top) for i in range(len(z)) if kept[i]))


SETTINGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 50, 0.9, 0.0),
    (0.7, 0, 0.9, 0.0),
    (1.3, 20, 1.0, 0.0),
    (0.8, 0, 1.0, 0.1),
    (0.5, 10, 0.8, 0.05),
    (1.0, 1, 1.0, 0.0),
    (2.0, 0, 0.3, 0.0),
]


def random_batch(
    seed: int, vocab: int = 300
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[float, int, float, float]]]:
    rng = random.Random(seed)
    rows = [SETTINGS[i % len(SETTINGS)] for i in range(4 * len(SETTINGS))]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    targets = torch.tensor([rng.randrange(vocab) if i % 3 else int(logits[i].argmax()) for i in range(len(rows))])
    return logits, targets, rows


def as_tensors(rows: list[tuple[float, int, float, float]]) -> dict[str, torch.Tensor]:
    return {
        "temperature": torch.tensor([r[0] for r in rows]),
        "top_k": torch.tensor([r[1] for r in rows]),
        "top_p": torch.tensor([r[2] for r in rows]),
        "min_p": torch.tensor([r[3] for r in rows]),
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_processed_logprobs_match_the_reference(seed):
    logits, targets, rows = random_batch(seed)
    t = as_tensors(rows)
    got = processed_logprobs(logits, targets, **t)
    kept = truncation_mask(logits / t["temperature"][:, None], t["top_k"], t["top_p"], t["min_p"])
    for i, row in enumerate(rows):
        assert kept[i].tolist() == reference_kept(logits[i].tolist(), *row), f"row {i} {row}"
        assert got[i].item() == pytest.approx(reference_logprob(logits[i].tolist(), int(targets[i]), row), abs=1e-5)
    # truncation only ever raises a kept token's log-prob (the mass is renormalised over fewer tokens)
    plain = torch.log_softmax(logits / t["temperature"][:, None], dim=-1).gather(1, targets[:, None]).squeeze(1)
    assert bool((got >= plain - 1e-6).all()) and bool((got > plain + 1e-3).any())


def test_untruncated_is_a_plain_log_softmax_and_needs_no_tensors():
    logits, targets, _ = random_batch(3)
    plain = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
    assert torch.allclose(processed_logprobs(logits, targets), plain, atol=1e-6)
    neutral = {"top_k": torch.zeros(len(targets), dtype=torch.long), "top_p": torch.ones(len(targets))}
    assert torch.allclose(processed_logprobs(logits, targets, 1.0, **neutral), plain, atol=1e-6)
    cooled = torch.log_softmax(logits / 0.5, dim=-1).gather(1, targets[:, None]).squeeze(1)
    assert torch.allclose(processed_logprobs(logits, targets, 0.5), cooled, atol=1e-5)


def test_gradient_flows_through_the_renormalised_kept_set():
    logits, targets, rows = random_batch(4, vocab=64)
    t = as_tensors(rows)
    x = logits.clone().requires_grad_(True)
    processed_logprobs(x, targets, **t).sum().backward()
    kept = truncation_mask(logits / t["temperature"][:, None], t["top_k"], t["top_p"], t["min_p"])
    kept[torch.arange(len(targets)), targets] = True
    z = (logits / t["temperature"][:, None]).masked_fill(~kept, -math.inf)
    expected = (torch.nn.functional.one_hot(targets, 64) - z.softmax(dim=-1)) / t["temperature"][:, None]
    assert torch.allclose(x.grad, expected, atol=1e-5)
    assert bool((x.grad[~kept] == 0).all())


def test_a_sampled_token_outside_the_kept_set_stays_possible():
    logits = torch.tensor([[5.0, 4.0, 0.0, -3.0]])
    target = torch.tensor([3])  # far outside top-2
    value = processed_logprobs(logits, target, 1.0, top_k=torch.tensor([2]))
    expected = -3.0 - torch.logsumexp(torch.tensor([5.0, 4.0, -3.0]), dim=0)
    assert math.isfinite(value.item()) and value.item() == pytest.approx(expected.item(), abs=1e-6)


def test_top_k_keeps_ties_with_the_kth_like_vllm():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    assert truncation_mask(logits, top_k=torch.tensor([2])).tolist() == [[True, True, True, False]]


def sample(i: int, sampling: TokenSampling, n: int = 3) -> StepSample:
    return StepSample(i, [1, 2, 3], list(range(10, 10 + n)), [1] * n, [-1.0] * n, 0.5, 1.0, sampling)


def test_micro_batch_carries_each_tokens_sampling():
    plain = build_micro_batch([sample(0, TokenSampling(1.0)), sample(1, TokenSampling())], 64, 0)
    assert plain.temperature.tolist() == [1.0] * 6
    assert plain.top_k is None and plain.top_p is None and plain.min_p is None  # no sort needed
    mixed = build_micro_batch(
        [sample(0, TokenSampling()), sample(1, TokenSampling(0.7, top_k=50, top_p=0.9), n=2)], 64, 0, 1.3
    )
    assert mixed.temperature.tolist() == pytest.approx([1.3, 1.3, 1.3, 0.7, 0.7])
    assert mixed.top_k.tolist() == [0, 0, 0, 50, 50]
    assert mixed.top_p.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.9, 0.9])
    assert mixed.min_p is None
    step = StepSettings(sampling_temperature=0.6)
    (batch,) = micro_batches([sample(0, TokenSampling())], step, 0)
    assert batch.temperature.tolist() == pytest.approx([0.6] * 3)


def test_token_sampling_from_the_recorded_params_and_through_json():
    recorded = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, max_tokens=8)
    assert TokenSampling.from_params(recorded) == TokenSampling(0.7, 50, 0.9, 0.05)
    assert TokenSampling.from_params({"top_k": -1}) == TokenSampling()
    assert TokenSampling.from_params(SamplingParams()) == TokenSampling()
    assert TokenSampling.from_params(None) == TokenSampling()
    s = sample(7, TokenSampling(0.7, 50, 0.9))
    assert StepSample(**asdict(s)) == s  # the distributed launcher's batch file
    with pytest.raises(ValueError, match="temperature must be > 0"):
        TokenSampling(0.0)


def parse_event_sampling(sampling: dict) -> SamplingParams:
    """The ``sampling`` of a completion as the event reader keeps it (unknown fields included)."""
    record = {"schema_version": 1, "type": "completion", "project": "p", "session_id": "s"}
    return parse_event({**record, "model": "m", "policy_version": "v", "sampling": sampling}).sampling


@pytest.mark.parametrize(
    ("sampling", "reason"),
    [
        (None, None),
        ({}, None),
        ({"temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.1, "seed": 3}, None),
        ({"temperature": 0.0}, "greedy"),
        ({"temperature": 0.7, "presence_penalty": 0.5}, "penalty"),
        ({"frequency_penalty": -0.1}, "penalty"),
        ({"repetition_penalty": 1.1}, "penalty"),
        ({"repetition_penalty": 1.0, "presence_penalty": 0.0}, None),
        ({"logit_bias": {"12": 3.0}}, "logit_bias"),
        ({"min_tokens": 4}, "min_tokens"),
        ({"constraints": ["structured_outputs"]}, "constrained"),
        ({"temperature": 0.7, "typical_p": 0.9}, "unknown_sampling"),  # a newer SDK's parameter
        (parse_event_sampling({"temperature": 0.7, "typical_p": 0.9}), "unknown_sampling"),
        (  # what rewarding stores in training_samples.sampling
            parse_event_sampling({"typical_p": 0.9}).model_dump(mode="json", exclude_defaults=True),
            "unknown_sampling",
        ),
        ({"temperature": "hot", "typical_p": 0.9}, "invalid_sampling"),
        ({"temperature": "hot"}, "invalid_sampling"),
        ([1, 2], "invalid_sampling"),
        (SamplingParams(temperature=0.0), "greedy"),
    ],
)
def test_sampling_exclusion_reasons(sampling, reason):
    assert sampling_exclusion(sampling) == reason


def test_selection_drops_and_counts_unreproducible_sampling():
    from datetime import UTC, datetime, timedelta

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    samplings = [None, {}, {"temperature": 0.7, "top_k": 50}, {"temperature": 0.0}, {"temperature": 0.0}]
    samplings += [{"repetition_penalty": 1.2}, {"logit_bias": {"5": 1.0}}]
    rows = [SampleMeta(i, f"c{i}", 1, "v1", "agent", t0 + timedelta(seconds=i), s) for i, s in enumerate(samplings)]
    rows.append(SampleMeta(99, "c99", 1, "v1", "agent", t0))  # a row read without the column: nothing recorded
    selection = choose(rows, SelectionRules(frozenset({"v1"}), frozenset({"agent"}), 1, 100))
    assert sorted(selection.ids) == [0, 1, 2, 99]
    assert selection.counts["untrainable_sampling"] == 4
    assert selection.counts["sampling_greedy"] == 2
    assert selection.counts["sampling_penalty"] == 1 and selection.counts["sampling_logit_bias"] == 1
    assert selection.counts["selected"] == 4


def tiny_policy():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def test_truth_check_matches_a_plain_forward_and_finds_a_wrong_logprob():
    from trainer.truth import TruthSample, check_logprobs

    model = tiny_policy()
    rng = random.Random(5)
    samplings = [None, {"temperature": 0.7, "top_p": 0.9, "top_k": 50}, {"temperature": 0.8, "min_p": 0.1}]
    samples = []
    for i in range(6):
        prompt = [rng.randrange(96) for _ in range(rng.randrange(2, 9))]
        completion = [rng.randrange(96) for _ in range(rng.randrange(1, 12))]
        sampling = samplings[i % 3]
        row = TokenSampling.from_params(sampling)
        with torch.no_grad():  # one sequence, no packing: what a server's forward sees
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        recorded = [
            reference_logprob(logits[j].tolist(), t, (row.temperature or 1.0, row.top_k, row.top_p, row.min_p))
            for j, t in enumerate(completion)
        ]
        samples.append(TruthSample(prompt, completion, recorded, sampling))
    samples.append(TruthSample([1, 2], [3], [-1.0], {"temperature": 0.0}))  # greedy: excluded, counted
    report = check_logprobs(model, samples, pack_row_tokens=64)
    assert report.max_abs_log_ratio < 1e-4, report.to_dict()
    assert report.tokens == sum(len(s.completion_ids) for s in samples[:6])
    assert report.excluded == {"greedy": 1} and report.logprobs[6] is None
    wrong = list(samples[4].recorded_logprobs)
    wrong[-1] -= 0.01
    samples[4] = TruthSample(samples[4].prompt_ids, samples[4].completion_ids, wrong, samples[4].sampling)
    report = check_logprobs(model, samples, pack_row_tokens=64)
    assert report.worst == (4, len(wrong) - 1) and report.max_abs_log_ratio == pytest.approx(0.01, abs=1e-4)
    with pytest.raises(ValueError, match="sample 0: 2 completion tokens but 1 recorded"):
        check_logprobs(model, [TruthSample([1], [2, 3], [-1.0])])
