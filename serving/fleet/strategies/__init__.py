"""Hot-swap strategies: how a checkpoint reaches a vLLM replica (``serving.strategy``)."""

from __future__ import annotations

from serving.fleet.strategies.base import GROUP, SwapStrategy, Target, get_strategy

__all__ = ["GROUP", "SwapStrategy", "Target", "get_strategy"]
