"""Annealing schedules: auxiliary coefficients that decay to zero, clocked by the session's start.

Using the session's own start time (not the worker's clock) keeps a reward a pure function
of its events, so a recompute reproduces it. :class:`AnnealSettings` is a part that any
extractor's settings may hold (shaping and parl do), so it lives here, next to its function.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field


class AnnealSettings(BaseModel):
    """A schedule that takes an auxiliary coefficient from its initial value to zero."""

    kind: Literal["constant", "linear", "cosine", "step"] = "linear"
    """Shape of the decay; ``step`` holds the value until the end, then drops to zero."""
    start_at: datetime | None = None
    """When the decay starts (session start time is the clock); None holds the initial value."""
    duration_s: float = Field(14 * 86400.0, gt=0.0, le=3650 * 86400.0)
    """How long the decay takes; after start_at + duration_s the coefficient is zero."""


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
