"""Plug-ins: reward extractors, eval suites and swap strategies, found through entry points.

A plug-in is a class registered under one of :data:`GROUPS` in its distribution's metadata
(``[project.entry-points."flywheel.reward_extractors"]`` in a ``pyproject.toml``, the
name being the one settings use). It brings its own settings model as the class attribute
``Settings`` (a pydantic model, every field with a default), so a plug-in that lives
outside this repository needs no edit here: its section of the settings arrives as a plain
mapping (``FLYWHEEL_REWARDING__SCORING__EXTRACTORS__<NAME>__<FIELD>``) and is validated by
:func:`plugin_settings` against the plug-in's own model, with errors that name the plug-in.
"""

from __future__ import annotations

import json
import types
from collections.abc import Mapping
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

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

    ``where`` names the section in errors, e.g. ``rewarding.scoring.extractors.grm``.
    """
    if isinstance(raw, model):
        return raw
    if isinstance(raw, BaseModel):
        raw = raw.model_dump()
    try:
        return model.model_validate(_json_from_env(model, dict(raw or {})))
    except ValidationError as err:
        problems = "; ".join(
            f"{where}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else f"{where}: {e['msg']}"
            for e in err.errors()
        )
        raise PluginError(f"invalid settings for {where}: {problems}") from err


def _json_from_env(model: type[BaseModel], raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with JSON text decoded where ``model`` wants a list, a mapping or a model, as
    pydantic-settings decodes such fields of its own models: an environment variable holds text
    (``..._EXTRACTORS__GRM__RUBRICS='[{"name": ...}]'``), and a section arrives untyped."""
    out = dict(raw)
    for name, field in model.model_fields.items():
        key = name if name in out else field.alias
        if key is None or key not in out:
            continue
        value = out[key]
        if isinstance(value, str) and _wants_json(field.annotation):
            try:
                out[key] = json.loads(value)
            except ValueError:
                pass  # left as it is: validation names the field
        elif isinstance(value, dict) and isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out[key] = _json_from_env(field.annotation, value)
    return out


def _wants_json(annotation: Any) -> bool:
    """Whether a field of this type is given as JSON text in the environment (not a scalar)."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return bool(args) and all(_wants_json(a) for a in args)
    origin = get_origin(annotation) or annotation
    return isinstance(origin, type) and issubclass(origin, (BaseModel, Mapping, list, tuple, set, frozenset))
