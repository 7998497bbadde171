"""The local stack of real services: Kafka-protocol broker, Postgres, Redis, vLLM replicas.

``flywheel up`` / ``down`` / ``status`` drive it; every other service finds the
components through :mod:`flywheel.stack.endpoints`. Names are imported lazily so that
importing this package (the CLI does) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "ComponentFailed",
    "ComponentStatus",
    "StackNotRunning",
    "StackState",
    "down",
    "status",
    "up",
]

if TYPE_CHECKING:
    from flywheel.stack.base import ComponentFailed, ComponentStatus, StackNotRunning, StackState
    from flywheel.stack.stack import down, status, up


def __getattr__(name: str) -> Any:
    if name in ("up", "down", "status"):
        from flywheel.stack import stack

        return getattr(stack, name)
    if name in ("ComponentFailed", "ComponentStatus", "StackNotRunning", "StackState"):
        from flywheel.stack import base

        return getattr(base, name)
    raise AttributeError(f"module 'flywheel.stack' has no attribute {name!r}")
