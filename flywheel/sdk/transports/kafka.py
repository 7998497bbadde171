"""Kafka transport: produce straight to the events topic with kafka-python.

Topic ``events_topic(topic_prefix)``, key = session id, value = the serialized event;
``acks=all``, retries within a bounded delivery timeout, gzip compression, one request
in flight per connection so a retried request cannot overtake a later one. A batch is
sent and then flushed: :meth:`KafkaTransport.send` returns only after the broker
acknowledged (or the delivery timeout ran out), so "sent" always means "acknowledged".

The producer is created lazily, in the sender thread. While the broker is down its
creation fails after ``connect_timeout_s``; the sender spools meanwhile and retries
with backoff. After a failed batch the producer is discarded, so the next attempt
starts from a fresh connection (a restarted broker, e.g. Tansu with memory storage,
knows nothing of the old producer's state).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

try:  # this module is imported only when the kafka transport is chosen (flywheel.sdk.transports.make_transport)
    from kafka.errors import InvalidTopicError, KafkaError, MessageSizeTooLargeError, RecordListTooLargeError
    from kafka.partitioner.default import DefaultPartitioner, murmur2
except ImportError as err:
    raise ImportError("the kafka transport needs kafka-python: pip install 'flywheel-rl[sdk]'") from err

from flywheel.core import kafka_clients
from flywheel.core.kafka_security import PLAINTEXT, KafkaSecurity, KafkaSecurityError
from flywheel.sdk.transports.base import Envelope, Rejection, SendResult, Transport, TransportUnavailable, failed

log = logging.getLogger("flywheel.sdk")

CONNECT_TIMEOUT_S = 2.0
"""How long creating a producer waits for the broker before the attempt counts as failed."""
REQUEST_TIMEOUT_S = 5.0
"""Timeout of one produce request."""
RECORD_OVERHEAD_BYTES = 64 * 1024
"""Room for a record's key and framing above its value (the services' ``kafka.RECORD_OVERHEAD_BYTES``)."""
MAX_REQUEST_BYTES = 16 * 1024 * 1024 + RECORD_OVERHEAD_BYTES
"""Default largest record (``max_request_size``): ``FLYWHEEL_MAX_EVENT_BYTES``'s default plus the overhead.
:func:`~flywheel.sdk.transports.make_transport` derives it from the configured ``max_event_bytes``;
a larger record is rejected by the producer (``MessageSizeTooLargeError``), and the event counted invalid."""


class NoBrokerConfigured(TransportUnavailable):
    """No broker is configured and no local stack records one: a person has to say where Kafka is."""


class BrokerRefused(TransportUnavailable):
    """The broker refused the configured security (SASL credentials, the TLS certificate or CA), or a TLS
    file does not load: a person has to change the ``kafka_*`` settings; retries go on meanwhile."""


class KafkaTransport(Transport):
    """Produces envelopes to ``topic`` on ``bootstrap`` (``host:port[,host:port]``, or a callable resolving it),
    connecting with ``security``'s TLS and SASL options (default: neither)."""

    name = "kafka"

    def __init__(
        self,
        bootstrap: str | Callable[[], str],
        topic: str,
        *,
        linger_ms: int = 5,
        compression: str | None = "gzip",
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        client_id: str = "flywheel-sdk",
        max_request_bytes: int = MAX_REQUEST_BYTES,
        security: KafkaSecurity = PLAINTEXT,
    ):
        self._bootstrap = bootstrap
        self.security = security
        self.max_request_bytes = max_request_bytes
        self.topic = topic
        self._linger_ms = linger_ms
        self._compression = compression
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._client_id = client_id
        self._producer: Any = None

    @property
    def delivery_timeout_s(self) -> float:
        """Longest a record may wait for its acknowledgement (kafka-python's ``delivery_timeout_ms``)."""
        return self._request_timeout_s + self._linger_ms / 1000 + 1.0

    def send(self, batch: Sequence[Envelope]) -> SendResult:
        """Produce ``batch`` and wait for every acknowledgement (bounded by the delivery timeout)."""
        try:
            producer = self._ensure_producer()
        except TransportUnavailable as err:
            return failed(str(err), needs_operator=isinstance(err, (NoBrokerConfigured, BrokerRefused)))
        futures: list[Any] = []
        rejected: dict[int, Rejection] = {}
        for index, envelope in enumerate(batch):
            try:
                futures.append(producer.send(self.topic, key=envelope.key, value=envelope.value))
            except KafkaError as err:
                if _is_permanent(err):
                    rejected[index] = _rejection(index, envelope, err)
                    futures.append(None)
                    continue
                self._discard()
                return self._result(batch, futures, rejected, stop=index, error=f"produce failed: {err!r}")
        try:
            producer.flush(timeout=self.delivery_timeout_s + 1.0)
        except KafkaError as err:
            log.debug("kafka flush did not complete: %r", err)
        return self._result(batch, futures, rejected, stop=len(batch), error=None)

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what is pending for up to ``timeout_s``, then close the producer."""
        producer, self._producer = self._producer, None
        if producer is not None:
            _close_producer(producer, timeout_s)

    # -- internals --------------------------------------------------------------------------

    def _result(
        self,
        batch: Sequence[Envelope],
        futures: list[Any],
        rejected: dict[int, Rejection],
        stop: int,
        error: str | None,
    ) -> SendResult:
        """Turn per-record futures into the prefix-shaped :class:`SendResult`."""
        sent = 0
        for index, future in enumerate(futures[:stop]):
            if future is None:
                continue
            if future.is_done and future.succeeded():
                sent += 1
                continue
            if future.is_done and _is_permanent(future.exception):
                rejected[index] = _rejection(index, batch[index], future.exception)
                continue
            reason = repr(future.exception) if future.is_done else "no acknowledgement within the delivery timeout"
            self._discard()
            return SendResult(
                sent=sent,
                rejected=[r for i, r in sorted(rejected.items()) if i < index],
                retry_from=index,
                error=f"record not acknowledged: {reason}",
            )
        done_rejections = [r for i, r in sorted(rejected.items()) if i < stop]
        if stop < len(batch):
            return SendResult(sent=sent, rejected=done_rejections, retry_from=stop, error=error)
        return SendResult(sent=sent, rejected=done_rejections)

    def _ensure_producer(self) -> Any:
        """The live producer, created on first use; raises :class:`TransportUnavailable`."""
        if self._producer is not None:
            return self._producer
        bootstrap = self._resolve_bootstrap()
        request_ms = int(self._request_timeout_s * 1000)
        try:
            self._producer = kafka_clients.producer(
                bootstrap,
                security=self.security,
                client_id=self._client_id,
                acks="all",
                retries=5,
                enable_idempotence=False,
                max_in_flight_requests_per_connection=1,
                compression_type=self._compression,
                linger_ms=self._linger_ms,
                batch_size=256 * 1024,
                max_request_size=self.max_request_bytes,
                partitioner=_memo_partitioner(),
                request_timeout_ms=request_ms,
                delivery_timeout_ms=int(self.delivery_timeout_s * 1000),
                max_block_ms=request_ms,
                bootstrap_timeout_ms=int(self._connect_timeout_s * 1000),
                reconnect_backoff_max_ms=1000,
            )
        except KafkaSecurityError as err:
            raise BrokerRefused(str(err)) from err
        except kafka_clients.BrokerUnreachable as err:
            raise (BrokerRefused if err.misconfigured else TransportUnavailable)(str(err)) from err
        except KafkaError as err:
            raise TransportUnavailable(f"no Kafka broker at {bootstrap} ({self.security.describe()}): {err}") from err
        return self._producer

    def _resolve_bootstrap(self) -> str:
        if isinstance(self._bootstrap, str):
            return self._bootstrap
        try:
            return self._bootstrap()
        except LookupError as err:  # no broker configured: a person has to say where Kafka is
            raise NoBrokerConfigured(
                f"{err}: set FLYWHEEL_KAFKA_BOOTSTRAP=host:port or pass kafka_bootstrap= to Flywheel()"
            ) from err

    def _discard(self) -> None:
        """Drop the producer after a failure, abandoning what it still holds (it is spooled)."""
        producer, self._producer = self._producer, None
        if producer is not None:
            _close_producer(producer, 0.0)


PARTITION_MEMO_KEYS = 65_536
"""Session keys whose murmur2 hash the partitioner remembers (then it starts over)."""


class MemoPartitioner(DefaultPartitioner):
    """kafka-python's default partitioner, with each key's murmur2 hash remembered.

    The partition is exactly the default one (``murmur2(key) & 0x7fffffff`` modulo the
    partition count, as the Java client and the gateway's producer compute it), so a
    session lands on the same partition whoever produces it. kafka-python's murmur2 is pure
    Python and costs microseconds per record; a session's key repeats for all its events.
    """

    def __init__(self) -> None:
        self._hashes: dict[bytes, int] = {}

    def partition(self, topic: str, key: Any, serialized_key: bytes | None, value: Any,
                  serialized_value: Any, cluster: Any) -> int:  # fmt: skip
        if serialized_key is None or topic not in cluster.topics():
            return super().partition(topic, key, serialized_key, value, serialized_value, cluster)
        hashed = self._hashes.get(serialized_key)
        if hashed is None:
            if len(self._hashes) >= PARTITION_MEMO_KEYS:
                self._hashes.clear()
            hashed = self._hashes[serialized_key] = murmur2(serialized_key) & 0x7FFFFFFF
        partitions = sorted(cluster.partitions_for_topic(topic))
        return partitions[hashed % len(partitions)]


def _memo_partitioner() -> MemoPartitioner:
    """A fresh :class:`MemoPartitioner` (one per producer)."""
    return MemoPartitioner()


def _close_producer(producer: Any, timeout_s: float) -> None:
    """Close a producer within ``timeout_s``, also when records are stuck in it.

    kafka-python's ``close()`` raises ``KafkaTimeoutError`` from its flush when records
    are still pending and then leaves its I/O thread running; force-closing that thread
    is the only way not to leak it.
    """
    try:
        producer.close(timeout=timeout_s)
    except KafkaError as err:
        log.debug("kafka producer did not close cleanly (%r); forcing it", err)
        io_thread = getattr(producer, "_sender", None)
        if io_thread is not None:
            io_thread.force_close()
            io_thread.join(1.0)


def _is_permanent(err: BaseException | None) -> bool:
    """Errors that no retry can fix: the record itself is unacceptable."""
    return isinstance(err, (MessageSizeTooLargeError, RecordListTooLargeError, InvalidTopicError))


def _rejection(index: int, envelope: Envelope, err: BaseException | None) -> Rejection:
    size = len(envelope.key) + len(envelope.value)
    reason = f"refused by Kafka ({size} bytes; FLYWHEEL_MAX_EVENT_BYTES sets the producer's limit): {err!r}"
    return Rejection(index=index, event_id=None, field="", reason=reason)
