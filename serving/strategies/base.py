"""The plug-in point of the hot swap: one :class:`SwapStrategy` per way of putting weights on a replica.

``full`` (:mod:`serving.strategies.full`) replaces the replica's weights in place (pause,
reload, set the weight version, resume): one replica serves one policy version.
``lora`` (:mod:`serving.strategies.lora`) loads an adapter under its policy version as the
model name: one replica serves the base and every loaded adapter side by side.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Target:
    """A checkpoint as the swap needs it."""

    checkpoint_id: str
    policy_version: str
    path: str
    format: str
    """``full`` or ``lora`` (the checkpoint row's format)."""


class SwapStrategy(ABC):
    """How a checkpoint is put on one replica and how its served model is named."""

    name: ClassVar[str]
    exclusive: ClassVar[bool]
    """Whether a replica serves exactly one policy version (then it is drained and paused to change it)."""

    @abstractmethod
    def load(self, url: str, target: Target, timeout_s: float) -> None:
        """Put ``target`` on the replica at ``url`` (paused by the caller when :attr:`exclusive`)."""

    @abstractmethod
    def model_name(self, url: str, target: Target) -> str:
        """The ``model`` field a request uses to reach ``target`` on this replica."""

    @abstractmethod
    def reports(self, url: str, target: Target) -> bool:
        """Whether the replica reports serving ``target`` (``/weight_info``, or its model list)."""


def get_strategy(name: str) -> SwapStrategy:
    """The strategy called ``name`` (``full`` or ``lora``); raises ``ValueError`` on any other."""
    from serving.strategies.full import FullWeights
    from serving.strategies.lora import LoraAdapter

    strategies: dict[str, type[SwapStrategy]] = {"full": FullWeights, "lora": LoraAdapter}
    if name not in strategies:
        raise ValueError(f"unknown swap strategy {name!r}: expected one of {sorted(strategies)}")
    return strategies[name]()
