"""Create and check the ingest topics: the events topic and its dead-letter topic.

Both are keyed by session id (so one session's events stay in one partition, in order) and
get their partition count, replication factor and retention from :class:`IngestSettings`, and
``max.message.bytes`` from ``kafka.max_record_bytes`` (so the largest event fits; Tansu 0.6
accepts the setting and enforces no record size at all).
An existing topic is never altered: a partition count that differs from the settings is
reported, because changing it would move sessions to other partitions mid-stream.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import KafkaError

from flywheel.core import kafka_clients
from flywheel.core.contracts.topics import dead_letter_topic, events_topic
from flywheel.core.settings import Settings
from ingest.limits import check_record_limit

log = logging.getLogger(__name__)

RETENTION_KEY = "retention.ms"
MAX_MESSAGE_KEY = "max.message.bytes"


@dataclass(frozen=True)
class TopicSpec:
    """What a topic should look like."""

    name: str
    partitions: int
    replication_factor: int
    retention_ms: int
    max_message_bytes: int


@dataclass
class TopicStatus:
    """What was found (and done) for one topic."""

    spec: TopicSpec
    created: bool = False
    partitions: int | None = None
    retention_ms: int | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Exists and matches its spec as far as the broker tells."""
        return self.partitions is not None and not self.problems


def topic_specs(settings: Settings) -> list[TopicSpec]:
    """The events topic and its dead-letter topic, as the settings want them."""
    ingest = settings.ingest
    retention_ms = ingest.retention_hours * 3_600_000
    prefix = settings.kafka.topic_prefix
    record = check_record_limit(settings)
    return [
        TopicSpec(events_topic(prefix), ingest.partitions, ingest.replication_factor, retention_ms, record),
        TopicSpec(dead_letter_topic(prefix), ingest.partitions, ingest.replication_factor, retention_ms, record),
    ]


def ensure_topics(settings: Settings, bootstrap: str, *, create: bool = True) -> list[TopicStatus]:
    """Create the missing ingest topics (when ``create``) and check every one against its spec."""
    specs = topic_specs(settings)
    admin = kafka_clients.admin(bootstrap, security=settings.kafka.security(), client_id="flywheel-ingest-topics")
    try:
        statuses = {spec.name: TopicStatus(spec) for spec in specs}
        if create:
            _create_missing(admin, specs, statuses)
        _check_partitions(admin, statuses)
        _check_retention(admin, statuses)
    finally:
        admin.close()
    for status in statuses.values():
        for problem in status.problems:
            log.warning("topic %s: %s", status.spec.name, problem)
    return list(statuses.values())


def _create_missing(admin, specs: list[TopicSpec], statuses: dict[str, TopicStatus]) -> None:
    existing = set(admin.list_topics())
    wanted = {
        spec.name: {
            "num_partitions": spec.partitions,
            "replication_factor": spec.replication_factor,
            "configs": {RETENTION_KEY: str(spec.retention_ms), MAX_MESSAGE_KEY: str(spec.max_message_bytes)},
        }
        for spec in specs
        if spec.name not in existing
    }
    if not wanted:
        return
    response = admin.create_topics(wanted, raise_errors=False, wait_for_metadata=True)
    for result in response["topics"]:
        status = statuses[result["name"]]
        if result["error_code"] == 0:
            status.created = True
            status.retention_ms = status.spec.retention_ms
            log.info("created topic %s (%d partitions)", result["name"], status.spec.partitions)
        elif result["error_code"] != 36:  # 36: created meanwhile by a concurrent starter
            status.problems.append(f"could not be created: {result['error_message'] or result['error_code']}")


def _check_partitions(admin, statuses: dict[str, TopicStatus]) -> None:
    found = {t["name"]: t for t in admin.describe_topics(list(statuses)) if t["error_code"] == 0}
    for name, status in statuses.items():
        topic = found.get(name)
        if topic is None:
            status.problems.append("does not exist")
            continue
        status.partitions = len(topic["partitions"])
        if status.partitions != status.spec.partitions:
            status.problems.append(
                f"has {status.partitions} partitions, settings say {status.spec.partitions} "
                "(left as is: repartitioning would reorder sessions in flight)"
            )


def _check_retention(admin, statuses: dict[str, TopicStatus]) -> None:
    """Compare retention and the record size limit where the broker reports them (Tansu does not
    answer DescribeConfigs)."""
    names = [name for name, status in statuses.items() if status.partitions is not None and not status.created]
    if not names:
        return
    try:
        with _quiet("kafka"):  # a broker without DescribeConfigs drops the connection: a note, not an error
            answer = admin.describe_configs(
                [
                    ConfigResource(ConfigResourceType.TOPIC, name, {RETENTION_KEY: None, MAX_MESSAGE_KEY: None})
                    for name in names
                ]
            )
    except KafkaError as err:
        for name in names:
            statuses[name].notes.append(f"retention not checked: the broker did not describe configs ({err})")
        return
    for name in names:
        entry = _config_value(answer, name, RETENTION_KEY)
        status = statuses[name]
        if entry is None:
            status.notes.append("retention not reported by the broker")
            continue
        status.retention_ms = int(entry)
        if status.retention_ms != status.spec.retention_ms:
            status.problems.append(f"retention is {status.retention_ms} ms, settings say {status.spec.retention_ms} ms")
        largest = _config_value(answer, name, MAX_MESSAGE_KEY)
        if largest is not None and int(largest) < status.spec.max_message_bytes:
            status.problems.append(
                f"{MAX_MESSAGE_KEY} is {largest}, below kafka.max_record_bytes = {status.spec.max_message_bytes}: "
                f"the largest events would be refused (raise the topic's {MAX_MESSAGE_KEY})"
            )


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Silence a logger below CRITICAL for the duration."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _config_value(answer: dict, topic: str, key: str) -> str | None:
    """``value`` of ``key`` in a describe_configs answer ``{type: {name: {key: {value: ...}}}}``."""
    for by_name in answer.values():
        config = by_name.get(topic, {}).get(key)
        if isinstance(config, dict):
            return config.get("value")
        if config is not None:
            return str(config)
    return None
