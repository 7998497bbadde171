"""Flywheel: continual learning from production agent traffic.

This package is importable with the SDK's light dependencies alone (pydantic);
service modules import their heavy dependencies themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # re-exported (redundant aliases): the names __getattr__ resolves at run time
    from flywheel.sdk import AsyncSession as AsyncSession
    from flywheel.sdk import Flywheel as Flywheel
    from flywheel.sdk import Session as Session
    from flywheel.sdk import observe as observe

_SDK_EXPORTS = frozenset({"Flywheel", "Session", "AsyncSession", "observe"})


def __getattr__(name: str) -> Any:
    """``from flywheel import Flywheel`` loads the SDK only when it is asked for."""
    if name in _SDK_EXPORTS:
        from flywheel import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'flywheel' has no attribute {name!r}")
