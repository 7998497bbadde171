"""Transports: Kafka directly, or HTTP through the gateway, behind one interface."""

from __future__ import annotations

from flywheel.core.contracts.topics import events_topic
from flywheel.sdk.settings import SdkSettings
from flywheel.sdk.transports.base import Envelope, Rejection, SendResult, Transport, TransportUnavailable


def no_broker_configured() -> str:
    """Stands in for a broker address that nobody gave: every send says what to set."""
    raise LookupError("no Kafka broker is configured")


def make_transport(settings: SdkSettings) -> Transport:
    """The transport that ``settings.transport`` names; raises ``ValueError`` on an unknown one."""
    if settings.transport == "kafka":
        from flywheel.sdk.transports.kafka import RECORD_OVERHEAD_BYTES, KafkaTransport  # lazy: kafka-python only

        bootstrap = settings.kafka_bootstrap or no_broker_configured
        return KafkaTransport(
            bootstrap,
            events_topic(settings.topic_prefix),
            linger_ms=min(settings.linger_ms, 100),
            connect_timeout_s=settings.kafka_connect_timeout_s,
            request_timeout_s=settings.kafka_request_timeout_s,
            max_request_bytes=settings.max_event_bytes + RECORD_OVERHEAD_BYTES,
            security=settings.kafka_security(),
        )
    if settings.transport == "http":
        from flywheel.sdk.transports.http import HttpTransport  # lazy: httpx only for this transport

        if settings.write_key is None or not settings.write_key.get_secret_value():
            raise ValueError("the http transport needs a write key: pass write_key= or set FLYWHEEL_WRITE_KEY")
        return HttpTransport(
            settings.gateway_url,
            settings.write_key.get_secret_value(),
            timeout_s=settings.http_timeout_s,
            max_body_bytes=settings.max_body_bytes,
        )
    raise ValueError(f"unknown transport {settings.transport!r} (known: kafka, http)")


__all__ = [
    "Envelope",
    "Rejection",
    "SendResult",
    "Transport",
    "TransportUnavailable",
    "make_transport",
    "no_broker_configured",
]
