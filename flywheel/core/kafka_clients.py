"""The only place Flywheel constructs kafka-python clients: each with the configured TLS and SASL.

Every producer, consumer and admin client of the services and the SDK comes from
:func:`producer`, :func:`consumer` or :func:`admin`, which take the security options
(:class:`~flywheel.core.kafka_security.KafkaSecurity`) as a required argument, so no client
can reach a managed broker without them (``tests/unit/test_kafka_client_sites.py`` fails on
a client constructed anywhere else). faust's clients get the same options from
``rewarding.transport.broker_credentials``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient
from kafka.errors import KafkaTimeoutError

from flywheel.core.kafka_security import KafkaSecurity

__all__ = ["BrokerUnreachable", "admin", "bootstrap_list", "consumer", "producer"]

C = TypeVar("C")

_CONNECT_ERROR = re.compile(
    r"(?:Connection lost|Connection failed|Bootstrap connection to \S+ failed): "
    r"(?P<why>.+?)(?: \(backoff [\d.]+ secs\))?$"
)
"""kafka-python's log lines that say why a connection to a broker failed (it raises only a timeout)."""


class BrokerUnreachable(KafkaTimeoutError):
    """No broker could be reached within the bootstrap timeout; says why when kafka-python logged it
    (a refused connection, a certificate that does not verify, SASL credentials the broker refused)."""

    def __init__(self, servers: list[str], security: KafkaSecurity, why: str | None):
        n = security.name
        hint = ""
        self.misconfigured = False
        """Whether the broker answered but refused these settings (credentials, certificate): retrying
        cannot help, a person has to change them."""
        if why and ("SaslAuthenticationFailed" in why or "UnsupportedSaslMechanism" in why):
            self.misconfigured = True
            hint = f"; check {n('sasl_username')}, {n('sasl_password')} and {n('sasl_mechanism')}"
        elif why and ("CERTIFICATE_VERIFY_FAILED" in why or "SSL" in why or "Handshake failed" in why):
            self.misconfigured = True
            hint = (
                f"; check {n('ssl_cafile')} (the CA that signed the broker's certificate) and {n('ssl_check_hostname')}"
            )
        elif why and "socket disconnected" in why and security.protocol in ("PLAINTEXT", "SASL_PLAINTEXT"):
            hint = f"; a broker that wants TLS drops plaintext connections: check {n('security_protocol')}"
        reason = f": {why}" if why else ""
        super().__init__(f"no Kafka broker at {','.join(servers)} answered ({security.describe()}){reason}{hint}")


class _LastConnectError(logging.Handler):
    """Keeps the last connection failure that kafka-python logs while a client is being made."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.why: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        match = _CONNECT_ERROR.search(record.getMessage())
        if match and not (self.why and "socket disconnected" in match["why"]):  # keep the more telling one
            self.why = match["why"]


def bootstrap_list(bootstrap: str | Sequence[str]) -> list[str]:
    """``host:port[,host:port]`` (or a list of them) as the list kafka-python takes."""
    if isinstance(bootstrap, str):
        return [b.strip() for b in bootstrap.split(",") if b.strip()]
    return list(bootstrap)


def _options(bootstrap: str | Sequence[str], security: KafkaSecurity, config: dict[str, Any]) -> dict[str, Any]:
    clashing = sorted(k for k in config if k == "security_protocol" or k.startswith(("ssl_", "sasl_")))
    if clashing:
        raise TypeError(f"security options come from the KafkaSecurity argument, not {clashing}")
    return {"bootstrap_servers": bootstrap_list(bootstrap), **config, **security.kafka_python()}


def _made(make: Callable[..., C], options: dict[str, Any], security: KafkaSecurity) -> C:
    """``make(**options)``; a bootstrap timeout becomes :class:`BrokerUnreachable`, saying why."""
    watch = _LastConnectError()
    logger = logging.getLogger("kafka")
    logger.addHandler(watch)
    try:
        return make(**options)
    except KafkaTimeoutError as err:
        raise BrokerUnreachable(options["bootstrap_servers"], security, watch.why) from err
    finally:
        logger.removeHandler(watch)


def producer(bootstrap: str | Sequence[str], *, security: KafkaSecurity, **config: Any) -> KafkaProducer:
    """A ``KafkaProducer`` on ``bootstrap`` with ``security``'s TLS/SASL and kafka-python ``config``."""
    return _made(KafkaProducer, _options(bootstrap, security, config), security)


def consumer(bootstrap: str | Sequence[str], *topics: str, security: KafkaSecurity, **config: Any) -> KafkaConsumer:
    """A ``KafkaConsumer`` on ``bootstrap`` (subscribed to ``topics``, if any) with ``security``'s TLS/SASL."""
    return _made(lambda **options: KafkaConsumer(*topics, **options), _options(bootstrap, security, config), security)


def admin(bootstrap: str | Sequence[str], *, security: KafkaSecurity, **config: Any) -> KafkaAdminClient:
    """A ``KafkaAdminClient`` on ``bootstrap`` with ``security``'s TLS/SASL and kafka-python ``config``."""
    return _made(KafkaAdminClient, _options(bootstrap, security, config), security)
