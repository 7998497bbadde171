"""flywheel.model.check: every kind of bad model folder gets an error naming what is wrong.

The good folders are tiny zoo models (random weights, built in seconds); each bad case is a
copy damaged one way. vLLM's registry is really consulted (imported once, a few seconds).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flywheel.model.check import (
    SINGLE_WEIGHTS,
    WEIGHT_INDEX,
    ModelCheckError,
    check_model,
    content_hash,
    model_policy_version,
)
from flywheel.model.zoo import build_zoo_model


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zoo")
    return {name: build_zoo_model(name, root / name) for name in ("qwen3", "mistral")}


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def copy_of(built: dict[str, Path], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(built[name], tmp_path / f"copy-{name}"))


def edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def refused(folder: Path, cache: Path, *fragments: str, completion_only: bool = False) -> str:
    with pytest.raises(ModelCheckError) as caught:
        check_model(folder, completion_only=completion_only, cache_dir=cache)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_good_folder_is_described_and_named_by_its_content(built, cache):
    info = check_model(built["qwen3"], cache_dir=cache)
    assert info.architecture == "Qwen3ForCausalLM" and info.model_type == "qwen3"
    assert info.dtype == "float32" and info.chat_template and not info.completion_only
    assert info.shard_files == [SINGLE_WEIGHTS] and info.max_positions == 1024
    assert info.parameters > 100_000 and info.vocab_size is not None and info.vllm_version
    assert len(info.content_hash) == 64 and info.policy_version == f"base-{info.content_hash[:12]}"
    assert model_policy_version(built["qwen3"], cache) == info.policy_version
    sharded = check_model(built["mistral"], cache_dir=cache)
    assert len(sharded.shard_files) == 2 and sharded.architecture == "MistralForCausalLM"
    assert sharded.content_hash != info.content_hash


def test_the_hash_follows_the_bytes_and_is_cached(built, cache, tmp_path):
    folder = copy_of(built, "qwen3", tmp_path)
    first = content_hash(folder, cache)
    assert first == content_hash(built["qwen3"], cache)  # same bytes elsewhere: same identity
    assert list((cache / ".checks").iterdir())  # the result was cached
    weights = folder / SINGLE_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert content_hash(folder, cache) != first


def test_a_missing_folder_or_config(tmp_path, cache):
    refused(tmp_path / "nowhere", cache, "no such folder")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", cache, "no config.json", "not a Hugging Face model folder")


def test_an_unparseable_config(built, cache, tmp_path):
    folder = copy_of(built, "qwen3", tmp_path)
    (folder / "config.json").write_text("{not json")
    refused(folder, cache, "config.json", "does not parse")


def test_a_folder_that_is_not_a_causal_lm(built, cache, tmp_path):
    folder = copy_of(built, "qwen3", tmp_path)
    edit_config(folder, architectures=["BertForMaskedLM"], model_type="bert")
    refused(folder, cache, "BertForMaskedLM", "not a causal language model")


def test_an_architecture_the_installed_vllm_does_not_serve(built, cache, tmp_path):
    folder = copy_of(built, "qwen3", tmp_path)
    edit_config(folder, architectures=["GPTNeoForCausalLM"], model_type="gpt_neo")
    refused(folder, cache, "GPTNeoForCausalLM", "not served by the installed vLLM")


def test_a_missing_tokenizer(built, cache, tmp_path):
    folder = copy_of(built, "qwen3", tmp_path)
    (folder / "tokenizer.json").unlink()
    refused(folder, cache, "no tokenizer")


def test_a_broken_tokenizer(built, cache, tmp_path):
    folder = copy_of(built, "qwen3", tmp_path)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": 17}')
    refused(folder, cache, "tokenizer does not load")


def test_an_unknown_dtype(built, cache, tmp_path):
    folder = copy_of(built, "qwen3", tmp_path)
    edit_config(folder, dtype="float13")
    refused(folder, cache, "dtype 'float13'")


def test_a_truncated_shard(built, cache, tmp_path):
    folder = copy_of(built, "qwen3", tmp_path)
    weights = folder / SINGLE_WEIGHTS
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size - 1000)
    refused(folder, cache, SINGLE_WEIGHTS, "truncated", f"{size - 1000} bytes", f"says {size}")


def test_a_shard_listed_in_the_index_is_missing(built, cache, tmp_path):
    folder = copy_of(built, "mistral", tmp_path)
    shards = sorted(set(json.loads((folder / WEIGHT_INDEX).read_text())["weight_map"].values()))
    (folder / shards[1]).unlink()
    refused(folder, cache, WEIGHT_INDEX, "missing", shards[1])


def test_a_tensor_the_index_places_in_the_wrong_shard(built, cache, tmp_path):
    folder = copy_of(built, "mistral", tmp_path)
    index = json.loads((folder / WEIGHT_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(t for t, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (folder / WEIGHT_INDEX).write_text(json.dumps(index))
    refused(folder, cache, name, f"not in {shards[1]}")


def test_weights_only_in_pytorch_format(built, cache, tmp_path):
    folder = copy_of(built, "qwen3", tmp_path)
    (folder / SINGLE_WEIGHTS).rename(folder / "pytorch_model.bin")
    refused(folder, cache, "no model.safetensors", "pytorch_model.bin", "convert the weights to safetensors")


def test_a_nan_tensor(built, cache, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    folder = copy_of(built, "qwen3", tmp_path)
    tensors = load_file(folder / SINGLE_WEIGHTS)
    name = sorted(tensors)[-1]
    tensors[name].view(-1)[3] = float("nan")
    save_file(tensors, folder / SINGLE_WEIGHTS, metadata={"format": "pt"})
    assert not bool(torch.isfinite(load_file(folder / SINGLE_WEIGHTS)[name]).all())
    refused(folder, cache, name, "1 non-finite values")


def test_no_chat_template_needs_completion_only(built, cache, tmp_path):
    folder = copy_of(built, "qwen3", tmp_path)
    (folder / "chat_template.jinja").unlink()
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    refused(folder, cache, "no chat template", "--completion-only")
    info = check_model(folder, completion_only=True, cache_dir=cache)
    assert info.completion_only and not info.chat_template
