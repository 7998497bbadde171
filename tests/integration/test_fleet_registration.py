"""Fleet registration without the demo, against a real vLLM replica and a real Postgres.

``flywheel fleet register`` runs as a subprocess (the console script) and the canary
controller as ``python -m serving.main canary``, both told where everything is through their
environment only, as compose or Kubernetes would. A replica that joins late is the session's
real replica behind a TCP port that starts forwarding only after the controller has recorded
it as failed; the router (in-process, on a free port) lists it routable on ``/ready`` once it is
recorded (a completion through the router needs a product key, which is not what this tests).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import VllmReplica, fresh_database
from sqlalchemy import select
from sqlalchemy.orm import Session

from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import AuditLog, Deployment, Replica
from flywheel.core.settings import Settings
from flywheel.stack.vllm import policy_version_of
from serving.fleet.deploy import reconcile
from serving.fleet.registry import ensure_fleet, register_replicas

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

FLYWHEEL = Path(sys.executable).with_name("flywheel")


def role_env(db_url: str, run_dir: Path, model_dir: Path, fleet: str, urls: list[str] | None) -> dict[str, str]:
    """The environment of a deployed serving process: endpoints, fleet, base model; nothing from a local stack."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(
        FLYWHEEL_ENVIRONMENT="test",
        FLYWHEEL_RUN_DIR=str(run_dir),
        FLYWHEEL_POSTGRES__URL=db_url,
        FLYWHEEL_MODEL__PATH=str(model_dir),
        FLYWHEEL_SERVING__FLEET=fleet,
        PYTHONUNBUFFERED="1",
    )
    if urls is not None:
        env["FLYWHEEL_VLLM__URLS"] = json.dumps(urls)
    return env


def register(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(FLYWHEEL), "fleet", "register", *args], env=env, capture_output=True, text=True, timeout=120
    )


def rows(engine: Any, fleet: str) -> tuple[list[Deployment], dict[str, Replica], list[AuditLog]]:
    with Session(engine) as session:
        deployments = list(session.scalars(select(Deployment).where(Deployment.fleet == fleet)))
        replicas = {r.url: r for r in session.scalars(select(Replica).where(Replica.fleet == fleet))}
        audit = list(session.scalars(select(AuditLog).where(AuditLog.action == "fleet.register").order_by(AuditLog.id)))
        return deployments, replicas, audit


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"{what} did not happen within {timeout_s:.0f} s\n{tail}")


class LatePort:
    """A loopback port that refuses connections until :meth:`open`, then forwards each one to ``target``."""

    def __init__(self, port: int, target: tuple[str, int]):
        self.port, self.target = port, target
        self.url = f"http://127.0.0.1:{port}"
        self.listener: socket.socket | None = None
        self.closing = False

    def open(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.closing = True
        if self.listener is not None:
            self.listener.close()

    def _accept(self) -> None:
        assert self.listener is not None
        while not self.closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@contextmanager
def router_serving(settings: Settings, engine: Any, port: int) -> Iterator[str]:
    """The router app under uvicorn (lifespan on: its refresh and probe loops run) in a thread; yields its URL."""
    import uvicorn

    from serving.proxy.router import create_app, uvicorn_config

    server = uvicorn.Server(uvicorn_config(create_app(settings, engine), "127.0.0.1", port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the router answering /health", lambda: _answers(f"{url}/health"), 30)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def db_url(pg_url: str) -> Iterator[str]:
    with fresh_database(pg_url, "fleet_registration") as url:
        yield url


def test_flywheel_fleet_register_records_the_replica_and_the_base_as_stable(
    db_url: str, vllm_replica: VllmReplica, base_model_dir: Path, tmp_path: Path, unused_port
) -> None:
    fleet = "registered-by-cli"
    dead = f"http://127.0.0.1:{unused_port()}"
    env = role_env(db_url, tmp_path, base_model_dir, fleet, [vllm_replica.url, dead])
    base = policy_version_of(base_model_dir)

    first = register(env)  # the URLs of the settings (FLYWHEEL_VLLM__URLS)
    assert first.returncode == 0, first.stderr
    assert "(the base model, registered now)" in first.stdout and f"{dead}  registered  FAILED" in first.stdout
    engine = get_engine(db_url)
    [stable], replicas, audit = rows(engine, fleet)
    assert (stable.role, stable.status, stable.checkpoint_id, stable.weight) == ("stable", "active", base, 1.0)
    assert (stable.created_by, len(audit)) == ("cli", 1)
    live = replicas[vllm_replica.url]
    assert (live.state, live.policy_version, live.checkpoint_id, live.deployment_id) == (
        "serving", base, base, stable.id,
    )  # fmt: skip
    assert (replicas[dead].state, replicas[dead].checkpoint_id) == ("failed", None)
    assert "did not answer" in replicas[dead].reason
    assert f"replica {replicas[dead].id}  {dead}  registered  FAILED" in first.stdout  # the id clients see, for ops

    again = register(env, vllm_replica.url, "--json")  # idempotent: nothing new written
    assert again.returncode == 0, again.stderr
    shown = json.loads(again.stdout)
    assert shown["stable"]["id"] == stable.id and len(shown["replicas"]) == 2
    assert {r["id"]: r["url"] for r in shown["replicas"]} == {r.id: u for u, r in replicas.items()}
    deployments, replicas_after, audit_after = rows(engine, fleet)
    assert [d.id for d in deployments] == [stable.id] and len(audit_after) == 1
    assert replicas_after[vllm_replica.url].updated_at == live.updated_at


def test_flywheel_fleet_register_refuses_without_urls_or_database(
    db_url: str, base_model_dir: Path, tmp_path: Path, unused_port
) -> None:
    none = register(role_env(db_url, tmp_path, base_model_dir, "nothing", []))
    assert none.returncode == 2 and "no replica URL" in none.stderr and "FLYWHEEL_VLLM__URLS" in none.stderr
    bad = register(role_env(db_url, tmp_path, base_model_dir, "nothing", None), "http://127.0.0.1:8000/v1")
    assert bad.returncode == 2 and "has a path" in bad.stderr
    away = f"postgresql+psycopg://flywheel:x@127.0.0.1:{unused_port()}/flywheel"
    gone = register(role_env(away, tmp_path, base_model_dir, "nothing", None), "http://127.0.0.1:9")
    assert gone.returncode == 1 and "database unreachable" in gone.stderr
    with Session(get_engine(db_url)) as session:
        assert session.scalars(select(Replica)).first() is None


def test_the_canary_controller_registers_a_replica_that_joins_late_and_the_router_routes_it(
    db_url: str,
    vllm_replica: VllmReplica,
    base_model_dir: Path,
    stack_settings: Settings,
    tmp_path: Path,
    unused_port,
) -> None:
    fleet = "registered-by-controller"
    replica = urlsplit(vllm_replica.url)
    late = LatePort(unused_port(), (replica.hostname, replica.port))
    env = role_env(db_url, tmp_path, base_model_dir, fleet, [late.url])
    env["FLYWHEEL_SERVING__CANARY__INTERVAL_S"] = "0.5"
    log = tmp_path / "canary.log"
    engine = get_engine(db_url)
    base = policy_version_of(base_model_dir)
    serving = stack_settings.serving.model_copy(update={"fleet": fleet, "refresh_s": 0.2, "health_interval_s": 0.2})
    router_settings = stack_settings.model_copy(update={"postgres": stack_settings.postgres.model_copy(
        update={"url": db_url}), "serving": serving})  # fmt: skip
    with open(log, "w") as out:
        controller = subprocess.Popen(
            [sys.executable, "-m", "serving.main", "canary"], env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        with router_serving(router_settings, engine, unused_port()) as router:

            def recorded_failed() -> bool:
                deployments, replicas, _ = rows(engine, fleet)
                return bool(deployments) and late.url in replicas and replicas[late.url].state == "failed"

            wait_for("the controller registering the unreachable replica as failed", recorded_failed, 90, log)

            late_id = str(rows(engine, fleet)[1][late.url].id)  # clients know a replica by its id alone

            # The router may have read the table between the controller's look and its write (an
            # empty fleet then): wait for a read that lists the row, not for the first read.
            def table_read() -> bool:
                return f"replica {late_id} is" in httpx.get(f"{router}/ready", timeout=5).text

            wait_for("the router reading the failed replica from the routing table", table_read, 30)
            not_ready = httpx.get(f"{router}/ready", timeout=5)
            reason = not_ready.json()["reason"]
            assert not_ready.status_code == 503 and f"replica {late_id} is failed" in reason, not_ready.text
            assert late.url not in reason and late.url.split("//")[1] not in reason, reason

            late.open()  # the replica joins

            def serving_stable() -> bool:
                [stable], replicas, _ = rows(engine, fleet)
                row = replicas[late.url]
                return (row.state, row.checkpoint_id, row.deployment_id) == ("serving", base, stable.id)

            wait_for("the controller recording the late replica as serving", serving_stable, 60, log)

            def routed() -> bool:
                answer = httpx.get(f"{router}/ready", timeout=5)
                now_id = str(rows(engine, fleet)[1][late.url].id)
                return answer.status_code == 200 and answer.json()["routable"].get(base) == [now_id]

            wait_for("the router routing to the late replica", routed, 30, log)
        [stable], replicas, audit = rows(engine, fleet)
        assert stable.created_by == "canary-controller" and stable.checkpoint_id == base
        assert [a.details["replicas_added"][0]["url"] for a in audit[:1]] == [late.url]
        # Brought in by the registration of a later look, or by that look's reconcile (a swap to the
        # stable) when the port opened between the two: either is written down.
        adopted = [a for a in audit if late.url in a.details["replicas_adopted"]]
        with Session(engine) as session:
            reconciled = session.scalars(select(AuditLog).where(AuditLog.action == "deploy.reconcile")).all()
            swapped = [a for a in reconciled if late.url in [s["url"] for s in a.details["swaps"]]]
        assert len(adopted) + len(swapped) == 1, (audit, reconciled)
        assert controller.poll() is None, log.read_text()[-3000:]
    finally:
        os.killpg(controller.pid, signal.SIGTERM)
        controller.wait(timeout=30)
        late.close()


def test_registration_records_a_failed_replica_as_serving_once_it_answers_without_a_swap(
    db_url: str, vllm_replica: VllmReplica, base_model_dir: Path, stack_settings: Settings, unused_port
) -> None:
    fleet = "adopted"
    replica = urlsplit(vllm_replica.url)
    late = LatePort(unused_port(), (replica.hostname, replica.port))
    settings = stack_settings.model_copy(update={
        "postgres": stack_settings.postgres.model_copy(update={"url": db_url}),
        "serving": stack_settings.serving.model_copy(update={"fleet": fleet}),
    })  # fmt: skip
    engine = get_engine(db_url)
    base = policy_version_of(base_model_dir)
    try:
        first = register_replicas(engine, settings, [late.url], base_model_dir, actor="test", build=False)
        assert first.stable_created and [r["state"] for r in first.added] == ["failed"] and first.adopted == []
        still = register_replicas(engine, settings, [late.url], base_model_dir, actor="test", build=False)
        assert (still.added, still.adopted) == ([], [])  # still unreachable: nothing written
        late.open()
        joined = register_replicas(engine, settings, [late.url], base_model_dir, actor="test", build=False)
        assert [(r["url"], r["state"], r["policy_version"]) for r in joined.adopted] == [(late.url, "serving", base)]
        status = ensure_fleet(engine, settings, [late.url], base_model_dir)  # the demo's call: idempotent
        [row] = status.replicas
        assert (row.state, row.checkpoint_id, row.deployment_id) == ("serving", base, status.stable.id)
        assert row.reason is None
        assert reconcile(engine, settings) == []  # in sync already: no swap needed
        _, _, audit = rows(engine, fleet)
        assert [(a.details["stable_created"], a.details["replicas_adopted"]) for a in audit] == [
            (True, []), (False, [late.url]),
        ]  # fmt: skip
    finally:
        late.close()
