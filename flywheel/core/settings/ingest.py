"""Settings: ingest: topics, the consumer, the HTTP gateway."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field, field_validator, model_validator

from flywheel.core.contracts.events import MAX_TOKENS

MAX_COMPLETION_TOKENS = 131_072
"""Default of ``ingest.max_completion_tokens`` (and of the SDK's ``FLYWHEEL_MAX_COMPLETION_TOKENS``)."""
MAX_EVENT_BYTES = 16 * 1024 * 1024
"""Default of ``ingest.max_event_bytes`` (and of the SDK's ``FLYWHEEL_MAX_EVENT_BYTES``): room for a
completion of :data:`MAX_COMPLETION_TOKENS` tokens with logprobs (about 4 MB of JSON, at most ~5.2 MB
with the longest ids and floats) plus its text and a prompt of the same length."""
ORIGIN_PATTERN = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")
"""What a browser sends as ``Origin`` for a page: scheme, host (or bracketed IPv6), optional port."""
MAX_BODY_BYTES = 32 * 1024 * 1024
"""Default of ``ingest.max_body_bytes`` (and of the SDK's ``FLYWHEEL_MAX_BODY_BYTES``)."""


class OtlpSettings(BaseModel):
    """The gateway's OTLP trace intake (``POST /v1/traces``)."""

    session_attribute: str | None = Field(None, min_length=1, max_length=256)
    """A span attribute that names the session, used when a span has neither ``gen_ai.conversation.id``
    nor ``session.id`` (e.g. ``app.thread_id``); else a span's session is its trace's."""


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
    """Kafka max.poll.interval: a consumer that does not poll for this long leaves its group (kafka-python
    also sends it as the rebalance timeout)."""
    session_timeout_ms: int = Field(10000, ge=1000, le=300000)
    """Kafka session timeout of a consumer (at most max_poll_interval_ms): a killed consumer's partitions move
    to another one after it. Tansu holds every join for about half of it, so a consumer started after others
    of its group stopped writes within about this long (they left cleanly) or twice it (they were killed)."""
    gateway_host: str = "127.0.0.1"
    """Address the HTTP gateway binds."""
    gateway_port: int = Field(18080, ge=1, le=65535)
    """Port of the HTTP gateway."""
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1024, le=256 * 1024 * 1024)
    """Largest request body the gateway reads (413 beyond); at least ``max_event_bytes`` plus the
    body's own 13 bytes, so that one event of the largest size can be sent."""
    max_event_bytes: int = Field(MAX_EVENT_BYTES, ge=256, le=64 * 1024 * 1024)
    """Largest single event, serialized as JSON: refused beyond, naming this setting, by the gateway
    (422 for that event) and the consumer (dead letter). Kafka records may be ``kafka.max_record_bytes``."""
    max_completion_tokens: int = Field(MAX_COMPLETION_TOKENS, ge=1, le=MAX_TOKENS)
    """Longest completion accepted, in tokens (``completion_token_ids``, and ``logprobs`` with them):
    refused beyond, naming this setting, by the gateway (422 for that event) and the consumer (dead letter)."""
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

    otlp: OtlpSettings = Field(default_factory=OtlpSettings)
    """OTLP trace intake on the gateway (``POST /v1/traces``)."""

    feedback_cors_origins: list[str] = Field(default_factory=list, max_length=256)
    """Web origins (``https://app.example.com``: scheme, host, optional port; no path) whose pages may
    post browser feedback to the gateway's ``POST /v1/feedback`` with a feedback token. Empty: none (a
    backend may still post it; a browser request from any origin is refused). Only that route is cross-origin."""

    feedback_token_rate_per_s: float = Field(1.0, gt=0, le=10_000)
    """Feedback requests per second one feedback token may send through one gateway process (a token bucket
    per token: a leaked token cannot flood a session with feedback); 429 with Retry-After beyond."""
    feedback_token_burst: int = Field(20, ge=1, le=100_000)
    """Feedback requests one feedback token may send at once."""
    feedback_key_rate_per_s: float = Field(200.0, gt=0, le=1_000_000)
    """Feedback requests per second all the tokens signed by one write key may send through one gateway
    process together (a bucket per signing key: minting many tokens does not lift the cap)."""
    feedback_key_burst: int = Field(400, ge=1, le=1_000_000)
    """Feedback requests the tokens of one write key may send at once."""

    @field_validator("feedback_cors_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:
            if not ORIGIN_PATTERN.fullmatch(origin):
                raise ValueError(
                    f"{origin!r} is not a web origin: scheme://host[:port] with http or https, no path, no "
                    "trailing slash, no wildcard (e.g. https://app.example.com)"
                )
        return origins

    @model_validator(mode="after")
    def _body_holds_an_event(self) -> IngestSettings:
        if self.max_body_bytes < self.max_event_bytes + len(b'{"events":[]}'):
            raise ValueError(
                f"ingest.max_body_bytes ({self.max_body_bytes}) cannot hold one event of ingest.max_event_bytes "
                f"({self.max_event_bytes}) in a gateway request; raise it to at least max_event_bytes + 13"
            )
        return self
