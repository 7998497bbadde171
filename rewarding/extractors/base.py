"""The extractor interface: a named, versioned function from a session to reward components.

An extractor reads only the :class:`~rewarding.session_state.Session` view and its own
configuration, so the same events and configuration always give the same components
(the judge extractor is the one that calls out; it caches and runs at temperature 0).
Bump ``version`` whenever the numbers an extractor produces for the same input change:
every reward row records each extractor's version next to the configuration hash.

An extractor is a plug-in: a subclass of :class:`Extractor` registered in the entry-point
group ``flywheel.reward_extractors`` under its ``name``, with its own settings model
(``Settings``). The factory (:func:`rewarding.extractors.build_extractors`) validates the
extractor's section of ``rewarding.scoring.extractors`` against that model and calls
:meth:`Extractor.build` with it and a :class:`BuildContext`.
"""

from __future__ import annotations

import math
import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeVar

from pydantic import BaseModel

from flywheel.core.plugins import PluginError, plugin_settings
from rewarding.session_state import Session

SECTION = "rewarding.scoring.extractors"
"""Where the extractors' settings sections live (``FLYWHEEL_REWARDING__SCORING__EXTRACTORS__<NAME>__<FIELD>``)."""

M = TypeVar("M", bound=BaseModel)


def mean(values: Iterable[float]) -> float:
    """``statistics.fmean`` (the same ``fsum / n``, so the same float) without its per-item
    generator: the extractors call it for every session on the worker's hot path."""
    data = values if isinstance(values, (list, tuple)) else list(values)
    if not data:
        raise statistics.StatisticsError("mean requires at least one data point")
    return math.fsum(data) / len(data)


class ExtractorError(RuntimeError):
    """An extractor could not run at all (a bug or a broken configuration); not recoverable by retrying."""


class ExtractorConfigError(ExtractorError, PluginError):
    """An extractor is unknown, fails to load, or its settings section is invalid: the worker does not start."""


@dataclass(frozen=True)
class BuildContext:
    """What :meth:`Extractor.build` may use besides the extractor's own settings."""

    judge_url: Callable[[], str]
    """The judge's base URL where the settings name none (the first vLLM replica); call it only if needed."""
    sections: Mapping[str, BaseModel | Mapping[str, Any]] = field(default_factory=dict)
    """Every extractor's settings by name (validated by the factory), for :meth:`settings_of`."""

    def settings_of(self, name: str, model: type[M]) -> M:
        """Extractor ``name``'s settings as ``model`` (parl and summary read the outcome rules)."""
        return plugin_settings(model, self.sections.get(name), f"{SECTION}.{name}")


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
    """Key of the extractor in weights, settings sections and components; also its entry-point name."""
    version: ClassVar[str]
    """Bumped whenever its numbers change for the same input."""
    Settings: ClassVar[type[BaseModel]]
    """Its settings model, every field with a default; its section is ``rewarding.scoring.extractors.<name>``."""
    unhashed: ClassVar[frozenset[str]] = frozenset()
    """Settings fields that decide how it runs (endpoints, timeouts), not its numbers: not in ``config_hash``."""
    calls_out: ClassVar[bool] = False
    """True for extractors that wait on a remote service: they run through :meth:`aextract`."""

    @classmethod
    def enabled(cls, settings: Any) -> bool:
        """Whether it runs when weighted (the judge has a switch of its own); ``settings`` is a ``Settings``."""
        return True

    @classmethod
    def build(cls, settings: Any, context: BuildContext) -> Self:
        """The extractor from its validated ``Settings``; override to use more of ``context``."""
        return cls(settings)  # type: ignore[call-arg]  # the built-in extractors take their settings

    @abstractmethod
    def extract(self, session: Session) -> Components:
        """Components of ``session``."""

    async def aextract(self, session: Session) -> Components:
        """Components of ``session`` inside an event loop (extractors that call out override this)."""
        return self.extract(session)

    async def aclose(self) -> None:
        """Release what the extractor holds (HTTP clients)."""
        return None  # a default hook, not abstract: an extractor that calls nothing out holds nothing
