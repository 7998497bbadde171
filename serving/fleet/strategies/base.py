"""The plug-in point of the hot swap: one :class:`SwapStrategy` per way of putting weights on a replica.

``full`` (:mod:`serving.fleet.strategies.full`) replaces the replica's weights in place (pause,
reload, set the weight version, resume): one replica serves one policy version.
``lora`` (:mod:`serving.fleet.strategies.lora`) loads an adapter under its policy version as the
model name: one replica serves the base and every loaded adapter side by side.

A strategy is a plug-in: a :class:`SwapStrategy` subclass registered under the entry-point
group :data:`GROUP` (``[project.entry-points."flywheel.swap_strategies"]`` in a
``pyproject.toml``, the name being the one ``serving.strategy`` uses) and loaded by
:func:`flywheel.core.plugins.load`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from flywheel.core import plugins

GROUP: plugins.Group = "flywheel.swap_strategies"


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
    """The strategy registered as ``name`` (``full``, ``lora`` or a plug-in's).

    Raises :class:`~flywheel.core.plugins.PluginError` (a ``ValueError``) naming the known
    strategies when none is registered under ``name``, or when the registered object is not
    a :class:`SwapStrategy` subclass.
    """
    known = plugins.registered(GROUP)
    if name not in known:
        raise plugins.PluginError(f"unknown swap strategy {name!r}: expected one of {sorted(known)}")
    strategy = plugins.load(GROUP, name)
    if not (isinstance(strategy, type) and issubclass(strategy, SwapStrategy)):
        raise plugins.PluginError(f"swap strategy {name!r} ({known[name].value}) is not a SwapStrategy subclass")
    return strategy()
