"""LoRA hot swap: load the adapter at runtime, served under its policy version as model name.

Needs replicas started with ``vllm.enable_lora`` (``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, see :mod:`flywheel.stack.vllm`). vLLM 0.32's
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` adds the adapter beside the base
model; requests choose it by ``model``. Nothing is paused: requests for other models go on.
"""

from __future__ import annotations

from typing import ClassVar

from flywheel.core import vllm_admin
from serving.fleet.strategies.base import SwapStrategy, Target


class LoraAdapter(SwapStrategy):
    """Load a peft adapter folder under the name of its policy version."""

    name: ClassVar[str] = "lora"
    exclusive: ClassVar[bool] = False

    def load(self, url: str, target: Target, timeout_s: float) -> None:
        """``/v1/load_lora_adapter``; an adapter already loaded under that name counts as loaded."""
        if self.reports(url, target):
            return  # loaded before, or the base model itself (served under its policy version)
        if target.format != "lora":
            raise vllm_admin.CheckpointInvalid(
                f"checkpoint {target.checkpoint_id} has format {target.format!r}: "
                "the lora strategy needs a LoRA adapter"
            )
        vllm_admin.load_lora_adapter(url, target.policy_version, target.path, timeout_s=timeout_s)

    def unload(self, url: str, target: Target, timeout_s: float = 30.0) -> None:
        """``/v1/unload_lora_adapter`` (after its deployment ended)."""
        vllm_admin.unload_lora_adapter(url, target.policy_version, timeout_s=timeout_s)

    def model_name(self, url: str, target: Target) -> str:
        """The adapter's name: its policy version."""
        return target.policy_version

    def reports(self, url: str, target: Target) -> bool:
        """Whether ``/v1/models`` lists the adapter."""
        return any(m.get("id") == target.policy_version for m in vllm_admin.models(url))
