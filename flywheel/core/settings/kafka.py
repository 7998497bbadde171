"""Settings: the Kafka-protocol broker."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from flywheel.core.kafka_security import (
    SERVICE_HINT,
    KafkaSecurity,
    SaslMechanism,
    SecurityProtocol,
    service_setting_name,
)

MAX_RECORD_BYTES = 64 * 1024 * 1024
"""Default of ``kafka.max_record_bytes``."""
RECORD_OVERHEAD_BYTES = 64 * 1024
"""What a record adds to its value at most, as Flywheel produces them (key, headers, batch framing)."""


class KafkaSettings(BaseModel):
    """The Kafka-protocol broker that carries session events."""

    model_config = ConfigDict(hide_input_in_errors=True)  # an error must not echo the SASL password

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
    security_protocol: SecurityProtocol = "PLAINTEXT"
    """``PLAINTEXT``, ``SSL`` (TLS), ``SASL_PLAINTEXT`` or ``SASL_SSL`` (SASL over TLS: managed Kafka)."""
    sasl_mechanism: SaslMechanism | None = None
    """``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512``; required with a ``SASL_*`` protocol."""
    sasl_username: str | None = None
    """SASL user name; required with a ``SASL_*`` protocol."""
    sasl_password: SecretStr | None = None
    """SASL password; required with a ``SASL_*`` protocol."""
    ssl_cafile: Path | None = None
    """PEM file of the CA(s) that signed the broker's certificate; unset: the system's CAs (TLS protocols only)."""
    ssl_certfile: Path | None = None
    """PEM client certificate, for brokers that want mutual TLS; it may hold the private key too."""
    ssl_keyfile: Path | None = None
    """PEM private key of ``ssl_certfile``, when that file does not hold it."""
    ssl_key_password: SecretStr | None = None
    """Password of an encrypted private key."""
    ssl_check_hostname: bool = True
    """Whether the broker's certificate must name the host connected to (the chain is verified regardless)."""

    @model_validator(mode="after")
    def _security_works(self) -> KafkaSettings:
        self.security()  # raises KafkaSecurityError (a ValueError), naming each setting to change
        return self

    def security(self) -> KafkaSecurity:
        """The TLS and SASL options every Kafka client of the services is made with."""
        return KafkaSecurity(
            protocol=self.security_protocol,
            sasl_mechanism=self.sasl_mechanism,
            sasl_username=self.sasl_username,
            sasl_password=self.sasl_password.get_secret_value() if self.sasl_password else None,
            ssl_cafile=str(self.ssl_cafile) if self.ssl_cafile else None,
            ssl_certfile=str(self.ssl_certfile) if self.ssl_certfile else None,
            ssl_keyfile=str(self.ssl_keyfile) if self.ssl_keyfile else None,
            ssl_key_password=self.ssl_key_password.get_secret_value() if self.ssl_key_password else None,
            ssl_check_hostname=self.ssl_check_hostname,
            name=service_setting_name,
            hint=SERVICE_HINT,
        )
