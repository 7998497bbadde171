"""The trainer on real hardware, the parts that run anywhere: device and dtype resolution, LoRA
precision, gradient checkpointing, the token budget of micro-batches, sharded reading and
streamed saving (no GPU and no process group needed)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from flywheel.core.settings.trainer import HardwareSettings, LoraSettings, StepSettings, TrainerSettings
from trainer.parallel import (
    HardwareError,
    Placement,
    Source,
    TensorFiles,
    fresh_adapter_value,
    resolve,
    save_streaming,
)
from trainer.step import StepSample, micro_batches

torch = pytest.importorskip("torch")


# --------------------------------------------------------------------------- resolution


@pytest.mark.parametrize(
    ("settings", "cuda", "expected"),
    [
        ({}, False, Placement("cpu", "float32", False)),
        ({}, True, Placement("cuda", "bfloat16", True)),
        ({"device": "cpu"}, True, Placement("cpu", "float32", False)),
        ({"dtype": "bfloat16"}, False, Placement("cpu", "bfloat16", False)),
        ({"dtype": "float32", "gradient_checkpointing": "off"}, True, Placement("cuda", "float32", False)),
        ({"gradient_checkpointing": "on"}, False, Placement("cpu", "float32", True)),
    ],
)
def test_resolve_device_dtype_and_checkpointing(settings, cuda, expected):
    assert resolve(HardwareSettings(**settings), cuda_available=cuda) == expected


def test_cuda_without_a_gpu_is_refused_by_name():
    with pytest.raises(HardwareError, match="trainer.hardware.device"):
        resolve(HardwareSettings(device="cuda"), cuda_available=False)


def test_hardware_settings_refuse_unknown_values_and_all_linear_stands_alone():
    with pytest.raises(ValidationError):
        HardwareSettings(dtype="float16")
    with pytest.raises(ValidationError, match="all-linear"):
        LoraSettings(target_modules=["all-linear", "q_proj"])
    assert LoraSettings().target_modules == ["all-linear"]


def test_device_and_checkpointing_are_operational_dtype_shapes_the_update():
    from trainer.cycle import training_config

    a = training_config(TrainerSettings())
    b = training_config(TrainerSettings(hardware={"device": "cpu", "gradient_checkpointing": "on"}))
    c = training_config(TrainerSettings(hardware={"dtype": "bfloat16"}))
    assert a == b
    assert a != c


# --------------------------------------------------------------------------- models


def tiny_llama_dir(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
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
    folder = tmp_path / "tiny"
    LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {"<pad>": 0, "a": 1}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>"
    )
    tokenizer.save_pretrained(folder)
    return folder


def random_samples(n: int, seed: int = 0, low: int = 3, high: int = 12) -> list[StepSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 64) for _ in range(rng.randint(low, high))]
        completion = [rng.randrange(1, 64) for _ in range(rng.randint(1, 9))]
        mask = [rng.choice([0, 1, 1]) for _ in completion]
        out.append(StepSample(i, prompt, completion, mask, [-1.0] * len(completion), rng.uniform(-1, 1), 0.0))
    return out


def test_lora_adapter_is_fp32_over_a_bf16_base_and_covers_every_linear_layer(tmp_path):
    from trainer.ckpt import PolicyRef, load_trainable
    from trainer.step import train_on_batch

    folder = tiny_llama_dir(tmp_path)
    parent = PolicyRef("p", "p", str(folder), "full", str(folder))
    model, tokenizer, base = load_trainable(parent, "lora", LoraSettings(), 0, Placement("cpu", "bfloat16", True))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all(p.dtype == torch.float32 for p in trainable.values())
    assert all(p.dtype == torch.bfloat16 for p in frozen.values())
    # all-linear: the seven projections of every layer, never the LM head.
    targeted = {n.split(".")[-1] for n in model.peft_config["default"].target_modules}
    assert targeted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not any("lm_head" in n for n in trainable)
    result = train_on_batch(model, random_samples(16), StepSettings(show_progress=False), _loss(), 0)
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in trainable.values())
    assert result.loss_after < result.loss_before
    # The adapter starts as peft's (A Kaiming-uniform, B zero) and is seeded by name, not by build order.
    again, _, _ = load_trainable(parent, "lora", LoraSettings(), 0, Placement())
    name = next(n for n in again.state_dict() if ".lora_A." in n)
    assert torch.equal(again.state_dict()[name], fresh_adapter_value(name, tuple(again.state_dict()[name].shape), 0))
    assert not torch.equal(fresh_adapter_value(name, (8, 32), 0), fresh_adapter_value(name, (8, 32), 1))


def test_all_linear_reaches_gpt2_conv1d_layers_but_not_the_head():
    from peft import get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer.parallel import lora_config

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64))
    peft_model = get_peft_model(model, lora_config(LoraSettings()))
    targeted = {n.split(".")[-1] for n in peft_model.peft_config["default"].target_modules}
    assert targeted == {"c_attn", "c_proj", "c_fc"}


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    from trainer.ckpt import PolicyRef, load_trainable
    from trainer.step import build_micro_batch, make_logprob_module

    folder = tiny_llama_dir(tmp_path)
    parent = PolicyRef("p", "p", str(folder), "full", str(folder))
    mb = build_micro_batch(random_samples(12), 64, 0)
    grads = []
    for checkpointing in (False, True):
        model, _, _ = load_trainable(parent, "full", LoraSettings(), 0, Placement("cpu", "float32", checkpointing))
        layer = model.model.layers[0]
        assert layer.gradient_checkpointing is checkpointing
        model.train()
        logp, _ = make_logprob_module(model, 1.0)(mb.input_ids, mb.position_ids, mb.pred_index, mb.target_ids)
        (-(logp * mb.advantages).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5), name


def _loss():
    from flywheel.core.settings.trainer import LossSettings

    return LossSettings()


# --------------------------------------------------------------------------- token budget


def test_micro_batches_stay_within_the_token_budget():
    """The packed tensor of every micro-batch (rows x width, padding included) stays within the budget."""
    budget, row = 200, 64
    step = StepSettings(micro_batch_tokens=budget, pack_row_tokens=row)
    for seed in range(20):
        samples = random_samples(60, seed=seed, low=3, high=50)
        batches = micro_batches(samples, step, 0)
        assert sum(mb.n_tokens for mb in batches) == sum(s.length for s in samples)
        for mb in batches:
            assert mb.n_tokens <= budget
            assert mb.input_ids.shape[1] <= row
            assert mb.input_ids.numel() <= budget


def test_a_sample_longer_than_the_budget_is_alone_in_its_micro_batch():
    step = StepSettings(micro_batch_tokens=100, pack_row_tokens=64)
    long = StepSample(0, list(range(1, 61)) * 3, [1, 2, 3], [1, 1, 1], [-1.0] * 3, 1.0, 0.0)
    samples = random_samples(10, seed=3)
    batches = micro_batches([*samples[:5], long, *samples[5:]], step, 0)
    holding = [mb for mb in batches if 0 in mb.sample_ids and mb.n_tokens > 100]
    assert len(holding) == 1 and holding[0].sample_ids == [0]
    assert holding[0].input_ids.shape == (1, long.length)  # one row of its own: over the budget, not split
    assert all(mb.input_ids.numel() <= 100 for mb in batches if mb is not holding[0])


def test_a_long_sample_does_not_widen_the_micro_batches_of_short_ones():
    """A sample longer than a packing row gets a row as wide as itself; short samples are not padded to it."""
    budget, row = 512, 64
    step = StepSettings(micro_batch_tokens=budget, pack_row_tokens=row)
    long = StepSample(0, list(range(1, 301)), [1, 2, 3], [1, 1, 1], [-1.0] * 3, 1.0, 0.0)
    samples = [*random_samples(40, seed=5, low=3, high=30)[1:], long]
    batches = micro_batches(samples, step, 0)
    assert sum(mb.n_tokens for mb in batches) == sum(s.length for s in samples)
    for mb in batches:
        assert mb.input_ids.numel() <= max(budget, max(s.length for s in samples if s.sample_id in mb.sample_ids))


# --------------------------------------------------------------------------- sharded reading, streamed saving


def test_row_slices_of_every_rank_rebuild_the_plain_load(tmp_path):
    """What each FSDP rank reads (its rows of every tensor) concatenates to the full weights, for a
    plain checkpoint and for a LoRA checkpoint merged into it (as peft merges)."""
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.parallel import lora_config, merge_config_of

    folder = tiny_llama_dir(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    peft_model = get_peft_model(plain, lora_config(LoraSettings(rank=4)))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.normal_()
    peft_model.save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    fresh = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()

    files = TensorFiles(folder)
    source = Source(files)
    merging = Source(
        files,
        merge=TensorFiles(tmp_path / "adapter", ("adapter_model.safetensors",)),
        merge_config=merge_config_of(tmp_path / "adapter"),
    )
    for world in (2, 3):
        for name, want in fresh.items():
            for src, expected in ((source, want), (merging, merged[name])):
                chunk = -(-want.shape[0] // world)
                parts = [
                    src.rows(name, tuple(want.shape), r * chunk, min((r + 1) * chunk, want.shape[0]))
                    for r in range(world)
                ]
                assert torch.allclose(torch.cat(parts), expected, atol=1e-6), name


def test_streamed_safetensors_file_reads_back(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "a.weight": torch.randn(5, 3),
        "b.weight": torch.randn(7).to(torch.bfloat16),
        "c.steps": torch.arange(4),
        "empty": torch.zeros(0, 2),
    }
    save_streaming(list(tensors.items()), tmp_path / "model.safetensors")
    back = load_file(str(tmp_path / "model.safetensors"))
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name
