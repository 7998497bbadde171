"""The pipeline's own processes (ingest, rewarding, trainer, serving) as supervised children.

The local stack (:mod:`flywheel.stack.stack`) runs the infrastructure: broker, Postgres,
Redis and vLLM. This module runs Flywheel's services next to it, the way the compose file
does in production, for the demo, the end-to-end tests and the fault tests (which kill a
service with SIGKILL and start it again):

>>> group = ServiceGroup(pipeline_specs(settings), env=settings_env(settings), log_dir=...)
>>> with group:                 # starts each, waits until ready, stops all on exit
...     group["ingest"].kill()  # SIGKILL, as a crash would
...     group["ingest"].start()

A group's services may also outlive the process that started them (``flywheel demo
--keep-up``): :meth:`ServiceGroup.records` describes the running ones as ``stack.json``
rows of kind ``service`` (:func:`flywheel.stack.stack.keep_services` records them), which
``flywheel status`` lists and ``flywheel down`` stops (:class:`ServiceComponent`).

Each child reads its settings from the environment like any deployed service: the run
folder (``FLYWHEEL_RUN_DIR``, where it finds the stack's ``stack.json``) and the overrides
that :func:`settings_env` flattens into ``FLYWHEEL_<SECTION>__<FIELD>`` variables.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from flywheel.core.settings import Settings
from flywheel.stack.base import (
    Component,
    ComponentFailed,
    ComponentRecord,
    Health,
    log_tail,
    now_iso,
    pid_alive,
    reap,
    record_alive,
    spawn,
    terminate_group,
)
from flywheel.stack.endpoints import endpoint_env

log = logging.getLogger(__name__)

SERVICE_KIND = "service"
"""Kind of a service's ``stack.json`` row (the infrastructure's are ``broker``, ``postgres``, ...)."""
STOP_GRACE_S = 15.0
"""How long a service gets to exit on SIGTERM before SIGKILL."""


@dataclass(frozen=True)
class ServiceSpec:
    """How to run one service."""

    name: str
    """Short name, also the log file's (``<log_dir>/<name>.log``)."""
    argv: tuple[str, ...]
    """Command line; the interpreter of this process runs Python modules."""
    health_url: str | None = None
    """``GET`` answering 200 means ready; None: ready once alive for ``settle_s``."""
    ready_timeout_s: float = 120.0
    """How long :meth:`Service.wait_ready` waits."""
    settle_s: float = 1.0
    """Without a health URL: how long the process must stay alive to count as started."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables added to the group's environment for this service only."""


class Service:
    """One supervised child process."""

    def __init__(self, spec: ServiceSpec, env: Mapping[str, str], log_dir: Path):
        self.spec = spec
        self.env = {**env, **spec.env}
        self.log_path = Path(log_dir) / f"{spec.name}.log"
        self.pid: int | None = None
        self.pid_start_ticks: int | None = None
        self.started_at: float | None = None
        self.started_iso: str | None = None
        self.restarts = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def alive(self) -> bool:
        return pid_alive(self.pid)

    def start(self) -> None:
        """Launch the process (detached, its own session); return at once."""
        if self.alive:
            raise ComponentFailed(self.name, f"already running as pid {self.pid}", self.log_path)
        if self.pid is not None:
            self.restarts += 1
        self.pid, self.pid_start_ticks = spawn(self.name, self.spec.argv, self.log_path, env=self.env)
        self.started_at, self.started_iso = time.monotonic(), now_iso()

    def wait_ready(self) -> None:
        """Block until the health URL answers 200 (or the process has settled); raise if it dies."""
        deadline = time.monotonic() + self.spec.ready_timeout_s
        last = "no probe yet"
        while True:
            if not self.alive:
                raise ComponentFailed(self.name, f"process {self.pid} exited during startup", self.log_path)
            if self.spec.health_url is None:
                if time.monotonic() - (self.started_at or 0) >= self.spec.settle_s:
                    return
            else:
                try:
                    response = httpx.get(self.spec.health_url, timeout=2.0)
                    if response.status_code == 200:
                        return
                    last = f"HTTP {response.status_code}"
                except httpx.HTTPError as err:
                    last = type(err).__name__
            if time.monotonic() > deadline:
                raise ComponentFailed(
                    self.name, f"not ready after {self.spec.ready_timeout_s:.0f} s (last probe: {last})", self.log_path
                )
            time.sleep(0.25)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group (SIGKILL by default: a crash) and reap it."""
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            deadline = time.monotonic() + 10
            while self.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            reap(self.pid)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the leader, then the rest of its group, SIGKILL after ``grace_s`` (:func:`terminate_group`)."""
        if self.pid is not None:
            terminate_group(self.pid, signal.SIGTERM, grace_s)
            reap(self.pid)

    def restart(self) -> None:
        """Stop (gracefully), start and wait until ready."""
        self.stop()
        self.start()
        self.wait_ready()

    def tail(self, lines: int = 40) -> str:
        """The end of the service's log."""
        return log_tail(self.log_path, lines)

    def record(self, index: int, source: str) -> ComponentRecord:
        """This service as a ``stack.json`` row (kind ``service``); ``index`` is its place in the start order."""
        url = self.spec.health_url.rsplit("/", 1)[0] if self.spec.health_url else None
        return ComponentRecord(
            name=self.name,
            kind=SERVICE_KIND,
            where=url or "-",
            started_by_us=True,
            source=source,
            pid=self.pid,
            pid_start_ticks=self.pid_start_ticks,
            log_path=str(self.log_path),
            started_at=self.started_iso,
            extra={"index": index, "health_url": self.spec.health_url, "argv": list(self.spec.argv)},
        )


class ServiceGroup:
    """Several services started in order and stopped in reverse order."""

    def __init__(self, specs: Iterable[ServiceSpec], env: Mapping[str, str], log_dir: Path):
        self.services = {s.name: Service(s, env, log_dir) for s in specs}

    def __getitem__(self, name: str) -> Service:
        return self.services[name]

    def __iter__(self) -> Iterator[Service]:
        return iter(self.services.values())

    def start(self) -> None:
        """Start every service, then wait for each; on a failure stop them all and raise."""
        try:
            for service in self:
                service.start()
            for service in self:
                service.wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for service in reversed(list(self)):
            service.stop()

    def records(self, source: str) -> list[ComponentRecord]:
        """The running services as ``stack.json`` rows, in start order (for ``flywheel demo --keep-up``)."""
        return [service.record(i, source) for i, service in enumerate(self) if service.alive]

    def dead(self) -> list[str]:
        """Services that were started and are no longer running."""
        return [s.name for s in self if s.pid is not None and not s.alive]

    def revive(self, max_restarts: int = 3) -> list[str]:
        """Start again every dead service (a supervisor's restart policy); the names restarted.

        Raises :class:`RuntimeError` for a service that has died more than ``max_restarts``
        times: a crash loop is a failure, not something to hide.
        """
        revived = []
        for name in self.dead():
            service = self[name]
            if service.restarts >= max_restarts:
                raise RuntimeError(f"service {name} died {service.restarts + 1} times; see {service.log_path}")
            log.warning("service %s (pid %s) died; restarting it: %s", name, service.pid, service.tail(3))
            reap(service.pid)
            service.start()
            revived.append(name)
        return revived

    def __enter__(self) -> ServiceGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServiceComponent(Component):
    """A recorded service (:meth:`ServiceGroup.records`), as ``flywheel status`` and ``flywheel down`` see it.

    The stack never starts one: a :class:`ServiceGroup` does (the demo's), and records the
    services it leaves running.
    """

    kind = SERVICE_KIND

    def start_or_locate(self) -> ComponentRecord:
        raise ComponentFailed(self.name, "services are started by their service group (the demo), not by the stack")

    def health(self, record: ComponentRecord) -> Health:
        """Alive, and its health URL (router, admin API) answering 200."""
        if not record_alive(record):
            return Health(False, f"process {record.pid} is not running (see {record.log_path})")
        url = record.extra.get("health_url")
        if not url:
            return Health(True, "running")
        try:
            response = httpx.get(url, timeout=2.0)
        except httpx.HTTPError as err:
            return Health(False, f"{url}: {type(err).__name__}")
        if response.status_code != 200:
            return Health(False, f"{url}: HTTP {response.status_code}")
        return Health(True, "running, /health answers 200")

    def stop(self, record: ComponentRecord, grace_s: float = STOP_GRACE_S) -> None:
        super().stop(record, grace_s)


def settings_env(settings: Settings, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, str]:
    """This process's environment plus what a child needs to see ``settings``' stack and ``overrides``.

    The stack's endpoints are passed as settings (:func:`~flywheel.stack.endpoints.endpoint_env`):
    services read settings alone, never the stack's ``stack.json``.

    ``overrides`` maps a settings section to field values, e.g.
    ``{"trainer": {"mode": "lora"}}`` → ``FLYWHEEL_TRAINER__MODE=lora``;
    lists and nested models are passed as JSON, which pydantic-settings parses.
    """
    env = dict(os.environ)
    env.update(endpoint_env(settings))
    env["FLYWHEEL_RUN_DIR"] = str(Path(settings.run_dir).resolve())
    env["FLYWHEEL_ENVIRONMENT"] = settings.environment
    env.setdefault("PYTHONUNBUFFERED", "1")
    for section, values in (overrides or {}).items():
        for key, value in values.items():
            _set_env(env, f"FLYWHEEL_{section.upper()}__{key.upper()}", value)
    return env


def _set_env(env: dict[str, str], name: str, value: Any) -> None:
    """``name=value``; a mapping whose section the environment already sets a field of (the stack's
    ``FLYWHEEL_TRAINER__GATE__ENGINE_URL`` under a ``trainer.gate`` override) goes field by field, since
    one JSON value for the section would replace that field."""
    if isinstance(value, dict) and any(k.startswith(f"{name}__") for k in env):
        for key, item in value.items():
            _set_env(env, f"{name}__{key.upper()}", item)
        return
    env[name] = _env_value(value)


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    if isinstance(value, Path):
        return str(value.resolve())
    return str(value)


def python_module(module: str, *args: str) -> tuple[str, ...]:
    """``python -m module args`` with this interpreter."""
    return (sys.executable, "-m", module, *args)


def scaled(specs: Iterable[ServiceSpec], counts: Mapping[str, int]) -> list[ServiceSpec]:
    """``specs`` with ``counts[name]`` processes of a service (``rewarding``, ``rewarding-2``, ...: one
    consumer group, one log each); a service not named keeps one."""
    out: list[ServiceSpec] = []
    for spec in specs:
        n = counts.get(spec.name, 1)
        if not 1 <= n <= 8:
            raise ValueError(f"{spec.name}: run 1 to 8 processes, not {n}")
        out += [spec if i == 0 else replace(spec, name=f"{spec.name}-{i + 1}") for i in range(n)]
    unknown = set(counts) - {spec.name for spec in specs}
    if unknown:
        raise ValueError(f"unknown service(s) {sorted(unknown)} to scale")
    return out


def pipeline_specs(settings: Settings, names: Iterable[str] | None = None) -> list[ServiceSpec]:
    """The pipeline's services, in start order (``names`` selects a subset, keeping the order)."""
    s = settings.serving
    specs = [
        ServiceSpec("ingest", python_module("ingest.main", "consume")),
        ServiceSpec("rewarding", python_module("rewarding.main", "worker"), settle_s=3.0),
        ServiceSpec("trainer-worker", python_module("trainer.main", "worker"), settle_s=3.0),
        ServiceSpec("trainer-beat", python_module("trainer.main", "beat"), settle_s=2.0),
        ServiceSpec(
            "router",
            python_module("serving.main", "router"),
            health_url=f"http://{s.router_host}:{s.router_port}/health",
        ),  # fmt: skip
        ServiceSpec(
            "admin", python_module("serving.main", "admin"), health_url=f"http://{s.admin_host}:{s.admin_port}/health"
        ),  # fmt: skip
        ServiceSpec("canary", python_module("serving.main", "canary"), settle_s=2.0),
    ]
    if names is None:
        return specs
    wanted = list(names)
    unknown = set(wanted) - {spec.name for spec in specs}
    if unknown:
        raise ValueError(f"unknown service(s) {sorted(unknown)}; choose from {', '.join(x.name for x in specs)}")
    return [spec for spec in specs if spec.name in wanted]
