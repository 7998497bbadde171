"""LoRA hot swap: load the adapter at runtime, served under its policy version as model name.

Needs replicas started with ``vllm.enable_lora`` (``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, see :mod:`flywheel.stack.vllm`). vLLM 0.32's
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` adds the adapter beside the base
model; requests choose it by ``model``. Nothing is paused: requests for other models go on.
"""

from __future__ import annotations

from typing import ClassVar

import httpx

from serving.fleet import vllm_admin
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
        body = {"lora_name": target.policy_version, "lora_path": str(target.path)}
        try:
            response = httpx.post(url.rstrip("/") + "/v1/load_lora_adapter", json=body, timeout=timeout_s)
        except httpx.HTTPError as err:
            raise vllm_admin.VllmAdminError(url, "/v1/load_lora_adapter", 0, f"{type(err).__name__}: {err}") from err
        if response.status_code >= 400:
            raise vllm_admin.VllmAdminError(url, "/v1/load_lora_adapter", response.status_code, response.text)

    def unload(self, url: str, target: Target, timeout_s: float = 30.0) -> None:
        """``/v1/unload_lora_adapter`` (after its deployment ended)."""
        body = {"lora_name": target.policy_version}
        try:
            response = httpx.post(url.rstrip("/") + "/v1/unload_lora_adapter", json=body, timeout=timeout_s)
        except httpx.HTTPError as err:
            raise vllm_admin.VllmAdminError(url, "/v1/unload_lora_adapter", 0, f"{type(err).__name__}: {err}") from err
        if response.status_code >= 400:
            raise vllm_admin.VllmAdminError(url, "/v1/unload_lora_adapter", response.status_code, response.text)

    def model_name(self, url: str, target: Target) -> str:
        """The adapter's name: its policy version."""
        return target.policy_version

    def reports(self, url: str, target: Target) -> bool:
        """Whether ``/v1/models`` lists the adapter."""
        try:
            response = httpx.get(url.rstrip("/") + "/v1/models", timeout=10.0)
        except httpx.HTTPError as err:
            raise vllm_admin.VllmAdminError(url, "/v1/models", 0, f"{type(err).__name__}: {err}") from err
        if response.status_code != 200:
            raise vllm_admin.VllmAdminError(url, "/v1/models", response.status_code, response.text)
        return any(m.get("id") == target.policy_version for m in response.json().get("data", []))
