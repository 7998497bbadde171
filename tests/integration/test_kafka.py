"""kafka-python against the stack's broker: keyed produce, group consume, offset commit."""

from __future__ import annotations

import json
import uuid

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from flywheel.core.contracts.ids import uuid7

pytestmark = pytest.mark.integration

GROUP_TIMEOUTS = {
    # Tansu's first group join waits for the rebalance timeout, which kafka-python takes
    # from max_poll_interval_ms: keep it small so the test does not wait minutes.
    "max_poll_interval_ms": 6000,
    "session_timeout_ms": 6000,
    "heartbeat_interval_ms": 1000,
    "request_timeout_ms": 10000,
}


def _topic(bootstrap: str, partitions: int = 3) -> str:
    name = f"test-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    finally:
        admin.close()
    return name


def _consumer(bootstrap: str, topic: str, group: str) -> KafkaConsumer:
    return KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        key_deserializer=lambda b: b.decode(),
        value_deserializer=lambda b: json.loads(b),
        **GROUP_TIMEOUTS,
    )


def _poll(consumer: KafkaConsumer, want: int, timeout_s: float = 30.0) -> list:
    import time

    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            got.extend(records)
    return got


def test_keyed_record_roundtrip_through_a_group_with_committed_offset(kafka_bootstrap):
    topic = _topic(kafka_bootstrap)
    session_id = str(uuid7())
    producer = KafkaProducer(
        bootstrap_servers=kafka_bootstrap,
        acks="all",
        key_serializer=str.encode,
        value_serializer=lambda v: json.dumps(v).encode(),
    )
    metadata = [
        producer.send(topic, key=session_id, value={"session_id": session_id, "seq": i}).get(timeout=10)
        for i in range(3)
    ]
    producer.flush()
    assert len({m.partition for m in metadata}) == 1  # one key, one partition: per-session order holds
    partition = TopicPartition(topic, metadata[0].partition)

    group = f"group-{uuid.uuid4().hex[:8]}"
    consumer = _consumer(kafka_bootstrap, topic, group)
    try:
        records = _poll(consumer, want=3)
        assert [(r.key, r.value["seq"]) for r in records] == [(session_id, 0), (session_id, 1), (session_id, 2)]
        consumer.commit()
        assert consumer.committed(partition) == metadata[-1].offset + 1
    finally:
        consumer.close()

    # A new member of the same group resumes after the committed offset.
    producer.send(topic, key=session_id, value={"session_id": session_id, "seq": 3}).get(timeout=10)
    producer.close()
    consumer = _consumer(kafka_bootstrap, topic, group)
    try:
        records = _poll(consumer, want=1)
        assert [r.value["seq"] for r in records] == [3]
    finally:
        consumer.close()
