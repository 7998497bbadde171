"""A zoo of tiny base models of other architectures, for tests and benchmarks.

``zoo_model("qwen3")`` returns the folder of a small randomly initialised model of that
architecture (``ARCHITECTURES``: qwen3, mistral, gpt2, gemma), built on first use and cached
under ``<model.cache_dir>/zoo/<name>-<key>/``. Each is a plain Hugging Face folder: float32
safetensors weights, the project's byte-level BPE tokenizer (trained on the calculator task's
demonstrations, :mod:`flywheel.model.tokenizer`) with its chat template, a generation config,
and ``zoo.json`` saying what it is. ``mistral`` is saved as two safetensors shards with an
index; the others as one ``model.safetensors``.

Shapes suit vLLM on the CPU: head_dim 64 (its CPU attention rejects smaller heads), 2 layers,
hidden 128, 1,024 positions. The weights are random (seeded): the models serve and train,
they do not solve the task. A zoo model is a base model like any other: register it with
``flywheel model register`` or select it with ``FLYWHEEL_MODEL__PATH``.

From a pytest fixture::

    @pytest.fixture(scope="session", params=ARCHITECTURES)
    def zoo_dir(request):
        return zoo_model(request.param)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from flywheel.core.fsutil import fsync_dir, fsync_tree
from flywheel.model.check import SINGLE_WEIGHTS, WEIGHT_INDEX

ZOO_VERSION = "1"
"""Bump when a zoo model's recipe changes (its cache key changes with it)."""
MARKER = "zoo.json"
HIDDEN = 128
HEAD_DIM = 64
LAYERS = 2
HEADS = 2
KV_HEADS = 1
INTERMEDIATE = 256
MAX_POSITIONS = 1024
VOCAB = 512
TOKENIZER_CHATS = 1500
SEED = 0

ARCHITECTURES = ("qwen3", "mistral", "gpt2", "gemma")
"""Names ``zoo_model`` builds."""
SHARDED = ("mistral",)
"""Zoo models saved as two safetensors shards with an index."""


class ZooError(ValueError):
    """An unknown zoo name, or a build that did not produce what it should."""


def zoo_model(name: str, cache_dir: Path | str | None = None, force: bool = False) -> Path:
    """The folder of the tiny ``name`` model, built (atomically) on first use and cached.

    ``cache_dir`` defaults to the settings' ``model.cache_dir``; the model lives in its
    ``zoo/`` folder. Concurrent callers may both build; the first rename wins.
    """
    if name not in ARCHITECTURES:
        raise ZooError(f"unknown zoo model {name!r}; known: {', '.join(ARCHITECTURES)}")
    if cache_dir is None:
        from flywheel.core.settings import get_settings

        cache_dir = get_settings().model.cache_dir
    root = Path(cache_dir).resolve() / "zoo"
    target = root / f"{name}-{zoo_key(name)}"
    if (target / MARKER).is_file() and not force:
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    os.chmod(tmp, 0o755)
    try:
        build_zoo_model(name, tmp)
        fsync_tree(tmp)
        if target.exists():
            if (target / MARKER).is_file() and not force:
                return target
            trash = root / f".trash-{target.name}-{os.getpid()}"
            os.rename(target, trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if (target / MARKER).is_file():
                return target  # a concurrent build of the same key finished first
            raise
        fsync_dir(root)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def zoo_key(name: str) -> str:
    """Hash of everything that determines the zoo model ``name``."""
    payload = {"name": name, "version": ZOO_VERSION, "config": model_config_kwargs(name, VOCAB), "seed": SEED}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def model_config_kwargs(name: str, vocab_size: int) -> dict[str, Any]:
    """The config of zoo model ``name`` (without token ids), as keyword arguments."""
    if name == "gpt2":
        return {"vocab_size": vocab_size, "n_positions": MAX_POSITIONS, "n_embd": HIDDEN, "n_layer": LAYERS,
                "n_head": HEADS, "n_inner": INTERMEDIATE}  # fmt: skip
    common = {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POSITIONS,
    }
    if name == "qwen3":
        return common | {"tie_word_embeddings": False}
    if name == "mistral":
        return common | {"sliding_window": None, "tie_word_embeddings": False}
    if name == "gemma":
        return common  # Gemma ties its embeddings
    raise ZooError(f"unknown zoo model {name!r}; known: {', '.join(ARCHITECTURES)}")


def build_zoo_model(name: str, folder: Path) -> Path:
    """Build zoo model ``name`` into ``folder`` (created if needed; not atomic: see :func:`zoo_model`)."""
    import torch
    from transformers import AutoModelForCausalLM, GemmaConfig, GenerationConfig, GPT2Config, MistralConfig, Qwen3Config

    from flywheel.model.build import demonstrations
    from flywheel.model.tokenizer import train_tokenizer

    config_class = {"qwen3": Qwen3Config, "mistral": MistralConfig, "gpt2": GPT2Config, "gemma": GemmaConfig}
    if name not in config_class:
        raise ZooError(f"unknown zoo model {name!r}; known: {', '.join(ARCHITECTURES)}")
    chats = demonstrations(TOKENIZER_CHATS, random.Random(f"flywheel-zoo:{SEED}"))
    tokenizer = train_tokenizer((m["content"] for chat in chats for m in chat), VOCAB)
    tokenizer.model_max_length = MAX_POSITIONS
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    config = config_class[name](**model_config_kwargs(name, len(tokenizer)), **ids)
    config.dtype = "float32"
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.generation_config = GenerationConfig(**ids, do_sample=True, temperature=1.0, top_p=1.0, max_new_tokens=32)
    folder.mkdir(parents=True, exist_ok=True)
    shard_size = None
    if name in SHARDED:
        total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        shard_size = int(total * 0.6)  # two shards: no single tensor is near 40 % of the model
    model.save_pretrained(folder, safe_serialization=True, **({"max_shard_size": shard_size} if shard_size else {}))
    tokenizer.save_pretrained(folder)
    _require_layout(name, folder)
    marker = {"name": name, "key": zoo_key(name), "zoo_version": ZOO_VERSION, "architecture": config.architectures,
              "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return folder


def _require_layout(name: str, folder: Path) -> None:
    if name in SHARDED:
        index = folder / WEIGHT_INDEX
        shards = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else set()
        if len(shards) != 2 or (folder / SINGLE_WEIGHTS).exists():
            raise ZooError(f"zoo model {name} should be two shards with an index; {folder} has {sorted(shards)}")
    elif not (folder / SINGLE_WEIGHTS).is_file():
        raise ZooError(f"zoo model {name}: save_pretrained wrote no {SINGLE_WEIGHTS} in {folder}")
