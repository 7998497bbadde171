"""scripts/compose_health.py's verdict on a container's state (the engine's own inspect format)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compose_health.py"
spec = importlib.util.spec_from_file_location("compose_health", SCRIPT)
compose_health = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compose_health)


def state(status, exit_code=0, health=None, output=""):
    s = {"Status": status, "ExitCode": exit_code}
    if health is not None:
        s["Health"] = {"Status": health, "Log": [{"ExitCode": 1, "Output": output}]}
    return {"State": s}


def test_running_with_a_passing_healthcheck_is_healthy():
    assert compose_health.verdict(state("running", health="healthy")) == (True, "healthy")


def test_a_failing_healthcheck_names_its_last_output():
    ok, why = compose_health.verdict(state("running", health="unhealthy", output="weight version\n not set yet"))
    assert not ok and why == "unhealthy: weight version not set yet"


def test_one_shot_services_count_only_when_they_exited_zero():
    assert compose_health.verdict(state("exited", 0)) == (True, "exited 0")
    assert compose_health.verdict(state("exited", 1)) == (False, "exited 1")
    # A long-running service (it has a healthcheck) that exited is down, whatever its code.
    assert compose_health.verdict(state("exited", 0, health="unhealthy"))[0] is False


def test_restarting_is_not_healthy():
    assert compose_health.verdict(state("restarting")) == (False, "restarting")
