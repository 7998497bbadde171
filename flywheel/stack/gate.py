"""The eval gate's vLLM replica: a server like the fleet's, reserved for the trainer's gate.

The trainer's eval gate (:mod:`trainer.engine`) loads each policy it evaluates into a vLLM
replica of its own, never into one that serves traffic: full checkpoints by reloading the
weights in place, LoRA checkpoints as runtime adapters. Locally that replica is started like
the fleet's (:class:`~flywheel.stack.vllm.VllmReplica`: development mode, the same dtype,
context length, KV cache and niceness, bound to loopback) on ``trainer.gate.local_port``, with
runtime LoRA loading when the trainer writes LoRA checkpoints (``trainer.mode``) or the fleet
loads adapters (``vllm.enable_lora``); a configured ``trainer.gate.engine_url`` is used instead.
(vLLM 0.32 refuses LoRA for some architectures, GPT-2's among them: a full-mode gate of such a
model starts without it.)

Idle, it costs little: an idle vLLM server waits on its sockets. Its CPU binding is the next
core after the fleet's replicas (round robin), and it works only while a cycle evaluates,
when the trainer itself does not compute.
"""

from __future__ import annotations

from pathlib import Path

from flywheel.core.settings import Settings
from flywheel.stack.vllm import VllmReplica

KIND = "gate"
NAME = "vllm-gate"


class GateReplica(VllmReplica):
    """The gate's replica: ``trainer.gate.engine_url`` from config, else a local server of ``model_dir``."""

    kind = KIND

    def __init__(self, settings: Settings, model_dir: Path | None = None):
        super().__init__(settings, settings.vllm.replicas, model_dir)
        self.name = NAME

    @property
    def port(self) -> int:
        return self.settings.trainer.gate.local_port

    @property
    def configured_url(self) -> str | None:
        url = self.settings.trainer.gate.engine_url
        return url.rstrip("/") if url else None

    @property
    def lora(self) -> bool:
        return self.settings.trainer.mode == "lora" or self.settings.vllm.enable_lora

    def initial_version(self, model_dir: Path, served: str) -> str:
        """The folder's resolved path: the weight version the gate's engine sets for the weights it reloads."""
        return str(model_dir.resolve())
