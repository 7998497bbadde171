"""Plug-ins: reward extractors, eval suites and swap strategies, found through entry points.

A plug-in is a class registered under one of :data:`GROUPS` in its distribution's metadata
(``[project.entry-points."flywheel.reward_extractors"]`` in a ``pyproject.toml``, the
name being the one settings use). It brings its own settings model as the class attribute
``Settings`` (a pydantic model, every field with a default), so a plug-in that lives
outside this repository needs no edit here: its section of the settings arrives as a plain
mapping (``FLYWHEEL_REWARDING__EXTRACTORS__<NAME>__<FIELD>``) and is validated by
:func:`plugin_settings` against the plug-in's own model, with errors that name the plug-in.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

Group = Literal["flywheel.reward_extractors", "flywheel.eval_suites", "flywheel.swap_strategies"]
GROUPS: tuple[Group, ...] = ("flywheel.reward_extractors", "flywheel.eval_suites", "flywheel.swap_strategies")

M = TypeVar("M", bound=BaseModel)


class PluginError(ValueError):
    """A plug-in is unknown, fails to load or is misconfigured (not recoverable by retrying)."""


@cache
def registered(group: Group) -> dict[str, EntryPoint]:
    """Name -> entry point of every plug-in installed under ``group``."""
    return {ep.name: ep for ep in entry_points(group=group)}


def load(group: Group, name: str) -> Any:
    """The object registered as ``name`` under ``group``; :class:`PluginError` names the known ones."""
    found = registered(group)
    if name not in found:
        known = ", ".join(sorted(found)) or "none installed"
        raise PluginError(f"no plug-in {name!r} in entry-point group {group!r} (known: {known})")
    try:
        return found[name].load()
    except Exception as err:  # an import error of third-party code, turned into a clear answer
        raise PluginError(f"plug-in {name!r} of {group!r} ({found[name].value}) failed to load: {err}") from err


def plugin_settings(model: type[M], raw: Mapping[str, Any] | BaseModel | None, where: str) -> M:
    """``raw`` (a settings section) validated against a plug-in's own settings ``model``.

    ``where`` names the section in errors, e.g. ``rewarding.extractors.grm``.
    """
    if isinstance(raw, model):
        return raw
    if isinstance(raw, BaseModel):
        raw = raw.model_dump()
    try:
        return model.model_validate(dict(raw or {}))
    except ValidationError as err:
        problems = "; ".join(
            f"{where}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else f"{where}: {e['msg']}"
            for e in err.errors()
        )
        raise PluginError(f"invalid settings for {where}: {problems}") from err
