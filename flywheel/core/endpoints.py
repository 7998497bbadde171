"""Where a service finds the infrastructure: from its settings alone.

Every deployed service is told where Kafka, Postgres, Redis, the vLLM replicas and the eval
gate's own vLLM replica live through its settings (``FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS`` and
friends). Nothing here looks for a development stack: the local stack (:mod:`flywheel.stack`)
is composition, and it tells the services it starts through their environment, as a deployment would.
A component that is not configured raises :class:`NotConfigured`, naming the variable
to set.
"""

from __future__ import annotations

from sqlalchemy.engine import make_url

from flywheel.core.entrypoint import NotConfigured
from flywheel.core.settings import Settings, get_settings

DRIVER = "postgresql+psycopg"

__all__ = [
    "DRIVER",
    "NotConfigured",
    "drop_database",
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
    if not settings.kafka.bootstrap_servers:
        raise NotConfigured(_missing("Kafka broker", "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS=host:port"))
    return settings.kafka.bootstrap_servers


def postgres_url(settings: Settings | None = None, database: str | None = None) -> str:
    """SQLAlchemy URL (``postgresql+psycopg://``) of the project's database, or of ``database``.

    A configured ``postgres.url`` keeps its own database name unless ``database`` is given
    (or it names none, then ``postgres.database`` is used).
    """
    settings = settings or get_settings()
    if not settings.postgres.url:
        raise NotConfigured(_missing("Postgres database", "FLYWHEEL_POSTGRES__URL=postgresql+psycopg://..."))
    base = settings.postgres.url
    return with_database(base, database or make_url(base).database or settings.postgres.database)


def redis_url(settings: Settings | None = None) -> str:
    """URL of the Redis that Celery uses."""
    settings = settings or get_settings()
    if not settings.redis.url:
        raise NotConfigured(_missing("Redis", "FLYWHEEL_REDIS__URL=redis://host:6379/0"))
    return settings.redis.url


def vllm_urls(settings: Settings | None = None) -> list[str]:
    """Base URLs (``http://host:port``, no ``/v1``) of the vLLM replicas, in index order."""
    settings = settings or get_settings()
    if not settings.vllm.urls:
        raise NotConfigured(_missing("vLLM replica", "FLYWHEEL_VLLM__URLS='[\"http://host:port\"]'"))
    return [u.rstrip("/") for u in settings.vllm.urls]


def gate_engine_url(settings: Settings | None = None) -> str:
    """Base URL (``http://host:port``, no ``/v1``) of the eval gate's vLLM replica (``trainer.gate.engine_url``)."""
    settings = settings or get_settings()
    if not settings.trainer.gate.engine_url:
        raise NotConfigured(_missing("eval-gate vLLM replica", "FLYWHEEL_TRAINER__GATE__ENGINE_URL=http://host:port"))
    return settings.trainer.gate.engine_url.rstrip("/")


def with_database(url: str, database: str) -> str:
    """``url`` pointing at ``database``, with the psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres", "postgresql+psycopg2"):
        parsed = parsed.set(drivername=DRIVER)
    return parsed.set(database=database).render_as_string(hide_password=False)


def ensure_database(url: str) -> str:
    """Create the database that ``url`` names if it does not exist; return ``url``.

    Connects to the server's ``postgres`` maintenance database with the same role.
    Safe to race: a concurrent creator's win counts as success.
    """
    import psycopg  # lazy: the driver only to create or drop a database, not to resolve an endpoint
    from psycopg import errors, sql

    name = _database_name(url)
    with psycopg.connect(_maintenance_conninfo(url), autocommit=True, connect_timeout=5) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            try:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            except errors.DuplicateDatabase:
                pass
    return url


def drop_database(url: str) -> None:
    """Drop the database that ``url`` names (if it exists), ending its connections."""
    import psycopg  # lazy: as in ensure_database
    from psycopg import sql

    name = _database_name(url)
    with psycopg.connect(_maintenance_conninfo(url), autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def libpq_conninfo(url: str) -> str:
    """A libpq connection string for a SQLAlchemy URL (for psycopg used directly)."""
    parsed = make_url(url)
    parts = {
        "host": parsed.host,
        "port": parsed.port,
        "user": parsed.username,
        "password": parsed.password,
        "dbname": parsed.database,
    }
    parts.update({k: v for k, v in parsed.query.items() if isinstance(v, str)})
    return " ".join(f"{k}={_quote(str(v))}" for k, v in parts.items() if v is not None)


def _database_name(url: str) -> str:
    name = make_url(url).database
    if not name:
        raise ValueError(f"the Postgres URL names no database: {url!r}")
    return name


def _maintenance_conninfo(url: str) -> str:
    return libpq_conninfo(with_database(url, "postgres"))


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _missing(what: str, env_hint: str) -> str:
    return (
        f"no {what} is configured: set {env_hint} (with the local development stack running, "
        '`eval "$(flywheel env)"` sets every endpoint)'
    )
