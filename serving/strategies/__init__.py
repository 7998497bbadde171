"""Hot-swap strategies: how a checkpoint reaches a vLLM replica (``serving.strategy``)."""

from __future__ import annotations

from serving.strategies.base import SwapStrategy, Target, get_strategy

__all__ = ["SwapStrategy", "Target", "get_strategy"]
