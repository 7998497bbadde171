"""Settings: environment overrides, constraints, placeholder secrets refused in production."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flywheel.core.settings import Settings


def test_nested_environment_overrides(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS", "broker:9092")
    monkeypatch.setenv("FLYWHEEL_VLLM__REPLICAS", "3")
    s = Settings()
    assert s.kafka.bootstrap_servers == "broker:9092"
    assert s.vllm.replicas == 3


def test_constraints_name_the_field(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_VLLM__REPLICAS", "99")
    with pytest.raises(ValidationError, match="vllm.replicas"):
        Settings()


def test_head_dim_below_64_refused():
    with pytest.raises(ValidationError, match="head_dim 16"):
        Settings(model={"hidden_size": 64, "num_heads": 4, "num_kv_heads": 1})


def test_production_demands_no_secret_key_that_nothing_reads(monkeypatch):
    # Tokens are 192 random bits stored as SHA-256 digests (flywheel.core.auth): no server secret is used,
    # so none is demanded; an old deployment's FLYWHEEL_SECRET_KEY is ignored.
    assert Settings(environment="production").environment == "production"
    monkeypatch.setenv("FLYWHEEL_SECRET_KEY", "anything")
    assert "secret_key" not in Settings(environment="production").model_dump()


def test_the_swap_strategy_is_any_registered_plugin_and_an_unknown_one_is_named() -> None:
    import pytest
    from pydantic import ValidationError

    from flywheel.core.settings import ServingSettings

    assert ServingSettings(strategy="lora").strategy == "lora"
    with pytest.raises(ValidationError, match=r"unknown swap strategy 'nope': expected one of \['full', 'lora'\]"):
        ServingSettings(strategy="nope")
