"""The offline base model: built once (cached), complete, loadable, and competent but imperfect."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from flywheel.core.settings import ModelSettings, get_settings
from flywheel.model import build as builder
from flywheel.model.check import check_model
from flywheel.model.eval import heldout_success, load_policy
from flywheel.task import arith

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]  # a cold build on a busy machine is slow


@pytest.fixture(scope="module")
def settings() -> ModelSettings:
    """The project's default model settings (so the cached build is the one everyone uses)."""
    return get_settings().model


@pytest.fixture(scope="module")
def model_dir(settings: ModelSettings) -> Path:
    return builder.build_model(settings)


def test_folder_is_complete(model_dir: Path, settings: ModelSettings) -> None:
    assert model_dir.name == builder.build_key(settings)
    assert model_dir.parent == Path(settings.cache_dir).resolve()
    for name in builder.REQUIRED_FILES:
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["hidden_size"] // config["num_attention_heads"] >= 64
    assert config.get("head_dim", 64) >= 64
    assert config["max_position_embeddings"] >= 256
    generation = json.loads((model_dir / "generation_config.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|eot|>"
    assert generation["eos_token_id"] == config["eos_token_id"]


def test_loads_with_transformers(model_dir: Path) -> None:
    import torch

    model, tokenizer = load_policy(model_dir)
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.head_dim >= 64
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|eot|>")
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.config.vocab_size >= len(tokenizer)


def test_chat_template_and_digits(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    messages = arith.render_messages(arith.Problem(37, "*", 48))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|bos|><|system|>")
    assert prompt.endswith("<|user|>What is 37*48?<|eot|><|assistant|>")
    full = messages + [
        {"role": "assistant", "content": "<calc>37*48</calc>"},
        {"role": "tool", "content": "1776"},
        {"role": "assistant", "content": "answer: 1776"},
    ]
    rendered = tokenizer.apply_chat_template(full, tokenize=False)
    assert rendered.endswith("<|tool|>1776<|eot|><|assistant|>answer: 1776<|eot|>")
    ids = tokenizer.encode("answer: -1234567890", add_special_tokens=False)
    assert tokenizer.decode(ids) == "answer: -1234567890"
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == list("1234567890")  # one digit per token
    with pytest.raises(Exception, match="unsupported role"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


def test_sidecar_success_in_range_and_reproducible(model_dir: Path) -> None:
    sidecar = builder.read_sidecar(model_dir)
    assert sidecar.build_key == model_dir.name
    # the content hash's version, as every base model is named (flywheel.model.check)
    assert sidecar.policy_version == check_model(model_dir, cache_dir=model_dir.parent).policy_version
    assert sidecar.param_count > 100_000
    assert sidecar.pretrain.final_loss is not None and sidecar.pretrain.final_loss < 1.0
    held = sidecar.heldout
    assert held.n == 200 and held.temperature == 1.0
    assert 0.10 <= held.success_rate <= 0.60, held
    again = heldout_success(model_dir, n=held.n, seed=held.seed, temperature=held.temperature)
    assert again.n == held.n
    assert abs(again.success_rate - held.success_rate) <= 0.02  # same seed: same problems and samples
    other = heldout_success(model_dir, n=200, seed=held.seed + 1)
    assert abs(other.success_rate - held.success_rate) <= 0.15  # fresh problems and samples


def test_calibration_keeps_the_attempt_nearest_the_band(model_dir: Path) -> None:
    attempts = builder.read_sidecar(model_dir).calibration
    assert 1 <= len(attempts) <= builder.CALIBRATION_ATTEMPTS
    assert [a.attempt for a in attempts] == list(range(len(attempts)))
    assert len({a.seed for a in attempts}) == len(attempts), "each attempt pre-trains from its own seed"
    chosen = [a for a in attempts if a.chosen]
    assert len(chosen) == 1, attempts
    distance = builder._band_distance
    assert distance(chosen[0].calibration_success) == min(distance(a.calibration_success) for a in attempts)
    if len(attempts) < builder.CALIBRATION_ATTEMPTS:  # it stopped early: the last attempt was in the band
        assert distance(attempts[-1].calibration_success) == 0.0 and chosen[0] == attempts[-1]
    # what was kept is what the chosen attempt measured (same calibration problems and sampling seed)
    again = heldout_success(
        model_dir, n=builder.EVAL_N, seed=builder.CALIBRATION_SEED, temperature=builder.EVAL_TEMPERATURE
    )
    assert abs(again.success_rate - chosen[0].calibration_success) <= 0.02


def test_greedy_eval_runs_whole_episodes(model_dir: Path) -> None:
    result = heldout_success(model_dir, n=40, temperature=0.0)
    assert result.n == 40 and sum(result.finish_reasons.values()) == 40
    assert 0.0 <= result.tool_call_rate <= 1.0


def test_second_call_reuses_the_cached_folder(model_dir: Path, settings: ModelSettings) -> None:
    stamp = os.stat(model_dir / "model.safetensors").st_mtime_ns
    started = time.perf_counter()
    assert builder.build_model(settings) == model_dir
    assert time.perf_counter() - started < 1.0
    assert os.stat(model_dir / "model.safetensors").st_mtime_ns == stamp


def test_corpus_matches_the_served_chat_format(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    chats = builder.demonstrations(30, random.Random(5))
    corpus = builder.tokenize_corpus(tokenizer, chats)
    for chat, ids, mask in zip(chats, corpus.ids, corpus.masks):
        assert ids == list(tokenizer.apply_chat_template(chat, tokenize=True)["input_ids"])
        trained = tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
        expected = "".join(m["content"] + "<|eot|>" for m in chat if m["role"] == "assistant")
        assert trained == expected


def test_corpus_and_tokenizer_are_deterministic() -> None:
    from flywheel.model.tokenizer import train_tokenizer

    def make() -> tuple[list[list[dict[str, str]]], dict[str, int]]:
        chats = builder.demonstrations(500, random.Random("seed"))
        tokenizer = train_tokenizer((m["content"] for chat in chats for m in chat), 512)
        return chats, tokenizer.get_vocab()

    first, second = make(), make()
    assert first == second
    problems = {arith.problem_from_id(f"{arith.TASK_VERSION}:{c[1]['content'][8:-1]}") for c in first[0]}
    assert all(p.split == "train" for p in problems)


def test_build_key_depends_on_settings_not_on_cache_dir(settings: ModelSettings, tmp_path: Path) -> None:
    moved = settings.model_copy(update={"cache_dir": tmp_path})
    assert builder.build_key(moved) == builder.build_key(settings)
    assert builder.build_key(settings.model_copy(update={"seed": settings.seed + 1})) != builder.build_key(settings)
    # choosing another base model does not change what the project's build is
    chosen = settings.model_copy(update={"path": tmp_path, "completion_only": True})
    assert builder.build_key(chosen) == builder.build_key(settings)
