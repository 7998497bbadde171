"""Checkpoints on disk: staged in a temporary folder, fsynced, renamed into place.

A checkpoint folder ``<checkpoint_dir>/<checkpoint_id>/`` is either

- ``full``: a Hugging Face model folder (``config.json``, ``model.safetensors``, tokenizer,
  ``generation_config.json``) that transformers and vLLM load, or
- ``lora``: a peft adapter (``adapter_config.json``, ``adapter_model.safetensors``) over
  the full model named by ``base_model``, plus the tokenizer,

and always ``flywheel_checkpoint.json``, written last: a
:class:`flywheel.core.contracts.checkpoint.CheckpointSidecar` (the shape lives in the core; this
module writes and reads it). Everything is written under ``.tmp-<id>-*`` in the same folder,
fsynced, and renamed; a reader never sees a partial checkpoint. The registry row is inserted
only after the rename (see ``trainer.cycle``); a crash between the two leaves an *orphan*
folder, which :func:`sweep` (run by the next cycle, under the cycle lock) removes together with any
leftover temporary folders. A checkpoint folder therefore belongs to one registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.core.contracts.checkpoint import SIDECAR_NAME, CheckpointSidecar, Format
from flywheel.core.fsutil import fsync_dir, fsync_tree
from flywheel.core.settings.trainer import LoraSettings
from trainer.parallel import CPU_FP32, Placement, init_fresh_adapter, lora_config, place

# torch, transformers and peft are imported inside the functions that use them: trainer.cycle
# imports this module in processes that never train (``flywheel-trainer check``).

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
FULL_FILES = ("config.json", "model.safetensors", "tokenizer.json", SIDECAR_NAME)
LORA_FILES = ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", SIDECAR_NAME)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (not recoverable by retrying as is)."""


def sample_ids_hash(ids: Iterable[int]) -> str:
    """SHA-256 of the sorted sample ids."""
    return hashlib.sha256(",".join(str(i) for i in sorted(ids)).encode()).hexdigest()


def config_hash(config: dict[str, Any]) -> str:
    """SHA-256 of a JSON-ready config dict (keys sorted)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def required_files(fmt: Format) -> Sequence[str]:
    """Files a complete checkpoint of format ``fmt`` holds."""
    return FULL_FILES if fmt == "full" else LORA_FILES


def is_complete(folder: Path, fmt: Format) -> bool:
    """True when ``folder`` holds every file of a finished checkpoint."""
    return all((folder / name).is_file() for name in required_files(fmt))


def stage(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, root: Path, checkpoint_id: str) -> Path:
    """Write weights (or the adapter) and tokenizer into a new temporary folder under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{checkpoint_id}-", dir=root))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    return tmp


def publish(tmp: Path, sidecar: CheckpointSidecar, root: Path) -> Path:
    """Write the sidecar into ``tmp``, fsync everything, rename to ``root/<id>``; return that path."""
    (tmp / SIDECAR_NAME).write_text(sidecar.model_dump_json(indent=2) + "\n")
    if not is_complete(tmp, sidecar.format):
        missing = [n for n in required_files(sidecar.format) if not (tmp / n).is_file()]
        raise CheckpointError(f"checkpoint {sidecar.checkpoint_id} is missing {missing} in {tmp}")
    fsync_tree(tmp)
    target = root / sidecar.checkpoint_id
    if target.exists():
        raise CheckpointError(f"{target} already exists; checkpoint ids must be unique")
    os.rename(tmp, target)
    fsync_dir(root)
    return target


def read_sidecar(folder: Path | str) -> CheckpointSidecar:
    """The sidecar of a checkpoint folder."""
    return CheckpointSidecar.model_validate_json((Path(folder) / SIDECAR_NAME).read_text())


def sweep(root: Path, known_ids: set[str]) -> list[Path]:
    """Remove leftover temporary folders and orphans (a sidecar but no registry row); return them.

    Call only while holding the cycle lock: no other cycle can be writing then.
    """
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        orphan = not entry.name.startswith(".") and (entry / SIDECAR_NAME).is_file() and entry.name not in known_ids
        if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)) or orphan:
            shutil.rmtree(entry)
            removed.append(entry)
    return removed


def delete(folder: Path) -> None:
    """Remove a checkpoint folder: renamed aside first, so it is never seen half deleted."""
    if not folder.exists():
        return
    trash = folder.with_name(f"{TRASH_PREFIX}{folder.name}-{os.getpid()}")
    os.rename(folder, trash)
    shutil.rmtree(trash)


def load_policy(
    path: Path | str, fmt: Format, base_model: str | None, trainable: bool, placement: Placement | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a checkpoint (a peft model for ``lora``) and its tokenizer, placed by ``placement``.

    Without a placement: float32 on the CPU. With one (``trainer.parallel.place``): on its device,
    trainable weights float32 and frozen ones in its compute dtype (a LoRA adapter's base, or a
    model loaded only to evaluate), gradient checkpointing and autocast as it says.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    placement = placement or CPU_FP32
    frozen = placement.compute_dtype()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if fmt == "full":
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32 if trainable else frozen)
        model.requires_grad_(trainable)
    elif fmt == "lora":
        from peft import PeftModel

        if base_model is None:
            raise CheckpointError(f"LoRA checkpoint {path} names no base model")
        base = AutoModelForCausalLM.from_pretrained(base_model, dtype=frozen)
        model = PeftModel.from_pretrained(base, str(path), is_trainable=trainable)
    else:
        raise CheckpointError(f"unknown checkpoint format {fmt!r}")
    place(model, placement, trainable)
    model.eval()
    return model, tokenizer


# --------------------------------------------------------------------------- policies to train


@dataclass(frozen=True)
class PolicyRef:
    """Where a registered checkpoint lives (plain data, so it can cross to torchrun workers)."""

    id: str
    policy_version: str
    path: str
    format: Format
    base_model: str


def load_trainable(
    parent: PolicyRef, mode: Format, lora: LoraSettings, seed: int, placement: Placement | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """The parent as a trainable policy in ``mode``, its tokenizer, and the new checkpoint's ``base_model``.

    - full from full: every weight trainable; full from LoRA: the adapter merged first (into a
      float32 base: trained weights are float32 whatever the compute dtype).
    - LoRA from full: a fresh adapter over the parent, initialised by parameter name and ``seed``
      (``trainer.parallel.fresh_adapter_value``: the same numbers as a sharded load); LoRA from
      LoRA: the parent's adapter keeps training over the same base. The adapter is float32,
      the frozen base in the placement's compute dtype.

    ``placement`` (``trainer.parallel.resolve(settings.hardware)``) defaults to float32 on the CPU.
    Under torchrun with FSDP, ``trainer.parallel.load_sharded`` is the sharded equivalent.
    """
    import torch

    placement = placement or CPU_FP32
    if mode == "full":
        if parent.format == "lora":
            model, tokenizer = load_policy(parent.path, "lora", parent.base_model, trainable=False, placement=CPU_FP32)
            model = model.merge_and_unload()
        else:
            model, tokenizer = load_policy(parent.path, "full", None, trainable=True, placement=CPU_FP32)
        model.requires_grad_(True)
        return place(model, placement, trainable=True), tokenizer, parent.base_model
    if mode != "lora":
        raise CheckpointError(f"unknown training mode {mode!r}")
    if parent.format == "lora":
        model, tokenizer = load_policy(parent.path, "lora", parent.base_model, trainable=True, placement=placement)
        return model, tokenizer, parent.base_model
    from peft import get_peft_model

    model, tokenizer = load_policy(parent.path, "full", None, trainable=False, placement=CPU_FP32)
    torch.manual_seed(seed)
    model = get_peft_model(model, lora_config(lora))
    init_fresh_adapter(model, seed)
    return place(model, placement, trainable=True), tokenizer, str(Path(parent.path).resolve())
