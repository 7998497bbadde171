"""The topics rewarding reads and writes: created when missing, partition counts read back.

The faust table over the events topic must have exactly the topic's partition count (its
changelog is co-partitioned with it), so the worker declares the count it finds here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from flywheel.core import kafka_clients
from flywheel.core.contracts.topics import events_topic, scored_topic
from flywheel.core.settings import Settings


@dataclass(frozen=True)
class Topics:
    """Names and partition counts."""

    events: str
    scored: str
    partitions: int
    """Partitions of the events topic (the scored topic is created with the same count)."""


def ensure_topics(settings: Settings, bootstrap: str) -> Topics:
    """Create the events and scored topics if missing; the events topic's real partition count."""
    prefix = settings.kafka.topic_prefix
    names = (events_topic(prefix), scored_topic(prefix))
    admin = kafka_clients.admin(bootstrap, security=settings.kafka.security(), client_id="flywheel-rewarding-topics")
    try:
        existing = set(admin.list_topics())
        for name in names:
            if name in existing:
                continue
            topic = NewTopic(name, settings.ingest.partitions, settings.ingest.replication_factor)
            try:
                admin.create_topics([topic])
            except TopicAlreadyExistsError:
                pass
        partitions = _partitions(admin, names[0])
    finally:
        admin.close()
    return Topics(events=names[0], scored=names[1], partitions=partitions)


def _partitions(admin, name: str, attempts: int = 20) -> int:
    """The partition count of ``name`` (a just-created topic may need a moment to report them)."""
    for _ in range(attempts):
        described = admin.describe_topics([name])
        if described and described[0]["partitions"]:
            return len(described[0]["partitions"])
        time.sleep(0.1)
    raise RuntimeError(f"topic {name} reports no partitions")
