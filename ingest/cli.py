"""``flywheel-ingest``: the consumer, the gateway, topics, project keys and the orphan report.

Heavy modules (kafka-python, psycopg, SQLAlchemy, FastAPI, and the settings with
pydantic-settings) are imported inside the commands and their helpers, so ``--help`` stays instant.
"""

from __future__ import annotations

import json
import logging
import signal
import threading

import typer

app = typer.Typer(
    name="flywheel-ingest", help="Kafka and HTTP into Postgres.", no_args_is_help=True, add_completion=False
)
keys_app = typer.Typer(
    no_args_is_help=True,
    help="Project keys: gateway write keys (fwk_) and router product keys (fwp_); only hashes are stored.",
)
KEY_ROLES = {"writer": "write key", "product": "product key"}
"""The roles ``keys`` manages, and what each is called."""
app.add_typer(keys_app, name="keys")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _settings():
    from flywheel.core.settings import get_settings

    return get_settings()


def _db_url(url: str | None) -> str:
    if url:
        return url
    from flywheel.core.endpoints import postgres_url

    return postgres_url(_settings())


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    logging.getLogger("kafka").setLevel(max(logging.WARNING, logging.getLogger().level))


@app.command()
def topics(
    check: bool = typer.Option(False, "--check", help="Only check; create nothing."),
    bootstrap: str | None = typer.Option(None, help="Broker (default: settings: FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS)."),
) -> None:
    """Create the events and dead-letter topics if missing, and check them; exit 1 on a mismatch."""
    from flywheel.core.endpoints import kafka_bootstrap
    from ingest.topics import ensure_topics

    settings = _settings()
    statuses = ensure_topics(settings, bootstrap or kafka_bootstrap(settings), create=not check)
    for status in statuses:
        state = "created" if status.created else ("ok" if status.ok else "PROBLEM")
        typer.echo(f"{status.spec.name}: {state}, {status.partitions} partitions (want {status.spec.partitions})")
        for line in [*status.problems, *status.notes]:
            typer.echo(f"  - {line}")
    if not all(s.ok for s in statuses):
        raise typer.Exit(1)


@app.command()
def consume(
    bootstrap: str | None = typer.Option(None, help="Broker (default: settings: FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS)."),
    db_url: str | None = typer.Option(None, "--db-url", help="Database URL (default: settings, else the stack)."),
    migrate: bool = typer.Option(False, help="Apply database migrations first."),
    log_level: str = typer.Option("info", help="Log level."),
) -> None:
    """Run one Kafka → Postgres consumer until SIGINT/SIGTERM (start more to scale out)."""
    from psycopg.errors import UndefinedTable

    from flywheel.core.endpoints import kafka_bootstrap
    from ingest import consumer, metrics
    from ingest.topics import ensure_topics

    _logging(log_level)
    settings = _settings()
    bootstrap = bootstrap or kafka_bootstrap(settings)
    url = _db_url(db_url)
    if migrate:
        from flywheel.core.db.migrate import upgrade

        upgrade(url)
    ensure_topics(settings, bootstrap)
    metrics.serve(settings.ingest.metrics_port, settings.ingest.metrics_host)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        consumer.run(settings, stop, bootstrap=bootstrap, db_url=url)
    except UndefinedTable as err:
        typer.echo(f"the database has no ingest tables ({err}); run `flywheel db upgrade` or pass --migrate", err=True)
        raise typer.Exit(2) from None


@app.command()
def gateway(
    host: str | None = typer.Option(None, help="Bind address (default: ingest.gateway_host)."),
    port: int | None = typer.Option(None, help="Port (default: ingest.gateway_port)."),
    db_url: str | None = typer.Option(None, "--db-url", help="Database URL of the write keys."),
    log_level: str = typer.Option("info", help="Log level."),
) -> None:
    """Serve the HTTP gateway (POST /v1/events, POST /v1/traces; /metrics, /docs and /openapi.json behind a key)."""
    import uvicorn

    from flywheel.core.endpoints import kafka_bootstrap
    from ingest.gateway import create_app
    from ingest.topics import ensure_topics

    _logging(log_level)
    settings = _settings()
    ensure_topics(settings, kafka_bootstrap(settings))
    app_ = create_app(settings, db_url=_db_url(db_url), key_cache_ttl_s=settings.ingest.key_cache_ttl_s)
    uvicorn.run(
        app_, host=host or settings.ingest.gateway_host, port=port or settings.ingest.gateway_port, log_level=log_level
    )


@app.command()
def report(
    project: str | None = typer.Option(None, help="Only this project."),
    limit: int = typer.Option(1000, min=1, help="Most rows per section."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    db_url: str | None = typer.Option(None, "--db-url", help="Database URL."),
) -> None:
    """List feedback/outcomes whose session has no session_start or is not known yet, and dead letters."""
    from flywheel.core.endpoints import libpq_conninfo
    from ingest.report import build_report

    report_after_s = _settings().ingest.feedback_report_after_s
    result = build_report(libpq_conninfo(_db_url(db_url)), project=project, limit=limit, report_after_s=report_after_s)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    typer.echo(f"feedback/outcomes for unknown sessions: {len(result.unknown_sessions)}")
    typer.echo(f"feedback/outcomes awaiting their session_start: {len(result.awaiting_start)}")
    overdue = len(result.unknown_completions)
    typer.echo(f"feedback for unknown completions (waiting over {report_after_s:.0f}s): {overdue}")
    typer.echo(f"feedback awaiting its completion: {len(result.awaiting_completion)}")
    for orphan in result.orphans:
        where = orphan.session_id if orphan.session_id is not None else f"completion {orphan.completion_id}"
        typer.echo(
            f"  {orphan.status:19} {orphan.project}/{where} {orphan.type} {orphan.event_id} "
            f"received {orphan.received_at:%Y-%m-%d %H:%M:%S}"
        )
    typer.echo(f"sessions whose feedback arrived before their start: {result.early_feedback_sessions}")
    typer.echo(f"dead letters: {sum(d['count'] for d in result.dead_letters)}")
    for dead in result.dead_letters:
        typer.echo(f"  {dead['count']:6} {dead['reason']}")


@app.command()
def check(
    bootstrap: str | None = typer.Option(None, help="Broker (default: settings: FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS)."),
    db_url: str | None = typer.Option(None, "--db-url", help="Database URL (default: settings, else the stack)."),
) -> None:
    """Health check: the broker has the events topic and the database has the ingest tables; exit 1 if not."""
    from flywheel.core.endpoints import kafka_bootstrap, libpq_conninfo

    settings = _settings()
    problems = _health_problems(settings, bootstrap or kafka_bootstrap(settings), libpq_conninfo(_db_url(db_url)))
    for problem in problems:
        typer.echo(problem, err=True)
    if problems:
        raise typer.Exit(1)
    typer.echo("ok")


def _health_problems(settings, bootstrap: str, conninfo: str) -> list[str]:
    """What keeps ingest from working: an unreachable broker, a missing topic, a missing schema."""
    import psycopg
    from kafka.errors import KafkaError

    from flywheel.core import kafka_clients
    from flywheel.core.contracts.topics import events_topic

    problems: list[str] = []
    topic = events_topic(settings.kafka.topic_prefix)
    try:
        probe = kafka_clients.consumer(bootstrap, security=settings.kafka.security(), bootstrap_timeout_ms=5000)
        try:
            if topic not in probe.topics():
                problems.append(f"broker {bootstrap}: topic {topic} does not exist (run `flywheel-ingest topics`)")
        finally:
            probe.close()
    except KafkaError as err:
        problems.append(f"broker {bootstrap}: {err}")
    try:
        with psycopg.connect(conninfo, connect_timeout=5) as conn:
            conn.execute("SELECT 1 FROM raw_events, sessions, dead_letters, pending_feedback LIMIT 0")
    except psycopg.Error as err:
        problems.append(f"database: {str(err).strip()}")
    return problems


def _key_role(role: str) -> str:
    if role not in KEY_ROLES:
        typer.echo(f"--role: must be one of {', '.join(KEY_ROLES)} (got {role!r})", err=True)
        raise typer.Exit(2)
    return role


@keys_app.command("create")
def keys_create(
    project: str = typer.Option(..., help="The project the key is scoped to."),
    name: str = typer.Option(..., help="A name to recognise the key by."),
    role: str = typer.Option(
        "writer", help="writer: sends events to the gateway (fwk_); product: calls the router's OpenAI API (fwp_)."
    ),
    rate_per_s: float | None = typer.Option(
        None, min=0.001, help="product: this key's router rate limit, requests/s (default serving.key_rate_per_s)."
    ),
    burst: int | None = typer.Option(
        None, min=1, help="product: this key's burst, requests at once (default serving.key_burst)."
    ),
    created_by: str | None = typer.Option(None, help="Who asked for it (recorded)."),
    db_url: str | None = typer.Option(None, "--db-url", help="Database URL."),
) -> None:
    """Create a write key or a product key and print its token once (only its hash is stored)."""
    from flywheel.core.auth import create_key
    from flywheel.core.db.engine import session_factory

    role = _key_role(role)
    with session_factory(_db_url(db_url))() as session:
        try:
            info, token = create_key(
                session, name=name, role=role, project=project, created_by=created_by, rate_per_s=rate_per_s,
                burst=burst,
            )  # fmt: skip
        except ValueError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        session.commit()
    what = KEY_ROLES[role]
    typer.echo(f"created {what} {info.id} ({info.token_prefix}…) for project {project}; store it now:", err=True)
    typer.echo(token)


@keys_app.command("list")
def keys_list(
    project: str | None = typer.Option(None, help="Only this project's keys."),
    role: str = typer.Option("writer", help="writer (gateway write keys) or product (router product keys)."),
    db_url: str | None = typer.Option(None, "--db-url", help="Database URL."),
) -> None:
    """List write keys or product keys (id, prefix, project, name, state); never the tokens."""
    from flywheel.core.auth import list_keys
    from flywheel.core.db.engine import session_factory

    role = _key_role(role)
    with session_factory(_db_url(db_url))() as session:
        rows = list_keys(session, role=role, project=project)
    for info in rows:
        state = f"revoked {info.revoked_at:%Y-%m-%d %H:%M}" if info.revoked_at else "active"
        used = f"last used {info.last_used_at:%Y-%m-%d %H:%M}" if info.last_used_at else "never used"
        limit = f", {info.rate_per_s or 'default'} req/s burst {info.burst or 'default'}" if role == "product" else ""
        typer.echo(f"{info.id:5}  {info.token_prefix:14} {info.project:20} {info.name:20} {state}, {used}{limit}")


@keys_app.command("revoke")
def keys_revoke(
    key_id: int = typer.Argument(..., help="Id of the key (from `keys list`)."),
    db_url: str | None = typer.Option(None, "--db-url", help="Database URL."),
) -> None:
    """Revoke a write key or a product key (the gateway refuses it within ingest.key_cache_ttl_s, the router
    within serving.refresh_s)."""
    from flywheel.core.auth import KeyNotFound, revoke_key
    from flywheel.core.db.engine import session_factory

    with session_factory(_db_url(db_url))() as session:
        try:
            info = revoke_key(session, key_id)
        except KeyNotFound as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(1) from None
        session.commit()
    typer.echo(f"revoked key {info.id} ({info.token_prefix}…, project {info.project})")
