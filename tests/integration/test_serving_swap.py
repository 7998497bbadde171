"""Hot swap and deployments against two real vLLM replicas of the base model and a real Postgres.

The session's shared pair of replicas (:func:`conftest.replica_pair`: vLLM on the CPU takes a minute
to start); every test starts from the same fleet: both replicas on the base weights, fresh deployment, replica
and audit rows (:func:`clean_fleet`). The second checkpoint is the base with every weight
perturbed by seeded noise (its greedy output differs); a truncated copy is the broken one.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import WARMUP_TIMEOUT_S, ReplicaPair
from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from flywheel.core import vllm_admin
from flywheel.core.db import migrate
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import AuditLog, Checkpoint, Deployment, Replica
from flywheel.core.settings import Settings
from flywheel.stack import endpoints
from flywheel.stack.base import log_dir, log_tail
from flywheel.stack.stack import up
from flywheel.stack.vllm import policy_version_of
from serving.fleet import swap
from serving.fleet.deploy import DeployError, deploy_canary, promote, reconcile, rollback, set_canary_weight
from serving.fleet.pins import apply_settings_pins, pin_role, unpin_role
from serving.fleet.registry import ensure_fleet, fleet_lock, fleet_status
from serving.fleet.strategies import Target, get_strategy
from serving.fleet.swap import SwapVerifyError, rolling_swap, swap_replica, verify_replica

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROMPT = "user: what is 3 + 4?\nassistant:"
PERTURBED = "perturbed-7"
TRUNCATED = "truncated-7"
POISONED = "nan-7"
ADAPTER = "lora-7"
REFRESH_S = 0.2


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def db_url(pg_url: str) -> Iterator[str]:
    """A fresh, migrated database of this module (dropped afterwards)."""
    url = endpoints.with_database(pg_url, f"serving_swap_{uuid.uuid4().hex[:10]}")
    endpoints.ensure_database(url)
    migrate.upgrade(url)
    yield url
    get_engine(url).dispose()
    endpoints.drop_database(url)


@pytest.fixture(scope="module")
def settings(replica_pair: ReplicaPair, db_url: str) -> Settings:
    """The shared pair's settings (LoRA rank 8 on) with this module's database and serving fields."""
    return replica_pair.settings_with(
        postgres={"url": db_url},
        serving={"refresh_s": REFRESH_S, "drain_timeout_s": 20.0, "canary_replicas": 1},
    )


@pytest.fixture(scope="module")
def engine(db_url: str):
    return get_engine(db_url)


@pytest.fixture(scope="module")
def fleet(replica_pair: ReplicaPair) -> list[str]:
    """The session's two warmed-up replicas of the base model, as the module before left them reset."""
    replica_pair.reset()
    return replica_pair.urls


@pytest.fixture(scope="module")
def base_version(base_model_dir: Path) -> str:
    return policy_version_of(base_model_dir)


def _perturbed_copy(base: Path, target: Path, seed: int) -> Path:
    """The base folder (config, tokenizer) with every weight tensor perturbed by seeded noise (HF safetensors)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, target)
    weights = load_file(str(base / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    perturbed = {}
    for name, tensor in weights.items():
        scale = tensor.float().std() if tensor.numel() > 1 else torch.tensor(1.0)
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * scale
        perturbed[name] = (tensor.float() + noise).to(tensor.dtype).contiguous()
    save_file(perturbed, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _nan_copy(base: Path, target: Path) -> Path:
    """The base folder with the first layer's MLP weights all NaN."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, target)
    weights = load_file(str(base / "model.safetensors"))
    poisoned = {k: torch.full_like(v, float("nan")) if "layers.0.mlp" in k else v for k, v in weights.items()}
    save_file(poisoned, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _adapter(base: Path, target: Path) -> Path:
    """A rank-8 peft LoRA adapter of the base with random (non-zero) A and B: its output differs from the base's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(str(target))
    return target


def _add_checkpoint(engine, checkpoint_id: str, path: Path, parent: str, base_dir: Path, fmt: str = "full") -> None:
    with Session(engine) as session:
        session.add(
            Checkpoint(
                id=checkpoint_id,
                policy_version=checkpoint_id,
                parent_id=parent,
                base_model=str(base_dir),
                path=str(path),
                format=fmt,
                status="candidate",
                status_reason="test checkpoint",
            )
        )
        session.commit()


@pytest.fixture(scope="module")
def checkpoints(engine, fleet, settings, base_model_dir: Path, base_version: str, tmp_path_factory) -> dict[str, Path]:
    """The base registered (through ensure_fleet), a perturbed candidate, and a truncated candidate."""
    ensure_fleet(engine, settings, fleet, model_dir=base_model_dir)
    root = tmp_path_factory.mktemp("checkpoints")
    perturbed = _perturbed_copy(base_model_dir, root / PERTURBED, seed=4321)
    truncated = root / TRUNCATED
    shutil.copytree(perturbed, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _add_checkpoint(engine, PERTURBED, perturbed, base_version, base_model_dir)
    _add_checkpoint(engine, TRUNCATED, truncated, base_version, base_model_dir)
    _add_checkpoint(engine, POISONED, _nan_copy(base_model_dir, root / POISONED), base_version, base_model_dir)
    _add_checkpoint(engine, ADAPTER, _adapter(base_model_dir, root / ADAPTER), base_version, base_model_dir, fmt="lora")
    return {PERTURBED: perturbed, TRUNCATED: truncated, base_version: base_model_dir}


def _direct_swap(url: str, weights: Path, version: str) -> None:
    """Put weights on a replica behind the fleet's back (what a restarted replica or a reset does)."""
    vllm_admin.pause(url, mode="keep")
    try:
        vllm_admin.reload_weights(url, weights)
        vllm_admin.update_weight_version(url, version)
    finally:
        vllm_admin.resume(url)


@pytest.fixture(autouse=True)
def clean_fleet(engine, settings, fleet, checkpoints, base_model_dir: Path, base_version: str) -> Iterator[None]:
    """Both replicas on the base weights; fresh replica, deployment and audit rows; candidates reset."""
    for url in fleet:
        if vllm_admin.is_paused(url):
            vllm_admin.resume(url)
        if vllm_admin.weight_info(url) != base_version:
            _direct_swap(url, base_model_dir, base_version)
    with Session(engine) as session:
        session.execute(delete(Replica))
        session.execute(delete(Deployment))
        session.execute(delete(AuditLog))
        session.execute(
            update(Checkpoint)
            .where(Checkpoint.id.in_((PERTURBED, TRUNCATED, POISONED, ADAPTER)))
            .values(status="candidate", last_deployed_at=None)
        )
        session.commit()
    ensure_fleet(engine, settings, fleet, model_dir=base_model_dir)
    yield


# --------------------------------------------------------------------------- helpers


def greedy(url: str, model: str) -> list[int]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0.0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def replica_logs(settings: Settings) -> str:
    """The last lines of both replicas' logs, for a failure message (a hung engine says why there)."""
    return "\n".join(f"--- vllm-{i} ---\n{log_tail(log_dir(settings) / f'vllm-{i}.log', 40)}" for i in range(2))


def replica_rows(engine) -> dict[str, Replica]:
    with Session(engine) as session:
        return {r.url: r for r in session.scalars(select(Replica))}


def deployment_rows(engine) -> list[Deployment]:
    with Session(engine) as session:
        return list(session.scalars(select(Deployment).order_by(Deployment.id)))


def audit_rows(engine, action: str | None = None) -> list[AuditLog]:
    with Session(engine) as session:
        query = select(AuditLog).order_by(AuditLog.id)
        if action:
            query = query.where(AuditLog.action == action)
        return list(session.scalars(query))


class MiniRouter:
    """Load that routes like the router: every refresh, re-read the rows; send only to ``serving`` replicas."""

    def __init__(self, engine, model: str, clients: int = 2):
        self.engine, self.model = engine, model
        self.stop = threading.Event()
        self.answers: list[tuple[str, int, bool]] = []  # (url, HTTP status, sent while another replica was not serving)
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> MiniRouter:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)

    def _run(self, index: int) -> None:
        table: dict[str, str] = {}
        read_at = 0.0
        n = index
        # Idle connections are dropped before vLLM's own 5 s keep-alive ends, as the router does
        # (serving.upstream_keepalive_s): a swapped replica's pooled connection was once closed by the
        # replica just as this client reused it ("Server disconnected without sending a response").
        limits = httpx.Limits(keepalive_expiry=2.0)
        with httpx.Client(timeout=120, limits=limits) as client:
            while not self.stop.is_set():
                if time.monotonic() - read_at >= REFRESH_S:
                    table = {url: row.state for url, row in replica_rows(self.engine).items()}
                    read_at = time.monotonic()
                serving = sorted(u for u, s in table.items() if s == "serving")
                if not serving:
                    time.sleep(0.01)
                    continue
                url = serving[n % len(serving)]
                n += 1
                during_swap = len(serving) < len(table)
                body = {"model": self.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
                try:
                    response = client.post(f"{url}/v1/completions", json=body)
                    self.answers.append((url, response.status_code, during_swap))
                except httpx.HTTPError as err:
                    self.errors.append(f"{url}: {type(err).__name__}: {err}")


# --------------------------------------------------------------------------- tests


def test_ensure_fleet_registers_the_base_as_stable_and_is_idempotent(
    engine, settings, fleet, base_version, base_model_dir
):
    status = fleet_status(engine, settings.serving.fleet)
    assert status.stable is not None and status.canary is None
    assert (status.stable.checkpoint_id, status.stable.policy_version) == (base_version, base_version)
    assert (status.stable.weight, status.stable.status, status.stable.role) == (1.0, "active", "stable")
    assert sorted(r.url for r in status.replicas) == sorted(fleet)
    for replica in status.replicas:
        assert (replica.state, replica.policy_version, replica.checkpoint_id) == ("serving", base_version, base_version)
        assert replica.deployment_id == status.stable.id

    again = ensure_fleet(engine, settings, fleet, model_dir=base_model_dir)
    assert again.stable.id == status.stable.id
    assert len(deployment_rows(engine)) == 1 and len(replica_rows(engine)) == 2
    assert len(audit_rows(engine, "fleet.register")) == 1
    assert status.to_dict()["stable"]["checkpoint_id"] == base_version


def test_rolling_swap_moves_both_replicas_while_the_other_one_answers(engine, settings, fleet, base_version):
    before = {url: greedy(url, base_version) for url in fleet}
    with MiniRouter(engine, base_version) as load:
        time.sleep(1.0)
        results = rolling_swap(engine, settings, fleet, PERTURBED, None)
        time.sleep(1.0)

    assert [r.ok for r in results] == [True, True], f"{[r.reason for r in results]}\n{replica_logs(settings)}"
    assert [r.url for r in results] == fleet  # one at a time, in order
    for r in results:
        assert (r.from_version, r.to_version, r.reverted, r.state) == (base_version, PERTURBED, False, "serving")
        assert r.drained and r.drain_ms >= 2 * REFRESH_S * 1000 and 0 < r.pause_ms <= r.total_ms
    rows = replica_rows(engine)
    for url in fleet:
        assert vllm_admin.weight_info(url) == PERTURBED
        assert (rows[url].state, rows[url].policy_version, rows[url].checkpoint_id, rows[url].reason) == (
            "serving", PERTURBED, PERTURBED, None,
        )  # fmt: skip
        assert greedy(url, base_version) != before[url]  # the weights really changed

    assert load.errors == []
    assert [a for a in load.answers if a[1] != 200] == []
    during = [a for a in load.answers if a[2]]
    assert during, "no request was sent while a replica was swapping"
    assert {a[0] for a in during} == set(fleet)  # each replica answered while the other one swapped
    swaps = audit_rows(engine, "replica.swap")
    assert [(a.target, a.success) for a in swaps] == [(url, True) for url in fleet]


def test_truncated_checkpoint_is_refused_before_the_replica_is_touched(engine, settings, fleet, base_version):
    url = fleet[1]
    before = greedy(url, base_version)
    result = swap_replica(engine, settings, url, TRUNCATED, None)
    assert not result.ok and not result.reverted and result.state is None
    assert "truncated" in result.reason and "refused before touching" in result.reason
    assert result.drain_ms == 0 and result.pause_ms == 0
    assert vllm_admin.weight_info(url) == base_version and not vllm_admin.is_paused(url)
    assert greedy(url, base_version) == before
    row = replica_rows(engine)[url]
    assert (row.state, row.policy_version) == ("serving", base_version)

    with pytest.raises(DeployError) as refused:
        deploy_canary(engine, settings, TRUNCATED, 0.1, "ops:test")
    assert refused.value.kind == "invalid" and "truncated" in refused.value.message
    assert [d.checkpoint_id for d in deployment_rows(engine)] == [base_version]
    audit = audit_rows(engine, "deploy.canary")[-1]
    assert (audit.success, audit.actor, audit.details["error"]) == (False, "ops:test", "invalid")
    assert vllm_admin.weight_info(url) == base_version


def test_failed_verification_reverts_the_replica_and_fails_the_canary(engine, settings, fleet, base_version):
    url = fleet[1]  # the canary replica: the last one serving the stable
    before = greedy(url, base_version)
    checked: list[str] = []

    def refuse_new_weights(url_, expected, model, strategy, target):
        checked.append(expected)
        if expected == PERTURBED:
            raise SwapVerifyError("injected: the new weights answer wrongly")
        verify_replica(url_, expected, model, strategy, target)

    with pytest.raises(DeployError) as failed:
        deploy_canary(engine, settings, PERTURBED, 0.1, "ops:test", verify=refuse_new_weights)
    assert failed.value.kind == "failed" and "injected" in failed.value.message
    assert checked == [PERTURBED, base_version]  # forward verification failed, the revert verified

    canary = [d for d in deployment_rows(engine) if d.role == "canary"]
    assert [(d.status, d.checkpoint_id) for d in canary] == [("failed", PERTURBED)]
    assert "injected" in canary[0].reason and canary[0].ended_at is not None
    rows = replica_rows(engine)
    assert (rows[url].state, rows[url].policy_version, rows[url].checkpoint_id) == (
        "serving",
        base_version,
        base_version,
    )
    assert "reverted to" in rows[url].reason
    for u in fleet:
        assert vllm_admin.weight_info(u) == base_version
    assert greedy(url, base_version) == before  # the old weights are really back
    audit = audit_rows(engine, "deploy.canary")[-1]
    assert audit.success is False and audit.details["error"] == "failed"
    assert audit.details["swaps"][0]["reverted"] is True and audit.details["swaps"][0]["pause_ms"] > 0
    assert fleet_status(engine, settings.serving.fleet).stable.checkpoint_id == base_version


def test_canary_promote_then_rollback_to_the_previous_stable(engine, settings, fleet, base_version):
    fleet_name = settings.serving.fleet
    first_stable = fleet_status(engine, fleet_name).stable.id

    out = deploy_canary(engine, settings, PERTURBED, 0.1, "ops:alice", details={"ticket": "T-1"})
    assert out["canary"]["status"] == "active" and out["canary"]["weight"] == 0.1
    assert out["canary"]["policy_version"] == PERTURBED and out["stable"]["id"] == first_stable
    assert [vllm_admin.weight_info(u) for u in fleet] == [base_version, PERTURBED]
    rows = replica_rows(engine)
    assert rows[fleet[1]].deployment_id == out["canary"]["id"] and rows[fleet[0]].deployment_id == first_stable

    out = set_canary_weight(engine, settings, 0.5, "ops:alice")
    assert out["canary"]["weight"] == 0.5

    out = promote(engine, settings, "ops:alice", details={"reason": "non-inferior"})
    assert out["canary"] is None
    new_stable = out["stable"]
    assert (new_stable["checkpoint_id"], new_stable["weight"], new_stable["status"]) == (PERTURBED, 1.0, "active")
    assert [(e["role"], e["status"]) for e in out["ended"]] == [("stable", "superseded"), ("canary", "promoted")]
    assert out["ended"][0]["id"] == first_stable
    assert [vllm_admin.weight_info(u) for u in fleet] == [PERTURBED, PERTURBED]
    assert [len(out["swaps"]), out["swaps"][0]["url"]] == [1, fleet[0]]  # only the replica not yet on the canary
    rows = replica_rows(engine)
    assert {r.deployment_id for r in rows.values()} == {new_stable["id"]}
    with Session(engine) as session:
        checkpoint = session.get(Checkpoint, PERTURBED)
        assert checkpoint.status == "deployed" and checkpoint.last_deployed_at is not None
    statuses = {d.id: (d.role, d.status) for d in deployment_rows(engine)}
    assert statuses[first_stable] == ("stable", "superseded")

    out = rollback(engine, settings, "ops:bob", details={"reason": "user complaints"})
    assert (out["stable"]["checkpoint_id"], out["stable"]["status"], out["stable"]["weight"]) == (
        base_version,
        "active",
        1.0,
    )
    assert [vllm_admin.weight_info(u) for u in fleet] == [base_version, base_version]
    assert [s["url"] for s in out["swaps"]] == fleet
    statuses = {d.id: (d.role, d.status) for d in deployment_rows(engine)}
    assert statuses[new_stable["id"]] == ("stable", "superseded")
    assert sorted(statuses.values()).count(("stable", "active")) == 1
    assert {r.deployment_id for r in replica_rows(engine).values()} == {out["stable"]["id"]}

    audit = [a for a in audit_rows(engine) if a.action.startswith("deploy.")]
    assert [(a.action, a.actor, a.success) for a in audit] == [
        ("deploy.canary", "ops:alice", True),
        ("deploy.weight", "ops:alice", True),
        ("deploy.promote", "ops:alice", True),
        ("deploy.rollback", "ops:bob", True),
    ]
    canary_audit, weight_audit, promote_audit, rollback_audit = audit
    assert canary_audit.before["canary"] is None and canary_audit.after["canary"]["checkpoint_id"] == PERTURBED
    assert canary_audit.details["ticket"] == "T-1" and canary_audit.details["swaps"][0]["ok"] is True
    assert (weight_audit.details["previous_weight"], weight_audit.after["canary"]["weight"]) == (0.1, 0.5)
    assert promote_audit.before["stable"]["checkpoint_id"] == base_version
    assert promote_audit.after["stable"]["checkpoint_id"] == PERTURBED
    assert rollback_audit.after["stable"]["checkpoint_id"] == base_version
    assert rollback_audit.details["reason"] == "user complaints"


def test_canary_rollback_returns_its_replica_to_the_stable(engine, settings, fleet, base_version):
    stable = fleet_status(engine, settings.serving.fleet).stable.id
    out = deploy_canary(engine, settings, PERTURBED, 0.05, "canary-controller")
    canary = out["canary"]["id"]
    out = rollback(engine, settings, "canary-controller", details={"reason": "error rate up"})
    assert out["canary"] is None and out["stable"]["id"] == stable
    assert [(e["id"], e["status"], e["reason"]) for e in out["ended"]] == [(canary, "rolled_back", "error rate up")]
    assert [vllm_admin.weight_info(u) for u in fleet] == [base_version, base_version]
    rows = replica_rows(engine)
    assert {(r.state, r.checkpoint_id, r.deployment_id) for r in rows.values()} == {("serving", base_version, stable)}


def test_a_full_weight_canary_never_takes_every_replica(engine, settings, fleet, base_version):
    greedy_settings = settings.model_copy(
        update={"serving": settings.serving.model_copy(update={"canary_replicas": 2})}
    )
    with pytest.raises(DeployError) as refused:
        deploy_canary(engine, greedy_settings, PERTURBED, 0.1, "ops:test")
    assert refused.value.kind == "conflict" and "would leave no stable replica" in refused.value.message
    assert [d.role for d in deployment_rows(engine)] == ["stable"]
    assert [vllm_admin.weight_info(u) for u in fleet] == [base_version, base_version]
    assert audit_rows(engine, "replica.swap") == []


def test_the_fleet_lock_refuses_a_concurrent_operation(engine, settings, fleet, base_version):
    entered, release = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def slow_verify(url, expected, model, strategy, target):
        entered.set()
        release.wait(timeout=120)
        verify_replica(url, expected, model, strategy, target)

    def run() -> None:
        try:
            outcome["result"] = deploy_canary(engine, settings, PERTURBED, 0.1, "ops:first", verify=slow_verify)
        except DeployError as err:  # reported to the test thread
            outcome["error"] = err

    worker = threading.Thread(target=run)
    worker.start()
    try:
        assert entered.wait(timeout=120), "the first deployment never reached verification"
        with pytest.raises(DeployError) as second:
            promote(engine, settings, "ops:second")
        assert second.value.kind == "conflict" and "another deployment operation is running" in second.value.message
        with pytest.raises(DeployError, match="another deployment operation is running"):
            reconcile(engine, settings)
    finally:
        release.set()
        worker.join(timeout=300)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"]["canary"]["status"] == "active"
    refused = [a for a in audit_rows(engine, "deploy.promote")]
    assert [(a.actor, a.success, a.details["error"]) for a in refused] == [("ops:second", False, "conflict")]
    with fleet_lock(engine, settings.serving.fleet), pytest.raises(DeployError, match="another deployment"):
        set_canary_weight(engine, settings, 0.2, "ops:third")


def test_reconcile_swaps_a_restarted_replica_back_to_its_deployment(engine, settings, fleet, checkpoints, base_version):
    out = deploy_canary(engine, settings, PERTURBED, 0.1, "ops:test")
    canary_url = fleet[1]
    # what a replica restarted by its supervisor looks like: the base weights and version
    _direct_swap(canary_url, checkpoints[base_version], base_version)
    assert vllm_admin.weight_info(canary_url) == base_version

    results = reconcile(engine, settings)
    assert [(r.url, r.ok, r.from_version, r.to_version) for r in results] == [
        (canary_url, True, base_version, PERTURBED)
    ]
    assert vllm_admin.weight_info(canary_url) == PERTURBED and vllm_admin.weight_info(fleet[0]) == base_version
    row = replica_rows(engine)[canary_url]
    assert (row.state, row.checkpoint_id, row.deployment_id) == ("serving", PERTURBED, out["canary"]["id"])
    assert reconcile(engine, settings) == []  # in sync: nothing to do
    assert len(audit_rows(engine, "deploy.reconcile")) == 1


def test_a_checkpoint_with_nan_weights_is_refused_before_the_replica_is_touched(engine, settings, fleet, base_version):
    # measured: a replica that served these weights answered HTTP 400 to every completion
    url = fleet[1]
    result = swap_replica(engine, settings, url, POISONED, None)
    assert not result.ok and result.state is None and "NaN or infinite" in result.reason and result.pause_ms == 0
    assert vllm_admin.weight_info(url) == base_version
    with pytest.raises(DeployError) as refused:
        deploy_canary(engine, settings, POISONED, 0.1, "ops:test")
    assert refused.value.kind == "invalid" and "NaN" in refused.value.message
    base = Target(base_version, base_version, "", "full")
    verify_replica(url, base_version, base_version, get_strategy("full"), base)  # still answering


def test_verification_resumes_a_replica_left_paused_and_then_passes(
    engine, settings, fleet, base_version, monkeypatch, caplog
):
    # a held request on a paused scheduler never answers: verification must notice, resume and ask again
    monkeypatch.setattr(swap, "VERIFY_TIMEOUT_S", 9.0)  # three tries of 3 s
    url = fleet[1]
    vllm_admin.pause(url, mode="keep")
    assert vllm_admin.is_paused(url)
    base = Target(base_version, base_version, "", "full")
    started = time.monotonic()
    verify_replica(url, base_version, base_version, get_strategy("full"), base)
    assert 3.0 <= time.monotonic() - started < 9.0  # the first try timed out, a later one answered
    assert not vllm_admin.is_paused(url)
    assert "verification completion timed out (attempt 1 of 3, paused: True)" in caplog.text


def test_a_revert_that_does_not_verify_marks_the_replica_failed_and_reconcile_recovers_it(
    engine, settings, fleet, base_version
):
    url = fleet[1]

    def refuse_everything(url_, expected, model, strategy, target):
        raise SwapVerifyError(f"injected: refuse {expected}")

    result = swap_replica(engine, settings, url, PERTURBED, None, verify=refuse_everything)
    assert not result.ok and not result.reverted and result.state == "failed"
    assert f"revert to {base_version} failed" in result.reason and "injected: refuse perturbed-7" in result.reason
    row = replica_rows(engine)[url]
    assert (row.state, "injected" in row.reason) == ("failed", True)
    assert vllm_admin.weight_info(url) == base_version  # the revert reloaded the old weights; only its check failed

    results = reconcile(engine, settings)
    assert [(r.url, r.ok, r.to_version) for r in results] == [(url, True, base_version)]
    row = replica_rows(engine)[url]
    assert (row.state, row.policy_version, row.reason) == ("serving", base_version, None)


def test_lora_canary_shares_the_replicas_then_promotes_and_rolls_back(engine, settings, fleet, base_version):
    lora = settings.model_copy(update={"serving": settings.serving.model_copy(update={"strategy": "lora"})})
    before = {url: greedy(url, base_version) for url in fleet}
    with pytest.raises(DeployError, match="holds full weights"):
        deploy_canary(engine, lora, PERTURBED, 0.1, "ops:test")

    out = deploy_canary(engine, lora, ADAPTER, 0.2, "ops:test")
    assert (out["canary"]["strategy"], out["canary"]["status"], out["canary"]["policy_version"]) == (
        "lora",
        "active",
        ADAPTER,
    )
    assert [(s["url"], s["ok"], s["pause_ms"], s["drain_ms"]) for s in out["swaps"]] == [
        (u, True, 0.0, 0.0) for u in fleet
    ]
    for url in fleet:
        models = {m["id"]: m.get("parent") for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert models[ADAPTER] == base_version  # the adapter is served beside the base, on every replica
        assert vllm_admin.weight_info(url) == base_version
        assert greedy(url, base_version) == before[url]  # stable traffic unchanged
        assert greedy(url, ADAPTER) != before[url]  # the adapter really answers
    assert {r.state for r in replica_rows(engine).values()} == {"serving"}

    out = promote(engine, lora, "ops:test")
    assert (out["stable"]["checkpoint_id"], out["stable"]["strategy"], out["canary"]) == (ADAPTER, "lora", None)
    out = rollback(engine, lora, "ops:test")
    assert out["stable"]["checkpoint_id"] == base_version and out["swaps"] == []  # the base is always on the replicas
    assert [vllm_admin.weight_info(u) for u in fleet] == [base_version, base_version]


def test_a_pinned_role_keeps_its_replica_through_a_stable_rollback_until_unpinned(
    engine, settings, fleet, base_version
):
    """Full weights: the pin takes one stable replica; stable operations swap only the others; unpinning
    returns it to the stable; settings pins are applied (and re-applied) by the controller's tick."""
    subagent = settings.model_copy(
        update={"serving": settings.serving.model_copy(update={"role_pins": {"subagent": base_version}})}
    )
    with pytest.raises(DeployError, match="is trained"):
        pin_role(engine, settings, "agent", base_version, "ops:test")
    with pytest.raises(DeployError, match="pinned by settings"):
        pin_role(engine, subagent, "subagent", PERTURBED, "ops:test")

    [out] = apply_settings_pins(engine, subagent)  # the controller's tick: pin the frozen base
    [pin] = out["pins"]
    assert (pin["agent_role"], pin["checkpoint_id"], pin["status"], pin["role"]) == (
        "subagent",
        base_version,
        "active",
        "pinned",
    )
    assert [s["url"] for s in out["swaps"]] == [fleet[0]]
    assert apply_settings_pins(engine, subagent) == []  # already applied: nothing to do
    rows = replica_rows(engine)
    assert rows[fleet[0]].deployment_id == pin["id"] and rows[fleet[1]].deployment_id == out["stable"]["id"]

    with pytest.raises(DeployError, match="would leave no stable replica"):
        deploy_canary(engine, subagent, PERTURBED, 0.1, "ops:test")  # the pinned replica is not the stable's

    out = rollback(engine, subagent, "ops:test", to_checkpoint_id=PERTURBED)
    assert [s["url"] for s in out["swaps"]] == [fleet[1]]  # the stable moved without the pinned replica
    assert [vllm_admin.weight_info(u) for u in fleet] == [base_version, PERTURBED]
    assert [p["checkpoint_id"] for p in out["pins"]] == [base_version]
    assert reconcile(engine, subagent) == []  # both replicas serve what their deployments say

    with pytest.raises(DeployError, match="pinned by settings"):
        unpin_role(engine, subagent, "subagent", "ops:test")
    out = unpin_role(engine, settings, "subagent", "ops:test")
    assert out["pins"] == [] and [(e["role"], e["status"]) for e in out["ended"]] == [("pinned", "unpinned")]
    assert [s["url"] for s in out["swaps"]] == [fleet[0]]
    assert [vllm_admin.weight_info(u) for u in fleet] == [PERTURBED, PERTURBED]
    assert {r.deployment_id for r in replica_rows(engine).values()} == {out["stable"]["id"]}
    actions = [(a.action, a.actor, a.success) for a in audit_rows(engine) if a.action.startswith("deploy.")]
    assert actions[0] == ("deploy.pin", "ops:test", False) and ("deploy.pin", "settings", True) in actions
    assert actions[-1] == ("deploy.unpin", "ops:test", True)


def test_a_lora_pin_loads_its_adapter_on_every_replica(engine, settings, fleet, base_version):
    lora = settings.model_copy(update={"serving": settings.serving.model_copy(update={"strategy": "lora"})})
    out = pin_role(engine, lora, "subagent", ADAPTER, "ops:test")
    assert [(p["agent_role"], p["policy_version"]) for p in out["pins"]] == [("subagent", ADAPTER)]
    assert [s["url"] for s in out["swaps"]] == fleet
    for url in fleet:
        assert ADAPTER in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
    out = pin_role(engine, lora, "subagent", base_version, "ops:test")  # re-pin: the base is on every replica
    assert [p["checkpoint_id"] for p in out["pins"]] == [base_version] and out["swaps"] == []
    assert [(e["checkpoint_id"], e["status"]) for e in out["ended"]] == [(ADAPTER, "unpinned")]


def test_a_replica_killed_between_pause_and_resume_ends_failed_and_the_admin_api_says_so(
    engine, settings, fleet, base_model_dir: Path, base_version, monkeypatch
):
    """A hot swap interrupted half-way: the replica dies right after ``pause``. Deployed through
    the admin API, the deployment ends ``failed``, the replica ``failed`` with the reason, the
    stable untouched and still answering, and ``GET /fleet`` reports exactly that. The replica,
    restarted, is put back on the stable by ``reconcile``."""
    import os
    import signal

    from fastapi.testclient import TestClient

    from flywheel.core.auth import create_key
    from flywheel.stack.base import load_state
    from serving.admin.app import create_app

    url = fleet[1]  # the canary replica
    victim = load_state(settings).components["vllm-1"]
    assert victim.where == url
    real_pause = vllm_admin.pause
    killed: list[str] = []

    def pause_then_die(target: str, mode: str = "keep") -> None:
        real_pause(target, mode=mode)
        if target == url and not killed:
            os.killpg(victim.pid, signal.SIGKILL)  # the whole replica: server and engine
            killed.append(target)

    monkeypatch.setattr(vllm_admin, "pause", pause_then_die)
    with Session(engine) as session:
        _, operator = create_key(session, name=f"op-{uuid.uuid4().hex[:6]}", role="operator", created_by="test")
        session.commit()
    client = TestClient(create_app(settings, engine))
    auth = {"Authorization": f"Bearer {operator}"}
    try:
        response = client.post(
            "/v1/canary", params={"wait": "true"}, json={"checkpoint_id": PERTURBED, "weight": 0.1}, headers=auth
        )
        assert killed == [url]
        assert response.status_code == 502, response.text  # the swap failed on a replica, said in words
        assert response.json()["error"] == "failed" and url in response.json()["reason"], response.text

        fleet_view = client.get("/v1/fleet", headers=auth)
        assert fleet_view.status_code == 200, fleet_view.text
        view = fleet_view.json()
        assert view["stable"]["checkpoint_id"] == base_version
        assert view["canary"] is None or view["canary"]["status"] != "active", view["canary"]
        replicas = {r["url"]: r for r in view["replicas"]}
        assert replicas[url]["state"] == "failed" and replicas[url]["reason"], replicas[url]
        assert replicas[fleet[0]]["state"] == "serving" and replicas[fleet[0]]["policy_version"] == base_version
        canary = [d for d in deployment_rows(engine) if d.role == "canary"]
        assert [(d.status, d.checkpoint_id) for d in canary] == [("failed", PERTURBED)]
        assert canary[0].ended_at is not None and canary[0].reason
        audit = audit_rows(engine, "deploy.canary")[-1]
        assert audit.success is False and audit.details["error"] == "failed"
        assert greedy(fleet[0], base_version)  # the stable replica never stopped answering
    finally:
        monkeypatch.setattr(vllm_admin, "pause", real_pause)
        state = up(settings, ["vllm"], model_dir=base_model_dir)  # the killed replica comes back (fresh process)
        assert state.components["vllm-1"].where == url and state.components["vllm-1"].pid != victim.pid
        httpx.post(f"{url}/v1/completions", json={"model": base_version, "prompt": "warm up", "max_tokens": 4},
                   timeout=WARMUP_TIMEOUT_S).raise_for_status()  # fmt: skip
    results = reconcile(engine, settings)
    assert all(r.ok for r in results), results
    rows = replica_rows(engine)
    assert (rows[url].state, rows[url].policy_version) == ("serving", base_version)
