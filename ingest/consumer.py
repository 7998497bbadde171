"""The Kafka → Postgres consumer: batches, idempotent writes, dead letters, offsets after the commit.

Two parts:

- :func:`process_batch` (pure): Kafka records → valid event rows, dead letters with their
  reason, and the offsets the batch covers. It never raises on input.
- :class:`IngestConsumer` / :func:`run`: poll a batch, write it to Postgres in one transaction
  (retrying transient errors with backoff, never skipping), publish its dead letters to the
  dead-letter topic, and only then commit the batch's offsets. The next batch is polled and
  parsed while the previous one is being written; commits stay in order.

Feedback by completion id alone (no session, keyed by the completion id) is kept in
``pending_feedback``; :mod:`ingest.pending` finds its session and re-produces it attached, and
that copy is then stored like any feedback.

A consumer killed at any point loses nothing (offsets trail the database) and doubles nothing
(rows are idempotent by event id and by Kafka position). Scale out by starting more consumers
with the same ``ingest.group_id``: Kafka spreads the partitions over them, and since records
are keyed by session id, a session's events are written by one consumer, in order.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from kafka import TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata
from pydantic_core import from_json

from flywheel.core import kafka_clients
from flywheel.core.contracts.events import (
    ContractError,
    Event,
    Feedback,
    parse_event,
    parse_event_fast,
    unknown_fields,
)
from flywheel.core.contracts.ids import uuid7_time_ms
from flywheel.core.contracts.topics import dead_letter_topic, events_topic
from flywheel.core.endpoints import kafka_bootstrap, libpq_conninfo, postgres_url
from flywheel.core.settings import Settings
from flywheel.core.settings.ingest import IngestSettings
from ingest import metrics
from ingest.limits import Limits, check_record_limit
from ingest.pending import ResolveResult, ResolveSettings, resolve_round
from ingest.writer import (
    TRANSIENT_ERRORS,
    DeadLetterRow,
    EventRow,
    UnattachedRow,
    Writer,
    WriteResult,
    clean_text,
)

log = logging.getLogger(__name__)

FIELD_MAX = 256
"""Length of ``dead_letters.field``."""
PROJECT_MAX = 128
"""Length of ``dead_letters.project``."""
DLQ_VALUE_MAX = 512 * 1024
"""Largest value copied onto the dead-letter topic (the table keeps the whole record)."""
BATCH_MAX_BYTES = 32 * 1024 * 1024
"""A batch closes early once its records reach this many bytes (one record larger than that is a batch alone)."""
FETCH_MAX_BYTES = 64 * 1024 * 1024
"""Most bytes one fetch returns over all partitions (at least ``kafka.max_record_bytes``)."""
RETRY_INITIAL_S = 0.1
RETRY_MAX_S = 5.0
KAFKA_TIMEOUT_S = 30.0
"""How long one DLQ publish or offset commit may take before it counts as failed."""


def group_timeouts_ms(ingest: IngestSettings) -> tuple[int, int]:
    """The consumer's (session timeout, heartbeat interval) in ms.

    The session timeout is ``ingest.session_timeout_ms``, at most ``max_poll_interval_ms``. A
    killed consumer's partitions move only once its session timed out, and Tansu holds every
    JoinGroup for about half the session timeout, so a replacement writes within about twice it
    (docs/reliability.md, "Joining after a stop"). Heartbeats go three times per session, at
    most every 3 s.
    """
    session = min(ingest.session_timeout_ms, ingest.max_poll_interval_ms)
    return session, min(3000, session // 3)


class RecordLike(Protocol):
    """What :func:`process_batch` reads of a Kafka record (``kafka.consumer.fetcher.ConsumerRecord``)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass
class BatchResult:
    """One batch, split: what to insert, what to dead-letter, and where the batch ends."""

    events: list[EventRow] = field(default_factory=list)
    dead_letters: list[DeadLetterRow] = field(default_factory=list)
    unattached: list[UnattachedRow] = field(default_factory=list)
    """Feedback by completion id alone, for ``pending_feedback``."""
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    """Next offset to consume per (topic, partition): what to commit once the batch is stored."""
    in_batch_duplicates: int = 0
    """Events whose id appeared earlier in the same batch (dropped before the insert)."""
    n_records: int = 0


def process_batch(records: Iterable[RecordLike], limits: Limits | None = None) -> BatchResult:
    """Split Kafka records into valid event rows and dead letters; never raises on input.

    ``limits``: the configured event limits (default: the settings' defaults); a record over
    one is a dead letter whose reason names the setting.
    """
    limits = limits or Limits()
    result = BatchResult()
    seen: set = set()
    for record in records:
        result.n_records += 1
        position = (record.topic, record.partition)
        result.offsets[position] = max(result.offsets.get(position, 0), record.offset + 1)
        outcome = classify(record, limits)
        if isinstance(outcome, DeadLetterRow):
            result.dead_letters.append(outcome)
        elif outcome.event_id in seen:
            result.in_batch_duplicates += 1
        else:
            seen.add(outcome.event_id)
            if isinstance(outcome, UnattachedRow):
                result.unattached.append(outcome)
            else:
                result.events.append(outcome)
    return result


def classify(record: RecordLike, limits: Limits | None = None) -> EventRow | UnattachedRow | DeadLetterRow:
    """One record → the row to insert, or the dead letter saying why it cannot be accepted."""
    limits = limits or Limits()
    value = record.value
    if value is None:
        return dead_letter(record, "", "the record has no value (a tombstone is not an event)", None)
    too_big = limits.size_problem(len(value))
    if too_big:
        return dead_letter(record, "", too_big, None, kind="limit")
    try:
        text = bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        return _contract_dead_letter(record, value, None)  # parse_event words the reason
    event = _parse_fast(text)
    if event is not None:
        project: str | None = event.project
    else:
        try:
            data = from_json(text)
        except (ValueError, RecursionError):
            return _contract_dead_letter(record, value, None)
        project = _project_of(data)
        try:
            event = parse_event(data)
        except ContractError as err:
            return dead_letter(record, err.field, err.reason, project)
    over = limits.event_problem(event)
    if over is not None:
        return dead_letter(record, over[0], over[1], event.project, kind="limit")
    key_problem = _key_problem(record.key, event)
    if key_problem:
        key_field = "session_id" if event.session_id is not None else "completion_id"
        return dead_letter(record, key_field, key_problem, project, kind="key")
    if "\\u0000" in text and _has_nul(from_json(text)):
        return dead_letter(record, "", "contains a NUL character (\\u0000), which Postgres cannot store", project)
    if isinstance(event, Feedback) and event.session_id is None:
        return _unattached(record, event, text)
    return EventRow(
        event_id=event.event_id,
        project=event.project,
        session_id=event.session_id,
        type=event.type.value,
        schema_version=event.schema_version,
        occurred_at=event.occurred_at,
        payload=text,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        event=event,
    )


def _parse_fast(text: str) -> Event | None:
    """:func:`~flywheel.core.contracts.events.parse_event_fast` (a seam for the test that compares both paths)."""
    return parse_event_fast(text)


def _contract_dead_letter(record: RecordLike, value: bytes, project: str | None) -> DeadLetterRow:
    try:
        parse_event(bytes(value))
    except ContractError as err:
        return dead_letter(record, err.field, err.reason, project)
    return dead_letter(record, "", "not a JSON document", project)  # pragma: no cover - decode failed above


def _unattached(record: RecordLike, event: Feedback, text: str) -> UnattachedRow:
    completion_id = event.completion_id
    assert completion_id is not None  # the contract requires it when session_id is omitted
    completion_at = datetime.fromtimestamp(uuid7_time_ms(completion_id) / 1000, UTC)
    return UnattachedRow(
        event_id=event.event_id,
        project=event.project,
        completion_id=completion_id,
        completion_at=completion_at,
        occurred_at=event.occurred_at,
        payload=text,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
    )


def _key_problem(key: bytes | None, event: Event) -> str | None:
    """Why the record key is not the event's key (its session id; the partitioning contract), or None."""
    expected = event.kafka_key
    what = "session id" if event.session_id is not None else "completion id (feedback without a session)"
    if key is None:
        return f"the record has no key; it must be the {what} {expected!r}"
    try:
        text = bytes(key).decode("utf-8")
    except UnicodeDecodeError:
        return f"the record key is not UTF-8; it must be the {what} {expected!r}"
    if text != expected:
        name = "session_id" if event.session_id is not None else "completion_id"
        return f"the record key {text[:200]!r} does not match {name} {expected!r}"
    return None


def _project_of(data: Any) -> str | None:
    project = data.get("project") if isinstance(data, dict) else None
    return clean_text(project, PROJECT_MAX) if isinstance(project, str) else None


def _has_nul(data: Any) -> bool:
    """Whether any string (key or value) in a decoded JSON document contains U+0000."""
    if isinstance(data, str):
        return "\x00" in data
    if isinstance(data, dict):
        return any("\x00" in k or _has_nul(v) for k, v in data.items())
    if isinstance(data, list):
        return any(_has_nul(v) for v in data)
    return False


def dead_letter(
    record: RecordLike, field_path: str, reason: str, project: str | None, *, kind: str = "contract"
) -> DeadLetterRow:
    """A dead letter for ``record`` with a storable field and reason."""
    return DeadLetterRow(
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=None if record.key is None else bytes(record.key),
        value=None if record.value is None else bytes(record.value),
        field=clean_text(field_path, FIELD_MAX),
        reason=clean_text(reason) or "invalid record",
        project=project,
        kind=kind,
    )


def dlq_headers(row: DeadLetterRow) -> list[tuple[str, bytes]]:
    """Headers of a dead letter on the DLQ topic: why, and where the record came from."""
    headers = [
        ("reason", row.reason.encode("utf-8")),
        ("field", row.field.encode("utf-8")),
        ("kind", row.kind.encode("utf-8")),
        ("source_topic", row.topic.encode("utf-8")),
        ("source_partition", str(row.partition).encode()),
        ("source_offset", str(row.offset).encode()),
    ]
    if row.value is not None and len(row.value) > DLQ_VALUE_MAX:
        headers.append(("value_truncated", str(len(row.value)).encode()))
    return headers


def dlq_value(row: DeadLetterRow) -> bytes | None:
    """The value copied onto the DLQ topic (cut to :data:`DLQ_VALUE_MAX`; the table keeps it whole)."""
    return None if row.value is None else row.value[:DLQ_VALUE_MAX]


def backoff_delays(initial_s: float = RETRY_INITIAL_S, max_s: float = RETRY_MAX_S) -> Iterable[float]:
    """Exponential retry delays, capped: 0.1, 0.2, 0.4, ... 5, 5, ..."""
    delay = initial_s
    while True:
        yield delay
        delay = min(delay * 2, max_s)


class Stopped(Exception):
    """The stop event was set while waiting to retry (the batch stays uncommitted)."""


@dataclass
class PendingWrite:
    """A batch handed to the writer thread, with the future of its write."""

    batch: BatchResult
    future: Future
    started: float


class IngestConsumer:
    """Polls the events topic, writes batches to Postgres, dead-letters bad records, commits offsets."""

    def __init__(self, settings: Settings, *, bootstrap: str, conninfo: str, stop_event: threading.Event):
        self.settings = settings
        self.bootstrap = bootstrap
        self.stop_event = stop_event
        self.record_bytes = check_record_limit(settings)
        self.limits = Limits.from_settings(settings)
        self.topic = events_topic(settings.kafka.topic_prefix)
        self.dlq_topic = dead_letter_topic(settings.kafka.topic_prefix)
        ingest = settings.ingest
        self.writer = Writer(conninfo, completion_window=timedelta(seconds=ingest.completion_window_s))
        self.resolve_conf = ResolveSettings.from_ingest(ingest)
        self.consumer = self._make_consumer()
        self.producer = self._make_producer()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-writer")
        self._last_lag = 0.0
        self._positions: dict[tuple[str, int], int] = {}
        self._resolving: Future | None = None
        self._resolve_at = 0.0
        """Monotonic time of the next round over pending feedback (0: as soon as possible)."""

    def _make_consumer(self):
        ingest = self.settings.ingest
        session_timeout, heartbeat_interval = group_timeouts_ms(ingest)
        consumer = kafka_clients.consumer(
            self.bootstrap,
            security=self.settings.kafka.security(),
            group_id=ingest.group_id,
            client_id=f"flywheel-ingest-{socket.gethostname()}-{os.getpid()}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=ingest.batch_max_events,
            max_poll_interval_ms=ingest.max_poll_interval_ms,
            session_timeout_ms=session_timeout,
            heartbeat_interval_ms=heartbeat_interval,
            fetch_max_bytes=max(FETCH_MAX_BYTES, self.record_bytes),
            max_partition_fetch_bytes=self.record_bytes,
            fetch_max_wait_ms=min(100, ingest.batch_max_wait_ms),
            check_crcs=ingest.check_crcs,
        )
        consumer.subscribe([self.topic])
        return consumer

    def _make_producer(self):
        return kafka_clients.producer(  # dead letters, and the resolved copies of unattached feedback
            self.bootstrap,
            security=self.settings.kafka.security(),
            client_id=f"flywheel-ingest-{os.getpid()}",
            acks="all",
            max_request_size=2 * DLQ_VALUE_MAX + 64 * 1024,
        )

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        """Consume until the stop event is set; the last in-flight batch is finished and committed."""
        pending: PendingWrite | None = None
        log.info("consuming %s as group %s", self.topic, self.settings.ingest.group_id)
        try:
            while not self.stop_event.is_set():
                records = self.collect()
                batch = process_batch(records, self.limits) if records else None
                if pending is not None:
                    self.finish(pending)
                    pending = None
                if batch is not None:
                    metrics.CONSUMED.inc(batch.n_records)
                    pending = PendingWrite(batch, self._executor.submit(self.store, batch), time.perf_counter())
                self.update_lag()
                self.schedule_resolve()
            if pending is not None:
                self.finish(pending)
        except Stopped:
            log.info("stopped while retrying; the uncommitted batch will be read again")
        finally:
            self.close()

    def collect(self) -> list[RecordLike]:
        """Poll until a batch is full (events or bytes) or ``batch_max_wait_ms`` passed since its first record."""
        ingest = self.settings.ingest
        records: list[RecordLike] = []
        size = 0
        deadline: float | None = None
        wait_s = ingest.batch_max_wait_ms / 1000
        while len(records) < ingest.batch_max_events and size < BATCH_MAX_BYTES:
            now = time.monotonic()
            timeout_s = wait_s if deadline is None else deadline - now
            if timeout_s <= 0 or self.stop_event.is_set():
                break
            polled = self.consumer.poll(
                timeout_ms=max(1, int(timeout_s * 1000)), max_records=ingest.batch_max_events - len(records)
            )
            for tp, partition_records in polled.items():
                records.extend(partition_records)
                size += sum(len(r.value or b"") for r in partition_records)
                self._positions[(tp.topic, tp.partition)] = partition_records[-1].offset + 1
            if records and deadline is None:
                deadline = now + wait_s
            elif not records:
                break  # an idle poll: let the loop look at the stop event and the lag
        return records

    def store(self, batch: BatchResult) -> WriteResult:
        """Write a batch to Postgres, retrying transient errors with backoff until it commits."""
        delays = backoff_delays()
        while True:
            try:
                return self.writer.write(batch.events, batch.dead_letters, batch.unattached)
            except TRANSIENT_ERRORS as err:
                delay = next(delays)
                metrics.DB_RETRIES.inc()
                log.warning("database write failed (%s); retrying in %.1fs without committing", err, delay)
                if self.stop_event.wait(delay):
                    raise Stopped() from err

    def finish(self, pending: PendingWrite) -> None:
        """Wait for a batch's write, publish its dead letters, then commit its offsets."""
        result = pending.future.result()
        batch = pending.batch
        dead = [*batch.dead_letters, *result.refused]
        self.publish_dead_letters(dead)
        self.commit(batch.offsets)
        self._count(batch, result, dead)
        if result.attached_at_once:
            self._resolve_at = 0.0  # publish the ones attached at once, without waiting for the next round
        metrics.BATCH_SECONDS.observe(time.perf_counter() - pending.started)

    def schedule_resolve(self) -> None:
        """Start a round over pending feedback in the writer thread when one is due and none is running.

        Rounds run after the batch writes queued before them, on the writer's connection. An error
        that is not a retryable database or Kafka error propagates here and stops the consumer.
        """
        running = self._resolving
        if running is not None:
            if not running.done():
                return
            self._resolving = None
            running.result()
        if time.monotonic() >= self._resolve_at:
            self._resolve_at = time.monotonic() + self.resolve_conf.retry_s
            self._resolving = self._executor.submit(self.resolve_pending)

    def resolve_pending(self) -> ResolveResult | None:
        """One round of :func:`ingest.pending.resolve_round`; a database or Kafka failure is retried next round."""
        try:
            result = resolve_round(self.writer.connection(), self.producer, self.topic, self.resolve_conf)
        except TRANSIENT_ERRORS as err:
            self.writer.close()
            log.warning("pending feedback round failed (%s); retrying next round", err)
            return None
        except KafkaError as err:
            log.warning("resolved feedback not acknowledged by Kafka (%s); retrying next round", err)
            return None
        if result.claimed >= self.resolve_conf.limit:
            self._resolve_at = 0.0  # a full round: more may be due now
        return result

    @staticmethod
    def _count(batch: BatchResult, result: WriteResult, dead: Sequence[DeadLetterRow]) -> None:
        metrics.WRITTEN.inc(result.inserted)
        metrics.DUPLICATES.inc(result.duplicates + batch.in_batch_duplicates)
        metrics.ORPHAN_FEEDBACK.inc(result.orphan_feedback)
        metrics.UNATTACHED_FEEDBACK.inc(result.unattached)
        for row in dead:
            metrics.DEAD_LETTERED.labels(kind=row.kind).inc()
            log.info(
                "dead letter %s[%d]@%d: %s%s", row.topic, row.partition, row.offset,
                f"{row.field}: " if row.field else "", row.reason,
            )  # fmt: skip
        for event_row in batch.events:
            unknown = unknown_fields(event_row.event)
            if unknown:  # a newer SDK's fields: stored in raw_events as they came (docs/contracts.md)
                metrics.UNKNOWN_FIELDS.labels(stage="consumer").inc()
                log.debug("event %s has fields this reader does not know: %s", event_row.event_id, unknown)

    def publish_dead_letters(self, rows: Sequence[DeadLetterRow]) -> None:
        """Produce dead letters to the DLQ topic and wait for the broker's acks, retrying until it answers."""
        if not rows:
            return
        delays = backoff_delays()
        while True:
            try:
                futures = [
                    self.producer.send(self.dlq_topic, key=row.key, value=dlq_value(row), headers=dlq_headers(row))
                    for row in rows
                ]
                for future in futures:
                    future.get(timeout=KAFKA_TIMEOUT_S)
                metrics.PRODUCED.labels(topic=self.dlq_topic).inc(len(rows))
                return
            except KafkaError as err:
                delay = next(delays)
                log.warning("publishing %d dead letters failed (%s); retrying in %.1fs", len(rows), err, delay)
                if self.stop_event.wait(delay):
                    raise Stopped() from err

    def commit(self, offsets: dict[tuple[str, int], int]) -> bool:
        """Commit offsets of partitions still assigned; a refused commit means the records are re-read."""
        assigned = self.consumer.assignment()
        to_commit = {
            TopicPartition(topic, partition): OffsetAndMetadata(offset, "", -1)
            for (topic, partition), offset in offsets.items()
            if TopicPartition(topic, partition) in assigned
        }
        if not to_commit:
            return False
        try:
            self.consumer.commit(to_commit, timeout_ms=int(KAFKA_TIMEOUT_S * 1000))
        except KafkaError as err:
            metrics.COMMIT_FAILURES.inc()
            log.warning("offset commit refused (%s); those records will be read again (no-ops)", err)
            return False
        return True

    def update_lag(self, every_s: float = 1.0) -> None:
        """Refresh the lag gauge (high-water mark minus the next offset to read) at most every ``every_s``."""
        now = time.monotonic()
        if now - self._last_lag < every_s:
            return
        self._last_lag = now
        assigned = self.consumer.assignment()
        for tp in assigned:
            highwater = self.consumer.highwater(tp)
            position = self._positions.get((tp.topic, tp.partition))
            if highwater is not None and position is not None:
                metrics.LAG.labels(partition=str(tp.partition)).set(max(0, highwater - position))
        mine = {(tp.topic, tp.partition) for tp in assigned}
        for position in [p for p in self._positions if p not in mine]:
            del self._positions[position]
            metrics.LAG.remove(str(position[1]))

    def close(self) -> None:
        """Leave the group and release the clients and the database connection."""
        try:
            self._executor.shutdown(wait=True)
            self.consumer.close(autocommit=False)
        finally:
            try:
                self.producer.close(timeout=KAFKA_TIMEOUT_S)
            finally:
                self.writer.close()


def run(
    settings: Settings, stop_event: threading.Event, *, bootstrap: str | None = None, db_url: str | None = None
) -> None:
    """Run one consumer until ``stop_event`` is set (the broker and database from settings)."""
    bootstrap = bootstrap or kafka_bootstrap(settings)
    conninfo = libpq_conninfo(db_url or postgres_url(settings))
    IngestConsumer(settings, bootstrap=bootstrap, conninfo=conninfo, stop_event=stop_event).run()
