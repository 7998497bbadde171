"""The demo's supervisor: a service that dies is started again; a crash loop is an error."""

from __future__ import annotations

import sys
import time

import pytest

from flywheel.stack.services import ServiceGroup, ServiceSpec


def _wait_dead(group: ServiceGroup, timeout_s: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if dead := group.dead():
            return dead
        time.sleep(0.05)
    raise AssertionError("the short-lived service never exited")


def test_a_dead_service_is_revived_and_a_crash_loop_raises(tmp_path):
    short = ServiceSpec("short", (sys.executable, "-c", "import time; time.sleep(0.3)"), settle_s=0.0)
    steady = ServiceSpec("steady", (sys.executable, "-c", "import time; time.sleep(60)"), settle_s=0.0)
    group = ServiceGroup([short, steady], {}, tmp_path)
    group.start()
    try:
        assert group.revive() == []  # nothing died yet
        for restart in (1, 2):
            assert _wait_dead(group) == ["short"]
            assert group.revive(max_restarts=2) == ["short"]
            assert group["short"].restarts == restart and group["short"].alive
        assert _wait_dead(group) == ["short"]
        with pytest.raises(RuntimeError, match="short died 3 times"):
            group.revive(max_restarts=2)
        assert group["steady"].alive and group["steady"].restarts == 0
    finally:
        group.stop()
