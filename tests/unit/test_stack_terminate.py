"""``terminate_group``: the leader of a session is signalled first and stops its own children; what
it leaves behind is signalled after it; SIGKILL only once the grace has run out."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

from flywheel.stack.base import group_alive, spawn, terminate_group

CHILD = """
import signal, sys, time
log = sys.argv[1]
def note(what):
    def handler(*_):
        open(log, "a").write(what + "\\n")
        sys.exit(0)
    return handler
signal.signal(signal.SIGTERM, note("child got SIGTERM"))
signal.signal(signal.SIGUSR1, note("child stopped by its leader"))
open(log, "a").write("child up\\n")
while True:
    time.sleep(0.05)
"""

LEADER = """
import signal, subprocess, sys, time
child_code, log, mode = sys.argv[1], sys.argv[2], sys.argv[3]
child = subprocess.Popen([sys.executable, "-c", child_code, log])  # the same session
def on_term(*_):
    open(log, "a").write("leader got SIGTERM\\n")
    if mode == "stops-children":
        child.send_signal(signal.SIGUSR1)
        child.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term if mode != "ignores" else signal.SIG_IGN)
while True:
    time.sleep(0.05)
"""


def start(tmp_path: Path, mode: str) -> tuple[int, Path]:
    log = tmp_path / f"{mode}.log"
    pid, _ = spawn("leader", [sys.executable, "-c", textwrap.dedent(LEADER), CHILD, log, mode], tmp_path / "out.log")
    deadline = time.monotonic() + 30
    while not (log.exists() and "child up" in log.read_text()):
        assert time.monotonic() < deadline, (tmp_path / "out.log").read_text()
        time.sleep(0.05)
    return pid, log


def test_the_leader_is_signalled_first_and_stops_its_children_itself(tmp_path: Path) -> None:
    pid, log = start(tmp_path, "stops-children")
    terminate_group(pid, grace_s=10.0)
    assert not group_alive(pid)
    lines = log.read_text().splitlines()
    assert lines == ["child up", "leader got SIGTERM", "child stopped by its leader"], lines


def test_children_a_leader_leaves_behind_get_the_signal_after_it(tmp_path: Path) -> None:
    pid, log = start(tmp_path, "orphans")
    started = time.monotonic()
    terminate_group(pid, grace_s=10.0)
    assert not group_alive(pid)
    assert time.monotonic() - started < 5.0  # not the SIGKILL at the end of the grace
    assert log.read_text().splitlines() == ["child up", "leader got SIGTERM", "child got SIGTERM"]


def test_a_leader_that_ignores_the_signal_is_killed_with_its_group_after_the_grace(tmp_path: Path) -> None:
    pid, log = start(tmp_path, "ignores")
    started = time.monotonic()
    terminate_group(pid, grace_s=1.5)
    assert not group_alive(pid)
    assert time.monotonic() - started >= 1.5
    assert log.read_text().splitlines() == ["child up"]  # SIGKILL: nobody wrote anything
