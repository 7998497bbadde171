"""The rewarding CLI's argument parsing and the worker harness's environment mapping."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import typer

from flywheel.core.settings import Settings
from rewarding.harness import settings_env
from rewarding.main import parse_since

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def test_since_accepts_look_backs_and_iso_times() -> None:
    assert parse_since("90s", NOW) == NOW - timedelta(seconds=90)
    assert parse_since("2h", NOW) == NOW - timedelta(hours=2)
    assert parse_since("7d", NOW) == NOW - timedelta(days=7)
    assert parse_since("2026-12-01T00:00:00Z", NOW) == datetime(2026, 12, 1, tzinfo=UTC)
    assert parse_since("2026-12-01T00:00:00", NOW).tzinfo is UTC
    with pytest.raises(typer.BadParameter):
        parse_since("yesterday", NOW)


def test_settings_env_round_trips_through_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    env = settings_env(
        {
            "kafka": {"topic_prefix": "px"},
            "rewarding": {
                "feedback_window_s": 1.5,
                "metrics_port": None,
                "scoring": {"task_weights": {"parl": {"parl": 1.0}}, "trainable_roles": ["agent"]},
            },
        }
    )
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.kafka.topic_prefix == "px"
    assert settings.rewarding.feedback_window_s == 1.5 and settings.rewarding.metrics_port is None
    assert settings.rewarding.scoring.task_weights == {"parl": {"parl": 1.0}}
    assert settings.rewarding.scoring.trainable_roles == ["agent"]
