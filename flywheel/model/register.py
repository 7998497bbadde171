"""A base model as a lineage root in the registry: one function for every base model."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from flywheel.core.contracts.checkpoint import CheckpointEval, HeldoutResult
from flywheel.core.db.models import Checkpoint
from flywheel.core.settings import ModelSettings
from flywheel.model.base import base_model_dir
from flywheel.model.build import SIDECAR_NAME, read_sidecar
from flywheel.model.check import ModelInfo, check_model
from flywheel.model.eval import DEFAULT_MAX_NEW_TOKENS, heldout_key
from flywheel.task import arith


def register_model(
    session: Session,
    path: Path | str,
    *,
    completion_only: bool = False,
    heldout: dict[str, HeldoutResult] | None = None,
    cache_dir: Path | str | None = None,
) -> ModelInfo:
    """Check the model folder ``path`` and record it as a lineage root (idempotent); return its info.

    The root's id and policy version are ``base-<12 hex of its content hash>``, its parent
    None, its ``config_hash`` the content hash and its metrics the check's
    :class:`~flywheel.model.check.ModelInfo` (under ``model``). ``heldout`` results, when
    given, are cached as the root's gate measurements (``checkpoints.eval``), so the gate
    does not evaluate the base again for that setup. Registering again updates the path only.
    Raises :class:`~flywheel.model.check.ModelCheckError` for a folder that is not usable.
    """
    info = check_model(path, completion_only=completion_only, cache_dir=cache_dir)
    version = info.policy_version
    statement = (
        insert(Checkpoint)
        .values(
            id=version,
            policy_version=version,
            parent_id=None,
            base_model=info.path,
            path=info.path,
            format="full",
            status="deployed",
            status_reason="base model: what the fleet serves before any deployment",
            n_samples=0,
            config_hash=info.content_hash,
            metrics={"model": info.model_dump(mode="json")},
            eval=CheckpointEval(heldout=heldout).to_dict() if heldout else {},
        )
        .on_conflict_do_update(index_elements=["id"], set_={"path": info.path, "base_model": info.path})
    )
    session.execute(statement)
    session.commit()
    return info


def build_heldout(folder: Path | str) -> dict[str, HeldoutResult] | None:
    """The held-out result a model build measured (its ``flywheel_model.json``), by gate key; None without one."""
    if not (Path(folder) / SIDECAR_NAME).is_file():
        return None
    sidecar = read_sidecar(folder)
    if sidecar.task_version != arith.TASK_VERSION:
        return None  # another task's figure (model.task): its own suite measures the base at the first gate
    held = sidecar.heldout
    key = heldout_key(held.n, held.seed, held.temperature, DEFAULT_MAX_NEW_TOKENS)
    return {key: HeldoutResult(**held.model_dump(), source="build")}


def register_base_model(
    session: Session, settings: ModelSettings, folder: Path | str | None = None, build: bool = False
) -> str:
    """Register the base model (``folder``, default: the one the settings select); return its checkpoint id.

    The folder defaults to :func:`~flywheel.model.base.base_model_dir` (built now when ``build``);
    a build's held-out result is attached (:func:`build_heldout`); the check runs with the
    settings' ``completion_only`` and cache.
    """
    folder = Path(folder) if folder is not None else base_model_dir(settings, build=build)
    info = register_model(
        session, folder, completion_only=settings.completion_only, heldout=build_heldout(folder),
        cache_dir=settings.cache_dir,
    )  # fmt: skip
    return info.policy_version
