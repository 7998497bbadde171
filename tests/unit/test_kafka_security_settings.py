"""Kafka TLS and SASL settings: their checks, and what kafka-python, faust (aiokafka) and the SDK get."""

from __future__ import annotations

import ssl
from pathlib import Path

import certifi
import pytest
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth
from pydantic import ValidationError

from flywheel.core.kafka_clients import BrokerUnreachable, _options
from flywheel.core.kafka_security import PLAINTEXT, KafkaSecurity, KafkaSecurityError, sdk_setting_name
from flywheel.core.settings import Settings
from flywheel.core.settings.kafka import KafkaSettings
from flywheel.sdk.settings import SdkSettings
from flywheel.sdk.transports import make_transport
from rewarding.transport import broker_credentials

CA = certifi.where()
"""A real PEM bundle of CA certificates."""
SCRAM = {"protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "u", "sasl_password": "p"}


def problems(**fields) -> str:
    with pytest.raises(KafkaSecurityError) as caught:
        KafkaSecurity(**fields)
    return str(caught.value)


def test_plaintext_is_the_default_and_adds_nothing_but_the_protocol() -> None:
    assert KafkaSecurity() == PLAINTEXT
    assert PLAINTEXT.kafka_python() == {"security_protocol": "PLAINTEXT"}
    assert broker_credentials(PLAINTEXT) is None
    assert credentials_to_aiokafka_auth(broker_credentials(PLAINTEXT)) == {"security_protocol": "PLAINTEXT"}


def test_sasl_ssl_scram_maps_to_kafka_python_with_a_verifying_tls_context() -> None:
    options = KafkaSecurity(**SCRAM, ssl_cafile=CA).kafka_python()
    context = options.pop("ssl_context")
    assert options == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "u",
        "sasl_plain_password": "p",
    }
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert context.cert_store_stats()["x509_ca"] > 10  # the CA file was loaded


def test_sasl_plaintext_has_no_tls_context_and_ssl_alone_no_sasl() -> None:
    sasl = KafkaSecurity(protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p")
    assert "ssl_context" not in sasl.kafka_python() and sasl.kafka_python()["sasl_mechanism"] == "PLAIN"
    tls = KafkaSecurity(protocol="SSL", ssl_check_hostname=False).kafka_python()
    assert set(tls) == {"security_protocol", "ssl_context"} and tls["security_protocol"] == "SSL"
    assert tls["ssl_context"].check_hostname is False and tls["ssl_context"].verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("protocol", "mechanism", "expected"),
    [
        ("SASL_SSL", "SCRAM-SHA-256", "SASL_SSL"),
        ("SASL_PLAINTEXT", "SCRAM-SHA-512", "SASL_PLAINTEXT"),
        ("SASL_SSL", "PLAIN", "SASL_SSL"),
    ],
)
def test_faust_credentials_become_the_same_aiokafka_options(protocol: str, mechanism: str, expected: str) -> None:
    security = KafkaSecurity(protocol=protocol, sasl_mechanism=mechanism, sasl_username="u", sasl_password="p")
    auth = credentials_to_aiokafka_auth(broker_credentials(security))
    assert (auth["security_protocol"], auth["sasl_mechanism"]) == (expected, mechanism)
    assert (auth["sasl_plain_username"], auth["sasl_plain_password"]) == ("u", "p")
    assert (auth["ssl_context"] is not None) == (protocol == "SASL_SSL")


def test_faust_tls_alone() -> None:
    auth = credentials_to_aiokafka_auth(broker_credentials(KafkaSecurity(protocol="SSL", ssl_cafile=CA)))
    assert auth["security_protocol"] == "SSL" and auth["ssl_context"].verify_mode == ssl.CERT_REQUIRED


def test_sasl_needs_a_mechanism_a_user_and_a_password() -> None:
    said = problems(protocol="SASL_SSL")
    for name in ("sasl_mechanism is required", "sasl_username is required", "sasl_password is required"):
        assert name in said
    assert "PLAIN, SCRAM-SHA-256, SCRAM-SHA-512" in said


def test_unknown_protocol_and_mechanism_are_named() -> None:
    assert "security_protocol is 'TLS'" in problems(protocol="TLS")
    assert "sasl_mechanism is 'GSSAPI'; expected one of PLAIN" in problems(**{**SCRAM, "sasl_mechanism": "GSSAPI"})


def test_settings_that_the_protocol_would_ignore_are_refused() -> None:
    assert "sasl_username is set but security_protocol is SSL" in problems(protocol="SSL", sasl_username="u")
    said = problems(
        protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p", ssl_cafile=CA
    )
    assert "ssl_cafile is set but security_protocol is SASL_PLAINTEXT, which does not use TLS" in said


def test_tls_files_must_exist_and_load(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    assert f"ssl_cafile: no file at {missing}" in problems(protocol="SSL", ssl_cafile=missing)
    assert "ssl_keyfile is set without ssl_certfile" in problems(protocol="SSL", ssl_keyfile=CA)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    security = KafkaSecurity(protocol="SSL", ssl_cafile=str(garbage))
    with pytest.raises(KafkaSecurityError, match=f"Kafka TLS files do not load \\(ssl_cafile={garbage}\\)"):
        security.ssl_context()


def test_describe_and_repr_never_show_a_secret() -> None:
    security = KafkaSecurity(**SCRAM | {"sasl_password": "hunter2"}, ssl_cafile=CA)
    assert "hunter2" not in repr(security) and "hunter2" not in security.describe()
    assert security.describe() == f"SASL_SSL, SCRAM-SHA-512 as u, CA {CA}"


def test_a_client_option_cannot_override_the_security() -> None:
    with pytest.raises(TypeError, match="security options come from the KafkaSecurity argument"):
        _options("h:1", PLAINTEXT, {"security_protocol": "SSL"})
    assert _options("a:1, b:2", PLAINTEXT, {"acks": "all"}) == {
        "bootstrap_servers": ["a:1", "b:2"],
        "acks": "all",
        "security_protocol": "PLAINTEXT",
    }


def test_unreachable_broker_error_names_the_settings_to_check() -> None:
    security = KafkaSecurity(**SCRAM, name=sdk_setting_name)
    refused = BrokerUnreachable(["h:1"], security, "[Error 58] SaslAuthenticationFailedError: Authentication failed")
    assert refused.misconfigured
    assert "SaslAuthenticationFailedError" in str(refused) and "check kafka_sasl_username, kafka_sasl_password" in str(
        refused
    )
    cert = BrokerUnreachable(["h:1"], security, "Handshake failed: [SSL: CERTIFICATE_VERIFY_FAILED]")
    assert cert.misconfigured and "check kafka_ssl_cafile" in str(cert)
    down = BrokerUnreachable(["h:1"], security, "[Errno 111] Connection refused")
    assert not down.misconfigured and "no Kafka broker at h:1 answered (SASL_SSL" in str(down)


def test_service_settings_from_the_environment(monkeypatch) -> None:
    for name, value in {
        "SECURITY_PROTOCOL": "SASL_SSL",
        "SASL_MECHANISM": "SCRAM-SHA-256",
        "SASL_USERNAME": "svc",
        "SASL_PASSWORD": "pw",
        "SSL_CAFILE": CA,
        "SSL_CHECK_HOSTNAME": "false",
    }.items():
        monkeypatch.setenv(f"FLYWHEEL_KAFKA__{name}", value)
    security = Settings().kafka.security()
    assert (security.protocol, security.sasl_mechanism, security.sasl_username) == ("SASL_SSL", "SCRAM-SHA-256", "svc")
    assert security.sasl_password == "pw" and security.ssl_cafile == CA and not security.ssl_check_hostname


def test_service_settings_errors_name_the_setting_and_hide_the_password(monkeypatch) -> None:
    monkeypatch.setenv("FLYWHEEL_KAFKA__SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("FLYWHEEL_KAFKA__SASL_PASSWORD", "hunter2-secret")
    with pytest.raises(ValidationError) as caught:
        Settings()
    said = str(caught.value)
    assert "kafka.sasl_username is required with kafka.security_protocol=SASL_SSL" in said
    assert "FLYWHEEL_KAFKA__<SETTING>" in said and "hunter2" not in said
    monkeypatch.setenv("FLYWHEEL_KAFKA__SASL_MECHANISM", "GSSAPI")
    with pytest.raises(ValidationError, match=r"kafka.sasl_mechanism\n  Input should be 'PLAIN', 'SCRAM-SHA-256'"):
        Settings()


def test_sdk_takes_the_same_options_as_keyword_arguments() -> None:
    settings = SdkSettings(
        kafka_bootstrap="h:1",
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="SCRAM-SHA-512",
        kafka_sasl_username="agent",
        kafka_sasl_password="pw",
        kafka_ssl_cafile=CA,
    )
    transport = make_transport(settings)
    assert transport.security == KafkaSecurity(
        **SCRAM | {"sasl_username": "agent", "sasl_password": "pw"}, ssl_cafile=CA
    )


def test_sdk_reads_them_from_its_environment_and_names_its_own_settings(monkeypatch) -> None:
    monkeypatch.setenv("FLYWHEEL_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("FLYWHEEL_KAFKA_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("FLYWHEEL_KAFKA_SASL_USERNAME", "agent")
    with pytest.raises(ValueError) as caught:  # pydantic's ValidationError is a ValueError: Flywheel() raises it
        SdkSettings(kafka_bootstrap="h:1")
    said = str(caught.value)
    assert "kafka_sasl_password is required with kafka_security_protocol=SASL_PLAINTEXT" in said
    assert "FLYWHEEL_KAFKA_<SETTING>" in said
    monkeypatch.setenv("FLYWHEEL_KAFKA_SASL_PASSWORD", "pw")
    security = SdkSettings(kafka_bootstrap="h:1").kafka_security()
    assert (security.protocol, security.sasl_username, security.sasl_password) == ("SASL_PLAINTEXT", "agent", "pw")
    monkeypatch.delenv("FLYWHEEL_KAFKA_SASL_PASSWORD")
    assert SdkSettings(transport="http").transport == "http"  # Kafka's settings are not checked for HTTP


def test_rewarding_workers_faust_clients_get_the_security(tmp_path: Path) -> None:
    """The worker's aiokafka consumer and producer are made with the settings' SASL and TLS (nothing connects)."""
    from rewarding.app import RewardingApp
    from rewarding.scorer import Scorer
    from rewarding.topics import Topics

    kafka = KafkaSettings(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-256",
        sasl_username="rw",
        sasl_password="pw",
        ssl_cafile=CA,
    )
    settings = Settings(run_dir=tmp_path, kafka=kafka)
    scorer = Scorer.from_settings(settings.rewarding, lambda: "http://127.0.0.1:1")
    worker = RewardingApp(settings, "127.0.0.1:1", "postgresql+psycopg://x@127.0.0.1:1/x", scorer, Topics("a", "b", 2))

    async def make_consumer():  # aiokafka makes its clients inside a running loop
        return worker.app.consumer._thread._create_worker_consumer(worker.app.transport)

    consumer = worker.app.loop.run_until_complete(make_consumer())
    assert (consumer._client._security_protocol, consumer._client._sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-256")
    assert consumer._client._sasl_plain_username == "rw" and consumer._client._ssl_context is not None
    producer_auth = worker.app.producer._settings_auth()
    assert producer_auth["security_protocol"] == "SASL_SSL" and producer_auth["sasl_plain_password"] == "pw"
    assert worker.app.transport.security == kafka.security()  # what changelog recovery's reads use
