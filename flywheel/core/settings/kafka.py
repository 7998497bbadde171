"""Settings: the Kafka-protocol broker."""

from __future__ import annotations

from pydantic import BaseModel, Field


class KafkaSettings(BaseModel):
    """The Kafka-protocol broker that carries session events."""

    bootstrap_servers: str | None = None
    """Existing broker(s), ``host:port[,host:port]``; ``None`` starts Tansu locally."""
    local_port: int = Field(19092, ge=1024, le=65535)
    """Port of the locally started Tansu broker (loopback only)."""
    topic_prefix: str = Field("flywheel", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Prefix of every topic name, so several deployments can share one broker."""
