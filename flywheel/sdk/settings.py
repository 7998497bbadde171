"""What an agent product configures for the SDK: environment variables read here, nowhere else."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from flywheel.core.contracts.events import MAX_TOKENS
from flywheel.core.kafka_security import SDK_HINT, KafkaSecurity, SaslMechanism, SecurityProtocol, sdk_setting_name

MAX_COMPLETION_TOKENS = 131_072
"""Default of ``max_completion_tokens``: the same as the services' ``ingest.max_completion_tokens``."""
MAX_EVENT_BYTES = 16 * 1024 * 1024
"""Default of ``max_event_bytes``: the same as the services' ``ingest.max_event_bytes``."""
MAX_BODY_BYTES = 32 * 1024 * 1024
"""Default of ``max_body_bytes``: the same as the gateway's ``ingest.max_body_bytes``."""


class SdkSettings(BaseSettings):
    """What an agent product's process configures for the SDK (read by ``Flywheel()``)."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_",
        env_nested_delimiter="__",
        extra="ignore",
        hide_input_in_errors=True,  # a validation error must not echo the write key or the SASL password
    )

    project: str | None = None
    """Project (tenant) name; FLYWHEEL_PROJECT."""
    write_key: SecretStr | None = None
    """Write key for the HTTP gateway; FLYWHEEL_WRITE_KEY."""
    transport: Literal["kafka", "http"] = "kafka"
    """How events leave the process; FLYWHEEL_TRANSPORT."""
    kafka_bootstrap: str | None = None
    """Broker for the Kafka transport; FLYWHEEL_KAFKA_BOOTSTRAP (required by that transport)."""
    kafka_security_protocol: SecurityProtocol = "PLAINTEXT"
    """``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT`` or ``SASL_SSL`` (managed Kafka); FLYWHEEL_KAFKA_SECURITY_PROTOCOL."""
    kafka_sasl_mechanism: SaslMechanism | None = None
    """``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512`` (with ``SASL_*``); FLYWHEEL_KAFKA_SASL_MECHANISM."""
    kafka_sasl_username: str | None = None
    """SASL user name (with ``SASL_*``); FLYWHEEL_KAFKA_SASL_USERNAME."""
    kafka_sasl_password: SecretStr | None = None
    """SASL password (with ``SASL_*``); FLYWHEEL_KAFKA_SASL_PASSWORD."""
    kafka_ssl_cafile: Path | None = None
    """PEM file of the CA(s) that signed the broker's certificate, else the system's; FLYWHEEL_KAFKA_SSL_CAFILE."""
    kafka_ssl_certfile: Path | None = None
    """PEM client certificate for mutual TLS (may hold the key too); FLYWHEEL_KAFKA_SSL_CERTFILE."""
    kafka_ssl_keyfile: Path | None = None
    """PEM private key of the client certificate; FLYWHEEL_KAFKA_SSL_KEYFILE."""
    kafka_ssl_key_password: SecretStr | None = None
    """Password of an encrypted private key; FLYWHEEL_KAFKA_SSL_KEY_PASSWORD."""
    kafka_ssl_check_hostname: bool = True
    """Whether the broker's certificate must name its host (the chain is always verified);
    FLYWHEEL_KAFKA_SSL_CHECK_HOSTNAME."""
    topic_prefix: str = "flywheel"
    """Topic prefix, as the services use it; FLYWHEEL_TOPIC_PREFIX."""
    gateway_url: str = "http://127.0.0.1:18080"
    """Gateway for the HTTP transport; FLYWHEEL_GATEWAY_URL."""
    queue_size: int = Field(10_000, ge=1, le=10_000_000)
    """In-memory queue bound; beyond it events go to the disk spool."""
    batch_size: int = Field(500, ge=1, le=100_000)
    """Most events the sender sends at once."""
    linger_ms: int = Field(50, ge=0, le=60_000)
    """Longest the sender waits to fill a batch."""
    spool_dir: Path = Path(".flywheel/spool")
    """Disk spool for when the queue is full or the broker unreachable."""
    spool_max_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    """Spool bound; beyond it events are dropped, counted and logged."""
    sample_rate: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of sessions logged (decided per session id, deterministically)."""
    redact: bool = True
    """Apply the default PII redactor before anything leaves the process."""
    http_timeout_s: float = Field(10.0, gt=0, le=300)
    """Timeout of one request to the gateway (HTTP transport); a timed-out batch is retried later."""
    kafka_connect_timeout_s: float = Field(2.0, gt=0, le=300)
    """How long connecting to the broker may take before the attempt counts as failed (Kafka transport)."""
    kafka_request_timeout_s: float = Field(5.0, gt=0, le=300)
    """Timeout of one produce request, which bounds how long a batch waits for its acknowledgement."""
    retry_backoff_max_s: float = Field(30.0, ge=0.5, le=3600)
    """Longest wait between attempts while the transport is down (the backoff doubles from 0.5 s up to it)."""
    exit_flush_timeout_s: float = Field(5.0, ge=0, le=600)
    """How long the flush at interpreter exit waits; what is left stays in the spool for the next start."""
    max_completion_tokens: int = Field(MAX_COMPLETION_TOKENS, ge=1, le=MAX_TOKENS)
    """Longest completion sent, in tokens; FLYWHEEL_MAX_COMPLETION_TOKENS. A longer one is not sent: it is
    counted as invalid and logged, naming this setting. Keep it equal to the services'
    ``ingest.max_completion_tokens``."""
    max_event_bytes: int = Field(MAX_EVENT_BYTES, ge=256, le=64 * 1024 * 1024)
    """Largest event sent, serialized; FLYWHEEL_MAX_EVENT_BYTES. A larger one is not sent (counted as invalid and
    logged, naming this setting); the Kafka transport's ``max_request_size`` follows from it. Keep it equal to the
    services' ``ingest.max_event_bytes``."""
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1024, le=256 * 1024 * 1024)
    """Largest request the HTTP transport sends; FLYWHEEL_MAX_BODY_BYTES. A batch is split into requests of at most
    this size (the gateway's ``ingest.max_body_bytes``); an event alone is always sent."""

    @model_validator(mode="after")
    def _kafka_security_works(self) -> SdkSettings:
        if self.transport == "kafka":
            self.kafka_security()  # raises KafkaSecurityError (a ValueError), naming each setting to change
        return self

    def kafka_security(self) -> KafkaSecurity:
        """The TLS and SASL options of the Kafka transport's producer (the same as the services')."""

        def secret(value: SecretStr | None) -> str | None:
            return value.get_secret_value() if value is not None else None

        def path(value: Path | None) -> str | None:
            return str(value) if value is not None else None

        return KafkaSecurity(
            protocol=self.kafka_security_protocol,
            sasl_mechanism=self.kafka_sasl_mechanism,
            sasl_username=self.kafka_sasl_username,
            sasl_password=secret(self.kafka_sasl_password),
            ssl_cafile=path(self.kafka_ssl_cafile),
            ssl_certfile=path(self.kafka_ssl_certfile),
            ssl_keyfile=path(self.kafka_ssl_keyfile),
            ssl_key_password=secret(self.kafka_ssl_key_password),
            ssl_check_hostname=self.kafka_ssl_check_hostname,
            name=sdk_setting_name,
            hint=SDK_HINT,
        )
