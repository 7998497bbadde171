"""What every role's console script shares: a configuration error is a message, not a traceback."""

from __future__ import annotations

import sys
from typing import Protocol


class NotConfigured(LookupError):
    """A component was asked for that the settings do not name (not recoverable by retrying)."""


class _App(Protocol):
    def __call__(self) -> object: ...


def run(app: _App) -> None:
    """Run a command-line ``app``; a :class:`NotConfigured` endpoint ends it with its message and exit code 2."""
    try:
        app()
    except NotConfigured as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
