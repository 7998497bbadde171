"""No Kafka client is made without the configured TLS and SASL.

kafka-python and aiokafka clients may be constructed only in ``flywheel/core/kafka_clients.py``
(whose factories require a ``KafkaSecurity``), and every faust app is given
``broker_credentials=`` (faust passes them to each aiokafka client it makes). The scan reads
every module of the shipped packages; a new construction anywhere else fails it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("flywheel", "ingest", "rewarding", "serving", "trainer")
FACTORY_MODULE = "flywheel/core/kafka_clients.py"
CLIENT_CLASSES = {
    "KafkaProducer",
    "KafkaConsumer",
    "KafkaAdminClient",
    "KafkaClient",
    "AIOKafkaProducer",
    "AIOKafkaConsumer",
    "AIOKafkaClient",
    "AIOKafkaAdminClient",
}


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _faust_app_classes(tree: ast.Module) -> set[str]:
    """``App`` and the module's own subclasses of ``faust.App``."""
    names = {"App"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            (isinstance(b, ast.Attribute) and b.attr == "App") or (isinstance(b, ast.Name) and b.id in names)
            for b in node.bases
        ):
            names.add(node.name)
    return names


def violations(source: str, path: str) -> list[str]:
    """Client constructions in ``source`` that could bypass the security settings."""
    tree = ast.parse(source)
    found: list[str] = []
    apps = _faust_app_classes(tree) if "faust" in source else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and path != FACTORY_MODULE:
            imported = {alias.name for alias in node.names} & CLIENT_CLASSES
            if imported and node.module and node.module.split(".")[0] in ("kafka", "aiokafka"):
                found.append(f"{path}:{node.lineno} imports {sorted(imported)} (use flywheel.core.kafka_clients)")
        if not isinstance(node, ast.Call):
            continue
        name = _called_name(node)
        if name in CLIENT_CLASSES and path != FACTORY_MODULE:
            found.append(f"{path}:{node.lineno} constructs {name} (use flywheel.core.kafka_clients)")
        if name in apps and not any(k.arg == "broker_credentials" for k in node.keywords):
            found.append(f"{path}:{node.lineno} makes a faust app ({name}) without broker_credentials=")
    return found


def test_every_kafka_client_is_made_with_the_security_settings() -> None:
    found: list[str] = []
    scanned = 0
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            rel = file.relative_to(ROOT).as_posix()
            found += violations(file.read_text(), rel)
            scanned += 1
    assert scanned > 100
    assert not found, "\n".join(found)


def test_the_scan_catches_each_kind_of_bypass() -> None:
    bad = """
from kafka import KafkaProducer
import aiokafka, faust
class MyApp(faust.App):
    pass
p = KafkaProducer(bootstrap_servers="h:1")
c = aiokafka.AIOKafkaConsumer("t")
a = faust.App("id", broker="kafka://h:1")
b = MyApp("id", broker="kafka://h:1")
ok = MyApp("id", broker="kafka://h:1", broker_credentials=None)
"""
    found = violations(bad, "somewhere.py")
    assert [f.split(" ", 1)[1] for f in found] == [
        "imports ['KafkaProducer'] (use flywheel.core.kafka_clients)",
        "constructs KafkaProducer (use flywheel.core.kafka_clients)",
        "constructs AIOKafkaConsumer (use flywheel.core.kafka_clients)",
        "makes a faust app (App) without broker_credentials=",
        "makes a faust app (MyApp) without broker_credentials=",
    ]
    assert violations("from kafka import KafkaConsumer\nKafkaConsumer()\n", FACTORY_MODULE) == []
