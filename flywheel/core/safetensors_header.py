"""Read and check a safetensors file's header without loading its tensors.

One reader for the two places that refuse a weights folder before anything heavy touches it:
the model check (:mod:`flywheel.model.check`, a base model being registered) and the hot-swap
client (:func:`flywheel.core.vllm_admin.check_checkpoint`, a checkpoint about to reach a
serving replica). Both need the same facts: the header parses, every tensor's byte range fits
its dtype and shape, and the file is exactly as long as the header says (shorter is truncated,
longer is corrupt).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
"""Bytes per element of each safetensors dtype."""
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The format's own bound on the header's length."""


class SafetensorsInvalid(ValueError):
    """The file is not a complete safetensors file; the message names the file and what is wrong."""


def read_header(file: Path) -> dict[str, Any]:
    """The parsed header of ``file`` (``__metadata__`` included), after checking it as above."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise SafetensorsInvalid(f"{file}: truncated: {size} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise SafetensorsInvalid(
                f"{file}: truncated or not safetensors: header of {length} bytes in a {size}-byte file"
            )
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, ValueError) as err:
            raise SafetensorsInvalid(f"{file}: safetensors header does not parse: {err}") from err
    if not isinstance(header, dict):
        raise SafetensorsInvalid(f"{file}: safetensors header is not a JSON object")
    end = 0
    for name, tensor in tensors(header).items():
        try:
            dtype, shape, (begin, stop) = tensor["dtype"], tensor["shape"], tensor["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise SafetensorsInvalid(f"{file}: tensor {name} has a malformed header entry") from err
        if dtype not in ITEMSIZE:
            raise SafetensorsInvalid(f"{file}: tensor {name} has an unknown dtype {dtype}")
        if stop - begin != numel(shape) * ITEMSIZE[dtype]:
            raise SafetensorsInvalid(f"{file}: tensor {name}: {stop - begin} bytes for shape {shape} of {dtype}")
        end = max(end, stop)
    expected = 8 + length + end
    if size < expected:
        raise SafetensorsInvalid(f"{file}: truncated: {size} bytes, its header says {expected}")
    if size > expected:
        raise SafetensorsInvalid(f"{file}: {size - expected} bytes after the last tensor (corrupt or not safetensors)")
    return header


def tensors(header: dict[str, Any]) -> dict[str, Any]:
    """The header's tensor entries (everything but ``__metadata__``)."""
    return {k: v for k, v in header.items() if k != "__metadata__"}


def numel(shape: list[int]) -> int:
    """Elements of a tensor of ``shape``."""
    return math.prod(shape)
