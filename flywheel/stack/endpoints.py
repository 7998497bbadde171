"""How every Flywheel service finds the stack's components.

Each function returns the configured value when the settings name one, else what
``flywheel up`` recorded in ``run_dir/stack.json``, else raises
:class:`~flywheel.stack.base.StackNotRunning` saying what to run or set.
"""

from __future__ import annotations

from flywheel.config import Settings, get_settings
from flywheel.stack.base import ComponentRecord, StackNotRunning, load_state, record_alive, state_path

DRIVER = "postgresql+psycopg"


def kafka_bootstrap(settings: Settings | None = None) -> str:
    """Bootstrap servers (``host:port[,host:port]``) of the Kafka-protocol broker."""
    settings = settings or get_settings()
    if settings.kafka.bootstrap_servers:
        return settings.kafka.bootstrap_servers
    return _recorded(settings, "broker", "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS").where


def postgres_url(settings: Settings | None = None, database: str | None = None) -> str:
    """SQLAlchemy URL (``postgresql+psycopg://``) of the project's database, or of ``database``.

    A configured ``postgres.url`` keeps its own database name unless ``database`` is given
    (or it names none, then ``postgres.database`` is used).
    """
    from sqlalchemy.engine import make_url

    settings = settings or get_settings()
    if settings.postgres.url:
        base = settings.postgres.url
    else:
        base = _recorded(settings, "postgres", "FLYWHEEL_POSTGRES__URL").where
    return with_database(base, database or make_url(base).database or settings.postgres.database)


def redis_url(settings: Settings | None = None) -> str:
    """URL of the Redis that Celery uses."""
    settings = settings or get_settings()
    if settings.redis.url:
        return settings.redis.url
    return _recorded(settings, "redis", "FLYWHEEL_REDIS__URL").where


def vllm_urls(settings: Settings | None = None) -> list[str]:
    """Base URLs (``http://host:port``, no ``/v1``) of the vLLM replicas, in index order."""
    settings = settings or get_settings()
    if settings.vllm.urls:
        return [u.rstrip("/") for u in settings.vllm.urls]
    records = load_state(settings).of_kind("vllm")
    if not records:
        raise StackNotRunning(_missing("vLLM", settings, "FLYWHEEL_VLLM__URLS='[\"http://host:port\"]'"))
    for record in records:
        _check_alive(record, settings)
    return [r.where for r in records]


def with_database(url: str, database: str) -> str:
    """``url`` pointing at ``database``, with the psycopg 3 driver."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres", "postgresql+psycopg2"):
        parsed = parsed.set(drivername=DRIVER)
    return parsed.set(database=database).render_as_string(hide_password=False)


def ensure_database(url: str) -> str:
    """Create the database that ``url`` names if it does not exist; return ``url``.

    Connects to the server's ``postgres`` maintenance database with the same role.
    Safe to race: a concurrent creator's win counts as success.
    """
    import psycopg
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
    import psycopg
    from psycopg import sql

    name = _database_name(url)
    with psycopg.connect(_maintenance_conninfo(url), autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def libpq_conninfo(url: str) -> str:
    """A libpq connection string for a SQLAlchemy URL (for psycopg used directly)."""
    from sqlalchemy.engine import make_url

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
    from sqlalchemy.engine import make_url

    name = make_url(url).database
    if not name:
        raise ValueError(f"the Postgres URL names no database: {url!r}")
    return name


def _maintenance_conninfo(url: str) -> str:
    return libpq_conninfo(with_database(url, "postgres"))


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


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
