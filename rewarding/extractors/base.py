"""The extractor interface: a named, versioned function from a session to reward components.

An extractor reads only the :class:`~rewarding.session_state.Session` view and its own
configuration, so the same events and configuration always give the same components
(the judge extractor is the one that calls out; it caches and runs at temperature 0).
Bump ``version`` whenever the numbers an extractor produces for the same input change:
every reward row records each extractor's version next to the configuration hash.
"""

from __future__ import annotations

import math
import statistics
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rewarding.session_state import Session


def mean(values: Iterable[float]) -> float:
    """``statistics.fmean`` (the same ``fsum / n``, so the same float) without its per-item
    generator: the extractors call it for every session on the worker's hot path."""
    data = values if isinstance(values, (list, tuple)) else list(values)
    if not data:
        raise statistics.StatisticsError("mean requires at least one data point")
    return math.fsum(data) / len(data)


class ExtractorError(RuntimeError):
    """An extractor could not run at all (a bug or a broken configuration); not recoverable by retrying."""


@dataclass(frozen=True)
class Components:
    """What one extractor says about one session."""

    value: float | None
    """The extractor's reward for the session; None when it has nothing to say (or failed)."""
    terms: dict[str, float] = field(default_factory=dict)
    """The parts ``value`` is made of, for explaining it."""
    per_completion: dict[str, dict[str, float]] = field(default_factory=dict)
    """Completion id -> terms added to that completion's sample only (e.g. a summary's credit)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Observed quantities that are not rewards (e.g. critical steps)."""
    flags: tuple[str, ...] = ()
    """Named conditions worth alerting on (e.g. ``disagreement``)."""
    failures: tuple[str, ...] = ()
    """Recorded failures (e.g. an unparsable judge answer); a failure is never a silent zero."""
    details: dict[str, Any] = field(default_factory=dict)
    """JSON-ready extra facts (ignored outcomes, raw judge answers)."""

    def __post_init__(self) -> None:
        numbers = [self.value] if self.value is not None else []
        numbers += list(self.terms.values()) + list(self.metrics.values())
        numbers += [v for terms in self.per_completion.values() for v in terms.values()]
        if not all(math.isfinite(v) for v in numbers):
            raise ExtractorError(f"non-finite number in components: {self}")

    def to_json(self) -> dict[str, Any]:
        """The JSON stored under the extractor's name in a reward row's components."""
        out: dict[str, Any] = {"value": self.value, "terms": dict(self.terms)}
        if self.per_completion:
            out["per_completion"] = {k: dict(v) for k, v in self.per_completion.items()}
        if self.metrics:
            out["metrics"] = dict(self.metrics)
        if self.flags:
            out["flags"] = list(self.flags)
        if self.failures:
            out["failures"] = list(self.failures)
        if self.details:
            out["details"] = self.details
        return out


class Extractor(ABC):
    """A reward extractor plug-in."""

    name: ClassVar[str]
    """Key of the extractor in weights and components."""
    version: ClassVar[str]
    """Bumped whenever its numbers change for the same input."""
    calls_out: ClassVar[bool] = False
    """True for extractors that wait on a remote service: they run through :meth:`aextract`."""

    @abstractmethod
    def extract(self, session: Session) -> Components:
        """Components of ``session``."""

    async def aextract(self, session: Session) -> Components:
        """Components of ``session`` inside an event loop (extractors that call out override this)."""
        return self.extract(session)

    async def aclose(self) -> None:
        """Release what the extractor holds (HTTP clients)."""
        return None  # a default hook, not abstract: an extractor that calls nothing out holds nothing
