"""Settings: ingest: topics, the consumer, the HTTP gateway."""

from __future__ import annotations

from pydantic import BaseModel, Field


class IngestSettings(BaseModel):
    """Topics, the Kafka-to-Postgres consumer and the HTTP gateway."""

    partitions: int = Field(4, ge=1, le=1024)
    """Partitions of the events topic (created at start if missing)."""
    replication_factor: int = Field(1, ge=1, le=7)
    """Replication factor of created topics."""
    retention_hours: int = Field(168, ge=1, le=87600)
    """Retention of the events topic."""
    group_id: str = Field("flywheel-ingest", min_length=1, max_length=128)
    """Consumer group of the Postgres writers; scale out by starting more consumers."""
    batch_max_events: int = Field(1000, ge=1, le=100000)
    """Most events written to Postgres in one transaction."""
    batch_max_wait_ms: int = Field(200, ge=1, le=60000)
    """Longest a partial batch waits before it is written."""
    max_poll_interval_ms: int = Field(30000, ge=1000, le=3600000)
    """Kafka max.poll.interval (Tansu's first join waits this long: keep it small in tests)."""
    gateway_host: str = "127.0.0.1"
    """Address the HTTP gateway binds."""
    gateway_port: int = Field(18080, ge=1, le=65535)
    """Port of the HTTP gateway."""
    max_body_bytes: int = Field(5_000_000, ge=1024, le=100_000_000)
    """Largest request body the gateway reads (413 beyond)."""
    max_event_bytes: int = Field(1_000_000, ge=256, le=50_000_000)
    """Largest single event, serialized (rejected beyond)."""
    max_batch_events: int = Field(1000, ge=1, le=100000)
    """Most events in one gateway request."""
    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Port of the consumer's Prometheus endpoint; None disables it."""
    metrics_host: str = "127.0.0.1"
    """Address the consumer's Prometheus endpoint binds."""
    check_crcs: bool = False
    """Verify Kafka record CRCs in the consumer. Off by default, as in librdkafka: kafka-python
    checks them in pure Python (~90 % of consume time without the crc32c extension), TCP and
    the broker already protect the bytes, and every record is validated against its contract."""
    key_cache_ttl_s: float = Field(10.0, ge=0, le=3600)
    """How long the gateway caches a write-key lookup (a revocation takes effect within it)."""
    feedback_retry_s: float = Field(5.0, ge=0.05, le=3600)
    """First wait before the consumer looks again for the completion of unattached feedback (feedback by
    completion id alone whose completion was not stored yet); it doubles per attempt up to feedback_retry_max_s."""
    feedback_retry_max_s: float = Field(300.0, ge=0.05, le=86400)
    """Longest wait between two lookups of a pending feedback's completion."""
    feedback_report_after_s: float = Field(3600.0, ge=0, le=30 * 86400)
    """How long unattached feedback may wait for its completion before it is reported as
    ``unknown_completion`` (logged, counted, listed by ``flywheel-ingest report``); it is kept and still retried."""
    completion_window_s: float = Field(86400.0, ge=1, le=365 * 86400)
    """A pending feedback's completion is searched among completions that occurred within this long of the
    time in its UUIDv7 completion id (the SDK mints the id when it logs the completion)."""
    feedback_sweep_max: int = Field(500, ge=1, le=100000)
    """Most pending feedback rows one lookup round handles."""
