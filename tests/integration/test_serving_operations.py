"""Deployment operations of the admin API against real Postgres and real admin API servers.

The deploy, weight, promote and rollback routes answer 202 with an operation that a thread of
the admin API process runs; ``GET /v1/operations/{id}`` follows it from Postgres; ``?wait=true``
gives the synchronous answer. The CLI prints the operation's id, and ``--wait`` follows it
(exit 0, 1 with the reason, 3 after ``--timeout``). An operation left running by a process
that died is failed as ``abandoned`` once its lease lapses: a row left behind, and a real
``flywheel-serving admin`` killed with SIGKILL mid-operation. ``flywheel status --url``
against a remote admin API reads no local stack.

Replicas are addresses where nothing listens (a swap fails at once) or a *black hole* that
accepts connections and never answers (a swap waits for its 10 s ``/weight_info`` timeout): a
real operation that runs long enough to be followed, refused against, or killed. The happy
path through real vLLM replicas is in tests/integration/test_serving_admin_e2e.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port
from fastapi.testclient import TestClient
from sqlalchemy import select, text, update
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from flywheel.cli import app as cli_app
from flywheel.core.auth import create_key
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import AuditLog, Checkpoint, Deployment, Operation, Replica
from flywheel.core.settings import ServingSettings, Settings, get_settings
from serving.admin.app import create_app
from serving.fleet.registry import fleet_lock

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
UUID_RE = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def engine(db_url: str):
    return get_engine(db_url)


@pytest.fixture(scope="module")
def tokens(engine) -> dict[str, str]:
    with Session(engine) as session:
        out = {role: create_key(session, name=f"{role}-ops", role=role, created_by="test")[1]
               for role in ("viewer", "operator")}  # fmt: skip
        session.commit()
    return out


@pytest.fixture(scope="module")
def base_id(engine, base_model_dir: Path) -> str:
    from flywheel.model.register import register_base_model

    with Session(engine) as session:
        return register_base_model(session, get_settings().model, base_model_dir)


@pytest.fixture
def fleet() -> str:
    return f"op-{uuid.uuid4().hex[:8]}"


def make_settings(fleet: str, **serving: Any) -> Settings:
    return Settings(environment="test", serving=ServingSettings(fleet=fleet, **serving))


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A replica address that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def stable_fleet(engine, fleet: str, base_id: str, urls: list[str]) -> int:
    """A fleet serving the base as its active stable on replicas registered at ``urls``."""
    with Session(engine) as session:
        stable = Deployment(fleet=fleet, checkpoint_id=base_id, role="stable", weight=1.0, strategy="full",
                            status="active", created_by="test")  # fmt: skip
        session.add(stable)
        session.flush()
        for url in urls:
            session.add(Replica(fleet=fleet, url=url, state="serving", policy_version=base_id, checkpoint_id=base_id,
                                deployment_id=stable.id))  # fmt: skip
        session.commit()
        return stable.id


def add_candidate(engine, base_id: str, base_model_dir: Path, tmp_path: Path) -> str:
    """A full-weight checkpoint (a copy of the base) in the registry."""
    checkpoint_id = f"ck-{uuid.uuid4().hex[:8]}"
    shutil.copytree(base_model_dir, tmp_path / checkpoint_id)
    with Session(engine) as session:
        session.add(Checkpoint(id=checkpoint_id, policy_version=checkpoint_id, parent_id=base_id,
                               base_model=str(base_model_dir), path=str(tmp_path / checkpoint_id), format="full",
                               status="candidate", status_reason="test", n_samples=1))  # fmt: skip
        session.commit()
    return checkpoint_id


def active_canary(engine, fleet: str, checkpoint_id: str, weight: float = 0.1) -> int:
    """An active canary deployment, written as a finished deploy would leave it (no replica serves it)."""
    with Session(engine) as session:
        row = Deployment(fleet=fleet, checkpoint_id=checkpoint_id, role="canary", weight=weight, strategy="full",
                         status="active", created_by="test")  # fmt: skip
        session.add(row)
        session.commit()
        return row.id


def follow(client: TestClient, token: str, operation_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Read an operation until it ends."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = client.get(f"/v1/operations/{operation_id}", headers=bearer(token))
        assert answer.status_code == 200, answer.text
        op = answer.json()
        if op["state"] in ("succeeded", "failed"):
            return op
        assert time.monotonic() < deadline, op
        time.sleep(0.2)


def operation_row(engine, operation_id: str) -> Operation:
    with Session(engine) as session:
        return session.get(Operation, uuid.UUID(operation_id))


# --------------------------------------------------------------------------- 202, poll, wait


def test_operations_answer_202_and_are_followed_to_their_result_or_waited_for(engine, tokens, base_id, fleet,
                                                                             base_model_dir, tmp_path):  # fmt: skip
    stable_fleet(engine, fleet, base_id, [])
    candidate = add_candidate(engine, base_id, base_model_dir, tmp_path)
    canary_id = active_canary(engine, fleet, candidate)
    client = TestClient(create_app(make_settings(fleet), engine))
    operator = bearer(tokens["operator"])

    accepted = client.put("/v1/canary/weight", json={"weight": 0.5, "reason": "more data"}, headers=operator)
    assert accepted.status_code == 202, accepted.text
    op = accepted.json()
    assert (op["kind"], op["state"], op["params"]) == (
        "deploy.weight",
        "queued",
        {"weight": 0.5, "reason": "more data"},
    )
    assert accepted.headers["location"] == f"/v1/operations/{op['id']}"
    done = follow(client, tokens["viewer"], op["id"])
    assert done["state"] == "succeeded" and done["error"] is None and done["reason"] is None, done
    result = done["result"]
    assert (result["action"], result["actor"], result["fleet"]) == ("deploy.weight", "token:operator-ops", fleet)
    assert result["canary"]["id"] == canary_id and result["canary"]["weight"] == 0.5
    with Session(engine) as session:
        [row] = session.scalars(select(AuditLog).where(AuditLog.details["operation_id"].astext == op["id"])).all()
    assert (row.action, row.success, row.actor) == ("deploy.weight", True, "token:operator-ops")
    assert row.details["reason"] == "more data"

    waited = client.put("/v1/canary/weight", params={"wait": "true"}, json={"weight": 0.7}, headers=operator)
    assert waited.status_code == 200, waited.text  # the synchronous answer: the operation, ended
    assert waited.json()["state"] == "succeeded" and waited.json()["result"]["canary"]["weight"] == 0.7

    rolled = client.post("/v1/rollback", params={"wait": "true", "wait_s": 60}, json={}, headers=operator)
    assert rolled.status_code == 200, rolled.text
    result = rolled.json()["result"]
    assert result["canary"] is None and result["stable"]["checkpoint_id"] == base_id
    assert [(e["id"], e["status"]) for e in result["ended"]] == [(canary_id, "rolled_back")]

    listed = client.get("/v1/operations", params={"fleet": fleet, "limit": 2}, headers=bearer(tokens["viewer"]))
    assert [i["kind"] for i in listed.json()["items"]] == ["deploy.rollback", "deploy.weight"]
    bad = client.get("/v1/operations/not-an-id", headers=bearer(tokens["viewer"]))
    assert bad.status_code == 422 and "path.operation_id" in bad.json()["reason"]
    missing = client.get(f"/v1/operations/{uuid.uuid4()}", headers=bearer(tokens["viewer"]))
    assert missing.status_code == 404 and "no operation" in missing.json()["reason"]
    assert client.get(f"/v1/operations/{op['id']}").status_code == 401


def test_one_operation_per_fleet_and_refusals_known_up_front_answer_at_once(engine, tokens, base_id, fleet,
                                                                           base_model_dir, tmp_path,
                                                                           black_hole):  # fmt: skip
    stable_fleet(engine, fleet, base_id, [dead_url(), black_hole])  # the canary takes the last: the black hole
    candidate = add_candidate(engine, base_id, base_model_dir, tmp_path)
    client = TestClient(create_app(make_settings(fleet), engine))
    operator = bearer(tokens["operator"])

    first = client.post("/v1/canary", json={"checkpoint_id": candidate, "weight": 0.1}, headers=operator)
    assert first.status_code == 202, first.text
    op_id = first.json()["id"]
    second = client.post("/v1/canary", json={"checkpoint_id": candidate, "weight": 0.2}, headers=operator)
    assert second.status_code == 409, second.text
    reason = second.json()["reason"]  # refused at once, while the first one runs (its black hole takes 10 s)
    assert re.search(rf"operation {op_id} \(deploy.canary by token:operator-ops\) is (queued|running)", reason)
    assert "one deployment operation per fleet" in reason and f"flywheel ops show {op_id} --wait" in reason
    for path, body, fragment in (
        ("/v1/promote", {}, "no active canary to promote"),
        ("/v1/canary", {"checkpoint_id": "nope", "weight": 0.1}, "no checkpoint 'nope'"),
        ("/v1/canary", {"checkpoint_id": base_id, "weight": 0.1}, "already the stable"),
    ):
        refused = client.post(path, json=body, headers=operator)
        assert refused.status_code in (404, 409) and fragment in refused.json()["reason"], refused.text
    op = follow(client, tokens["viewer"], op_id)
    assert op["state"] == "failed" and op["error"] == "failed" and black_hole in op["reason"], op
    assert op["finished_at"]

    canary_id = active_canary(engine, fleet, candidate)
    with fleet_lock(engine, fleet):  # another process (the canary controller, a reconcile) holds the fleet
        held = client.post("/v1/promote", json={}, headers=operator)
    assert held.status_code == 409 and "holds its lock" in held.json()["reason"], held.text
    with Session(engine) as session:
        session.execute(update(Deployment).where(Deployment.id == canary_id).values(status="rolled_back"))
        session.commit()


# --------------------------------------------------------------------------- abandoned operations


def test_an_operation_left_running_by_a_dead_process_is_failed_at_start_and_a_live_peers_is_not(
    engine, tokens, base_id, fleet, base_model_dir, tmp_path
):
    peer_fleet = f"{fleet}-peer"
    dead_id, live_id = uuid.uuid4(), uuid.uuid4()
    with Session(engine) as session:
        session.add(Operation(id=dead_id, fleet=fleet, kind="deploy.promote", state="running", actor="token:x",
                              params={}, owner="gone-host:1:deadbeef", lease_s=30.0))  # fmt: skip
        session.add(Operation(id=live_id, fleet=peer_fleet, kind="deploy.rollback", state="running", actor="token:y",
                              params={}, owner="peer-host:7:cafe0001", lease_s=30.0))  # fmt: skip
        session.flush()
        session.execute(text("UPDATE operations SET started_at = now() - interval '2 hours', "
                             "heartbeat_at = now() - interval '1 hour' WHERE id = :id"), {"id": dead_id})  # fmt: skip
        session.commit()

    with TestClient(create_app(make_settings(fleet), engine)) as client:  # its start looks for abandoned ones
        dead, live = operation_row(engine, str(dead_id)), operation_row(engine, str(live_id))
        assert (dead.state, dead.error) == ("failed", "abandoned") and dead.finished_at is not None
        assert "gone-host:1:deadbeef stopped renewing" in dead.reason and "lease 30 s" in dead.reason
        assert (live.state, live.error) == ("running", None)  # a live peer's lease is fresh: never taken for dead
        shown = client.get(f"/v1/operations/{dead_id}", headers=bearer(tokens["viewer"])).json()
        assert (shown["state"], shown["error"], shown["reason"]) == ("failed", "abandoned", dead.reason)

        stable_fleet(engine, fleet, base_id, [])
        active_canary(engine, fleet, add_candidate(engine, base_id, base_model_dir, tmp_path))
        again = client.put("/v1/canary/weight", params={"wait": "true"}, json={"weight": 0.3},
                           headers=bearer(tokens["operator"]))  # fmt: skip
        assert again.status_code == 200, again.text  # the fleet takes operations again
        busy = client.post("/v1/rollback", json={}, headers=bearer(tokens["operator"]))
        assert busy.status_code == 202, busy.text
        follow(client, tokens["viewer"], busy.json()["id"])
    with Session(engine) as session:
        session.execute(update(Operation).where(Operation.id == live_id).values(state="failed", error="test"))
        session.commit()


def test_a_killed_admin_api_leaves_its_operation_failed_as_abandoned(engine, db_url, tokens, base_id, fleet,
                                                                    base_model_dir, tmp_path,
                                                                    black_hole):  # fmt: skip
    """A real ``flywheel-serving admin`` process killed with SIGKILL while its operation runs."""
    stable_fleet(engine, fleet, base_id, [dead_url(), black_hole])
    candidate = add_candidate(engine, base_id, base_model_dir, tmp_path)
    port = free_port()
    env = {**os.environ, "FLYWHEEL_POSTGRES__URL": db_url, "FLYWHEEL_ENVIRONMENT": "test",
           "FLYWHEEL_SERVING__FLEET": fleet, "FLYWHEEL_SERVING__OPERATION_LEASE_S": "2"}  # fmt: skip
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("flywheel-serving")), "admin", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        accepted = httpx.post(f"{url}/v1/canary", json={"checkpoint_id": candidate, "weight": 0.1},
                              headers=bearer(tokens["operator"]), timeout=30)  # fmt: skip
        assert accepted.status_code == 202, accepted.text
        op_id = accepted.json()["id"]
        assert accepted.json()["owner"].split(":")[1] == str(proc.pid)
        state = "queued"
        while state == "queued":
            time.sleep(0.1)
            state = httpx.get(f"{url}/v1/operations/{op_id}", headers=bearer(tokens["viewer"])).json()["state"]
        assert state == "running"
        os.kill(proc.pid, signal.SIGKILL)  # mid-swap: the black hole has not answered yet
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    left = operation_row(engine, op_id)
    assert left.state == "running" and left.finished_at is None  # what the dead process left behind

    client = TestClient(create_app(make_settings(fleet), engine))  # another admin API process
    time.sleep(2.5)  # the dead process's 2 s lease lapses
    op = client.get(f"/v1/operations/{op_id}", headers=bearer(tokens["viewer"])).json()
    assert (op["state"], op["error"]) == ("failed", "abandoned"), op
    assert f":{proc.pid}:" in op["reason"] and "stopped renewing" in op["reason"] and "lease 2 s" in op["reason"]

    with Session(engine) as session:  # the replica is reachable again as far as the registry knows
        session.execute(update(Replica).where(Replica.fleet == fleet).values(state="serving"))
        session.execute(update(Deployment).where(Deployment.fleet == fleet, Deployment.status == "pending")
                        .values(status="failed", reason="left pending by the killed admin API"))  # fmt: skip
        session.commit()
    again = client.post("/v1/canary", params={"wait": "true"}, json={"checkpoint_id": candidate, "weight": 0.1},
                        headers=bearer(tokens["operator"]))  # fmt: skip
    assert again.status_code == 502, again.text  # the fleet's lock died with the process: the next one runs
    assert black_hole in again.json()["reason"]


# --------------------------------------------------------------------------- the CLI


@pytest.fixture
def cli_server(engine, fleet: str, serve_app) -> Iterator[str]:
    with serve_app(create_app(make_settings(fleet), engine)) as server:
        yield server.url


def flywheel(*args: str, token: str, env: dict[str, str] | None = None):
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(cli_app, list(args), env={"FLYWHEEL_TOKEN": token, **(env or {})})
    finally:
        get_settings.cache_clear()


def test_the_cli_prints_the_operation_and_wait_follows_it_with_its_exit_code(engine, tokens, base_id, fleet,
                                                                            base_model_dir, tmp_path, black_hole,
                                                                            cli_server):  # fmt: skip
    stable_fleet(engine, fleet, base_id, [dead_url(), black_hole])
    candidate = add_candidate(engine, base_id, base_model_dir, tmp_path)
    ops = tokens["operator"]

    timed_out = flywheel("deploy", candidate, "--wait", "--timeout", "1", "--url", cli_server, token=ops)
    assert timed_out.exit_code == 3, timed_out.output
    op_id = re.search(rf"operation ({UUID_RE}) queued: deploy.canary on fleet {fleet} by token:operator-ops",
                      timed_out.stderr).group(1)  # fmt: skip
    assert f"still running after 1 s; it goes on: follow it with `flywheel ops show {op_id} --wait`" in timed_out.stderr
    busy = flywheel("deploy", candidate, "--url", cli_server, token=ops)
    assert busy.exit_code == 1 and f"HTTP 409 conflict: operation {op_id}" in busy.stderr, busy.output

    failed = flywheel("ops", "show", op_id, "--wait", "--url", cli_server, token=tokens["viewer"])
    assert failed.exit_code == 1, failed.output
    assert f"operation {op_id} failed: deploy.canary" in failed.stdout
    assert f"error    failed: swap of {black_hole}" in failed.stdout
    assert f"error: operation {op_id} (deploy.canary) failed: failed: swap of {black_hole}" in failed.stderr

    active_canary(engine, fleet, candidate)
    started = flywheel("canary", "weight", "0.4", "--reason", "ramp", "--url", cli_server, token=ops)
    assert started.exit_code == 0, started.output
    weight_id = re.fullmatch(rf"operation ({UUID_RE}) queued: deploy.weight on fleet {fleet} by token:operator-ops\n",
                             started.stdout).group(1)  # fmt: skip
    shown = flywheel("ops", "show", weight_id, "--wait", "--url", cli_server, token=tokens["viewer"])
    assert shown.exit_code == 0, shown.output
    assert f"operation {weight_id} succeeded: deploy.weight" in shown.stdout and "weight=0.40" in shown.stdout

    waited = flywheel("canary", "weight", "0.6", "--wait", "--json", "--url", cli_server, token=ops)
    assert waited.exit_code == 0, waited.output
    answer = json.loads(waited.stdout)
    assert answer["state"] == "succeeded" and answer["result"]["canary"]["weight"] == 0.6
    assert re.search(rf"operation {UUID_RE} succeeded \(\d+ s\)", waited.stderr), waited.stderr

    rolled = flywheel("rollback", "--reason", "done", "--wait", "--url", cli_server, token=ops)
    assert rolled.exit_code == 0, rolled.output
    assert "deploy.rollback done by token:operator-ops" in rolled.stdout and "canary  none" in rolled.stdout

    listed = flywheel("ops", "--url", cli_server, token=tokens["viewer"])
    assert listed.exit_code == 0, listed.output
    kinds = [line.split()[2] for line in listed.stdout.splitlines()][:4]  # newest first: this test's
    assert kinds == ["deploy.rollback", "deploy.weight", "deploy.weight", "deploy.canary"], listed.stdout
    only_failed = flywheel("ops", "list", "--state", "failed", "--url", cli_server, token=tokens["viewer"])
    assert op_id in only_failed.stdout and weight_id not in only_failed.stdout
    missing = flywheel("ops", "show", str(uuid.uuid4()), "--url", cli_server, token=tokens["viewer"])
    assert missing.exit_code == 1 and "HTTP 404 not_found: no operation" in missing.stderr


# --------------------------------------------------------------------------- remote status


class Listener:
    """A TCP listener that counts the connections made to it (a stand-in for a local broker, Postgres, Redis)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


def run_flywheel(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("flywheel")
    return subprocess.run([str(script), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_status_against_a_remote_admin_api_reads_no_local_stack(engine, tokens, base_id, fleet, tmp_path, cli_server):
    stable_fleet(engine, fleet, base_id, [dead_url()])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "stack.json").write_text("{this is not a stack")  # reading it would fail loudly
    listener = Listener()  # where the local broker, Postgres and Redis would be probed
    local = f"127.0.0.1:{listener.port}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")},
        "FLYWHEEL_RUN_DIR": str(run_dir),
        "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS": local,
        "FLYWHEEL_POSTGRES__URL": f"postgresql+psycopg://flywheel@{local}/flywheel",
        "FLYWHEEL_REDIS__URL": f"redis://{local}/0",
        "FLYWHEEL_VLLM__URLS": f'["http://{local}"]',
    }
    try:
        by_flag = run_flywheel(["status", "--url", cli_server, "--token", tokens["viewer"]], env, tmp_path)
        by_env = run_flywheel(["status", "--json"], {**env, "FLYWHEEL_SERVING__ADMIN_URL": cli_server,
                                                    "FLYWHEEL_TOKEN": tokens["viewer"]}, tmp_path)  # fmt: skip
        remote_probes = listener.connections
        # Without a URL, today's local behaviour: the stack file is read (here it cannot be) ...
        poisoned = run_flywheel(["status", "--no-fleet"], env, tmp_path)
        # ... and, with no stack recorded, the configured local endpoints are probed.
        probed = run_flywheel(["status", "--no-fleet"], {**env, "FLYWHEEL_RUN_DIR": str(tmp_path / "empty")}, tmp_path)
    finally:
        listener.close()
    assert by_flag.returncode == 0, by_flag.stdout + by_flag.stderr
    assert f"fleet {fleet}" in by_flag.stdout and f"stable  checkpoint={base_id}" in by_flag.stdout
    assert "flywheel stack" not in by_flag.stdout and "trainer: running" in by_flag.stdout
    assert by_env.returncode == 0, by_env.stdout + by_env.stderr
    assert json.loads(by_env.stdout)["fleet"]["fleet"] == fleet
    assert remote_probes == 0  # nothing local was probed by the two remote runs ...
    assert sorted(p.name for p in run_dir.iterdir()) == ["stack.json"]  # ... nor written
    assert poisoned.returncode != 0 and "flywheel stack" not in poisoned.stdout, poisoned.stdout
    assert "Invalid JSON" in poisoned.stdout + poisoned.stderr
    assert "flywheel stack" in probed.stdout and listener.connections > remote_probes, probed.stdout
