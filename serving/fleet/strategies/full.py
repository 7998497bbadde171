"""Full-weight hot swap through vLLM 0.32's RL endpoints (reload in place, then set the version).

After the reload the prefix cache is reset (``POST /reset_prefix_cache``, a dev endpoint):
``pause`` clears it too, but measured here a replica that had served broken (NaN) weights
kept answering a cached prompt with non-finite logprobs after the good weights were
reloaded, until the prefix cache was reset. Resetting again costs nothing.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import httpx

from serving.fleet import vllm_admin
from serving.fleet.strategies.base import SwapStrategy, Target

log = logging.getLogger(__name__)


class FullWeights(SwapStrategy):
    """Reload every weight from the checkpoint folder; ``/weight_info`` then reports its policy version."""

    name: ClassVar[str] = "full"
    exclusive: ClassVar[bool] = True

    def load(self, url: str, target: Target, timeout_s: float) -> None:
        """``reload_weights`` (the folder is checked locally first), ``update_weight_version``,
        reset the prefix cache."""
        vllm_admin.reload_weights(url, target.path, timeout_s=timeout_s)
        vllm_admin.update_weight_version(url, target.policy_version)
        if not reset_prefix_cache(url):
            log.warning(
                "%s: the prefix cache could not be reset after the reload (blocks held by paused requests)", url
            )

    def model_name(self, url: str, target: Target) -> str:
        """The replica's base model name: the weights change, the served name does not."""
        return base_model_name(url)

    def reports(self, url: str, target: Target) -> bool:
        """``/weight_info`` equals the target's policy version."""
        return vllm_admin.weight_info(url) == target.policy_version


def base_model_name(url: str, timeout_s: float = 10.0) -> str:
    """The id of the replica's base model in ``/v1/models`` (the entry without a parent)."""
    try:
        response = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout_s)
    except httpx.HTTPError as err:
        raise vllm_admin.VllmAdminError(url, "/v1/models", 0, f"{type(err).__name__}: {err}") from err
    if response.status_code != 200:
        raise vllm_admin.VllmAdminError(url, "/v1/models", response.status_code, response.text)
    models = response.json().get("data", [])
    bases = [m["id"] for m in models if not m.get("parent")]
    if not bases:
        raise vllm_admin.VllmAdminError(url, "/v1/models", 200, f"no base model listed: {models}")
    return bases[0]


def reset_prefix_cache(url: str, timeout_s: float = 30.0) -> bool:
    """``POST /reset_prefix_cache``; False when vLLM could not (blocks still held by requests)."""
    try:
        response = httpx.post(url.rstrip("/") + "/reset_prefix_cache", timeout=timeout_s)
    except httpx.HTTPError as err:
        raise vllm_admin.VllmAdminError(url, "/reset_prefix_cache", 0, f"{type(err).__name__}: {err}") from err
    if response.status_code >= 400:
        raise vllm_admin.VllmAdminError(url, "/reset_prefix_cache", response.status_code, response.text)
    return bool(response.json().get("success", False))
