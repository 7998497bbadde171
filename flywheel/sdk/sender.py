"""The background sender: turns logged records into events and gets them out of the process.

The agent's threads only append cheap tuples (:data:`Record`) to a deque. One daemon
thread, the sender, takes them in order and, for each, builds the contract model
(validation: a product bug that makes an invalid event is logged and counted, never
raised), redacts its free text, serializes it (:func:`~flywheel.core.contracts.dump_event`)
and hands batches to the transport.

Order is kept by one rule: the spool is a FIFO *in front of* the transport. Whenever the
spool holds anything, new batches are appended to it rather than sent, and the sender
replays the spool (oldest first) whenever the transport may be tried. A failed batch
goes to the spool from its first unsent event on. So a session's events reach the
broker in the order they were logged, including across outages and replay.

The sender also spools instead of sending while it is behind (the queue more than
:data:`BACKLOG_FRACTION` full), so a slow broker turns into disk writes, not into a full
queue. Only when the queue is completely full (the sender cannot even keep up with the
disk) or the spool is at its bound is an event dropped, and every drop is counted and
logged.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from flywheel.core.contracts.events import EVENT_TYPES, dump_event
from flywheel.sdk.redact import RedactFn, redact_completion, redact_fields
from flywheel.sdk.spool import Spool
from flywheel.sdk.transports.base import Envelope, Rejection, SendResult, Transport

log = logging.getLogger("flywheel.sdk")

Fields = dict[str, Any] | tuple[Any, ...]
"""A record's type fields: a dict in the contract's shape, or a compact tuple (see :func:`expand`)."""
Record = tuple[str, str, str | None, Fields, int, float]
"""What the hot path enqueues: (event type, project, session id, type fields, event id as int, unix time).

The session id is ``None`` only for feedback by completion id alone, keyed by its completion id.

The hottest calls enqueue only atoms and tuples of atoms (the event id as its 128-bit int,
not a ``UUID``), which the garbage collector stops tracking, so a deep queue during an
outage adds no collector work to the agent's process.
"""

BACKLOG_FRACTION = 0.75
"""Queue fill above which live batches are spooled instead of sent (the sender is behind)."""
BACKOFF_MIN_S = 0.5
"""First wait after a failed send; it doubles per failure up to ``backoff_max_s`` (SdkSettings.retry_backoff_max_s)."""
FLUSH_RETRY_S = 0.25
"""While a flush waits, the transport is retried this often, whatever the backoff."""
REPLAY_SLICE_S = 0.5
"""Longest the sender replays the spool before it looks at the live queue again."""
MIN_IDLE_WAIT_S = 0.005
"""Shortest idle poll of an empty queue (``linger_ms`` below it is raised to it)."""
LOG_EVERY_S = 10.0
"""Repeated warnings of one kind are logged at most this often (with the count since)."""


class InvalidEvent(ValueError):
    """A record that does not make a valid event (a product bug); counted, logged, never sent."""


class EventBuilder:
    """Record -> validated, redacted, serialized :class:`Envelope` (runs in the sender thread).

    ``max_completion_tokens`` and ``max_event_bytes`` (``None``: no limit but the contract's) are the
    deployment's limits (:class:`~flywheel.sdk.settings.SdkSettings`): an event over one is invalid,
    and the error names the setting, so it is refused here rather than by the gateway or ingest.
    A completion built without some of its token data because redaction changed its text
    (:func:`~flywheel.sdk.redact.redact_completion`) is counted in ``counters`` as ``token_data_redacted``.
    """

    def __init__(
        self,
        sdk: str,
        redactor: RedactFn | None,
        *,
        max_completion_tokens: int | None = None,
        max_event_bytes: int | None = None,
        counters: Counters | None = None,
    ):
        self.sdk = sdk
        self.redactor = redactor
        self.max_completion_tokens = max_completion_tokens
        self.max_event_bytes = max_event_bytes
        self.counters = counters

    def build(self, record: Record, sent_at: datetime | None = None) -> Envelope:
        """The envelope of one record; raises :class:`InvalidEvent` naming what is wrong.

        ``sent_at`` (default: now) is when the batch is handed to the transport or the spool.
        """
        kind, project, session_id, fields, event_id, occurred = record
        cls = EVENT_TYPES.get(kind)
        if cls is None:
            raise InvalidEvent(f"type: unknown event type {kind!r}")
        data = expand(fields)
        self._check_tokens(kind, data)
        _stringify_arguments(data)
        token_data_dropped = False
        if self.redactor is not None:
            try:
                if kind == "completion":
                    token_data_dropped = redact_completion(data, self.redactor)
                else:
                    redact_fields(data, self.redactor)
            except Exception as err:  # the product's own redactor: never send unredacted text
                raise InvalidEvent(f"redactor failed: {err!r}") from err
        data.update(
            event_id=uuid.UUID(int=event_id),
            project=project,
            session_id=session_id,
            occurred_at=datetime.fromtimestamp(occurred, UTC),
            sent_at=sent_at or datetime.now(UTC),
            sdk=self.sdk,
        )
        try:
            event = cls.model_validate(data)
        except ValidationError as err:
            raise InvalidEvent(_first_error(kind, err)) from None
        except (TypeError, ValueError) as err:
            raise InvalidEvent(f"{kind}: {err}") from None
        value = dump_event(event)
        if self.max_event_bytes is not None and len(value) > self.max_event_bytes:
            raise InvalidEvent(
                f"{kind}: event is {len(value)} bytes serialized, over the limit FLYWHEEL_MAX_EVENT_BYTES "
                f"(max_event_bytes) = {self.max_event_bytes}"
            )
        if token_data_dropped and self.counters is not None:
            self.counters.add("token_data_redacted")
        return Envelope(event.kafka_key.encode("utf-8"), value)

    def _check_tokens(self, kind: str, data: dict[str, Any]) -> None:
        """A completion over ``max_completion_tokens`` is invalid (checked before the costly validation)."""
        limit = self.max_completion_tokens
        if limit is None or kind != "completion":
            return
        tokens = data.get("completion_token_ids")
        if tokens is not None and hasattr(tokens, "__len__") and len(tokens) > limit:
            raise InvalidEvent(
                f"completion.completion_token_ids: {len(tokens)} tokens, over the limit "
                f"FLYWHEEL_MAX_COMPLETION_TOKENS (max_completion_tokens) = {limit}"
            )


def _tool_call(f: tuple[Any, ...]) -> dict[str, Any]:
    _, span_id, role, call_id, name, arguments = f
    return {
        "span": {"span_id": span_id, "role": role},
        "tool_calls": [{"id": call_id, "name": name, "arguments": arguments}],
    }


def _tool_result(f: tuple[Any, ...]) -> dict[str, Any]:
    _, span_id, role, call_id, content, is_error, document_ids = f
    result = {"tool_call_id": call_id, "content": content, "is_error": is_error}
    if document_ids:
        result["document_ids"] = list(document_ids)
    return {"span": {"span_id": span_id, "role": role}, "tool_results": [result]}


def _message(f: tuple[Any, ...]) -> dict[str, Any]:
    _, span_id, role, message_role, content, name, tool_call_id = f
    message = {"role": message_role, "content": content}
    if name is not None:
        message["name"] = name
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    return {"span": {"span_id": span_id, "role": role}, "messages": [message]}


COMPACT_FORMS: dict[str, Callable[[tuple[Any, ...]], dict[str, Any]]] = {
    "tool_call": _tool_call,
    "tool_result": _tool_result,
    "message": _message,
}
"""Compact record fields of the hot calls: ``(form, span_id, span role, ...)`` tuples, expanded by the sender."""


def expand(fields: Fields) -> dict[str, Any]:
    """A record's type fields as a fresh dict in the contract's shape."""
    if isinstance(fields, tuple):
        form = COMPACT_FORMS.get(fields[0]) if fields else None
        if form is None:
            raise InvalidEvent(f"unknown compact record form {fields[:1]!r}")
        try:
            return form(fields)
        except ValueError as err:
            raise InvalidEvent(f"malformed {fields[0]} record: {err}") from None
    return dict(fields)


def _stringify_arguments(data: dict[str, Any]) -> None:
    """Tool-call arguments given as objects become the JSON text the contract wants."""
    for call in data.get("tool_calls") or ():
        if isinstance(call, dict) and not isinstance(call.get("arguments", ""), str):
            call["arguments"] = json.dumps(call["arguments"], default=str)


def _first_error(kind: str, err: ValidationError) -> str:
    first = err.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{kind}.{where}: {first['msg']}" if where else f"{kind}: {first['msg']}"


@dataclass(frozen=True)
class SdkStats:
    """Counters of one client, since it started."""

    enqueued: int
    """Events accepted from the agent (sampled sessions only)."""
    sent: int
    """Events delivered: acknowledged by Kafka or accepted by the gateway."""
    spooled: int
    """Events written to the disk spool (each is later replayed, or counted as dropped)."""
    replayed: int
    """Events delivered from the spool (part of ``sent``)."""
    dropped: int
    """Events lost: queue completely full, spool full or unwritable, or logged after close."""
    invalid: int
    """Events refused as invalid: by the SDK's own validation, the redactor, or the other side."""
    send_failures: int
    """Send attempts that failed (broker down, gateway unreachable or refusing the key); their events were kept."""
    errors: int
    """Internal errors the SDK caught to keep the agent running (each logged)."""
    token_data_redacted: int
    """Completions built without some of their token data because redaction changed the text it encodes:
    ``completion_token_ids`` and ``logprobs`` (completion text or a tool call changed), ``prompt_token_ids``
    (prompt text or a prompt message changed), or both. The trainer cannot train on them."""
    token_data_refused: int
    """Calls the OpenAI wrapper made again without a token-data field the server refused
    (``request_token_data="auto"``: ``return_token_ids``, ``logprobs``); see :mod:`flywheel.sdk.openai`."""
    queued: int
    """Records waiting in memory now."""
    spool_bytes: int
    """Bytes in the disk spool now."""


class Counters:
    """Thread-safe counters behind :class:`SdkStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        names = ("sent", "spooled", "replayed", "dropped", "invalid", "send_failures", "errors", "token_data_redacted",
                 "token_data_refused")  # fmt: skip
        self.values = {name: 0 for name in names}

    def add(self, name: str, count: int = 1) -> None:
        with self._lock:
            self.values[name] += count

    def get(self, name: str) -> int:
        return self.values[name]


class RateLimitedLog:
    """Logs the first occurrence of a kind of problem, then at most every ``every_s`` with the count since."""

    def __init__(self, every_s: float = LOG_EVERY_S):
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, level: int, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.every_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            if len(self._last) > 1000:  # bounded, however many distinct problems a product has
                self._last.clear()
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            message += f" ({suppressed} similar messages suppressed in the last {self.every_s:.0f}s)"
        log.log(level, message, *args)


class Sender:
    """The background thread that drains the queue into the transport (or the spool)."""

    def __init__(
        self,
        queue: deque[Record],
        builder: EventBuilder,
        transport: Transport,
        spool: Spool | None,
        counters: Counters,
        *,
        queue_size: int,
        batch_size: int,
        linger_s: float,
        backoff_max_s: float = 30.0,
    ):
        self.queue = queue
        self.builder = builder
        self.transport = transport
        self.spool = spool
        self.counters = counters
        self.queue_size = queue_size
        self.batch_size = batch_size
        self.idle_wait_s = max(linger_s, MIN_IDLE_WAIT_S)
        self.backoff_max_s = max(backoff_max_s, BACKOFF_MIN_S)
        self.say = RateLimitedLog()
        self._taken = 0
        self._processed = 0
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._flushers = 0
        self._backoff_s = 0.0
        self._next_attempt = 0.0
        self._last_attempt = 0.0
        self._down_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="flywheel-sender", daemon=True)

    # -- the agent's side -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def taken(self) -> int:
        """Records taken from the queue so far."""
        return self._taken

    def flush(self, timeout_s: float | None) -> bool:
        """Wait until every record enqueued before the call is delivered; ``False`` if some are still pending.

        Pending means in the queue or in the spool (e.g. the broker is down): those are
        delivered later, by this process or by the next one that claims the spool lane.
        """
        target = self._taken + len(self.queue)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._flushers += 1  # the sender skips its idle wait and retries the transport sooner
            self._wake.set()
            try:
                while not self._flushed(target):
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if not self.alive or (remaining is not None and remaining <= 0):
                        return False
                    self._cond.wait(0.05 if remaining is None else min(remaining, 0.05))
                return True
            finally:
                self._flushers -= 1

    def stop(self, timeout_s: float) -> None:
        """Stop the thread: what is still queued is sent if the transport is up, else spooled; then close."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "flywheel sender did not stop within %.1fs; %d records still queued", timeout_s, len(self.queue)
            )

    def _flushed(self, target: int) -> bool:
        return self._processed >= target and (self.spool is None or self.spool.empty)

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                records = self._take()
                try:
                    self._step(records)
                except Exception as err:  # keep the sender alive whatever happens; counted and logged
                    self._internal_error("sender step failed", err)
                self._mark_processed(len(records))
                if self._stopping.is_set() and not self.queue:
                    break
                if not records:
                    self._idle()
        finally:
            self._shutdown()

    def _take(self) -> list[Record]:
        queue, records = self.queue, []
        popleft = queue.popleft
        for _ in range(min(self.batch_size, len(queue))):
            records.append(popleft())
        self._taken += len(records)
        return records

    def _step(self, records: list[Record]) -> None:
        if records:
            self._process_live(records)
        if self.spool is not None and not self.spool.empty and self._may_attempt():
            self._replay()

    def _idle(self) -> None:
        if self._flushers or self._stopping.is_set():
            wait = FLUSH_RETRY_S if self._spool_waiting() else MIN_IDLE_WAIT_S
        elif self._spool_waiting():
            wait = min(self.idle_wait_s * 4, max(self._next_attempt - time.monotonic(), MIN_IDLE_WAIT_S))
        else:
            wait = self.idle_wait_s
        if self.queue and not self._stopping.is_set():
            return
        self._wake.wait(wait)
        self._wake.clear()

    def _spool_waiting(self) -> bool:
        return self.spool is not None and not self.spool.empty

    def _mark_processed(self, count: int) -> None:
        with self._cond:
            self._processed += count
            self._cond.notify_all()

    # -- live records -----------------------------------------------------------------------

    def _process_live(self, records: list[Record]) -> None:
        envelopes = self._build_all(records)
        if not envelopes:
            return
        if self._spool_waiting() or self._backlogged() or not self._may_attempt():
            self._to_spool(envelopes)
            return
        result = self._deliver(envelopes)
        self._count(result)
        if not result.ok:
            assert result.retry_from is not None
            self._to_spool(envelopes[result.retry_from :])

    def _build_all(self, records: list[Record]) -> list[Envelope]:
        envelopes = []
        sent_at = datetime.now(UTC)
        for record in records:
            try:
                envelopes.append(self.builder.build(record, sent_at))
            except InvalidEvent as err:
                self.counters.add("invalid")
                problem = str(err).partition(":")[0]  # e.g. "turn.messages.0.role": each problem is logged
                self.say(logging.WARNING, f"invalid:{problem}", "flywheel: invalid %s event not sent (session %s): %s",
                         record[0], record[2], err)  # fmt: skip
        return envelopes

    def _backlogged(self) -> bool:
        return self.spool is not None and len(self.queue) >= self.queue_size * BACKLOG_FRACTION

    # -- sending and replay -----------------------------------------------------------------

    def _may_attempt(self) -> bool:
        now = time.monotonic()
        if now >= self._next_attempt:
            return True
        return bool(self._flushers) and now - self._last_attempt >= FLUSH_RETRY_S

    def _deliver(self, envelopes: Sequence[Envelope]) -> SendResult:
        """Send through the transport; a failure of any kind becomes "retry the whole batch"."""
        self._last_attempt = time.monotonic()
        try:
            result = self.transport.send(envelopes)
        except Exception as err:  # a transport bug must not lose events or stop the sender
            self._internal_error(f"{self.transport.name} transport raised", err)
            result = SendResult(retry_from=0, error=f"transport raised {err!r}")
        if result.ok:
            self._recovered()
        else:
            self._failed(result)
        return result

    def _replay(self) -> None:
        assert self.spool is not None
        deadline = time.monotonic() + REPLAY_SLICE_S
        while not self.spool.empty and time.monotonic() < deadline:
            envelopes = self.spool.peek(self.batch_size)
            if not envelopes:
                break
            result = self._deliver(envelopes)
            self._count(result)
            self.counters.add("replayed", result.sent)
            self.spool.ack(len(envelopes) if result.ok else result.retry_from or 0)
            if not result.ok:
                break

    def _count(self, result: SendResult) -> None:
        self.counters.add("sent", result.sent)
        if result.rejected:
            self.counters.add("invalid", len(result.rejected))
            for rejection in result.rejected[:3]:
                self._log_rejection(rejection)

    def _log_rejection(self, rejection: Rejection) -> None:
        self.say(logging.WARNING, "rejected", "flywheel: %s refused event %s: %s%s",
                 self.transport.name, rejection.event_id or f"#{rejection.index}",
                 f"{rejection.field}: " if rejection.field else "", rejection.reason)  # fmt: skip

    def _failed(self, result: SendResult) -> None:
        self.counters.add("send_failures")
        now = time.monotonic()
        self._backoff_s = min(max(self._backoff_s * 2, BACKOFF_MIN_S), self.backoff_max_s)
        wait = result.retry_after_s if result.retry_after_s is not None else self._backoff_s
        self._next_attempt = now + wait * random.uniform(0.8, 1.2)
        if self._down_since is None:
            self._down_since = now
        spool = (
            f"events go to the spool in {self.spool.lane} ({self.spool.bytes} of {self.spool.max_bytes} bytes used)"
            if self.spool is not None
            else "no spool: events that cannot be sent are dropped"
        )
        level = logging.ERROR if result.needs_operator else logging.WARNING
        self.say(level, "down", "flywheel: %s transport cannot send (%s); %s; retrying in %.1fs",
                 self.transport.name, result.error, spool, wait)  # fmt: skip

    def _recovered(self) -> None:
        if self._down_since is not None:
            log.info("flywheel: %s transport is back after %.1fs; replaying the spool",
                     self.transport.name, time.monotonic() - self._down_since)  # fmt: skip
        self._down_since = None
        self._backoff_s = 0.0
        self._next_attempt = 0.0

    # -- the spool --------------------------------------------------------------------------

    def _to_spool(self, envelopes: Sequence[Envelope]) -> None:
        stored = 0
        if self.spool is not None:
            try:
                stored = self.spool.append(envelopes)
            except OSError as err:
                self._internal_error(f"spool write to {self.spool.lane} failed", err)
        self.counters.add("spooled", stored)
        lost = len(envelopes) - stored
        if lost:
            self.counters.add("dropped", lost)
            where = (
                f"spool full ({self.spool.bytes} of {self.spool.max_bytes} bytes in {self.spool.lane})"
                if self.spool is not None
                else "no spool"
            )
            self.say(logging.WARNING, "drop", "flywheel: DROPPED %d events: %s and the %s transport cannot "
                     "take them now; %d dropped so far (raise spool_max_bytes or fix the transport)",
                     lost, where, self.transport.name, self.counters.get("dropped"))  # fmt: skip

    # -- errors and shutdown ----------------------------------------------------------------

    def _internal_error(self, what: str, err: BaseException) -> None:
        self.counters.add("errors")
        log.error("flywheel: %s: %r", what, err, exc_info=err)

    def _shutdown(self) -> None:
        try:
            if self.spool is not None:
                self.spool.close()
        except OSError as err:
            self._internal_error("closing the spool failed", err)
        try:
            self.transport.close()
        except Exception as err:  # closing must not raise into interpreter exit; counted and logged
            self._internal_error(f"closing the {self.transport.name} transport failed", err)
        with self._cond:
            self._cond.notify_all()
