"""Shaping: latency and length penalties whose coefficients anneal to zero.

Both are auxiliary terms that help early training (answer quickly, do not ramble); the
schedule takes them to zero so the final policy optimises task success alone.
"""

from __future__ import annotations

from flywheel.core.settings import ShapingSettings
from rewarding.anneal import anneal_factor
from rewarding.extractors.base import Components, Extractor, mean
from rewarding.session_state import Session


class ShapingExtractor(Extractor):
    """Annealed latency and length penalties."""

    name = "shaping"
    version = "1"

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
