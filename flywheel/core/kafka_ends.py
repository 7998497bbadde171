"""The real end offset of Kafka partitions, also where the broker's ListOffsets answer is wrong.

Tansu 0.6 answers ListOffsets(latest) with the base offset of a partition's *last record
batch* plus one, not its last offset plus one (batches of 1, 3 and 5 records at offsets 0,
1-3 and 4-8 report an end of 5, not 9). Fetch responses carry the right high watermark. So
each non-empty partition is fetched once from (reported end - 1), and its end is the largest
of the reported end, the fetch's high watermark and the last fetched offset + 1. Against
Apache Kafka that is the ListOffsets answer itself, at the cost of one small fetch per
partition.

Used by rewarding's table recovery (``rewarding.changelog``) and the dashboard's Kafka lag
(``serving.dashboard.api``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from kafka import TopicPartition

from flywheel.core import kafka_clients
from flywheel.core.kafka_security import KafkaSecurity

log = logging.getLogger(__name__)

K = TypeVar("K")
"""A topic-partition (kafka-python's or faust's): anything with ``topic`` and ``partition``."""


def fetched_ends(
    bootstrap: Sequence[str],
    reported: Mapping[K, int | None],
    timeout_s: float,
    *,
    security: KafkaSecurity,
    **client: Any,
) -> dict[K, int]:
    """The real end offset of each partition, from one fetch at (reported end - 1).

    ``reported``: the ListOffsets answer per partition (e.g. ``KafkaConsumer.end_offsets``).
    A partition that returns nothing within ``timeout_s`` keeps its reported end (logged).
    ``security``: the broker's TLS/SASL options; ``client``: more settings of the kafka-python
    consumer used for the fetch.
    """
    ends = {tp: end or 0 for tp, end in reported.items()}
    wanted = {TopicPartition(tp.topic, tp.partition): tp for tp, end in ends.items() if end > 0}
    if not wanted:
        return ends
    consumer = kafka_clients.consumer(
        bootstrap,
        security=security,
        group_id=None,
        enable_auto_commit=False,
        **{"client_id": "flywheel-end-offsets", **client},
    )
    try:
        consumer.assign(list(wanted))
        for ktp, tp in wanted.items():
            consumer.seek(ktp, ends[tp] - 1)
        pending = set(wanted)
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for ktp, records in consumer.poll(timeout_ms=200).items():
                tp = wanted[ktp]
                highwater = consumer.highwater(ktp) or 0
                last = records[-1].offset + 1 if records else 0
                ends[tp] = max(ends[tp], highwater, last)
                pending.discard(ktp)
        if pending:
            log.warning(
                "could not fetch the end of partitions %s within %.0fs; keeping the broker's ListOffsets",
                sorted(f"{t.topic}[{t.partition}]" for t in pending),
                timeout_s,
            )
    finally:
        consumer.close()
    return ends
