"""faust's aiokafka transport with a bounded fetch wait (and a cheaper per-message hand-over:
see :meth:`Consumer._drain_messages`).

faust 0.15.3 creates its aiokafka consumer with ``fetch_max_wait_ms=1500`` and no setting
to change it. A Kafka broker answers a waiting fetch as soon as records arrive, so the
value only matters on an idle topic; Tansu 0.6 holds the fetch for the full wait even when
records arrive meanwhile (measured here: produce-to-consume 0.65 s at 1500 ms, 0.16 s at
500 ms, 5 ms at 100 ms). A worker that keeps up with its topic therefore saw every record
up to 1.5 s late, and consumed in bursts. :class:`Transport` gives the consumer
``RewardingSettings.fetch_max_wait_s`` instead (idle cost: one fetch per that interval).

The transport also carries the broker's TLS/SASL options (:attr:`Transport.security`), which
the app gives faust as ``broker_credentials`` (:func:`broker_credentials`: faust hands them to
every aiokafka client it makes) and which changelog recovery's own kafka-python reads use.

Installed with ``app.transport = Transport(...)`` (faust's public setter) before anything
creates the consumer; the wait is set on the consumer before it starts, through
aiokafka's ``_fetch_max_wait_ms`` (the value it passes to its fetcher at start; checked
against aiokafka 0.14).
"""

from __future__ import annotations

import asyncio
import collections.abc
from typing import Any

import aiokafka
from faust.auth import Credentials, SASLCredentials, SSLCredentials
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as faust_aiokafka

from flywheel.core.kafka_security import PLAINTEXT, KafkaSecurity

YIELD_EVERY = 100
"""Messages handed over between two yields to the event loop (faust's value)."""


def broker_credentials(security: KafkaSecurity) -> Credentials | None:
    """faust's ``broker_credentials`` setting for ``security``: SASL (over TLS with ``SASL_SSL``), TLS alone,
    or ``None`` for ``PLAINTEXT``. faust maps them to aiokafka's ``security_protocol``, ``sasl_*`` and
    ``ssl_context`` for its consumer, producer and admin requests; the TLS context is the one kafka-python
    clients get (:meth:`~flywheel.core.kafka_security.KafkaSecurity.ssl_context`)."""
    context = security.ssl_context() if security.tls else None
    if security.sasl:
        return SASLCredentials(
            username=security.sasl_username,
            password=security.sasl_password,
            mechanism=security.sasl_mechanism,
            ssl_context=context,
        )
    if context is not None:
        return SSLCredentials(context)
    return None


class ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """faust's consumer thread, its aiokafka consumer given the transport's fetch wait."""

    def _create_worker_consumer(self, transport: Any) -> aiokafka.AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        if not (hasattr(consumer, "_fetch_max_wait_ms") and hasattr(consumer, "_fetch_max_bytes")):
            raise RuntimeError("this aiokafka keeps its fetch wait elsewhere; rewarding.transport needs updating")
        consumer._fetch_max_wait_ms = transport.fetch_max_wait_ms
        consumer._fetch_max_bytes = max(consumer._fetch_max_bytes, transport.fetch_max_bytes)
        return consumer


class Consumer(faust_aiokafka.Consumer):
    """faust's aiokafka consumer with :class:`ConsumerThread` and a cheaper per-message wait."""

    _abort: asyncio.Future | None = None
    _seeks = 0
    """Seeks to the committed offsets so far: a hand-over records its read offset only if none
    happened meanwhile (see :meth:`_drain_messages`)."""

    async def perform_seek(self) -> None:
        self._seeks += 1
        await super().perform_seek()

    def _new_consumer_thread(self) -> ConsumerThread:
        return ConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def _drain_messages(self, fetcher: Any) -> None:
        """faust-streaming 0.15.3's fetch loop, verbatim but for how each message is handed over.

        faust awaits ``wait_first(callback(message), suspend_flow.wait())`` per message: a
        delivery that blocks is abandoned when a rebalance suspends the flow, or the consumer
        stops or crashes. That call makes four tasks and an ``asyncio.wait`` per message (~8 %
        of a busy rewarding worker's CPU). :meth:`_deliver` keeps exactly that per-message
        contract with no task at all for a delivery that does not wait (nearly every one), and for
        one that waits one task, the three "abandon" events being watched by one shared task
        that lives until one of them is set. (Delivering a whole fetched batch in
        one task was tried, and lost sessions across rebalances:
        ``test_a_worker_joining_and_leaving_mid_stream_loses_and_doubles_nothing``.)

        One more difference: a message's read offset is recorded only if no rebalance began
        during its hand-over. faust records it anyway, and a revoke has just dropped the revoked
        partitions' read offsets and stopped the flow (in one step): the offset recorded then is
        stale, for a partition this worker may no longer hold. If the partition comes back in a
        later generation while its committed offset is still below that stale value, faust,
        which resumes the flow before its seek to the committed offsets has finished, drops the
        records it fetches meanwhile as already read ("DROPPED MESSAGE ROFF"), and once the seek
        is done takes the next record's jump for a gap in the offsets, which it counts as acked:
        records committed without being processed (seen with a whole-batch hand-over, whose
        reads run further ahead of its commits). Not recording an offset can at worst hand a
        message over twice, which the session states absorb (events apply idempotently by id).
        The flow resumes only in a new generation, so the two checks cover the whole rebalance.
        A third: no seek to the committed offsets happened during the hand-over. faust seeks
        twice after an assignment, the second time with the flow already active; an offset
        recorded after that seek would have the records fetched again from the committed
        offset dropped as already read (seen with a whole-batch hand-over: docs/rewards.md).
        """
        app = self.app
        callback = self.callback
        getmany = self.getmany
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        set_flag = self.diag.set_flag
        unset_flag = self.diag.unset_flag
        commit_every = self._commit_every
        acks_enabled_for = self.app.topics.acks_enabled_for
        deliver = self._deliver
        num_since_yield = 0
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                set_flag(CONSUMER_FETCHING)
                ait = getmany(timeout=1.0)
                # Sleeping because sometimes getmany is called in a loop never releasing to the event loop
                await self.sleep(0)
                if not self.should_stop:
                    async for tp, message in ait:
                        num_since_yield += 1
                        if num_since_yield > YIELD_EVERY:
                            await asyncio.sleep(0)
                            num_since_yield = 0
                        offset = message.offset
                        r_offset = get_read_offset(tp)
                        if r_offset is None or offset >= r_offset:
                            gap = offset - (r_offset or 0)
                            if gap > 1 and r_offset and acks_enabled_for(message.topic):  # a gap in the offsets
                                await self._add_gap(tp, r_offset + 1, offset)
                            if commit_every is not None and self._n_acked >= commit_every:
                                self._n_acked = 0
                                await self.commit()
                            seeks = self._seeks
                            await deliver(callback, message)
                            if (
                                self.flow_active
                                and message.generation_id == app.consumer_generation_id
                                and self._seeks == seeks
                            ):
                                set_read_offset(tp, offset)  # not if a rebalance or a seek intervened (docstring)
                        else:
                            self.log.dev("DROPPED MESSAGE ROFF %r: k=%r v=%r", offset, message.key, message.value)
                unset_flag(CONSUMER_FETCHING)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise
        finally:
            unset_flag(CONSUMER_FETCHING)
            if self._abort is not None and not self._abort.done():
                self._abort.cancel()
            self._abort = None

    async def _deliver(self, callback: Any, message: Any) -> None:
        """``await wait_first(callback(message), suspend_flow.wait())`` as faust has it (which also
        ends on the service's stopped and crashed events): a delivery that waits is cancelled if
        the flow is suspended, or the consumer stops or crashes, first; its exception is raised here.

        The delivery runs at once, up to its first wait: the conductor puts the message on its
        stream's queue without waiting unless the app's flow control is suspended, the
        producer's buffer is over its limit or the queue is full. A delivery that never waits
        cannot be abandoned, so it needs no task and no watcher (~13 us and an event-loop
        iteration per message, measured); one that waits is finished in its own task
        (:class:`_Started`), as before, and watched.
        """
        coro = callback(message)
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return  # delivered without waiting
        abort = self._abort
        if abort is None or abort.done():
            abort = self._abort = asyncio.ensure_future(self.wait_first(self.suspend_flow.wait()))
        task = asyncio.ensure_future(_Started(coro, waiting_on))
        try:
            await asyncio.wait((task, abort), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            task.result()  # raises the delivery's exception, as wait_first does


class _Started(collections.abc.Coroutine):
    """A coroutine that has run up to a wait (it yielded ``waiting_on``), for a task to drive the
    rest of: the task's first step gets ``waiting_on`` back, every later step (or a cancellation,
    also one before the first step) goes to the coroutine itself. The task therefore waits and
    is woken exactly as if it had run the coroutine from the start."""

    __slots__ = ("_coro", "_waiting_on", "_first")

    def __init__(self, coro: Any, waiting_on: Any):
        self._coro, self._waiting_on, self._first = coro, waiting_on, True

    def send(self, value: Any) -> Any:
        if self._first:
            self._first = False
            return self._waiting_on
        return self._coro.send(value)

    def throw(self, *exc: Any) -> Any:
        self._first = False
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()

    def __next__(self) -> Any:
        return self.send(None)

    def __iter__(self) -> _Started:
        return self

    def __await__(self) -> _Started:
        return self


class Transport(faust_aiokafka.Transport):
    """faust's aiokafka transport whose consumer waits at most ``fetch_max_wait_s`` per fetch and
    fetches at least ``fetch_max_bytes`` (``kafka.max_record_bytes``) at once (aiokafka's default is
    50 MB; faust has no setting for it)."""

    Consumer = Consumer

    def __init__(
        self,
        url: Any,
        app: Any,
        *args: Any,
        fetch_max_wait_s: float,
        fetch_max_bytes: int = 0,
        security: KafkaSecurity = PLAINTEXT,
        **kwargs: Any,
    ):
        super().__init__(url, app, *args, **kwargs)
        self.security = security
        """The broker's TLS/SASL options (the app's ``broker_credentials`` were made from them)."""
        self.fetch_max_wait_ms = max(1, int(fetch_max_wait_s * 1000))
        self.fetch_max_bytes = fetch_max_bytes
