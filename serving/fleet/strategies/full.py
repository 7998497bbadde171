"""Full-weight hot swap through vLLM 0.32's RL endpoints (reload in place, then set the version).

After the reload the prefix cache is reset (``POST /reset_prefix_cache``, a dev endpoint):
``pause`` clears it too, but measured here a replica that had served broken (NaN) weights
kept answering a cached prompt with non-finite logprobs after the good weights were
reloaded, until the prefix cache was reset. Resetting again costs nothing.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from flywheel.core import vllm_admin
from flywheel.core.vllm_admin import base_model_name, reset_prefix_cache
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
