"""``flywheel db``: apply and roll back migrations."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer

app = typer.Typer(no_args_is_help=True)


def _url(url: str | None) -> str:
    if url:
        return url
    from flywheel.core.db.engine import default_url

    return default_url()


@contextmanager
def _installed_migrations() -> Iterator[None]:
    """A broken install (no migrations in the package) ends the command with its message, not a traceback."""
    from flywheel.core.db.migrate import MigrationsMissing

    try:
        yield
    except MigrationsMissing as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None


@app.command()
def upgrade(
    revision: str = typer.Argument("head", help="Target revision."),
    url: str = typer.Option(None, help="Database URL (default: settings, else the local stack)."),
) -> None:
    """Apply migrations (``alembic upgrade``)."""
    from flywheel.core.db import migrate

    target = _url(url)
    with _installed_migrations():
        migrate.upgrade(target, revision)
    typer.echo(f"database at {migrate.current(target)}")


@app.command()
def downgrade(
    revision: str = typer.Argument("base", help="Target revision."),
    url: str = typer.Option(None, help="Database URL (default: settings, else the local stack)."),
) -> None:
    """Roll migrations back (``alembic downgrade``)."""
    from flywheel.core.db import migrate

    target = _url(url)
    with _installed_migrations():
        migrate.downgrade(target, revision)
    typer.echo(f"database at {migrate.current(target) or 'base'}")


@app.command()
def current(url: str = typer.Option(None, help="Database URL.")) -> None:
    """Print the database's revision."""
    from flywheel.core.db import migrate

    typer.echo(migrate.current(_url(url)) or "base (empty)")
