"""The dashboard's Kafka lag against the real broker: the ingest group's committed offsets
against the events topic's real end, also where the broker's ListOffsets answer is the base
of the last record batch (Tansu 0.6)."""

from __future__ import annotations

import uuid

import pytest
from conftest import topic_in_batches
from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from flywheel.core.contracts.topics import events_topic
from flywheel.core.settings import Settings
from serving.dashboard.api import measure_kafka_lag

pytestmark = pytest.mark.integration


def test_lag_counts_every_uncommitted_record_to_the_real_end(kafka_bootstrap: str) -> None:
    prefix, group = f"lag{uuid.uuid4().hex[:8]}", f"ingest-{uuid.uuid4().hex[:8]}"
    topic = events_topic(prefix)
    # partition 0: offsets 0, 1-3, 4-8 in three record batches; partition 1: 2 records
    topic_in_batches(kafka_bootstrap, topic, {0: (1, 3, 5), 1: (2,)})
    committer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False)
    try:
        committer.commit({TopicPartition(topic, 0): OffsetAndMetadata(4, "", -1)})
    finally:
        committer.close()
    settings = Settings(
        environment="test",
        kafka={"bootstrap_servers": kafka_bootstrap, "topic_prefix": prefix},
        ingest={"group_id": group},
    )

    lag = measure_kafka_lag(settings, timeout_s=20.0)

    # partition 0: 9 records, 4 committed; partition 1: 2 records, never committed; partition 2: empty
    assert lag["partitions"] == {"0": 5, "1": 2, "2": 0}, lag
    assert lag["value"] == 7 and lag["uncommitted_partitions"] == [1, 2], lag
