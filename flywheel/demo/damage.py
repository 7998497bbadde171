"""``flywheel demo --inject-regression``: a deliberately damaged checkpoint, deployed by ops.

The damaged checkpoint is the stable checkpoint with noise added to every weight matrix:
a well-formed checkpoint (it loads, it answers) that is clearly worse at the task, the
kind of regression the eval gate exists for. Here ops bypass the gate on purpose and
deploy it as canary through the admin API, to show that the canary controller catches
what the live rewards prove worse and rolls it back on its own. :class:`Ops` is what an
operator does through the admin API; :mod:`flywheel.demo.regression` runs the scene.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

from flywheel.core.contracts.checkpoint import SIDECAR_NAME
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
        shutil.copytree(source, tmp, ignore=shutil.ignore_patterns(SIDECAR_NAME))
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


def ops_token(engine: Any, name: str = "demo-ops", role: str = "operator") -> str:
    """A token for the demo's ops actions (``operator``) or for a person to look around (``viewer``).

    Only its hash is stored.
    """
    from sqlalchemy.orm import Session

    from flywheel.core.auth import create_key

    with Session(engine) as session:
        _, token = create_key(session, name=f"{name}-{uuid.uuid4().hex[:6]}", role=role, created_by="demo")
        session.commit()
    return token


class AdminRefused(RuntimeError):
    """The admin API refused a call (``status`` its HTTP status) or did not answer (``status`` None)."""

    def __init__(self, method: str, path: str, status: int | None, reason: str):
        self.status = status
        self.reason = reason
        how = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{method} {path}: {how}: {reason}")


class Ops:
    """What an operator does through the admin API (``flywheel deploy``, ``rollback``, ``canary pause`` ...)."""

    def __init__(self, url: str, token: str, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        """Deployments hot-swap replicas before they end: minutes on a busy machine (the API holds the request that
        long with ``?wait=true``; the client waits a little longer)."""

    @classmethod
    def for_demo(cls, engine: Any, settings: Settings) -> Ops:
        """An operator token of its own, and the admin API of ``settings``."""
        s = settings.serving
        return cls(s.admin_url or f"http://{s.admin_host}:{s.admin_port}", ops_token(engine))

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The API's JSON answer; :class:`AdminRefused` for an error status or no answer."""
        import httpx

        try:
            response = httpx.request(method, f"{self.url}{path}", json=body, timeout=self.timeout_s + 30.0,
                                     headers={"Authorization": f"Bearer {self.token}"})  # fmt: skip
        except httpx.HTTPError as err:
            raise AdminRefused(method, path, None, f"{type(err).__name__}: {err}") from err
        if response.status_code >= 400:
            try:
                reason = str(response.json().get("reason") or response.text)
            except ValueError:
                reason = response.text
            raise AdminRefused(method, path, response.status_code, reason[:500])
        return response.json()

    def canary(self) -> dict[str, Any]:
        """``GET /v1/canary``: the controller's flag and the fleet's canary (or None) and stable."""
        return self.call("GET", "/v1/canary")

    def pause(self, what: str, reason: str) -> None:
        """Pause ``trainer`` or ``canary`` (the controller)."""
        self.call("POST", f"/v1/{what}/pause", {"reason": reason})

    def resume(self, what: str, reason: str) -> None:
        """Resume ``trainer`` or ``canary``."""
        self.call("POST", f"/v1/{what}/resume", {"reason": reason})

    def audit(self, action: str, limit: int = 20) -> list[dict[str, Any]]:
        """``GET /v1/audit``: the newest entries of ``action`` (``flywheel audit``)."""
        return self.call("GET", f"/v1/audit?action={action}&limit={limit}")["items"]

    def operation(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A deployment operation, waited for (``?wait=true``): the succeeded operation; :class:`AdminRefused` with
        the failure's status and reason, or status None when it still runs after ``timeout_s``."""
        path = f"{path}?wait=true&wait_s={self.timeout_s:g}"
        op = self.call(method, path, body)
        if op.get("state") != "succeeded":
            raise AdminRefused(method, path, None, f"operation {op.get('id')} still {op.get('state')}")
        return op

    def deploy_canary(self, checkpoint_id: str, weight: float) -> dict[str, Any]:
        """``POST /v1/canary`` (``flywheel deploy --wait``)."""
        return self.operation("POST", "/v1/canary", {"checkpoint_id": checkpoint_id, "weight": weight})

    def rollback_canary(self, stable_checkpoint_id: str, reason: str) -> dict[str, Any]:
        """End the canary, back to ``stable_checkpoint_id`` (``flywheel rollback --wait``).

        Naming the stable makes the call harmless when the canary ended meanwhile: the API
        then refuses (it is already the stable) instead of rolling the stable back.
        """
        return self.operation("POST", "/v1/rollback", {"to_checkpoint_id": stable_checkpoint_id, "reason": reason})
