"""Typed settings for every Flywheel service.

Environment variables are read here and nowhere else. Every field can be set as
``FLYWHEEL_<SECTION>__<FIELD>`` (for example ``FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS``),
or in a ``.env`` file in the working directory.

A service reads every endpoint (Kafka, Postgres, Redis, the vLLM replicas) from these
settings alone (:mod:`flywheel.core.endpoints`). For the local development stack, a field
left at ``None`` where an external service could be named means "the stack provides it":
``flywheel up`` starts (or finds) the component, records where it lives in the run
folder's ``stack.json``, and passes it to the services it starts through their
environment (``flywheel env`` prints the same variables).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from flywheel.core.settings.ingest import IngestSettings
from flywheel.core.settings.kafka import KafkaSettings
from flywheel.core.settings.model import ModelSettings
from flywheel.core.settings.postgres import PostgresSettings
from flywheel.core.settings.redis import RedisSettings
from flywheel.core.settings.rewarding import DetectorSettings, RewardingSettings, ScoringSettings, ShiftBound
from flywheel.core.settings.serving import CanarySettings, ServingSettings
from flywheel.core.settings.trainer import TrainerSettings
from flywheel.core.settings.vllm import VllmSettings


class Settings(BaseSettings):
    """Root settings shared by every Flywheel process."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_",
        env_nested_delimiter="__",
        env_file=".env",
        extra="ignore",
        hide_input_in_errors=True,  # a validation error must not echo a password (kafka.sasl_password, URLs)
    )

    environment: Literal["development", "test", "production"] = "development"
    """Deployment kind."""
    run_dir: Path = Path(".flywheel/run")
    """Run folder of the local stack: logs, data of embedded servers, stack.json."""
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    """Broker."""
    postgres: PostgresSettings = Field(default_factory=PostgresSettings)
    """Database."""
    redis: RedisSettings = Field(default_factory=RedisSettings)
    """Celery broker."""
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    """Serving fleet."""
    model: ModelSettings = Field(default_factory=ModelSettings)
    """Base model."""
    ingest: IngestSettings = Field(default_factory=IngestSettings)
    """Ingest."""
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    """Trainer."""
    rewarding: RewardingSettings = Field(default_factory=RewardingSettings)
    """Rewarding."""
    serving: ServingSettings = Field(default_factory=ServingSettings)
    """Router, hot swap, canary controller and admin API."""


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()


__all__ = [
    "CanarySettings",
    "DetectorSettings",
    "IngestSettings",
    "KafkaSettings",
    "ModelSettings",
    "PostgresSettings",
    "RedisSettings",
    "RewardingSettings",
    "ScoringSettings",
    "ServingSettings",
    "Settings",
    "ShiftBound",
    "TrainerSettings",
    "VllmSettings",
    "get_settings",
]
