"""Wait until every service of a compose project is healthy, then print one JSON line.

    .venv/bin/python scripts/compose_health.py [--project flywheel-cpu] [--timeout-s 1800]

A service counts as healthy when every one of its containers is running with a passing
healthcheck, or (a one-shot service such as migrate) has exited 0. Waits until all are, or until
the timeout; then prints ``{"services_total", "services_healthy", "seconds", "unhealthy"}``
(``unhealthy`` names each service that is not, with its state and last healthcheck output or
exit code) and exits 0 only when every service is healthy. Reads the engine with the docker CLI
(``DOCKER``, default /usr/bin/docker). With ``--compose-file`` (default: the file that
scripts/compose-cpu.sh renders, when it exists), a service of the file without a container yet
counts too, as not created.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

DOCKER = os.environ.get("DOCKER", "/usr/bin/docker")


def containers(project: str) -> list[dict]:
    ids = subprocess.run(
        [DOCKER, "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    if not ids:
        return []
    out = subprocess.run([DOCKER, "inspect", *ids], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def verdict(container: dict) -> tuple[bool, str]:
    """Whether the container is healthy, and why not."""
    state = container["State"]
    health = state.get("Health")
    if state["Status"] == "exited":
        code = state["ExitCode"]
        return code == 0 and health is None, f"exited {code}"
    if state["Status"] != "running":
        return False, state["Status"]
    if health is None:
        return True, "running (no healthcheck)"
    if health["Status"] == "healthy":
        return True, "healthy"
    last = (health.get("Log") or [{}])[-1]
    output = " ".join(str(last.get("Output", "")).split())[-300:]
    return False, f"{health['Status']}: {output}" if output else health["Status"]


def services(project: str, expected: list[str]) -> dict[str, tuple[bool, str]]:
    by_service: dict[str, tuple[bool, str]] = {name: (False, "not created") for name in expected}
    for container in containers(project):
        labels = container["Config"]["Labels"]
        name = labels.get("com.docker.compose.service", container["Name"])
        if labels.get("com.docker.compose.oneoff") == "True" or (expected and name not in expected):
            continue  # a one-off container (`docker-compose run`), or a service started only on demand
        ok, why = verdict(container)
        seen_ok, seen_why = by_service.get(name, (True, ""))
        if seen_why == "not created":
            seen_ok, seen_why = True, ""
        by_service[name] = (seen_ok and ok, why if not ok else seen_why or why)
    return by_service


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project", default=os.environ.get("COMPOSE_PROJECT_NAME", "flywheel-cpu"))
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--interval-s", type=float, default=10.0)
    parser.add_argument("--compose-file", type=Path, default=Path(".flywheel/compose-cpu.yml"))
    args = parser.parse_args(argv)
    expected = []
    if args.compose_file.is_file():
        # A service in a profile (the loop test's client) is started only on demand: not expected.
        declared = yaml.safe_load(args.compose_file.read_text())["services"]
        expected = [name for name, service in declared.items() if not service.get("profiles")]
    start = time.monotonic()
    while True:
        state = services(args.project, expected)
        healthy = sorted(name for name, (ok, _) in state.items() if ok)
        if state and len(healthy) == len(state) or time.monotonic() - start > args.timeout_s:
            break
        time.sleep(args.interval_s)
    if not state:
        print(f"compose_health: no containers of project {args.project!r}", file=sys.stderr)
    line = {
        "services_total": len(state),
        "services_healthy": len(healthy),
        "seconds": round(time.monotonic() - start, 1),
        "unhealthy": {name: why for name, (ok, why) in sorted(state.items()) if not ok},
    }
    print(json.dumps(line))
    return 0 if state and len(healthy) == len(state) else 1


if __name__ == "__main__":
    sys.exit(main())
