"""Where the migrations are found: beside flywheel.core.db.migrate, so a wheel and a checkout agree."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import flywheel.core.db as db_package
from flywheel.cli.db import app as db_app
from flywheel.core.db import migrate


def test_the_migrations_are_inside_the_package() -> None:
    """In a checkout ``flywheel/core/db/migrations`` links to the top-level ``migrations/``."""
    package = Path(db_package.__file__).resolve().parent
    cfg = migrate.alembic_config("postgresql+psycopg://u@127.0.0.1/x")
    assert Path(cfg.config_file_name).resolve() == package / "alembic.ini"
    assert Path(cfg.get_main_option("script_location")) == package / "migrations"
    assert sorted((package / "migrations" / "versions").glob("0001_*.py")), "no first revision beside the package"


def test_an_install_without_its_migrations_is_named_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate, "MIGRATIONS", tmp_path / "migrations")
    with pytest.raises(migrate.MigrationsMissing, match=r"migrations/env\.py is missing"):
        migrate.alembic_config("postgresql+psycopg://u@127.0.0.1/x")

    result = CliRunner().invoke(db_app, ["upgrade", "--url", "postgresql+psycopg://u@127.0.0.1:1/x"])
    assert result.exit_code == 1
    assert "lacks its migrations" in result.output and "Traceback" not in result.output


def test_the_checkout_keeps_one_copy_of_the_migrations_at_the_top_level() -> None:
    package = Path(db_package.__file__).resolve().parent
    top = package.parents[2] / "migrations"
    if not (package.parents[2] / "pyproject.toml").is_file():
        pytest.skip("not a checkout")
    assert (package / "migrations").is_symlink()
    assert (package / "migrations").resolve() == top.resolve()
