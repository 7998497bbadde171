"""``flywheel fleet``: register the vLLM replicas of a fleet in Postgres, without the demo.

``flywheel fleet register [URL ...]`` writes straight to the database the settings name (as
``flywheel db upgrade`` does): a row per replica, and the base model as the stable deployment
of a fleet that has none. The canary controller does the same at every look for the replicas
``vllm.urls`` names; this command is for a fleet whose controller is not running yet, or for
replicas added by hand. The imports happen inside the command, so ``flywheel --help`` stays
instant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import typer

if TYPE_CHECKING:
    from flywheel.core.settings import Settings

app = typer.Typer(no_args_is_help=True, help="The vLLM fleet in Postgres: register its replicas.")


def bad_url(url: str) -> str | None:
    """Why ``url`` is not a replica's base URL (``http(s)://host:port``, no path but ``/``), else None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a port that is not a number)
    except ValueError as err:
        return f"{url!r} is not a URL: {err}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http(s)://host:port URL"
    if parts.path.rstrip("/") or parts.query or parts.fragment:
        return f"{url!r} has a path; give the replica's base URL (http://host:port, no /v1)"
    return None


@app.command("register")
def register_command(
    urls: list[str] = typer.Argument(None, help="Replica base URLs (http://host:port); default: vllm.urls."),
    fleet: str | None = typer.Option(None, help="Fleet name (default: serving.fleet)."),
    model_dir: Path | None = typer.Option(
        None, help="Base model folder for a fleet without a stable deployment (default: model.path or the built model)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the fleet as JSON."),
) -> None:
    """Register replicas (idempotent): one that does not answer is recorded failed and registered once it does.

    Exit 2: no URL given and none configured, a malformed URL or no database configured;
    exit 1: the database is unreachable or not migrated, the base model is missing, a replica
    belongs to another fleet, or another deployment operation holds the fleet's lock.
    """
    from flywheel.core.endpoints import NotConfigured, postgres_url
    from flywheel.core.settings import get_settings

    settings = get_settings()
    if fleet is not None:
        settings = settings.model_copy(update={"serving": settings.serving.model_copy(update={"fleet": fleet})})
    urls = [u.rstrip("/") for u in (urls or settings.vllm.urls)]
    if not urls:
        typer.echo(
            "no replica URL: pass them (flywheel fleet register http://host:8000 ...) "
            "or set FLYWHEEL_VLLM__URLS='[\"http://host:8000\"]'",
            err=True,
        )
        raise typer.Exit(2)
    problems = [why for why in map(bad_url, urls) if why]
    if problems:
        typer.echo("\n".join(problems), err=True)
        raise typer.Exit(2)
    try:
        db = postgres_url(settings)
    except NotConfigured as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    code = _register(settings, db, urls, model_dir, as_json)
    if code:
        raise typer.Exit(code)


def _register(settings: Settings, db: str, urls: list[str], model_dir: Path | None, as_json: bool) -> int:
    from sqlalchemy.exc import OperationalError, ProgrammingError, SQLAlchemyError

    from flywheel.core.db.engine import get_engine
    from flywheel.model.base import BaseModelMissing
    from flywheel.model.check import ModelCheckError
    from serving.fleet.registry import DeployError, fleet_status, register_replicas

    engine = get_engine(db)
    try:
        result = register_replicas(engine, settings, urls, model_dir, actor="cli", build=False)
        status = fleet_status(engine, settings.serving.fleet)
    except OperationalError as err:
        typer.echo(f"database unreachable: {_sql_reason(err)}", err=True)
        return 1
    except ProgrammingError as err:
        typer.echo(f"database not migrated (run `flywheel db upgrade`): {_sql_reason(err)}", err=True)
        return 1
    except SQLAlchemyError as err:
        typer.echo(f"database: {type(err).__name__}: {_sql_reason(err)}", err=True)
        return 1
    except (BaseModelMissing, ModelCheckError) as err:
        typer.echo(f"base model: {err}", err=True)
        return 1
    except DeployError as err:
        typer.echo(err.message, err=True)
        return 1
    finally:
        engine.dispose()
    if result.locked_out:
        typer.echo(
            f"fleet {result.fleet!r} is locked by another deployment operation: nothing registered, try again",
            err=True,
        )
        return 1
    if as_json:
        typer.echo(json.dumps(status.to_dict()))
        return 0
    wanted = set(urls)
    new = {r["url"] for r in result.added} | {r["url"] for r in result.adopted}
    stable = status.stable
    typer.echo(
        f"fleet {status.fleet}: stable {stable.checkpoint_id if stable else None}"
        + (" (the base model, registered now)" if result.stable_created else "")
    )
    for rep in status.replicas:
        if rep.url not in wanted:
            continue
        how = "registered" if rep.url in new else "already registered"
        state = rep.state
        if rep.state == "failed":
            state = f"FAILED ({rep.reason}; the canary controller, or this command again, records it once it answers)"
        typer.echo(f"replica {rep.id}  {rep.url}  {how}  {state}  policy_version={rep.policy_version}")
    return 0


def _sql_reason(err: Exception) -> str:
    return str(getattr(err, "orig", err) or err).strip().splitlines()[0]
