"""Settings: the Kafka-protocol broker."""

from __future__ import annotations

from pydantic import BaseModel, Field

MAX_RECORD_BYTES = 64 * 1024 * 1024
"""Default of ``kafka.max_record_bytes``."""
RECORD_OVERHEAD_BYTES = 64 * 1024
"""What a record adds to its value at most, as Flywheel produces them (key, headers, batch framing)."""


class KafkaSettings(BaseModel):
    """The Kafka-protocol broker that carries session events."""

    bootstrap_servers: str | None = None
    """Existing broker(s), ``host:port[,host:port]``; ``None`` starts Tansu locally."""
    local_port: int = Field(19092, ge=1024, le=65535)
    """Port of the locally started Tansu broker (loopback only)."""
    topic_prefix: str = Field("flywheel", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Prefix of every topic name, so several deployments can share one broker."""
    max_record_bytes: int = Field(MAX_RECORD_BYTES, ge=1024 * 1024, le=1024 * 1024 * 1024)
    """Largest Kafka record a Flywheel client produces or fetches: the producers' ``max.request.size``,
    the consumers' fetch sizes, the ``max.message.bytes`` of the topics ingest creates. Besides events
    (``ingest.max_event_bytes``, plus :data:`RECORD_OVERHEAD_BYTES`) it bounds rewarding's records: a
    session's state in the table changelog (all its events) and a ``rewards.scored`` record (all its
    samples). A broker of its own needs ``message.max.bytes`` at least this (docker-compose.yml sets it)."""
