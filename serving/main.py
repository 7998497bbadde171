"""``flywheel-serving``: the serving role's entry point.

``router`` serves the OpenAI-compatible router (the only public ingress), ``admin`` the admin
API, ``canary`` runs the canary controller; ``fleet`` reports on the vLLM replicas the stack or
the settings name, ``check`` is a readiness probe of every replica and ``check-db`` one of the
database the serving processes share. Each command parses its options first and imports the
server it runs (and the settings, the database driver and httpx) only then, so ``--help`` is
instant: the settings alone would more than double its time.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import typer

from flywheel.core.entrypoint import run

if TYPE_CHECKING:
    from flywheel.core.settings import Settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

app = typer.Typer(
    name="flywheel-serving",
    help="Serving: the router, the admin API, the canary controller and the vLLM fleet.",
    no_args_is_help=True,
    add_completion=False,
)


def _fleet() -> list[dict[str, object]]:
    from flywheel.core import vllm_admin
    from flywheel.core.endpoints import vllm_urls

    rows: list[dict[str, object]] = []
    for url in vllm_urls():
        healthy = vllm_admin.health(url)
        rows.append(
            {
                "url": url,
                "healthy": healthy,
                "weight_version": vllm_admin.weight_info(url) if healthy else None,
                "paused": vllm_admin.is_paused(url) if healthy else None,
            }
        )
    return rows


@app.command()
def fleet(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Show every vLLM replica: health, weight version, paused."""
    from flywheel.core.endpoints import NotConfigured

    try:
        rows = _fleet()
    except NotConfigured as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for row in rows:
        state = "healthy" if row["healthy"] else "UNHEALTHY"
        typer.echo(f"{row['url']}  {state}  weight_version={row['weight_version']}  paused={row['paused']}")


@app.command()
def check() -> None:
    """Exit 0 when every replica answers /health, else 1 naming the ones that do not."""
    from flywheel.core.endpoints import NotConfigured

    try:
        rows = _fleet()
    except NotConfigured as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    bad = [str(r["url"]) for r in rows if not r["healthy"]]
    if bad:
        typer.echo(f"unhealthy replicas: {', '.join(bad)}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{len(rows)} replica(s) healthy")


def _settings(**serving: object) -> Settings:
    """The process settings, with the ``serving`` fields given on the command line (None: keep)."""
    from flywheel.core.settings import get_settings

    settings = get_settings()
    changed = {k: v for k, v in serving.items() if v is not None}
    if changed:
        settings = settings.model_copy(update={"serving": settings.serving.model_copy(update=changed)})
    return settings


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


@app.command()
def router(
    host: str | None = typer.Option(None, help="Bind address (default: serving.router_host)."),
    port: int | None = typer.Option(None, min=1, max=65535, help="Port (default: serving.router_port)."),
    log_level: str = typer.Option("info", help="Log level."),
) -> None:
    """Serve the OpenAI-compatible router in front of the fleet (the only public ingress)."""
    _logging(log_level)
    from serving.proxy.router import serve

    serve(_settings(router_host=host, router_port=port))


@app.command()
def admin(
    host: str | None = typer.Option(None, help="Bind address (default: serving.admin_host)."),
    port: int | None = typer.Option(None, min=1, max=65535, help="Port (default: serving.admin_port)."),
    log_level: str = typer.Option("info", help="Log level."),
) -> None:
    """Serve the admin API (checkpoints, deploy, promote, rollback, pause flags, audit, tokens)."""
    _logging(log_level)
    from serving.admin.app import serve

    serve(_settings(admin_host=host, admin_port=port))


@app.command()
def canary(log_level: str = typer.Option("info", help="Log level.")) -> None:
    """Run the canary controller: every serving.canary.interval_s, step up, promote, roll back or hold."""
    _logging(log_level)
    from serving.canary.controller import run

    run(_settings())


@app.command("check-db")
def check_db() -> None:
    """Exit 0 when Postgres answers and has the serving tables (deployments, replicas, audit log), else 1."""
    from sqlalchemy import text
    from sqlalchemy.exc import SQLAlchemyError

    from flywheel.core.db.engine import get_engine
    from flywheel.core.endpoints import NotConfigured, postgres_url

    try:
        with get_engine(postgres_url(_settings())).connect() as conn:
            conn.execute(text("SELECT 1 FROM deployments, replicas, audit_log LIMIT 0"))
    except NotConfigured as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    except SQLAlchemyError as exc:
        typer.echo(f"database: {type(exc).__name__}: {str(getattr(exc, 'orig', exc) or exc).strip()}", err=True)
        raise typer.Exit(1) from None
    typer.echo("ok")


def main() -> None:
    """Console-script entry point."""
    run(app)


if __name__ == "__main__":
    main()
