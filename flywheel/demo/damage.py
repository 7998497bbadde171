"""``flywheel demo --inject-regression``: a deliberately damaged checkpoint, deployed by ops.

The damaged checkpoint is the stable checkpoint with noise added to every weight matrix:
a well-formed checkpoint (it loads, it answers) that is clearly worse at the task, the
kind of regression the eval gate exists for. Here ops bypass the gate on purpose and
deploy it as canary through the admin API, to show that the canary controller catches
what the live rewards prove worse and rolls it back on its own.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

from flywheel.core.settings import Settings

NOISE_SCALE = 0.6
"""Noise standard deviation, relative to each weight matrix's own standard deviation."""


def damaged_checkpoint(engine: Any, settings: Settings, seed: int = 0) -> str:
    """Write and register (status ``candidate``) a damaged copy of the stable checkpoint; return its id."""
    import torch
    from safetensors.torch import load_file, save_file
    from sqlalchemy.orm import Session

    from flywheel.core.db.models import Checkpoint
    from trainer import registry

    with Session(engine) as session:
        stable_id = registry.stable_checkpoint_id(session)
        if stable_id is None:
            raise RuntimeError("no stable deployment to damage")
        stable = registry.get_checkpoint(session, stable_id)
        source = Path(stable.path)
        checkpoint_id = f"damaged-{uuid.uuid4().hex[:8]}"
        target = Path(settings.trainer.checkpoints.dir).resolve() / checkpoint_id
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".tmp-{checkpoint_id}")
        shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("flywheel_checkpoint.json"))
        generator = torch.Generator().manual_seed(seed)
        for file in sorted(tmp.glob("*.safetensors")):
            tensors = load_file(file)
            for name, tensor in tensors.items():
                if tensor.ndim == 2 and tensor.is_floating_point():
                    noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
                    tensors[name] = (tensor.float() + NOISE_SCALE * tensor.float().std() * noise).to(tensor.dtype)
            save_file(tensors, file, metadata={"format": "pt"})
        tmp.rename(target)
        session.add(
            Checkpoint(
                id=checkpoint_id,
                policy_version=checkpoint_id,
                parent_id=stable_id,
                base_model=stable.base_model,
                path=str(target),
                format="full",
                status="candidate",
                status_reason=f"deliberately damaged copy of {stable_id} (demo --inject-regression); not gated",
                n_samples=0,
                metrics={"damage": {"noise_scale": NOISE_SCALE, "seed": seed, "source": stable_id}},
            )
        )
        session.commit()
    return checkpoint_id


def ops_token(engine: Any, name: str = "demo-ops") -> str:
    """An operator token for the demo's ops actions (shown nowhere; only its hash is stored)."""
    from sqlalchemy.orm import Session

    from flywheel.core.auth import create_key

    with Session(engine) as session:
        _, token = create_key(session, name=f"{name}-{uuid.uuid4().hex[:6]}", role="operator", created_by="demo")
        session.commit()
    return token


def deploy_through_admin(engine: Any, settings: Settings, checkpoint_id: str, weight: float) -> dict[str, Any]:
    """``POST /v1/canary`` on the admin API, as ops would (``flywheel deploy``); returns the API's answer."""
    import httpx

    s = settings.serving
    url = s.admin_url or f"http://{s.admin_host}:{s.admin_port}"
    response = httpx.post(
        f"{url.rstrip('/')}/v1/canary",
        json={"checkpoint_id": checkpoint_id, "weight": weight},
        headers={"Authorization": f"Bearer {ops_token(engine)}"},
        timeout=600,
    )
    if response.status_code >= 400:
        raise RuntimeError(f"the admin API refused the canary: HTTP {response.status_code}: {response.text[:500]}")
    return response.json()
