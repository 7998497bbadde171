"""Annealing schedules: auxiliary coefficients that decay to zero, clocked by the session's start.

Using the session's own start time (not the worker's clock) keeps a reward a pure function
of its events, so a recompute reproduces it.
"""

from __future__ import annotations

import math
from datetime import datetime

from flywheel.core.settings import AnnealSettings


def anneal_factor(schedule: AnnealSettings, at: datetime | None) -> float:
    """Multiplier in [0, 1] of an annealed coefficient for a session started ``at``."""
    if schedule.kind == "constant" or schedule.start_at is None or at is None:
        return 1.0
    progress = (at - schedule.start_at).total_seconds() / schedule.duration_s
    if progress <= 0.0:
        return 1.0
    if progress >= 1.0:
        return 0.0
    if schedule.kind == "linear":
        return 1.0 - progress
    if schedule.kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule.kind == "step":
        return 1.0
    raise ValueError(f"unknown anneal kind {schedule.kind!r}")
