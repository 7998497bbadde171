"""How a Kafka client proves who it is and encrypts what it sends: TLS and SASL (PLAIN, SCRAM).

One :class:`KafkaSecurity` comes from the services' settings (``kafka.security_protocol``
and friends, :meth:`flywheel.core.settings.kafka.KafkaSettings.security`) or from the SDK's
(``kafka_security_protocol`` and friends). Every Kafka client Flywheel makes takes its
connection options from it: kafka-python clients through :mod:`flywheel.core.kafka_clients`
(:meth:`KafkaSecurity.kafka_python`), faust's aiokafka clients through
``rewarding.transport.broker_credentials``. One TLS context (:meth:`KafkaSecurity.ssl_context`)
serves both libraries, so they verify the broker the same way.

Stdlib and nothing else: the SDK imports this module.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
"""Kafka's ``security.protocol``: TLS or not, SASL or not."""
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
"""The SASL mechanisms Flywheel's clients speak (kafka-python's and aiokafka's names)."""

SECURITY_PROTOCOLS: tuple[str, ...] = get_args(SecurityProtocol)
SASL_MECHANISMS: tuple[str, ...] = get_args(SaslMechanism)


class KafkaSecurityError(ValueError):
    """The security settings cannot work (not recoverable: a person has to change them)."""


@dataclass(frozen=True)
class KafkaSecurity:
    """TLS and SASL options of a Kafka client, checked on creation (:class:`KafkaSecurityError`).

    ``name`` turns a field name into what the person configured (a setting and its
    environment variable), so every error names what to change.
    """

    protocol: str = "PLAINTEXT"
    """``PLAINTEXT``, ``SSL`` (TLS), ``SASL_PLAINTEXT`` (SASL without TLS) or ``SASL_SSL``."""
    sasl_mechanism: str | None = None
    """``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512``; required with a ``SASL_*`` protocol."""
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    """PEM file of the CA(s) the broker's certificate must chain to; ``None``: the system's CAs."""
    ssl_certfile: str | None = None
    """PEM client certificate (mutual TLS); may hold the private key too."""
    ssl_keyfile: str | None = None
    """PEM private key of ``ssl_certfile``, when that file does not hold it."""
    ssl_key_password: str | None = field(default=None, repr=False)
    """Password of an encrypted ``ssl_keyfile``."""
    ssl_check_hostname: bool = True
    """Whether the broker's certificate must name the host connected to (the chain is always verified)."""
    name: Callable[[str], str] = field(default=str, repr=False, compare=False)
    """Turns a field name into what the person set (default: the field name itself)."""
    hint: str = field(default="", repr=False, compare=False)
    """Where those settings are set, added to an error (e.g. their environment variables)."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            hint = f" ({self.hint})" if self.hint else ""
            raise KafkaSecurityError(f"Kafka security settings{hint}: " + "; ".join(problems))

    @property
    def tls(self) -> bool:
        """Whether connections are encrypted (``SSL`` or ``SASL_SSL``)."""
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def sasl(self) -> bool:
        """Whether clients authenticate with SASL (``SASL_PLAINTEXT`` or ``SASL_SSL``)."""
        return self.protocol in ("SASL_PLAINTEXT", "SASL_SSL")

    def problems(self) -> list[str]:
        """Everything that keeps these settings from working, each naming the setting to change."""
        n = self.name
        if self.protocol not in SECURITY_PROTOCOLS:
            return [f"{n('security_protocol')} is {self.protocol!r}; expected one of {', '.join(SECURITY_PROTOCOLS)}"]
        out: list[str] = []
        if self.sasl:
            if self.sasl_mechanism is None:
                out.append(
                    f"{n('sasl_mechanism')} is required with {n('security_protocol')}={self.protocol}"
                    f" (one of {', '.join(SASL_MECHANISMS)})"
                )
            elif self.sasl_mechanism not in SASL_MECHANISMS:
                out.append(
                    f"{n('sasl_mechanism')} is {self.sasl_mechanism!r}; expected one of {', '.join(SASL_MECHANISMS)}"
                )
            for what, value in (("sasl_username", self.sasl_username), ("sasl_password", self.sasl_password)):
                if not value:
                    out.append(f"{n(what)} is required with {n('security_protocol')}={self.protocol}")
        else:
            for what, value in (
                ("sasl_mechanism", self.sasl_mechanism),
                ("sasl_username", self.sasl_username),
                ("sasl_password", self.sasl_password),
            ):
                if value:
                    out.append(
                        f"{n(what)} is set but {n('security_protocol')} is {self.protocol}, which does not use"
                        " SASL: set it to SASL_SSL or SASL_PLAINTEXT"
                    )
        files = (
            ("ssl_cafile", self.ssl_cafile),
            ("ssl_certfile", self.ssl_certfile),
            ("ssl_keyfile", self.ssl_keyfile),
        )
        for what, value in files:
            if value is None:
                continue
            if not self.tls:
                out.append(
                    f"{n(what)} is set but {n('security_protocol')} is {self.protocol}, which does not use TLS:"
                    " set it to SSL or SASL_SSL"
                )
            elif not Path(value).is_file():
                out.append(f"{n(what)}: no file at {value}")
        if self.tls and self.ssl_keyfile and not self.ssl_certfile:
            out.append(f"{n('ssl_keyfile')} is set without {n('ssl_certfile')}, the certificate it belongs to")
        if self.ssl_key_password and not (self.ssl_certfile or self.ssl_keyfile):
            out.append(f"{n('ssl_key_password')} is set without a key ({n('ssl_keyfile')} or {n('ssl_certfile')})")
        return out

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS client context: TLS 1.2 or later, the broker's chain verified against ``ssl_cafile`` (or
        the system's CAs), its host name checked unless ``ssl_check_hostname`` is off, the client
        certificate loaded when one is given. A key that does not load raises :class:`KafkaSecurityError`."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = self.ssl_check_hostname
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            if self.ssl_cafile:
                ctx.load_verify_locations(cafile=self.ssl_cafile)
            else:
                ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
            if self.ssl_certfile:
                ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile, self.ssl_key_password)
        except (ssl.SSLError, OSError) as err:
            files = ", ".join(
                f"{self.name(k)}={v}"
                for k, v in (
                    ("ssl_cafile", self.ssl_cafile),
                    ("ssl_certfile", self.ssl_certfile),
                    ("ssl_keyfile", self.ssl_keyfile),
                )
                if v
            )
            raise KafkaSecurityError(f"Kafka TLS files do not load ({files}): {err}") from err
        return ctx

    def kafka_python(self) -> dict[str, Any]:
        """Keyword arguments of kafka-python's ``KafkaProducer``, ``KafkaConsumer`` and ``KafkaAdminClient``."""
        out: dict[str, Any] = {"security_protocol": self.protocol}
        if self.tls:
            out["ssl_context"] = self.ssl_context()
        if self.sasl:
            out |= {
                "sasl_mechanism": self.sasl_mechanism,
                "sasl_plain_username": self.sasl_username,
                "sasl_plain_password": self.sasl_password,
            }
        return out

    def describe(self) -> str:
        """One line for logs and health answers: the protocol and mechanism, never a secret."""
        parts = [self.protocol]
        if self.sasl:
            parts.append(f"{self.sasl_mechanism} as {self.sasl_username}")
        if self.tls:
            parts.append(f"CA {self.ssl_cafile or 'system'}")
            if self.ssl_certfile:
                parts.append(f"client certificate {self.ssl_certfile}")
            if not self.ssl_check_hostname:
                parts.append("host name not checked")
        return ", ".join(parts)


PLAINTEXT = KafkaSecurity()
"""No TLS, no SASL: a local broker (the development stack's Tansu, tests)."""


def service_setting_name(field_name: str) -> str:
    """How the services' settings name a security field: ``kafka.<field>``."""
    return f"kafka.{field_name}"


SERVICE_HINT = "kafka.<setting> is the environment variable FLYWHEEL_KAFKA__<SETTING>"


def sdk_setting_name(field_name: str) -> str:
    """How the SDK names a security field: ``kafka_<field>``."""
    return f"kafka_{field_name}"


SDK_HINT = "kafka_<setting> is Flywheel(kafka_<setting>=...) or the environment variable FLYWHEEL_KAFKA_<SETTING>"
