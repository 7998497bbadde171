"""The Kafka transport's partitioner: the default one's partitions, with the key hash remembered."""

from __future__ import annotations

from kafka.partitioner.default import DefaultPartitioner

from flywheel.sdk.transports import kafka as kafka_transport


class Cluster:
    """What a partitioner reads of kafka-python's ClusterMetadata."""

    def __init__(self, partitions: dict[str, set[int]]):
        self._partitions = partitions

    def topics(self) -> set[str]:
        return set(self._partitions)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return self._partitions.get(topic)

    def available_partitions_for_topic(self, topic: str) -> set[int]:
        return self._partitions.get(topic, set())


def test_memo_partitioner_matches_the_default_one(monkeypatch) -> None:
    monkeypatch.setattr(kafka_transport, "PARTITION_MEMO_KEYS", 50)  # also exercise starting over
    memo, default = kafka_transport._memo_partitioner(), DefaultPartitioner()
    for count in (1, 3, 4, 12):
        cluster = Cluster({"events": set(range(count))})
        for round_ in range(2):  # the second round is answered from the memo
            for i in range(120):
                key = f"session-{i}".encode()
                args = ("events", key, key, b"v", b"v", cluster)
                assert memo.partition(*args) == default.partition(*args), (count, round_, key)
    assert len(memo._hashes) <= 50


def test_memo_partitioner_without_a_key_picks_any_partition() -> None:
    cluster = Cluster({"events": {0, 1, 2}})
    assert kafka_transport._memo_partitioner().partition("events", None, None, b"v", b"v", cluster) in {0, 1, 2}
