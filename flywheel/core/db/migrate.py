"""Run Alembic migrations from Python (the CLI, services at start, tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine

HERE = Path(__file__).resolve().parent
ALEMBIC_INI = HERE / "alembic.ini"
"""Alembic's configuration (logging and file template), shipped inside the package."""
MIGRATIONS = HERE / "migrations"
"""The migration scripts (env.py, script.py.mako, versions/). In a checkout this is a link to the
repository's top-level ``migrations/``; a wheel holds a copy (setuptools follows the link), so an
install anywhere finds them beside this module, as a checkout does."""


class MigrationsMissing(FileNotFoundError):
    """This install lacks its migrations (a broken build; not recoverable by retrying)."""


def alembic_config(url: str) -> Config:
    """An Alembic config for the project's migrations against ``url``."""
    for needed in (ALEMBIC_INI, MIGRATIONS / "env.py", MIGRATIONS / "script.py.mako", MIGRATIONS / "versions"):
        if not needed.exists():
            raise MigrationsMissing(
                f"{needed} is missing: this install of flywheel-rl lacks its migrations "
                "(a wheel built without pyproject.toml's package-data?)"
            )
    cfg = Config(str(ALEMBIC_INI))
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations up to ``revision``."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Roll migrations back to ``revision``."""
    command.downgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    """The revision the database is at, or None for an empty database."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
