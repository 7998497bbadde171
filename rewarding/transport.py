"""faust's aiokafka transport with a bounded fetch wait.

faust 0.15.3 creates its aiokafka consumer with ``fetch_max_wait_ms=1500`` and no setting
to change it. A Kafka broker answers a waiting fetch as soon as records arrive, so the
value only matters on an idle topic; Tansu 0.6 holds the fetch for the full wait even when
records arrive meanwhile (measured here: produce-to-consume 0.65 s at 1500 ms, 0.16 s at
500 ms, 5 ms at 100 ms). A worker that keeps up with its topic therefore saw every record
up to 1.5 s late, and consumed in bursts. :class:`Transport` gives the consumer
``RewardingSettings.fetch_max_wait_s`` instead (idle cost: one fetch per that interval).

Installed with ``app.transport = Transport(...)`` (faust's public setter) before anything
creates the consumer; the wait is set on the consumer before it starts, through
aiokafka's ``_fetch_max_wait_ms`` (the value it passes to its fetcher at start; checked
against aiokafka 0.14).
"""

from __future__ import annotations

from typing import Any

import aiokafka
from faust.transport.drivers import aiokafka as faust_aiokafka


class ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """faust's consumer thread, its aiokafka consumer given the transport's fetch wait."""

    def _create_worker_consumer(self, transport: Any) -> aiokafka.AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        if not hasattr(consumer, "_fetch_max_wait_ms"):
            raise RuntimeError("this aiokafka keeps its fetch wait elsewhere; rewarding.transport needs updating")
        consumer._fetch_max_wait_ms = transport.fetch_max_wait_ms
        return consumer


class Consumer(faust_aiokafka.Consumer):
    """faust's aiokafka consumer with :class:`ConsumerThread`."""

    def _new_consumer_thread(self) -> ConsumerThread:
        return ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class Transport(faust_aiokafka.Transport):
    """faust's aiokafka transport whose consumer waits at most ``fetch_max_wait_s`` per fetch."""

    Consumer = Consumer

    def __init__(self, url: Any, app: Any, *args: Any, fetch_max_wait_s: float, **kwargs: Any):
        super().__init__(url, app, *args, **kwargs)
        self.fetch_max_wait_ms = max(1, int(fetch_max_wait_s * 1000))
