"""The demo's supervisor: a service that dies is started again; a crash loop is an error; kept services
become stack records."""

from __future__ import annotations

import sys
import time

import pytest

from flywheel.core.settings import Settings
from flywheel.stack.services import SERVICE_KIND, ServiceComponent, ServiceGroup, ServiceSpec


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


def test_running_services_become_stack_records_that_the_stack_can_stop(tmp_path):
    steady = ServiceSpec("steady", (sys.executable, "-c", "import time; time.sleep(60)"), settle_s=0.0)
    web = ServiceSpec("web", (sys.executable, "-c", "import time; time.sleep(60)"), settle_s=0.0,
                      health_url="http://127.0.0.1:9/health")  # fmt: skip
    group = ServiceGroup([steady, web], {}, tmp_path)
    for service in group:  # started, not waited for: nothing answers web's health URL
        service.start()
    try:
        records = group.records(source="demo")
        assert [(r.name, r.kind, r.extra["index"], r.pid) for r in records] == [
            ("steady", SERVICE_KIND, 0, group["steady"].pid),
            ("web", SERVICE_KIND, 1, group["web"].pid),
        ]
        assert records[1].where == "http://127.0.0.1:9" and records[0].where == "-"
        assert all(r.started_by_us and r.pid_start_ticks is not None and r.log_path for r in records)
        component = ServiceComponent(Settings(run_dir=tmp_path), "steady")
        assert component.health(records[0]).ok
        assert not ServiceComponent(Settings(run_dir=tmp_path), "web").health(records[1]).ok  # nothing on port 9
        component.stop(records[0], grace_s=5.0)
        assert not group["steady"].alive and not component.health(records[0]).ok
        assert group.records(source="demo")[0].name == "web"  # only running services are handed over
    finally:
        group.stop()
