"""Bring the local stack up, take it down, report its status.

``up`` finds or starts each requested component in parallel, waits for health, and
records what runs where in ``run_dir/stack.json``. It is idempotent: a healthy
recorded component is reused, a dead or mismatched one is replaced. When any
component fails, everything this call started is stopped again and
:class:`~flywheel.stack.base.ComponentFailed` is raised. ``down`` stops what the
stack started (never an external or machine service) and forgets the rest.

The pipeline's services that ``flywheel demo --keep-up`` leaves running are recorded
too (:func:`keep_services`, kind ``service``): ``status`` lists them and ``down`` stops
them first, before the infrastructure they use.
"""

from __future__ import annotations

import fcntl
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from flywheel.core.settings import Settings, get_settings
from flywheel.stack.base import (
    Component,
    ComponentFailed,
    ComponentRecord,
    ComponentStatus,
    StackState,
    load_state,
    record_alive,
    save_state,
)
from flywheel.stack.broker import Broker
from flywheel.stack.gate import KIND as GATE_KIND
from flywheel.stack.gate import GateReplica
from flywheel.stack.postgres import Postgres
from flywheel.stack.redis import Redis
from flywheel.stack.services import SERVICE_KIND, ServiceComponent
from flywheel.stack.vllm import VllmReplica

KINDS = ("broker", "postgres", "redis", "vllm", GATE_KIND)
"""Component kinds in display order; ``--only`` takes a comma-separated subset (``gate``: the trainer's
eval-gate replica, :mod:`flywheel.stack.gate`)."""
DOWN_KINDS = (SERVICE_KIND, *KINDS)
"""What ``down`` may stop: the kept services (``service``) too, first."""


def parse_components(components: Iterable[str] | str | None, choices: tuple[str, ...] = KINDS) -> tuple[str, ...]:
    """Validate a component selection (None = all ``choices``), keeping their order."""
    if components is None:
        return choices
    if isinstance(components, str):
        components = [c for c in components.split(",")]
    wanted = {c.strip().lower() for c in components if c.strip()}
    unknown = wanted - set(choices)
    if unknown:
        raise ValueError(f"unknown component(s) {sorted(unknown)}; choose from {', '.join(choices)}")
    return tuple(k for k in choices if k in wanted)


def up(
    settings: Settings | None = None,
    components: Iterable[str] | str | None = None,
    model_dir: Path | str | None = None,
) -> StackState:
    """Find or start ``components`` (default: all) and wait until each is healthy.

    ``model_dir`` is the model the local vLLM replicas serve; by default the base model the
    settings select (:func:`flywheel.model.base.base_model_dir`: ``model.path``, else the
    project's build, built on first use).
    Raises :class:`ComponentFailed` naming the part that failed, after stopping
    whatever this call started.
    """
    settings = settings or get_settings()
    kinds = parse_components(components)
    model_path = Path(model_dir).resolve() if model_dir is not None else None
    with _locked(settings):
        state = load_state(settings)
        plan = _plan(settings, kinds, model_path)
        if "vllm" in kinds:
            _retire_extra_replicas(settings, state, {c.name for c in plan if c.kind == "vllm"})
        pending: list[Component] = []
        for component in plan:
            record = state.components.get(component.name)
            if record is not None and component.matches(record) and _healthy(component, record):
                continue  # reuse
            if record is not None:
                component.stop(record)
                state.components.pop(component.name, None)
            pending.append(component)
        save_state(settings, state)
        if any(isinstance(c, VllmReplica) and c.model_dir is None and not c.configured_url for c in pending):
            resolved = _default_model_dir(settings)
            pending = [_with_model(settings, c, resolved) for c in pending]
        for record in _start_all(pending):
            state.components[record.name] = record
        save_state(settings, state)
        return state


def down(settings: Settings | None = None, components: Iterable[str] | str | None = None) -> list[str]:
    """Stop what the stack started (SIGTERM, SIGKILL after a grace period) and forget it.

    ``components`` (default: all of :data:`DOWN_KINDS`) may name ``service``: the pipeline's
    services kept running by ``flywheel demo --keep-up``, stopped before the infrastructure.
    External and machine services are forgotten but never stopped. Returns the names
    of the processes that were stopped.
    """
    settings = settings or get_settings()
    kinds = parse_components(components, DOWN_KINDS)
    with _locked(settings):
        state = load_state(settings)
        services = state.of_kind(SERVICE_KIND) if SERVICE_KIND in kinds else []
        chosen = [r for r in state.components.values() if r.kind in kinds and r.kind != SERVICE_KIND]
        stopped = [r.name for r in [*services, *chosen] if r.started_by_us and record_alive(r)]
        for batch in (services, chosen):
            _stop_records(settings, batch)
            for record in batch:
                state.components.pop(record.name, None)
            save_state(settings, state)
    return stopped


def keep_services(settings: Settings, records: Iterable[ComponentRecord]) -> None:
    """Record services that outlive the process that started them (``flywheel demo --keep-up``).

    ``records`` are :meth:`~flywheel.stack.services.ServiceGroup.records`; from now on
    ``status`` lists them and ``down`` stops them. Raises :class:`ValueError` for a name
    that an infrastructure component already uses.
    """
    with _locked(settings):
        state = load_state(settings)
        for record in records:
            existing = state.components.get(record.name)
            if record.kind != SERVICE_KIND or (existing is not None and existing.kind != SERVICE_KIND):
                raise ValueError(f"{record.name}: not a service record, or the name of a stack component")
            state.components[record.name] = record
        save_state(settings, state)


def status(settings: Settings | None = None) -> list[ComponentStatus]:
    """One row per recorded component (probed now), plus a row for each kind not running."""
    settings = settings or get_settings()
    state = load_state(settings)
    rows: list[ComponentStatus] = []
    for kind in KINDS:
        records = state.of_kind(kind) or _configured_records(settings, kind)
        for record in records:
            component = _component_for(settings, record)
            if record.started_by_us and not record_alive(record):
                healthy, detail = False, f"process {record.pid} is not running (run `flywheel up`)"
            else:
                probe = component.health(record)
                healthy, detail = probe.ok, probe.detail
            rows.append(
                ComponentStatus(
                    name=record.name,
                    where=_display(record.where),
                    started_by_us=record.started_by_us,
                    healthy=healthy,
                    detail=detail,
                    pid=record.pid,
                )
            )
        if not records:
            rows.append(
                ComponentStatus(
                    name=kind, where="-", started_by_us=False, healthy=False, detail="not up (run `flywheel up`)"
                )
            )
    for record in state.of_kind(SERVICE_KIND):  # only when kept running: no row otherwise
        probe = ServiceComponent(settings, record.name).health(record)
        rows.append(
            ComponentStatus(
                name=record.name,
                where=record.where,
                started_by_us=True,
                healthy=probe.ok,
                detail=probe.detail,
                pid=record.pid,
            )
        )
    return rows


# ---------------------------------------------------------------- internals


def _plan(settings: Settings, kinds: tuple[str, ...], model_dir: Path | None) -> list[Component]:
    plan: list[Component] = []
    for kind in kinds:
        if kind == "broker":
            plan.append(Broker(settings))
        elif kind == "postgres":
            plan.append(Postgres(settings))
        elif kind == "redis":
            plan.append(Redis(settings))
        elif kind == "vllm":
            count = len(settings.vllm.urls) if settings.vllm.urls else settings.vllm.replicas
            plan.extend(VllmReplica(settings, i, model_dir) for i in range(count))
        elif kind == GATE_KIND:
            plan.append(GateReplica(settings, model_dir))
    return plan


def _with_model(settings: Settings, component: Component, model_dir: Path) -> Component:
    """``component`` serving ``model_dir`` when it is a local vLLM replica given none."""
    if isinstance(component, GateReplica):
        return GateReplica(settings, model_dir)
    if isinstance(component, VllmReplica):
        return VllmReplica(settings, component.index, model_dir)
    return component


def _configured_records(settings: Settings, kind: str) -> list[ComponentRecord]:
    """Records for services that the settings name but ``up`` has not recorded yet."""
    configured: list[tuple[str, str]] = []
    if kind == "broker" and settings.kafka.bootstrap_servers:
        configured = [("broker", settings.kafka.bootstrap_servers)]
    elif kind == "postgres" and settings.postgres.url:
        configured = [("postgres", settings.postgres.url)]
    elif kind == "redis" and settings.redis.url:
        configured = [("redis", settings.redis.url)]
    elif kind == "vllm":
        configured = [(f"vllm-{i}", u.rstrip("/")) for i, u in enumerate(settings.vllm.urls)]
    elif kind == GATE_KIND and settings.trainer.gate.engine_url:
        configured = [(GateReplica(settings).name, settings.trainer.gate.engine_url.rstrip("/"))]
    return [
        ComponentRecord(name=name, kind=kind, where=where, started_by_us=False, source="config", extra={"index": i})
        for i, (name, where) in enumerate(configured)
    ]


def _component_for(settings: Settings, record: ComponentRecord) -> Component:
    if record.kind == "vllm":
        return VllmReplica(settings, int(record.extra.get("index", 0)))
    if record.kind == GATE_KIND:
        return GateReplica(settings)
    if record.kind == SERVICE_KIND:
        return ServiceComponent(settings, record.name)
    return {"broker": Broker, "postgres": Postgres, "redis": Redis}[record.kind](settings)


def _healthy(component: Component, record: ComponentRecord) -> bool:
    if record.started_by_us and not record_alive(record):
        return False
    return component.health(record).ok


def _retire_extra_replicas(settings: Settings, state: StackState, keep: set[str]) -> None:
    extra = [r for r in state.of_kind("vllm") if r.name not in keep]
    _stop_records(settings, extra)
    for record in extra:
        state.components.pop(record.name, None)


def _stop_records(settings: Settings, records: list[ComponentRecord]) -> None:
    ours = [r for r in records if r.started_by_us]
    if not ours:
        return
    with ThreadPoolExecutor(max_workers=len(ours)) as pool:
        list(pool.map(lambda r: _component_for(settings, r).stop(r), ours))


def _start_all(pending: list[Component]) -> list[ComponentRecord]:
    """Start ``pending`` in parallel; on any failure stop what was started and raise."""
    if not pending:
        return []
    cancel = threading.Event()
    lock = threading.Lock()
    started: list[tuple[Component, ComponentRecord]] = []
    failures: list[ComponentFailed] = []

    def run(component: Component) -> None:
        try:
            record = component.start_or_locate()
            with lock:
                started.append((component, record))
            component.wait_ready(record, cancel)
        except ComponentFailed as err:
            with lock:
                failures.append(err)
            cancel.set()
        except Exception as err:  # an unexpected error still names its component
            with lock:
                failures.append(ComponentFailed(component.name, f"{type(err).__name__}: {err}", component.log_path))
            cancel.set()

    pool = ThreadPoolExecutor(max_workers=len(pending), thread_name_prefix="stack-up")
    try:
        futures = [pool.submit(run, c) for c in pending]
        for future in futures:
            future.result()
    except BaseException:
        cancel.set()
        pool.shutdown(wait=True)
        _stop_started(started)
        raise
    pool.shutdown(wait=True)
    if failures:
        _stop_started(started)
        first = min(failures, key=lambda f: _is_cancel(f))  # a real failure before a cancellation
        raise first
    return [record for _, record in started]


def _is_cancel(err: ComponentFailed) -> bool:
    return err.reason.startswith("startup cancelled")


def _stop_started(started: list[tuple[Component, ComponentRecord]]) -> None:
    ours = [(c, r) for c, r in started if r.started_by_us]
    if not ours:
        return
    with ThreadPoolExecutor(max_workers=len(ours)) as pool:
        list(pool.map(lambda cr: cr[0].stop(cr[1]), ours))


def _default_model_dir(settings: Settings) -> Path:
    """The base model the settings select (``model.path``, else the project's build, built now), checked."""
    from flywheel.model.base import base_model_dir
    from flywheel.model.check import ModelCheckError, check_model

    try:
        folder = base_model_dir(settings.model, build=True)
    except Exception as err:  # the resolver's and builder's own errors, reported under the component that needs them
        raise ComponentFailed("vllm", f"the base model is unavailable: {type(err).__name__}: {err}") from err
    try:
        check_model(folder, settings.model.completion_only, settings.model.cache_dir)
    except ModelCheckError as err:
        raise ComponentFailed("vllm", f"the base model is not usable: {err}") from err
    return folder


def _display(where: str) -> str:
    if "://" in where and "@" in where and where.startswith("postgres"):
        from sqlalchemy.engine import make_url

        return make_url(where).render_as_string(hide_password=True)
    return where


@contextmanager
def _locked(settings: Settings) -> Iterator[None]:
    """Serialize ``up``/``down`` on one run folder across processes."""
    run_dir = Path(settings.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".stack.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
