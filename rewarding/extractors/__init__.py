"""Reward extractors: plug-ins found through the entry-point group ``flywheel.reward_extractors``.

An extractor is a subclass of :class:`Extractor` (``name``, ``version``, its own settings
model ``Settings``, ``extract``), registered under its name in its distribution's metadata;
the built-in ones are registered in this repository's ``pyproject.toml``, one module each
here. Its settings section is ``rewarding.scoring.extractors.<name>``
(``FLYWHEEL_REWARDING__SCORING__EXTRACTORS__<NAME>__<FIELD>``), validated against its
``Settings``; a weight (``rewarding.scoring.weights`` or a task's) makes it run. An
extractor outside this repository needs no edit here: see docs/rewards.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from flywheel.core.plugins import Group, PluginError, load, plugin_settings, registered
from flywheel.core.settings import RewardingSettings, ScoringSettings
from rewarding.extractors.base import (
    SECTION,
    BuildContext,
    Components,
    Extractor,
    ExtractorConfigError,
    ExtractorError,
)

__all__ = [
    "GROUP",
    "JudgeUrl",
    "SECTION",
    "BuildContext",
    "Components",
    "Configured",
    "Extractor",
    "ExtractorConfigError",
    "ExtractorError",
    "build_extractors",
    "configured",
    "extractor_class",
    "needed",
    "versions",
]

GROUP: Group = "flywheel.reward_extractors"
"""The entry-point group of reward extractors."""

RESERVED = frozenset(ScoringSettings.model_fields)
"""Names an extractor may not take: the scoring settings' own fields (they share the config hash's keys)."""

JudgeUrl = Callable[[], str]
"""Returns the judge's base URL when the settings name none (the first vLLM replica)."""


@dataclass(frozen=True)
class Configured:
    """A registered extractor's class and its validated settings."""

    cls: type[Extractor]
    settings: BaseModel


def extractor_class(name: str) -> type[Extractor]:
    """The extractor class registered as ``name``; :class:`ExtractorConfigError` naming it otherwise."""
    try:
        cls: Any = load(GROUP, name)
    except PluginError as err:
        raise ExtractorConfigError(str(err)) from err
    where = registered(GROUP)[name].value
    if not (isinstance(cls, type) and issubclass(cls, Extractor)):
        raise ExtractorConfigError(f"reward extractor {name!r} ({where}) is not a subclass of Extractor")
    if getattr(cls, "name", None) != name:
        raise ExtractorConfigError(f"reward extractor registered as {name!r} ({where}) is named {cls.name!r}")
    if not (isinstance(getattr(cls, "Settings", None), type) and issubclass(cls.Settings, BaseModel)):
        raise ExtractorConfigError(f"reward extractor {name!r} ({where}) has no pydantic Settings model")
    if name in RESERVED:
        raise ExtractorConfigError(f"reward extractor {name!r} ({where}) takes a reserved name ({sorted(RESERVED)})")
    return cls


def versions() -> dict[str, str]:
    """Extractor name -> version, of every registered extractor."""
    return {name: extractor_class(name).version for name in sorted(registered(GROUP))}


def configured(scoring: ScoringSettings) -> dict[str, Configured]:
    """Every registered extractor with its section of ``scoring.extractors`` validated (defaults where
    there is none); a section of no registered extractor, or an invalid one, is refused."""
    known = sorted(registered(GROUP))
    strays = sorted(set(scoring.extractors) - set(known))
    if strays:
        raise ExtractorConfigError(f"{SECTION} has sections of unknown reward extractors {strays} (known: {known})")
    out: dict[str, Configured] = {}
    for name in known:
        cls = extractor_class(name)
        try:
            settings = plugin_settings(cls.Settings, scoring.extractors.get(name), f"{SECTION}.{name}")
        except PluginError as err:
            raise ExtractorConfigError(str(err)) from err
        out[name] = Configured(cls, settings)
    return out


def _needed(scoring: ScoringSettings, known: dict[str, Configured]) -> list[str]:
    names = {n for n, w in scoring.weights.items() if w != 0.0}
    for weights in scoring.task_weights.values():
        names |= {n for n, w in weights.items() if w != 0.0}
    unknown = sorted(names - set(known))
    if unknown:
        raise ExtractorConfigError(
            f"unknown reward extractors in rewarding.scoring weights: {unknown} (known: {sorted(known)})"
        )
    return sorted(n for n in names if known[n].cls.enabled(known[n].settings))


def needed(settings: RewardingSettings) -> list[str]:
    """Extractors with a non-zero weight in the defaults or in any task's weights, and enabled."""
    return _needed(settings.scoring, configured(settings.scoring))


def build_extractors(settings: RewardingSettings, judge_url: JudgeUrl) -> dict[str, Extractor]:
    """Every extractor that some weight needs; an unknown name or an invalid section is refused
    (:class:`ExtractorConfigError`, a :class:`~flywheel.core.plugins.PluginError`)."""
    known = configured(settings.scoring)
    context = BuildContext(judge_url, {name: c.settings for name, c in known.items()})
    return {name: known[name].cls.build(known[name].settings, context) for name in _needed(settings.scoring, known)}
