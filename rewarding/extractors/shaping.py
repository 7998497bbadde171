"""Shaping: latency and length penalties whose coefficients anneal to zero.

Both are auxiliary terms that help early training (answer quickly, do not ramble); the
schedule takes them to zero so the final policy optimises task success alone.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from rewarding.anneal import AnnealSettings, anneal_factor
from rewarding.extractors.base import Components, Extractor, mean
from rewarding.session_state import Session


class ShapingSettings(BaseModel):
    """Auxiliary latency and length penalties, annealed to zero so task success alone is optimised."""

    latency_coef: float = Field(0.02, ge=0.0, le=100.0)
    """Penalty per second of mean completion latency above ``latency_free_s``."""
    latency_free_s: float = Field(2.0, ge=0.0, le=3600.0)
    """Mean completion latency that costs nothing."""
    length_coef: float = Field(0.1, ge=0.0, le=100.0)
    """Penalty per 1000 generated tokens above ``length_free_tokens``."""
    length_free_tokens: int = Field(512, ge=0, le=10_000_000)
    """Generated tokens per session that cost nothing."""
    anneal: AnnealSettings = Field(default_factory=AnnealSettings)
    """Schedule of both coefficients."""


class ShapingExtractor(Extractor):
    """Annealed latency and length penalties."""

    name = "shaping"
    version = "1"
    Settings = ShapingSettings

    def __init__(self, settings: ShapingSettings):
        self.settings = settings

    def extract(self, session: Session) -> Components:
        if not session.completions:
            return Components(value=None)
        s = self.settings
        factor = anneal_factor(s.anneal, session.started_at)
        latency_s = mean([c.latency_ms for c in session.completions]) / 1000.0
        tokens = sum(len(c.completion_token_ids or ()) for c in session.completions)
        latency = -factor * s.latency_coef * max(0.0, latency_s - s.latency_free_s)
        length = -factor * s.length_coef * max(0, tokens - s.length_free_tokens) / 1000.0
        return Components(
            value=latency + length,
            terms={"latency": latency, "length": length},
            metrics={"anneal_factor": factor, "mean_latency_s": latency_s, "completion_tokens": float(tokens)},
        )
