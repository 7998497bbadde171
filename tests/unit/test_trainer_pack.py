"""Packing: rows within capacity, and packed log-probs equal to one-sequence-at-a-time log-probs."""

from __future__ import annotations

import random

import pytest

from flywheel.core.settings.trainer import LossSettings, StepSettings
from trainer.step import (
    DistInfo,
    StepSample,
    build_micro_batch,
    make_logprob_module,
    pack_rows,
    shard_plan,
    split_micro_batches,
    train_on_batch,
)

torch = pytest.importorskip("torch")


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def random_samples(n: int, seed: int = 0) -> list[StepSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 64) for _ in range(rng.randint(3, 12))]
        completion = [rng.randrange(1, 64) for _ in range(rng.randint(1, 9))]
        mask = [rng.choice([0, 1, 1]) for _ in completion]
        out.append(StepSample(i, prompt, completion, mask, [-1.0] * len(completion), rng.uniform(-1, 1), 0.0))
    return out


def test_pack_rows_respects_capacity_and_keeps_every_index():
    lengths = [7, 3, 9, 1, 4, 4, 8, 2]
    rows = pack_rows(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert len(rows) == 4  # 38 tokens need at least 4 rows of 10


def test_pack_rows_gives_an_oversized_sequence_its_own_row():
    rows = pack_rows([30, 2, 2], 10)
    assert [0] in rows
    assert sorted(i for row in rows for i in row) == [0, 1, 2]


def test_split_micro_batches_by_token_budget():
    assert split_micro_batches([5, 5, 5, 5], 10) == [[0, 1], [2, 3]]
    assert split_micro_batches([12, 1], 10) == [[0], [1]]


def test_shard_plan_same_step_count_on_every_rank_and_disjoint():
    config = StepSettings(mini_batch_samples=4, epochs=2)
    plans = [shard_plan(10, config, DistInfo(rank=r, world=2, strategy="ddp")) for r in range(2)]
    assert [len(e) for e in plans[0]] == [len(e) for e in plans[1]] == [3, 3]
    for epoch in range(2):
        seen = [i for p in plans for chunk in p[epoch] for i in chunk]
        assert sorted(seen) == list(range(10))


def test_packed_logprobs_equal_unpacked():
    model = tiny_llama()
    samples = random_samples(6)
    module = make_logprob_module(model, temperature=1.0)
    mb = build_micro_batch(samples, row_tokens=32, pad_id=0)
    assert mb.input_ids.shape[0] < len(samples)  # really packed
    with torch.no_grad():
        packed, _ = module(mb.input_ids, mb.position_ids, mb.pred_index, mb.target_ids)
        expected = []
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logits = model(input_ids=ids).logits[0].log_softmax(-1)
            for j, m in enumerate(s.target_mask):
                if m:
                    pos = len(s.prompt_ids) + j - 1
                    expected.append(logits[pos, s.completion_ids[j]])
    assert packed.shape[0] == sum(s.n_trained for s in samples)
    assert torch.allclose(packed, torch.stack(expected), atol=1e-5)


def test_only_masked_tokens_get_gradient():
    """A sample whose mask is all zero contributes nothing: the update equals training without it."""
    samples = random_samples(4, seed=3)
    silent = StepSample(99, [5, 6, 7], [8, 9], [0, 0], [-1.0, -1.0], 5.0, 1.0)
    step = StepSettings(learning_rate=1e-2, mini_batch_samples=8, show_progress=False)
    loss = LossSettings(kind="cispo")
    a, b = tiny_llama(), tiny_llama()
    train_on_batch(a, samples, step, loss, pad_id=0)
    train_on_batch(b, samples + [silent], step, loss, pad_id=0)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), name


def test_train_on_batch_lowers_the_batch_loss():
    samples = random_samples(16, seed=1)
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = StepSettings(learning_rate=5e-3, epochs=3, mini_batch_samples=8, show_progress=False)
    result = train_on_batch(model, samples, step, LossSettings(), pad_id=0)
    assert result.loss_after < result.loss_before
    assert len(result.steps) == 6
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    for key in ("loss", "reward_mean", "adv_std", "ratio_mean", "clip_frac", "kl", "tokens_per_s"):
        assert key in result.steps[0]
