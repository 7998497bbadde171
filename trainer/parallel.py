"""The policy on real hardware: device, precision, gradient checkpointing, and FSDP2 without a full copy.

**Placement** (:func:`resolve`, from ``trainer.hardware``): CUDA when asked for (or, with
``auto``, when torch sees a GPU), else the CPU; bf16 compute on CUDA, fp32 on the CPU unless
set; gradient checkpointing on CUDA. :func:`place` applies it to a loaded model:

- weights that train are **float32** (they are the master copy, and AdamW's state follows their
  dtype); weights that do not (a LoRA adapter's base) are stored in the compute dtype;
- with bf16 compute in one process, the backbone runs under ``torch.autocast`` (matmuls in bf16;
  norms, softmax and the log-probs' LM head outside it in fp32 where the weights are fp32);
- gradient checkpointing is transformers' own, non-reentrant (it also enables input gradients,
  which peft's frozen embeddings need).

**FSDP2 under torchrun** (:func:`load_sharded`): the model is built from its config with no
storage (``accelerate.init_empty_weights``; buffers such as rotary frequencies are real, they
are small), LoRA layers injected, then :func:`shard_policy` applies ``fully_shard`` to every
decoder layer and one grouped ``fully_shard`` to the modules left outside them (embeddings,
final norm, LM head: one group, so tied weights stay one parameter), with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` when computing in bf16. The
storage is then allocated shard by shard (``to_empty``) and each rank reads only its rows of
every tensor from the safetensors files (``safe_open(...).get_slice``): no rank ever holds the
whole model. A LoRA parent's adapter is read the same way; a fresh adapter is initialised by
parameter name (:func:`fresh_adapter_value`), so a sharded and a plain load agree bit for bit;
a full update from a LoRA parent merges each shard's rows of ``B @ A`` into the base rows.

:func:`save_streaming` writes the trained result as one safetensors file on rank 0, one tensor
gathered at a time, so the full state dict is never held either.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from flywheel.core.settings.trainer import HardwareSettings, LoraSettings

# torch, transformers, peft and safetensors are imported inside the functions that use them.

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from trainer.ckpt import PolicyRef

ADAPTER_NAME = "default"
WEIGHT_FILES = ("model.safetensors",)
WEIGHT_INDEX = "model.safetensors.index.json"
ADAPTER_FILE = "adapter_model.safetensors"


class HardwareError(RuntimeError):
    """The hardware settings cannot be honoured on this machine (names the setting)."""


# --------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Placement:
    """Resolved ``trainer.hardware``: where the policy lives and how it computes."""

    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype (trained weights stay float32 whatever it is)."""
    gradient_checkpointing: bool = False

    def torch_device(self) -> torch.device:
        """The torch device (the current CUDA device under torchrun)."""
        import torch

        if self.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def compute_dtype(self) -> torch.dtype:
        import torch

        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32


CPU_FP32 = Placement()
"""The placement of every load before ``trainer.hardware`` existed (and the CPU default)."""


def resolve(hw: HardwareSettings, cuda_available: bool | None = None) -> Placement:
    """``trainer.hardware`` resolved on this machine (``cuda_available`` given: pretend, for tests)."""
    probe = cuda_available is None
    if probe:
        import torch

        cuda_available = torch.cuda.is_available()
    if hw.device == "cuda" and not cuda_available:
        raise HardwareError("trainer.hardware.device is 'cuda' but torch sees no CUDA device")
    device: Literal["cpu", "cuda"] = (
        "cuda" if hw.device == "cuda" or (hw.device == "auto" and cuda_available) else "cpu"
    )
    dtype: Literal["float32", "bfloat16"]
    if hw.dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    else:
        dtype = hw.dtype
    if probe and device == "cuda" and dtype == "bfloat16":
        import torch

        if not torch.cuda.is_bf16_supported():
            raise HardwareError("trainer.hardware.dtype resolves to 'bfloat16' but this GPU has no bf16 support")
    checkpointing = hw.gradient_checkpointing == "on" or (hw.gradient_checkpointing == "auto" and device == "cuda")
    return Placement(device, dtype, checkpointing)


def causal_lm(model: Any) -> Any:
    """The ``*ForCausalLM`` inside a peft model, or ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone(model: Any) -> Any:
    """The transformer under the LM head (``model.model`` for Llama and Qwen, ``transformer`` for GPT-2)."""
    lm = causal_lm(model)
    return getattr(lm, lm.base_model_prefix)


def cast_params(model: torch.nn.Module, compute: torch.dtype) -> None:
    """Trainable parameters to float32, frozen ones to ``compute`` (works on the meta device too)."""
    import torch

    for param in model.parameters():
        want = torch.float32 if param.requires_grad else compute
        if param.is_floating_point() and param.dtype != want:
            param.data = param.data.to(want)


def enable_checkpointing(model: Any) -> None:
    """Non-reentrant gradient checkpointing per decoder layer, input gradients on (peft's frozen embeddings)."""
    causal_lm(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def install_autocast(model: Any, device_type: str, dtype: torch.dtype) -> None:
    """Run the backbone's forward under ``torch.autocast(device_type, dtype)`` (idempotent).

    The LM head stays outside, so trained-token logits come from fp32 weights in full
    fine-tuning. A fresh autocast context per call: the wrapper is re-entrant.
    """
    import torch

    body = backbone(model)
    if getattr(body, "_flywheel_autocast", None) == (device_type, dtype):
        return
    forward = body.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    body.forward = autocast_forward
    body._flywheel_autocast = (device_type, dtype)


def place(model: Any, placement: Placement, trainable: bool) -> Any:
    """Cast, move, checkpoint and autocast ``model`` for ``placement`` (one process); returns it."""
    compute = placement.compute_dtype()
    cast_params(model, compute)
    model.to(placement.torch_device())
    if trainable and placement.gradient_checkpointing:
        enable_checkpointing(model)
    if placement.dtype != "float32":
        install_autocast(model, placement.device, compute)
    return model


# --------------------------------------------------------------------------- LoRA


def lora_config(lora: LoraSettings) -> Any:
    """peft's ``LoraConfig`` for ``trainer.lora`` (``["all-linear"]`` becomes peft's shorthand)."""
    from peft import LoraConfig

    targets: str | list[str] = "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"flywheel-lora:{seed}:{name}".encode()).digest()[:8], "little")


def fresh_adapter_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial value of a new adapter's parameter ``name``: peft's scheme, seeded by the name.

    ``lora_A`` Kaiming-uniform (a = sqrt 5), ``lora_B`` zero (so the adapter starts as a no-op);
    ``lora_embedding_A`` zero, ``lora_embedding_B`` normal. Independent of how the model is built
    or sharded, so every rank and a plain load compute the same numbers.
    """
    import torch

    generator = torch.Generator().manual_seed(_name_seed(seed, name))
    value = torch.zeros(shape, dtype=torch.float32)
    if ".lora_A." in name:
        torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
    elif ".lora_embedding_B" in name:
        torch.nn.init.normal_(value, generator=generator)
    elif not (".lora_B." in name or ".lora_embedding_A" in name):
        raise HardwareError(f"no initialisation known for the adapter parameter {name!r}")
    return value


def init_fresh_adapter(model: torch.nn.Module, seed: int) -> None:
    """Initialise every trainable adapter parameter with :func:`fresh_adapter_value` (plain, unsharded)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(fresh_adapter_value(name, tuple(param.shape), seed))


# --------------------------------------------------------------------------- reading by slices


class TensorFiles:
    """The tensors of a folder's safetensors files, read by rows without loading a file whole."""

    def __init__(self, folder: Path, files: tuple[str, ...] = WEIGHT_FILES) -> None:
        from safetensors import safe_open

        self.folder = folder
        index = folder / WEIGHT_INDEX
        if index.is_file() and files == WEIGHT_FILES:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        else:
            names = [f for f in files if (folder / f).is_file()]
            if not names:
                raise HardwareError(f"no {' or '.join(files)} in {folder}")
            weight_map = {}
        self._handles = {name: safe_open(str(folder / name), framework="pt", device="cpu") for name in names}
        for name, handle in self._handles.items():
            for key in handle.keys():
                weight_map.setdefault(key, name)
        self.weight_map = weight_map

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self.weight_map[key]].get_slice(key).get_shape())

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``key`` (the whole of a 0-d tensor)."""
        if key not in self.weight_map:
            raise HardwareError(f"tensor {key!r} is not in the safetensors files of {self.folder}")
        part = self._handles[self.weight_map[key]].get_slice(key)
        if len(part.get_shape()) == 0:
            return part[...]
        return part[start:stop]

    def columns(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Columns ``start:stop`` of the 2-d tensor ``key``."""
        return self._handles[self.weight_map[key]].get_slice(key)[:, start:stop]


@dataclass
class Source:
    """Where each parameter of a policy being built comes from."""

    base: TensorFiles
    """The full weights (a full checkpoint, or a LoRA checkpoint's base model)."""
    adapter: TensorFiles | None = None
    """A LoRA parent's adapter trained further (mode lora from lora)."""
    merge: TensorFiles | None = None
    """A LoRA parent's adapter merged into the base (mode full from lora)."""
    merge_config: dict[str, Any] | None = None
    fresh_seed: int | None = None
    """Seed of a new adapter (mode lora from full)."""

    def rows(self, name: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the model parameter (or buffer) called ``name``."""
        import torch

        if ".lora_" in name:
            if self.adapter is not None:
                return self.adapter.rows(adapter_key(name), start, stop)
            if self.fresh_seed is not None:
                return fresh_adapter_value(name, shape, self.fresh_seed)[start:stop]
            raise HardwareError(f"adapter parameter {name} has no source")
        key = base_key(name)
        value = self.base.rows(key, start, stop)
        if self.merge is not None:
            delta = self._merge_rows(key, start, stop)
            if delta is not None:
                value = (value.to(torch.float32) + delta).to(value.dtype)
        return value

    def _merge_rows(self, key: str, start: int, stop: int) -> torch.Tensor | None:
        """Rows of ``scale * B @ A`` for the base tensor ``key`` (None when no adapter targets it)."""
        assert self.merge is not None and self.merge_config is not None
        if not key.endswith(".weight"):
            return None
        stem = "base_model.model." + key[: -len("weight")]
        a_key, b_key = stem + "lora_A.weight", stem + "lora_B.weight"
        if a_key not in self.merge:
            return None
        config = self.merge_config
        rank = config["r"]
        scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
        a = self.merge.rows(a_key, 0, self.merge.shape(a_key)[0]).float()
        if config.get("fan_in_fan_out"):
            # Conv1D stores the weight (in, out): rows of (B @ A).T are columns of A.
            b = self.merge.rows(b_key, 0, self.merge.shape(b_key)[0]).float()
            return scale * (a[:, start:stop].T @ b.T)
        return scale * (self.merge.rows(b_key, start, stop).float() @ a)


def base_key(name: str) -> str:
    """The key of a model parameter in the full checkpoint (peft's prefix and ``base_layer`` removed)."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model.") :]
    return name.replace(".base_layer.", ".")


def adapter_key(name: str) -> str:
    """The key of an adapter parameter in ``adapter_model.safetensors`` (the adapter name removed, as peft saves)."""
    return name.replace(f".{ADAPTER_NAME}", "")


def merge_config_of(folder: Path) -> dict[str, Any]:
    """A LoRA adapter's config, refused when it uses what the row-wise merge does not implement."""
    config = json.loads((folder / "adapter_config.json").read_text())
    unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern") if config.get(k)]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if config.get("modules_to_save"):
        unsupported.append("modules_to_save")
    if unsupported:
        raise HardwareError(f"cannot merge the adapter in {folder} shard by shard: it uses {unsupported}")
    return config


# --------------------------------------------------------------------------- FSDP2


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The repeated blocks of the model (its ``_no_split_modules`` classes, e.g. ``LlamaDecoderLayer``)."""
    lm = causal_lm(model)
    names = set(getattr(lm, "_no_split_modules", None) or [])
    layers = [m for m in lm.modules() if type(m).__name__ in names]
    if not layers:
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise HardwareError(f"{type(lm).__name__}: no decoder layers found to shard")
    return layers


def is_sharded(model: torch.nn.Module) -> bool:
    """True once :func:`shard_policy` (or any ``fully_shard``) was applied inside ``model``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def mp_policy(placement: Placement) -> Any:
    """FSDP2 mixed precision: bf16 parameters in compute, fp32 gradient reduction (none in fp32)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if placement.dtype == "float32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=placement.compute_dtype(), reduce_dtype=torch.float32)


@functools.cache
def data_mesh(device_type: str) -> Any:
    """The 1-D mesh of all ranks on ``device_type`` (FSDP's default would pick CUDA whenever a GPU
    exists, even for a CPU run over gloo)."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (tdist.get_world_size(),))


def shard_policy(model: torch.nn.Module, policy: Any, device_type: str) -> None:
    """``fully_shard`` each decoder layer, then the modules outside them as one group (not the root)."""
    from torch.distributed.fsdp import fully_shard

    mesh = data_mesh(device_type)
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    inside = {id(p) for layer in layers for p in layer.parameters()}
    rest = [m for m in model.modules() if any(id(p) not in inside for p in m.parameters(recurse=False))]
    if rest:
        fully_shard(rest if len(rest) > 1 else rest[0], mesh=mesh, mp_policy=policy)


def wrap_for_dist(module: torch.nn.Module, strategy: str, world: int) -> torch.nn.Module:
    """DDP or FSDP2 around the step's log-prob ``module`` (whose ``policy`` is the model).

    FSDP2: the policy is sharded here unless :func:`load_sharded` did it already, and ``module``
    becomes the root (it owns no parameters: its forward is what runs every group).
    """
    if world == 1 or strategy == "none":
        return module
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module)
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = module.policy
        device_type = next(policy.parameters()).device.type
        if not is_sharded(policy):
            shard_policy(policy, MixedPrecisionPolicy(), device_type)
        fully_shard(module, mesh=data_mesh(device_type))
        return module
    raise ValueError(f"unknown distributed strategy {strategy!r}")


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The local tensor of ``param`` and the rows of the full tensor it holds (all of a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = param.to_local()
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if tuple(shape) != tuple(local.shape):
            raise HardwareError(f"unexpected shard layout {tuple(local.shape)} vs {tuple(shape)}")
        start = offset[0] if len(offset) else 0
        return local, start, start + (local.shape[0] if local.dim() else 0)
    return param, 0, param.shape[0] if param.dim() else 0


def load_sharded(
    parent: PolicyRef, mode: str, lora: LoraSettings, seed: int, placement: Placement
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """The parent as a trainable FSDP2-sharded policy (``load_trainable``'s meaning, under torchrun).

    Call in every rank after the process group is up; returns the model (decoder layers and the
    rest sharded, the root left to :func:`wrap_for_dist`), the tokenizer and the new ``base_model``.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = Path(parent.path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if parent.format == "full":
        base_dir = path
    elif parent.format == "lora":
        base_dir = Path(parent.base_model)
    else:
        raise HardwareError(f"unknown checkpoint format {parent.format!r}")
    source = Source(TensorFiles(base_dir))
    config = AutoConfig.from_pretrained(str(base_dir))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # not done under init_empty_weights; a tied LM head must stay one parameter
    if (base_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(base_dir))

    if mode == "full":
        if parent.format == "lora":
            source.merge = TensorFiles(path, (ADAPTER_FILE,))
            source.merge_config = merge_config_of(path)
        model.requires_grad_(True)
        base_model = parent.base_model
    elif mode == "lora":
        from peft import LoraConfig, get_peft_model

        model.requires_grad_(False)
        if parent.format == "lora":
            peft_config = LoraConfig.from_pretrained(str(path))
            peft_config.inference_mode = False
            source.adapter = TensorFiles(path, (ADAPTER_FILE,))
            base_model = parent.base_model
        else:
            peft_config = lora_config(lora)
            source.fresh_seed = seed
            base_model = str(path.resolve())
        model = get_peft_model(model, peft_config)
    else:
        raise HardwareError(f"unknown training mode {mode!r}")

    cast_params(model, placement.compute_dtype())
    if placement.gradient_checkpointing:
        enable_checkpointing(model)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    shard_policy(model, mp_policy(placement), placement.device)
    model.to_empty(device=placement.torch_device())
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            value = buffers[name]
            if base_key(name) in source.base:
                value = source.base.rows(base_key(name), 0, value.shape[0] if value.dim() else 0)
            buffer.copy_(value.to(buffer.dtype))
        for name, param in _unique_parameters(model, source):
            local, start, stop = local_rows(param)
            local.copy_(source.rows(name, tuple(param.shape), start, stop).to(local.dtype))
    model.eval()
    return model, tokenizer, base_model


def _unique_parameters(model: torch.nn.Module, source: Source) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter once, under a name the source holds (a tied weight may be stored under either name)."""
    names: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    for key, aliases in names.items():
        stored = [n for n in aliases if ".lora_" in n or base_key(n) in source.base]
        yield (stored or aliases)[0], params[key]


def resident_parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of parameters this rank holds, and bytes of the whole model's parameters."""
    from torch.distributed.tensor import DTensor

    local = total = 0
    for param in model.parameters():
        held = param.to_local() if isinstance(param, DTensor) else param
        local += held.numel() * held.element_size()
        total += param.numel() * param.element_size()
    return local, total


# --------------------------------------------------------------------------- saving


_ST_DTYPES = {
    "torch.float32": "F32",
    "torch.bfloat16": "BF16",
    "torch.float16": "F16",
    "torch.int64": "I64",
    "torch.int32": "I32",
    "torch.bool": "BOOL",
    "torch.uint8": "U8",
}


def save_streaming(entries: list[tuple[str, torch.Tensor]], file: Path | None) -> None:
    """Write ``entries`` (file key, possibly sharded tensor) as one safetensors file, one tensor at a time.

    Collective: every rank calls it with the same entries; each sharded tensor is gathered in
    turn (``full_tensor``), rank 0 (``file`` not None) appends its bytes and drops it, so no
    rank holds more than one full tensor. The header comes first (shapes and dtypes are known
    before any gather), in the safetensors layout: header length, JSON header padded to 8 bytes,
    data.
    """
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, tensor in entries:
        dtype = _ST_DTYPES.get(str(tensor.dtype))
        if dtype is None:
            raise HardwareError(f"cannot save {key}: dtype {tensor.dtype}")
        size = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    out = file.open("wb") if file is not None else None
    try:
        if out is not None:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
        for _key, tensor in entries:
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if out is not None:
                data = full.detach().contiguous().cpu()
                out.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
            del full
    finally:
        if out is not None:
            out.close()


def save_trained(model: Any, tokenizer: Any, folder: Path, rank: int) -> None:
    """Write the trained FSDP policy as a checkpoint folder (full weights, or the LoRA adapter) from rank 0.

    Full: the tensors of the parent's checkpoint (the same keys, so a tied weight is written once),
    config, generation config, tokenizer. LoRA: the adapter's trainable tensors under peft's keys
    and its ``adapter_config.json``.
    """
    import copy

    state = model.state_dict()
    if hasattr(model, "peft_config"):
        entries = [
            (adapter_key(name), state[name])
            for name, param in model.named_parameters()
            if param.requires_grad and name in state
        ]
        file_name = ADAPTER_FILE
    else:
        seen: set[int] = set()
        entries = []
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            entries.append((name, state[name]))
        persistent = {n for n in state if n not in dict(model.named_parameters(remove_duplicate=False))}
        entries += [(n, state[n]) for n in sorted(persistent)]
        file_name = "model.safetensors"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    save_streaming(entries, folder / file_name if rank == 0 else None)
    if rank != 0:
        return
    if hasattr(model, "peft_config"):
        config = copy.deepcopy(model.peft_config[ADAPTER_NAME])
        config.inference_mode = True
        config.save_pretrained(str(folder))
    else:
        model.config.save_pretrained(str(folder))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
