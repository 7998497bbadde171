"""Which folder is the base model: the one place that answers it.

``model.path`` (``FLYWHEEL_MODEL__PATH``) names any local Hugging Face causal-LM folder;
unset, the base model is the project's own build (``flywheel model build``), cached under
``model.cache_dir/<build key>/``. The trainer's cycle, the local stack, the demo and the
serving fleet's first stable deployment all resolve it here, and name it by its content
hash (:func:`flywheel.model.check.model_policy_version`), so every part agrees on its version.
"""

from __future__ import annotations

from pathlib import Path

from flywheel.core.settings import ModelSettings
from flywheel.model.build import build_key, build_model, is_complete
from flywheel.model.check import CONFIG


class BaseModelMissing(RuntimeError):
    """The base model folder the settings name does not exist (or is not built)."""


def base_model_dir(settings: ModelSettings, build: bool = False) -> Path:
    """The base model's folder, resolved.

    ``settings.path`` when set (it must hold a ``config.json``; the full check is
    :func:`flywheel.model.check.check_model`); else the project's built model, built now
    when ``build`` and missing, otherwise :class:`BaseModelMissing`.
    """
    if settings.path is not None:
        folder = Path(settings.path).expanduser().resolve()
        if not (folder / CONFIG).is_file():
            raise BaseModelMissing(
                f"model.path {folder} is not a model folder (no {CONFIG}); set FLYWHEEL_MODEL__PATH to one"
            )
        return folder
    folder = Path(settings.cache_dir).resolve() / build_key(settings)
    if is_complete(folder):
        return folder
    if build:
        return build_model(settings)
    raise BaseModelMissing(
        f"base model not built at {folder}; run `flywheel model build` (or set FLYWHEEL_MODEL__PATH)"
    )
