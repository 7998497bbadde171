"""Endpoints: services resolve them from settings alone; composition passes the stack's on."""

from __future__ import annotations

import json

import pytest

from flywheel.core import endpoints
from flywheel.core.endpoints import NotConfigured
from flywheel.core.settings import Settings
from flywheel.stack.endpoints import endpoint_env


def _settings(tmp_path, **sections) -> Settings:
    return Settings(environment="test", run_dir=tmp_path / "run", **sections)


@pytest.mark.parametrize(
    ("resolve", "variable"),
    [
        (endpoints.kafka_bootstrap, "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS"),
        (endpoints.postgres_url, "FLYWHEEL_POSTGRES__URL"),
        (endpoints.redis_url, "FLYWHEEL_REDIS__URL"),
        (endpoints.vllm_urls, "FLYWHEEL_VLLM__URLS"),
        (endpoints.gate_engine_url, "FLYWHEEL_TRAINER__GATE__ENGINE_URL"),
    ],
)
def test_a_service_without_an_endpoint_is_told_which_variable_to_set(tmp_path, resolve, variable) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "stack.json").write_text('{"components": {}}')  # a stack file is never read by a service
    with pytest.raises(NotConfigured, match=variable):
        resolve(_settings(tmp_path))


def test_a_server_only_url_takes_the_database_from_settings(tmp_path) -> None:
    settings = _settings(tmp_path, postgres={"url": "postgresql://u:pw@db:5432", "database": "flywheel_x"})
    assert endpoints.postgres_url(settings) == "postgresql+psycopg://u:pw@db:5432/flywheel_x"
    assert endpoints.postgres_url(settings, "other") == "postgresql+psycopg://u:pw@db:5432/other"


def test_composition_passes_configured_endpoints_on_with_a_server_only_postgres_url(tmp_path, monkeypatch) -> None:
    settings = _settings(
        tmp_path,
        kafka={"bootstrap_servers": "k:9092"},
        postgres={"url": "postgresql+psycopg://u@db:5432/flywheel"},
        redis={"url": "redis://r:6379/0"},
        vllm={"urls": ["http://v0:8000/", "http://v1:8000"]},
        trainer={"gate": {"engine_url": "http://gate:8000/"}},
    )
    env = endpoint_env(settings)
    assert env == {
        "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS": "k:9092",
        "FLYWHEEL_POSTGRES__URL": "postgresql+psycopg://u@db:5432",
        "FLYWHEEL_REDIS__URL": "redis://r:6379/0",
        "FLYWHEEL_VLLM__URLS": json.dumps(["http://v0:8000", "http://v1:8000"]),
        "FLYWHEEL_TRAINER__GATE__ENGINE_URL": "http://gate:8000",
    }
    for name, value in env.items():  # what a service started with this environment sees
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLYWHEEL_POSTGRES__DATABASE", "flywheel_child")
    assert endpoints.postgres_url(Settings()) == "postgresql+psycopg://u@db:5432/flywheel_child"


def test_composition_leaves_out_what_neither_settings_nor_a_stack_know(tmp_path) -> None:
    assert endpoint_env(_settings(tmp_path)) == {}


@pytest.mark.parametrize(
    ("module", "argv", "variable"),
    [
        ("ingest.main", ["consume"], "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS"),
        ("trainer.main", ["status"], "FLYWHEEL_POSTGRES__URL"),
    ],
)
def test_a_role_started_without_an_endpoint_says_what_to_set_and_exits_2(tmp_path, module, argv, variable) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert variable in done.stderr and "Traceback" not in done.stderr, done.stderr
