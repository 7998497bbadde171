"""The base model as the registry's root checkpoint."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from flywheel.core.contracts.checkpoint import CheckpointEval, HeldoutResult
from flywheel.core.db.models import Checkpoint
from flywheel.model.build import read_sidecar
from flywheel.model.eval import DEFAULT_MAX_NEW_TOKENS, heldout_key


def register_base(session: Session, model_dir: Path | str) -> str:
    """Register the built base model as the root checkpoint (idempotent); return its id.

    The id and policy version are the sidecar's ``base-<key8>``; the build-time held-out
    evaluation is cached as the root's gate measurement.
    """
    model_dir = Path(model_dir).resolve()
    sidecar = read_sidecar(model_dir)
    held = sidecar.heldout
    key = heldout_key(held.n, held.seed, held.temperature, DEFAULT_MAX_NEW_TOKENS)
    statement = (
        insert(Checkpoint)
        .values(
            id=sidecar.policy_version,
            policy_version=sidecar.policy_version,
            parent_id=None,
            base_model=str(model_dir),
            path=str(model_dir),
            format="full",
            status="deployed",
            status_reason="base model: what the fleet serves before any deployment",
            n_samples=0,
            config_hash=sidecar.build_key,
            metrics={"build": {"build_key": sidecar.build_key, "param_count": sidecar.param_count}},
            eval=CheckpointEval(heldout={key: HeldoutResult(**held.model_dump(), source="build")}).to_dict(),
        )
        .on_conflict_do_update(index_elements=["id"], set_={"path": str(model_dir), "base_model": str(model_dir)})
    )
    session.execute(statement)
    session.commit()
    return sidecar.policy_version
