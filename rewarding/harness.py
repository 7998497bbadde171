"""Run rewarding workers as processes and feed them events: for tests, the benchmark and demos.

Workers are configured only through ``FLYWHEEL_*`` environment variables (as in
production), built from nested override dicts by :func:`settings_env`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from flywheel.core import kafka_clients
from flywheel.core.contracts.events import EventBase, dump_event
from flywheel.core.kafka_security import PLAINTEXT, KafkaSecurity

T = TypeVar("T")
READY_MARK = "[^Worker]: Ready"
HOLDING_MARK = re.compile(rb"fetching from t=(\d+\.\d+)")
"""The worker's log line when it holds its partitions, its tables recovered (``rewarding.app.HOLDING_LOG``)."""
HOLDING_CPU_MARK = re.compile(rb"fetching from t=\d+\.\d+ cpu=(\d+\.\d+)")
"""The same line's CPU seconds the worker process had used by then."""
FIRST_EVENTS_MARK = re.compile(rb"first events since the assignment: t=(\d+\.\d+)")
"""The worker's log line at the first batch after each assignment (``rewarding.app.FIRST_EVENTS_LOG``)."""
WORKER_COMMAND = [sys.executable, "-m", "rewarding.main", "worker"]


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def settings_env(overrides: dict[str, Any], prefix: str = "FLYWHEEL") -> dict[str, str]:
    """``{"rewarding": {"feedback_window_s": 1}}`` -> ``{"FLYWHEEL_REWARDING__FEEDBACK_WINDOW_S": "1"}``.

    Dicts nest one level per ``__``; lists and dict-valued fields (weights, rules) are JSON;
    ``None`` leaves the field at its default.
    """
    env: dict[str, str] = {}
    for key, value in overrides.items():
        name = f"{prefix}_{key.upper()}" if prefix == "FLYWHEEL" else f"{prefix}__{key.upper()}"
        if value is None:
            continue
        if isinstance(value, dict) and not _json_leaf(key):
            env.update(settings_env(value, name))
        elif isinstance(value, (dict, list, bool)):
            env[name] = json.dumps(value)
        else:
            env[name] = str(value)
    return env


def _json_leaf(key: str) -> bool:
    """Dict-valued fields passed as one JSON value rather than nested variables."""
    return key in {"weights", "task_weights", "rules", "bounds"}


class WorkerProcess:
    """One ``flywheel-rewarding worker`` process, its log in a file."""

    def __init__(self, env: dict[str, str], log_path: Path, cwd: Path | None = None, command: list[str] | None = None):
        self.env = {**os.environ, **env}
        self.log_path = log_path
        self.cwd = cwd
        self.command = command or WORKER_COMMAND
        """The worker's command line (the benchmark's ``--profile`` runs it under cProfile)."""
        self.proc: subprocess.Popen | None = None
        self._log_offset = 0

    def start(self, ready_timeout_s: float = 120.0) -> WorkerProcess:
        """Start it and wait until faust says it is ready."""
        return self.launch().wait_ready(ready_timeout_s)

    def launch(self) -> WorkerProcess:
        """Start the process (without waiting for it)."""
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                env=self.env,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> WorkerProcess:
        """Wait until faust says this run of the worker is ready."""
        wait_until(lambda: self._ready_since(self._log_offset), timeout_s, f"worker ready (log {self.log_path})")
        return self

    def _ready_since(self, offset: int) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"worker exited with {self.proc.returncode}; log: {self.log_tail()}")
        data = self.log_path.read_bytes()[max(0, offset - 200) :]
        return READY_MARK.encode() in data

    def log_times(self, mark: re.Pattern[bytes]) -> list[float]:
        """The Unix times that ``mark`` (one group: the time) found in this run's log, in order."""
        data = self.log_path.read_bytes()[self._log_offset :] if self.log_path.exists() else b""
        return [float(m.group(1)) for m in mark.finditer(data)]

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system, every thread) the running process has used (Linux ``/proc``)."""
        if self.proc is None:
            raise RuntimeError("not started")
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final commit."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, chars: int = 4000) -> str:
        """The end of its log."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def wait_until(check: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.1) -> T:
    """Poll ``check`` until it returns something truthy; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def make_producer(bootstrap: str, security: KafkaSecurity = PLAINTEXT):
    """A kafka-python producer as the SDK configures one (key = session id, acks=all)."""
    return kafka_clients.producer(bootstrap, security=security, acks="all", linger_ms=5)


def produce(producer, topic: str, events: Iterable[EventBase], flush: bool = True) -> int:
    """Send ``events`` keyed by session id; the number sent."""
    n = 0
    for event in events:
        producer.send(topic, key=event.session_id.encode(), value=dump_event(event))
        n += 1
    if flush:
        producer.flush()
    return n
