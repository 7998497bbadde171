"""``flywheel-trainer``: the trainer's worker, beat, manual trigger, pause/resume, status and check.

Every command parses its options first and imports Celery, SQLAlchemy, rich and torch (and
the trainer modules that import them) only when it runs, so ``--help`` is instant.
``flywheel train ...`` mounts this same ``app``.
"""

from __future__ import annotations

import getpass
import json
import tempfile
import uuid
from typing import Any

import typer

from flywheel.core.entrypoint import run
from flywheel.core.settings import Settings, get_settings

app = typer.Typer(
    name="flywheel-trainer",
    help="The trainer: on-policy checkpoints from scored samples, every hour.",
    no_args_is_help=True,
    add_completion=False,
)


def _session() -> Any:
    from flywheel.core.db.engine import session_factory
    from flywheel.core.endpoints import postgres_url

    return session_factory(postgres_url())()


def _actor() -> str:
    return f"cli:{getpass.getuser()}"


@app.command()
def worker(
    concurrency: int = typer.Option(1, min=1, help="Worker processes (cycles still run one at a time)."),
    pool: str = typer.Option("prefork", help="Celery pool: prefork (time limits enforced) or solo."),
    loglevel: str = typer.Option("INFO", help="Log level."),
    max_tasks_per_child: int = typer.Option(1, min=1, help="Recycle a prefork child after this many cycles."),
) -> None:
    """Run a Celery worker on the trainer queue."""
    from trainer.celery_app import app as celery_app

    argv = [
        "worker",
        "-Q",
        get_settings().trainer.schedule.queue,
        "--concurrency",
        str(concurrency),
        "--pool",
        pool,
        "--loglevel",
        loglevel,
        "--max-tasks-per-child",
        str(max_tasks_per_child),
        "--without-gossip",
        "--without-mingle",
        "--hostname",
        f"trainer-{uuid.uuid4().hex[:6]}@%h",
    ]
    celery_app.worker_main(argv)


@app.command()
def beat(loglevel: str = typer.Option("INFO", help="Log level.")) -> None:
    """Run Celery beat: one ``train_cycle`` every ``trainer.schedule.interval_s``."""
    from trainer.celery_app import app as celery_app

    settings = get_settings()
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    schedule = settings.run_dir / "trainer-beat-schedule"
    celery_app.start(["beat", "--loglevel", loglevel, "--schedule", str(schedule)])


@app.command()
def now(
    inline: bool = typer.Option(False, help="Run the cycle in this process instead of sending it to a worker."),
    wait: bool = typer.Option(True, help="Wait for the worker's result."),
    key: str | None = typer.Option(None, help="Idempotency key (default: a new one)."),
    timeout: float = typer.Option(3600.0, help="Seconds to wait for the result."),
) -> None:
    """Trigger a training cycle now (skipped with its reason if paused or one is running)."""
    key = key or f"manual:{uuid.uuid4()}"
    if inline:
        from trainer.cycle import run_cycle

        typer.echo(json.dumps(run_cycle(key, "manual").to_dict(), indent=2, default=str))
        return
    from trainer.tasks import train_cycle

    result = train_cycle.apply_async(kwargs={"trigger": "manual", "idempotency_key": key})
    typer.echo(f"sent {result.id} (key {key})")
    if wait:
        typer.echo(json.dumps(result.get(timeout=timeout), indent=2, default=str))


@app.command()
def pause(reason: str | None = typer.Option(None, help="Why (kept in the audit log).")) -> None:
    """Pause training: later cycles are skipped with reason ``paused`` until resumed."""
    from trainer import registry

    with _session() as session:
        state = registry.set_paused(session, True, _actor(), reason)
    typer.echo(f"paused by {state.actor}")


@app.command()
def resume(reason: str | None = typer.Option(None, help="Why (kept in the audit log).")) -> None:
    """Resume training."""
    from trainer import registry

    with _session() as session:
        state = registry.set_paused(session, False, _actor(), reason)
    typer.echo(f"resumed by {state.actor}" if not state.paused else "still paused")


@app.command()
def status(limit: int = typer.Option(10, min=1, help="Rows of each table.")) -> None:
    """The pause flag, the latest cycles and the latest checkpoints."""
    from rich.console import Console
    from rich.table import Table

    from trainer import registry

    console = Console()
    with _session() as session:
        state = registry.pause_state(session)
        console.print(f"[bold]trainer[/bold]: {'PAUSED by ' + str(state.actor) if state.paused else 'running'}")
        cycles = Table("id", "trigger", "status", "reason", "checkpoint", "started", title="cycles")
        for c in registry.recent_cycles(session, limit):
            cycles.add_row(
                str(c.id),
                c.trigger,
                c.status,
                (c.reason or "")[:80],
                c.checkpoint_id or "",
                f"{c.started_at:%Y-%m-%d %H:%M:%S}",
            )
        console.print(cycles)
        ckpts = Table("id", "parent", "format", "status", "samples", "created", title="checkpoints")
        for k in registry.recent_checkpoints(session, limit):
            ckpts.add_row(
                k.id, k.parent_id or "", k.format, k.status, str(k.n_samples), f"{k.created_at:%Y-%m-%d %H:%M:%S}"
            )
        console.print(ckpts)


@app.command()
def check() -> None:
    """Check settings, Postgres (migrated), Redis, the base model and the checkpoint folder."""
    settings = get_settings()
    problems = []
    for name, probe in (
        ("postgres", _check_postgres),
        ("redis", _check_redis),
        ("base model", _check_model),
        ("checkpoint dir", _check_ckpt_dir),
    ):
        try:
            detail = probe(settings)
            typer.echo(f"ok    {name}: {detail}")
        except Exception as exc:  # a check reports every failure, then exits non-zero
            problems.append(name)
            typer.echo(f"FAIL  {name}: {type(exc).__name__}: {exc}")
    if problems:
        raise typer.Exit(1)


def _check_postgres(settings: Settings) -> str:
    from flywheel.core.db import migrate
    from flywheel.core.endpoints import postgres_url

    url = postgres_url(settings)
    revision = migrate.current(url)
    if revision is None:
        raise RuntimeError("database not migrated; run `flywheel db upgrade`")
    return f"revision {revision}"


def _check_redis(settings: Settings) -> str:
    import redis

    from flywheel.core.endpoints import redis_url

    url = redis_url(settings)
    redis.Redis.from_url(url, socket_timeout=3).ping()
    return url


def _check_model(settings: Settings) -> str:
    from flywheel.model.base import base_model_dir
    from flywheel.model.check import check_model

    info = check_model(base_model_dir(settings.model), settings.model.completion_only, settings.model.cache_dir)
    return f"{info.path} ({info.policy_version}, {info.architecture})"


def _check_ckpt_dir(settings: Settings) -> str:
    root = settings.trainer.checkpoints.dir
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=root, prefix=".tmp-check-"):
        pass
    return str(root.resolve())


def main() -> None:
    """Console-script entry point."""
    run(app)


if __name__ == "__main__":
    main()
