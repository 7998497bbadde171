"""Where the local development stack's components run, for composition and tests.

Each function returns the configured value when the settings name one, else what
``flywheel up`` recorded in ``run_dir/stack.json``, else raises
:class:`~flywheel.stack.base.StackNotRunning` saying what to run or set. Services never
call this module: composition resolves the endpoints here and passes them to the
services it starts through their environment (:func:`endpoint_env`), and services read
them from settings alone (:mod:`flywheel.core.endpoints`).
"""

from __future__ import annotations

import json

from sqlalchemy.engine import make_url

from flywheel.core import endpoints as configured
from flywheel.core.endpoints import drop_database, ensure_database, libpq_conninfo, with_database
from flywheel.core.settings import Settings, get_settings
from flywheel.stack.base import ComponentRecord, StackNotRunning, load_state, record_alive, state_path

__all__ = [
    "drop_database",
    "endpoint_env",
    "ensure_database",
    "gate_engine_url",
    "kafka_bootstrap",
    "libpq_conninfo",
    "postgres_url",
    "redis_url",
    "vllm_urls",
    "with_database",
]


def kafka_bootstrap(settings: Settings | None = None) -> str:
    """Bootstrap servers (``host:port[,host:port]``) of the Kafka-protocol broker."""
    settings = settings or get_settings()
    if settings.kafka.bootstrap_servers:
        return configured.kafka_bootstrap(settings)
    return _recorded(settings, "broker", "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS").where


def postgres_url(settings: Settings | None = None, database: str | None = None) -> str:
    """SQLAlchemy URL of the project's database (or of ``database``);
    see :func:`flywheel.core.endpoints.postgres_url`."""
    settings = settings or get_settings()
    if settings.postgres.url:
        return configured.postgres_url(settings, database)
    base = _recorded(settings, "postgres", "FLYWHEEL_POSTGRES__URL").where
    return with_database(base, database or make_url(base).database or settings.postgres.database)


def redis_url(settings: Settings | None = None) -> str:
    """URL of the Redis that Celery uses."""
    settings = settings or get_settings()
    if settings.redis.url:
        return configured.redis_url(settings)
    return _recorded(settings, "redis", "FLYWHEEL_REDIS__URL").where


def vllm_urls(settings: Settings | None = None) -> list[str]:
    """Base URLs (``http://host:port``, no ``/v1``) of the vLLM replicas, in index order."""
    settings = settings or get_settings()
    if settings.vllm.urls:
        return configured.vllm_urls(settings)
    records = load_state(settings).of_kind("vllm")
    if not records:
        raise StackNotRunning(_missing("vLLM", settings, "FLYWHEEL_VLLM__URLS='[\"http://host:port\"]'"))
    for record in records:
        _check_alive(record, settings)
    return [r.where for r in records]


def gate_engine_url(settings: Settings | None = None) -> str:
    """Base URL of the eval gate's vLLM replica (``trainer.gate.engine_url``, else the stack's ``gate``)."""
    settings = settings or get_settings()
    if settings.trainer.gate.engine_url:
        return configured.gate_engine_url(settings)
    records = load_state(settings).of_kind("gate")
    if not records:
        raise StackNotRunning(
            _missing("eval-gate vLLM replica", settings, "FLYWHEEL_TRAINER__GATE__ENGINE_URL=http://host:port")
        )
    _check_alive(records[0], settings)
    return records[0].where


def endpoint_env(settings: Settings | None = None) -> dict[str, str]:
    """``FLYWHEEL_*`` variables naming every component that the settings or the stack know of.

    The Postgres URL names the server only (no database), so that a service's own
    ``postgres.database`` still chooses the database. A component that neither the
    settings nor the stack know of is left out (the service then says it is not configured).
    """
    settings = settings or get_settings()
    env: dict[str, str] = {}
    for var, resolve in (
        ("FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS", lambda: kafka_bootstrap(settings)),
        ("FLYWHEEL_POSTGRES__URL", lambda: _server_only(postgres_url(settings))),
        ("FLYWHEEL_REDIS__URL", lambda: redis_url(settings)),
        ("FLYWHEEL_VLLM__URLS", lambda: json.dumps(vllm_urls(settings))),
        ("FLYWHEEL_TRAINER__GATE__ENGINE_URL", lambda: gate_engine_url(settings)),
    ):
        try:
            env[var] = resolve()
        except StackNotRunning:
            continue
    return env


def _server_only(url: str) -> str:
    # URL.set(database=None) keeps the database (None means "unchanged" there); _replace clears it.
    return make_url(url)._replace(database=None).render_as_string(hide_password=False)


def _recorded(settings: Settings, name: str, env_hint: str) -> ComponentRecord:
    record = load_state(settings).components.get(name)
    if record is None:
        raise StackNotRunning(_missing(name, settings, f"{env_hint}=..."))
    _check_alive(record, settings)
    return record


def _check_alive(record: ComponentRecord, settings: Settings) -> None:
    if record.started_by_us and not record_alive(record):
        raise StackNotRunning(
            f"{state_path(settings)} records {record.name} as pid {record.pid}, which is no longer running; "
            "run `flywheel up` to restart it"
        )


def _missing(what: str, settings: Settings, env_hint: str) -> str:
    return (
        f"no {what} is configured and none is recorded in {state_path(settings)}: run `flywheel up` (or set {env_hint})"
    )
