"""The built wheel is complete: installed into a fresh virtual environment, away from the
checkout, it migrates a real Postgres to head, every command answers ``--help`` and the
dashboard's files are there.

The wheel is built from a copy of the working tree (the files git tracks or would track), so a
file that only exists in the checkout, or a stale ``build/`` folder, cannot fill a gap. The temporary
venv sees the already-installed dependencies through a plain path line in a ``.pth`` file: such a line
adds the folder to ``sys.path`` without running that folder's own ``.pth`` files, so the checkout's
editable install stays off and ``import flywheel`` must come from the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import uuid
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from flywheel.core import endpoints
from flywheel.core.db import migrate
from flywheel.core.db.models import Base

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("flywheel", "ingest", "rewarding", "trainer", "serving")
DASHBOARD_STATIC = REPO / "serving" / "dashboard" / "static"


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the working tree."""
    src = tmp_path_factory.mktemp("src")
    listed = _run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO)
    for rel in filter(None, listed.split("\0")):
        if (REPO / rel).is_symlink():  # flywheel/core/db/migrations -> the top-level migrations/
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(REPO / rel), src / rel)
        elif (REPO / rel).is_file():  # a tracked file deleted in the working tree is not copied
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    out = tmp_path_factory.mktemp("wheel")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(src),
        ],
        cwd=src,
    )
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel, with this environment's dependencies but not its editable flywheel."""
    root = tmp_path_factory.mktemp("venv") / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root.parent)
    python = root / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
        cwd=root.parent,
    )
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=root).strip())
    deps = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site / "zz_flywheel_test_deps.pth").write_text("".join(f"{path}\n" for path in deps))
    return root


@pytest.fixture
def outside(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A working folder outside the checkout, and an environment that does not point into it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["HOME"] = str(tmp_path)
    assert REPO not in tmp_path.resolve().parents
    return tmp_path, env


def _site(venv: Path, cwd: Path, env: dict[str, str]) -> Path:
    return Path(
        _run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd, env
        ).strip()
    ).resolve()


def test_the_installed_wheel_imports_from_the_venv_not_the_checkout(venv: Path, outside) -> None:
    cwd, env = outside
    site = _site(venv, cwd, env)
    code = "import importlib, importlib.metadata as m; " + (
        f"print(*[importlib.import_module(n).__file__ for n in {PACKAGES!r}], sep='\\n'); "
        "print(m.distribution('flywheel-rl').locate_file(''))"
    )
    lines = _run([str(venv / "bin" / "python"), "-c", code], cwd, env).split()
    assert len(lines) == len(PACKAGES) + 1, lines
    for name, path in zip(PACKAGES, lines[:-1], strict=True):
        assert Path(path).resolve().is_relative_to(site), f"{name} imported from {path}, not the wheel in {site}"
    assert Path(lines[-1]).resolve() == site, f"the flywheel-rl distribution found is {lines[-1]}, not the wheel's"


def test_db_upgrade_from_the_wheel_migrates_a_fresh_database_to_head(venv: Path, outside, pg_url: str) -> None:
    cwd, env = outside
    site = _site(venv, cwd, env)
    where = _run(
        [str(venv / "bin" / "python"), "-c", "from flywheel.core.db import migrate; print(migrate.ALEMBIC_INI.parent)"],
        cwd,
        env,
    ).strip()
    assert Path(where).resolve().is_relative_to(site), f"the migrations are read from {where}, not the wheel"

    url = endpoints.with_database(pg_url, f"wheel_{uuid.uuid4().hex[:10]}")
    endpoints.ensure_database(url)
    try:
        out = _run([str(venv / "bin" / "flywheel"), "db", "upgrade", "--url", url], cwd, env)
        head = ScriptDirectory.from_config(migrate.alembic_config(url)).get_current_head()
        assert f"database at {head}" in out, out
        engine = create_engine(url)
        try:
            with engine.connect() as conn:
                assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [head]
            tables = set(inspect(engine).get_table_names())
        finally:
            engine.dispose()
        missing = set(Base.metadata.tables) - tables
        assert not missing, f"tables the models define but the wheel's migrations did not create: {sorted(missing)}"
    finally:
        endpoints.drop_database(url)


def test_every_command_answers_help_from_the_wheel(venv: Path, outside) -> None:
    cwd, env = outside
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "flywheel" in scripts and len(scripts) >= 5
    for name in scripts:
        script = venv / "bin" / name
        assert script.is_file(), f"the wheel installed no {name} command"
        assert str(venv) in script.read_text().splitlines()[0], f"{name} does not run the venv's Python"
        out = _run([str(script), "--help"], cwd, env, timeout=180)
        assert "Usage" in out, f"{name} --help printed no usage:\n{out}"


def test_the_dashboard_files_are_in_the_installed_package(venv: Path, outside) -> None:
    cwd, env = outside
    site = _site(venv, cwd, env)
    static = Path(
        _run(
            [str(venv / "bin" / "python"), "-c", "from serving.dashboard import STATIC_DIR; print(STATIC_DIR)"],
            cwd,
            env,
        ).strip()
    ).resolve()
    assert static.is_relative_to(site), f"the dashboard serves from {static}, not the wheel"
    expected = sorted(p.name for p in DASHBOARD_STATIC.iterdir() if p.is_file())
    assert {"index.html", "app.js", "style.css"} <= set(expected)
    for name in expected:
        installed = static / name
        assert installed.is_file(), f"the wheel lacks serving/dashboard/static/{name}"
        assert installed.read_bytes() == (DASHBOARD_STATIC / name).read_bytes(), f"{name} differs from the checkout's"
