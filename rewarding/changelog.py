"""The tables' changelogs: written before the events that caused them are acked, and read to
their real end when a worker recovers. Together these make "a SIGKILLed worker loses no
session" hold: an event's offset is committed only after its state is in the changelog,
and a restarted worker restores every changelog record there is.

**Written before acked** (:class:`ChangelogTable`). faust commits an offset once its event
is acked, after ``producer.flush()``; but that flush gives up on faust's own produce buffer
when no record leaves it for 0.1 s (a busy loop, a full aiokafka batch), so an offset
could be committed while the changelog records of its events were still in memory. The
agent therefore takes its events unacked and acks each batch only when the broker has
acknowledged the changelog records that batch caused (in the background, so the next
batch is applied meanwhile).

**Read to the real end** (:class:`ChangelogEndRecovery`). faust restores a table by
reading its changelog partitions up to their "highwater" (the ListOffsets answer for the
latest offset, minus one) and then pauses them: a record past that point is never
applied. Tansu 0.6 answers ListOffsets with the base offset of the partition's *last
record batch* plus one, not its last offset plus one (seen here: batches of 1, 3, 1 and 5
records at offsets 0, 1-3, 4 and 5-9 report ends 1, 2, 5 and 6). Table writes reach the
changelog in batches, so a restarted worker stopped at the first record of the last batch
and silently lacked the states in the rest of it, while the offsets of those sessions'
events were committed: the sessions were lost (the restart test missed 5 of 300 that way,
about one run in two). Fetch responses carry the right high watermark, so each non-empty
partition is fetched once from (reported end - 1), and its end is the largest of the
reported end, the fetch's high watermark and the last fetched offset + 1. Against Apache
Kafka that is the ListOffsets answer itself, at the cost of one small fetch per changelog
partition per rebalance.

Both hook in through faust's documented ``Table`` and ``TableManager`` app settings; the
override of ``Recovery._build_highwaters`` (a private method) is checked against
faust-streaming 0.15.3.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import faust
from faust.tables.manager import TableManager
from faust.tables.recovery import Recovery
from faust.transport.drivers.aiokafka import server_list
from faust.types import TP

from flywheel.core.kafka_ends import fetched_ends
from flywheel.core.kafka_security import KafkaSecurity

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0
"""Longest the end-offset fetch may take before the broker's ListOffsets answer is kept."""


class ChangelogTable(faust.Table):
    """A table whose changelog records can be awaited: :meth:`wait_written` before acking."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._unwritten: list[asyncio.Future] = []

    def send_changelog(self, *args: Any, **kwargs: Any) -> Any:
        fut = super().send_changelog(*args, **kwargs)
        self._unwritten.append(fut)
        return fut

    def take_unwritten(self) -> list[asyncio.Future]:
        """The changelog records sent since the last call (futures: done when the broker has them)."""
        pending, self._unwritten = self._unwritten, []
        return pending

    async def wait_written(self) -> int:
        """Wait until every changelog record sent so far is acknowledged by the broker; how many there were.

        A failed send raises here.
        """
        pending = self.take_unwritten()
        if pending:
            await asyncio.gather(*pending)
        return len(pending)


class _RealEnds:
    """The consumer as recovery sees it, with ``highwaters`` answered by :func:`fetched_ends`."""

    def __init__(self, consumer: Any, bootstrap: Sequence[str], security: KafkaSecurity):
        self._consumer = consumer
        self._bootstrap = bootstrap
        self._security = security

    async def highwaters(self, *tps: TP) -> dict[TP, int]:
        reported = await self._consumer.highwaters(*tps)
        ends = await asyncio.to_thread(
            fetched_ends,
            self._bootstrap,
            reported,
            FETCH_TIMEOUT_S,
            security=self._security,
            client_id="flywheel-rewarding-recovery",
        )
        for tp, end in sorted(ends.items()):
            if end != (reported.get(tp) or 0):
                log.info(
                    "changelog %s[%d]: broker reported end offset %s, records reach %d (recovering to %d)",
                    tp.topic,
                    tp.partition,
                    reported.get(tp),
                    end,
                    end,
                )
        return ends


class ChangelogEndRecovery(Recovery):
    """faust's recovery, reading each changelog partition to its real end (see the module doc)."""

    async def _build_highwaters(self, consumer: Any, tps: Any, destination: Any, title: str) -> None:
        bootstrap = server_list(self.app.conf.broker, 9092)
        security = self.app.transport.security  # rewarding.transport.Transport: the broker's TLS/SASL options
        await super()._build_highwaters(_RealEnds(consumer, bootstrap, security), tps, destination, title)


class RewardingTableManager(TableManager):
    """faust's table manager with :class:`ChangelogEndRecovery` (``TableManager=`` app setting)."""

    @property
    def recovery(self) -> Recovery:
        if self._recovery is None:
            self._recovery = ChangelogEndRecovery(self.app, self, beacon=self.beacon, loop=self.loop)
        return self._recovery
