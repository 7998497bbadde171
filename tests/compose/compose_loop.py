"""``make test-compose``: the production compose project, built and run in a real Docker engine,
with the whole loop driven through its public ingresses; one JSON line of figures at the end.

    .venv/bin/python tests/compose/compose_loop.py [--skip-build] [--keep-up] [--budget-s 1800]

Steps (each timed; docs/deploy.md says what they need):

1. A Docker engine (``scripts/docker-engine.sh``: Debian's docker.io, dockerd started if none
   answers), the base images from Debian's packages (``scripts/build-base-images.sh``), the
   wheelhouse of the lock (``scripts/build-wheelhouse.sh``) and the services image built from
   this checkout with ``ACCEL=cpu``. Each is reused when it is up to date.
2. The compose project ``flywheel-loop`` from docker-compose.yml + docker-compose.cpu.yml +
   tests/compose/loop.yml (the demo's training and canary pace), from empty volumes, until every
   service is healthy. When this machine has already built the project's model (``make test``
   builds it), that build is copied into the empty models volume's cache first, so that the
   ``model-build`` service finds it built, as it would on its second start, instead of training it
   again for minutes on two cores shared with the whole project (``--build-model`` builds it in
   the container instead).
3. Keys, the way ops make them, inside the containers: a write key and a product key
   (``flywheel keys create``), the first admin token (``flywheel tokens create``, bootstrap).
4. ``loop-client`` (tests/compose/loop_client.py), on the ``public`` network only: the demo's
   agent through the router and the ingest gateway until a checkpoint has been trained, gated,
   canaried and promoted and a later canary is on trial; that canary rolled back through the
   admin API.
5. Every event the gateway accepted must reach Postgres and every ended session be scored;
   then the counts of events, rewards, sessions and checkpoints (with their files on the
   checkpoint volume).
6. ``down`` (volumes kept), ``up`` again, healthy again, and the same counts again.

The last line is one JSON object: ``services_total``, ``services_healthy``, ``sessions_sent``,
``events_sent``, ``events_lost``, ``promotions``, ``rollbacks``, ``events_after_restart``,
``seconds`` and more. Exit 0 only when every check held (``failures`` lists the ones that did not).
Traffic stays on the compose networks; only the host's loopback reaches the published ports.
The project is taken down with its volumes at the end unless ``--keep-up``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCKER = os.environ.get("DOCKER", "/usr/bin/docker")
PROJECT = os.environ.get("COMPOSE_PROJECT_NAME", "flywheel-loop")
IMAGE = os.environ.get("FLYWHEEL_IMAGE", "flywheel:0.1.0-cpu")
BASE_IMAGE = os.environ.get("FLYWHEEL_BASE_IMAGE", "flywheel/python:3.11-bookworm")
PY = str(ROOT / ".venv" / "bin" / "python")

COUNTS = r"""
import json, pathlib, sys
from sqlalchemy import create_engine, text
from flywheel.core.settings import get_settings
project = sys.argv[1]
engine = create_engine(get_settings().postgres.url)
with engine.connect() as c:
    one = lambda sql: c.execute(text(sql), {"p": project}).scalar()
    checkpoints = c.execute(text("SELECT id, path, status FROM checkpoints")).all()
    out = {
        "events": one("SELECT count(*) FROM raw_events WHERE project = :p"),
        "event_ids": one("SELECT count(DISTINCT event_id) FROM raw_events WHERE project = :p"),
        "dead_letters": one("SELECT count(*) FROM dead_letters"),
        "sessions": one("SELECT count(*) FROM sessions WHERE project = :p"),
        "sessions_ended": one("SELECT count(*) FROM sessions WHERE project = :p AND ended_at IS NOT NULL"),
        "sessions_scored": one("SELECT count(DISTINCT session_id) FROM rewards WHERE project = :p"),
        "rewards": one("SELECT count(*) FROM rewards WHERE project = :p"),
        "samples": one("SELECT count(*) FROM training_samples"),
        "checkpoints": len(checkpoints),
        "checkpoint_ids": sorted(i for i, _, _ in checkpoints),
        "checkpoint_statuses": sorted({s for _, _, s in checkpoints}),
        "checkpoint_files_missing": [i for i, p, _ in checkpoints if not pathlib.Path(p).exists()],
        "promotions": one("SELECT count(*) FROM deployments WHERE status = 'promoted'"),
        "rollbacks": one("SELECT count(*) FROM deployments WHERE status = 'rolled_back'"),
        "operator_rollbacks": one(
            "SELECT count(*) FROM audit_log WHERE action = 'deploy.rollback' AND success AND actor LIKE 'token:%'"
        ),
    }
print(json.dumps(out))
"""


def log(message: str) -> None:
    print(f"[compose-loop {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(argv: list[str], *, env: dict[str, str] | None = None, capture: bool = False, timeout: float | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(
        argv, cwd=ROOT, env={**os.environ, **(env or {})}, check=check, text=True, timeout=timeout,
        stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None,
    )  # fmt: skip


class Compose:
    """docker-compose on the CPU-rendered project with the loop override (scripts/compose-cpu.sh)."""

    def __init__(self, project: str, env: dict[str, str]):
        self.env = {"COMPOSE_PROJECT_NAME": project, "FLYWHEEL_COMPOSE_EXTRA": "tests/compose/loop.yml", **env}
        self.project = project

    def __call__(self, *args: str, capture: bool = False, timeout: float | None = None, check: bool = True):
        return run(["scripts/compose-cpu.sh", *args], env=self.env, capture=capture, timeout=timeout, check=check)

    def exec(self, service: str, *argv: str) -> str:
        """Run ``argv`` in ``service``'s running container; its stdout (stderr goes to the log)."""
        done = self("exec", "-T", service, *argv, capture=True, timeout=300, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"{service}: {' '.join(argv[:3])} exited {done.returncode}: {done.stderr.strip()[-2000:]}"
            )
        return done.stdout

    def health(self, timeout_s: float) -> dict[str, Any]:
        done = run(
            [PY, "scripts/compose_health.py", "--project", self.project, "--timeout-s", str(timeout_s)],
            env=self.env, capture=True, check=False,
        )  # fmt: skip
        return json.loads(done.stdout.strip().splitlines()[-1])

    def counts(self, project: str) -> dict[str, Any]:
        return json.loads(self.exec("admin-api", "python", "-c", COUNTS, project).strip().splitlines()[-1])


def build(timings: dict[str, float]) -> None:
    steps = [
        ("engine", ["scripts/docker-engine.sh"], {}),
        ("base_images", ["scripts/build-base-images.sh"], {}),
        ("wheelhouse", ["scripts/build-wheelhouse.sh"], {}),
        ("services_image", [DOCKER, "build", "--build-arg", f"BASE={BASE_IMAGE}", "--build-arg", "ACCEL=cpu",
                            "-t", IMAGE, "."], {"DOCKER_BUILDKIT": "1"}),
    ]  # fmt: skip
    for name, argv, env in steps:
        log(f"{name}: {' '.join(argv)}")
        t0 = time.monotonic()
        run(argv, env=env)
        timings[name] = round(time.monotonic() - t0, 1)


def host_model_build() -> Path | None:
    """This checkout's build of the project's model (``flywheel model build``), if there is a finished one."""
    done = run(
        [PY, "-c", "from pathlib import Path; from flywheel.core.settings import get_settings; "
         "from flywheel.model.build import build_key, is_complete; m = get_settings().model; "
         "f = Path(m.cache_dir).resolve() / build_key(m); print(f if is_complete(f) else '')"],
        capture=True, check=False,
    )  # fmt: skip
    folder = done.stdout.strip()
    return Path(folder) if done.returncode == 0 and folder else None


def seed_model(compose: Compose, folder: Path) -> None:
    """Copy a finished build into the models volume's cache (``/models/cache/<build key>``), as its owner."""
    target = f"/models/cache/{folder.name}"
    compose(
        "run", "--rm", "--no-deps", "-T", "-u", "root", "-v", f"{folder}:/seed:ro", "--entrypoint", "sh",
        "model-build", "-c",
        f"mkdir -p /models/cache && rm -rf {target}.tmp && cp -r /seed {target}.tmp && "
        f"chown -R flywheel:flywheel /models && mv {target}.tmp {target}",
        capture=True,
    )  # fmt: skip


def wait_drained(compose: Compose, project: str, events_sent: int, timeout_s: float) -> dict[str, Any]:
    """Counts once every accepted event is in Postgres and every ended session scored (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = compose.counts(project)
        done = counts["events"] >= events_sent and counts["sessions_scored"] >= counts["sessions_ended"]
        if done or time.monotonic() > deadline:
            return counts
        log(f"draining: {counts['events']}/{events_sent} events, "
            f"{counts['sessions_scored']}/{counts['sessions_ended']} ended sessions scored")  # fmt: skip
        time.sleep(5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-build", action="store_true", help="use the images as they are")
    parser.add_argument("--keep-up", action="store_true", help="leave the project and its volumes up at the end")
    parser.add_argument("--budget-s", type=float, default=1800.0, help="longest the client's loop may take")
    parser.add_argument("--health-timeout-s", type=float, default=1800.0)
    parser.add_argument("--build-model", action="store_true", help="build the model in the container, not seed it")
    args = parser.parse_args(argv)

    started = time.monotonic()
    timings: dict[str, float] = {}
    result: dict[str, Any] = {"project": PROJECT}
    failures: list[str] = []
    compose = Compose(PROJECT, {"POSTGRES_PASSWORD": os.environ.get("POSTGRES_PASSWORD") or secrets.token_hex(16),
                                "FLYWHEEL_IMAGE": IMAGE})  # fmt: skip
    try:
        if not args.skip_build:
            build(timings)
        log("removing what an earlier run left (containers and volumes)")
        compose("down", "-v", "--remove-orphans", capture=True, check=False)

        t0 = time.monotonic()
        if not args.build_model and (built := host_model_build()) is not None:
            log(f"seeding the models volume with this machine's build of the model: {built}")
            seed_model(compose, built)
            result["model_seeded"] = built.name
        timings["seed_model"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        log("up: every service, from empty volumes")
        compose("up", "-d", "--no-build", check=False)
        health = compose.health(args.health_timeout_s)
        timings["first_up"] = round(time.monotonic() - t0, 1)
        result.update(services_total=health["services_total"], services_healthy=health["services_healthy"])
        if health["unhealthy"]:
            failures.append(f"unhealthy after up: {health['unhealthy']}")
            return 1
        log(f"healthy: {health}")

        project = f"compose-{uuid.uuid4().hex[:6]}"
        write_key = compose.exec("admin-api", "flywheel", "keys", "create", "--project", project, "--name", "loop",
                                 "--role", "writer").strip().splitlines()[-1]  # fmt: skip
        product_key = compose.exec("admin-api", "flywheel", "keys", "create", "--project", project, "--name",
                                   "loop-agent", "--role", "product", "--rate-per-s", "1000",
                                   "--burst", "1000").strip().splitlines()[-1]  # fmt: skip
        admin_token = compose.exec("admin-api", "flywheel", "tokens", "create", "--name", "compose-ops",
                                   "--role", "admin").strip().splitlines()[-1]  # fmt: skip

        t0 = time.monotonic()
        log(f"loop-client: project {project}, budget {args.budget_s:.0f} s")
        client = compose(
            "run", "--rm", "-T", "-e", f"PROJECT={project}", "-e", f"WRITE_KEY={write_key}",
            "-e", f"PRODUCT_KEY={product_key}", "-e", f"ADMIN_TOKEN={admin_token}", "-e", f"BUDGET_S={args.budget_s}",
            "loop-client", capture=True, timeout=args.budget_s + 600, check=False,
        )  # fmt: skip
        sys.stderr.write(client.stderr[-6000:])
        timings["loop"] = round(time.monotonic() - t0, 1)
        lines = [line for line in client.stdout.splitlines() if line.startswith("{")]
        if not lines:
            failures.append(f"loop-client exited {client.returncode} without its JSON line")
            return 1
        seen = json.loads(lines[-1])
        result["client"] = seen
        if client.returncode != 0:
            failures.append(f"loop-client exited {client.returncode}: {seen.get('phases')}")
        result.update(sessions_sent=seen["sessions_sent"], events_sent=seen["events_sent"],
                      failed_requests=seen["failed_requests"])  # fmt: skip

        before = wait_drained(compose, project, seen["events_sent"], timeout_s=300)
        result.update(
            events_lost=seen["events_sent"] - before["events"] + seen["sdk_dropped"],
            events_stored=before["events"], sessions_scored=before["sessions_scored"],
            sessions_ended=before["sessions_ended"], rewards=before["rewards"], checkpoints=before["checkpoints"],
            promotions=before["promotions"], rollbacks=before["rollbacks"],
            operator_rollbacks=before["operator_rollbacks"], dead_letters=before["dead_letters"],
        )  # fmt: skip
        log(f"before the restart: { {k: v for k, v in before.items() if k != 'checkpoint_ids'} }")

        t0 = time.monotonic()
        compose("down", check=True)
        timings["down"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        compose("up", "-d", "--no-build", check=False)
        again = compose.health(args.health_timeout_s)
        timings["second_up"] = round(time.monotonic() - t0, 1)
        result["services_healthy_after_restart"] = again["services_healthy"]
        if again["unhealthy"]:
            failures.append(f"unhealthy after the restart: {again['unhealthy']}")
            return 1
        after = compose.counts(project)
        log(f"after the restart: { {k: v for k, v in after.items() if k != 'checkpoint_ids'} }")
        result.update(
            events_after_restart=after["events"], rewards_after_restart=after["rewards"],
            checkpoints_after_restart=after["checkpoints"],
            checkpoint_files_missing=after["checkpoint_files_missing"],
        )  # fmt: skip

        checks = {
            "every service healthy": result["services_healthy"] == result["services_total"],
            "events_lost is 0": result["events_lost"] == 0,
            "no event stored twice": before["events"] == before["event_ids"],
            "no dead letters": before["dead_letters"] == 0,
            "every ended session scored": before["sessions_scored"] >= before["sessions_ended"] > 0,
            "failed_requests is 0": result["failed_requests"] == 0,
            "at least one promotion": result["promotions"] >= 1,
            "a rollback through the admin API": result["operator_rollbacks"] >= 1 and result["rollbacks"] >= 1,
            "events kept across down/up": after["events"] == before["events"],
            "rewards kept across down/up": after["rewards"] == before["rewards"],
            "checkpoints kept across down/up": set(before["checkpoint_ids"]) <= set(after["checkpoint_ids"])
            and before["checkpoints"] >= 2,
            "every checkpoint's files there": not after["checkpoint_files_missing"],
        }
        failures += [name for name, ok in checks.items() if not ok]
        return 1 if failures else 0
    except Exception as err:  # noqa: BLE001 - reported in the JSON line, then the exit code says it failed
        failures.append(f"{type(err).__name__}: {err}")
        if isinstance(err, subprocess.CalledProcessError) and err.stderr:
            sys.stderr.write(err.stderr[-4000:])
        return 1
    finally:
        if failures:
            logs = compose("logs", "--tail", "40", capture=True, check=False)
            sys.stderr.write(logs.stdout[-20000:])
        if not args.keep_up:
            compose("down", "-v", "--remove-orphans", capture=True, check=False)
        result.update(timings=timings, failures=failures, seconds=round(time.monotonic() - started, 1))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
