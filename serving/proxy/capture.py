"""Router-side capture: the completions the router proxies for a project with capture on become events.

A product that only points its OpenAI client at the router (``base_url``, a product key) gets
each completion recorded as the ``completion`` event the SDK's ``wrap_openai`` would send, into
the events topic: prompt messages or text, completion text, tool calls, finish reason, the full
sampling settings, prompt and completion token ids, sampling logprobs, the policy version and
replica that served it, the latency. The session is ``x-flywheel-session-id``, else the body's
``user``, else one session per request.

The router asks vLLM for what training needs (``return_token_ids``, the sampled tokens'
logprobs) when the client did not, and takes it out of the answer again, so the client sees
the response it asked for; streamed answers are rewritten event by event. Each completion gets
its id before the request goes upstream, and the ids (one per choice) go back in the
``x-flywheel-completion-ids`` header, so feedback can target them and a producer that also
logs the completion can reuse them: the captured event's ``event_id`` is its completion id,
so ingest keeps one of the two.

Capture never fails or holds up a request: events go into a bounded buffer that a thread
drains into Kafka; a full buffer, an oversized event or a record Kafka refuses is dropped and
counted (``flywheel_router_capture_dropped_total{reason}``).
"""

from __future__ import annotations

import copy
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import orjson

from flywheel.core import kafka_clients
from flywheel.core.contracts import headers
from flywheel.core.contracts.events import Completion, SpanRef, dump_event
from flywheel.core.contracts.ids import uuid7
from flywheel.core.contracts.topics import events_topic
from flywheel.core.endpoints import kafka_bootstrap
from flywheel.core.openai_fields import (
    Kind,
    StreamAccumulator,
    as_name,
    as_object,
    given,
    parse_chat_completion,
    parse_text_completion,
    request_fields,
)
from flywheel.core.redact import RedactFn, redact_completion
from flywheel.core.settings import Settings

log = logging.getLogger("flywheel.serving.capture")

COMPLETION_IDS_HEADER = headers.COMPLETION_IDS.encode()
try:
    PRODUCER = f"flywheel-router/{version('flywheel-rl')}"
except PackageNotFoundError:  # run from a source tree that was never installed
    PRODUCER = "flywheel-router/unknown"
"""What captured events carry as ``sdk``: the router and the installed distribution's version."""
MAX_CHOICES = 128
"""Requests asking for more choices than this are proxied but not captured."""


def _loads(body: bytes) -> tuple[Any, bool]:
    """JSON from vLLM, and whether orjson read it (several times faster than the standard library on
    answers that carry token ids and logprobs). What orjson refuses but Python's json reads (``NaN``,
    ``-Infinity`` logprobs) is read by the standard library, and must be written by it too."""
    try:
        return orjson.loads(body), True
    except orjson.JSONDecodeError:
        return json.loads(body), False


def _dumps(data: Any, fast: bool) -> bytes:
    """Compact JSON, non-ASCII kept as UTF-8, as vLLM writes it. ``fast``: ``data`` came through orjson, so
    holds no non-finite float (which orjson would write as ``null``)."""
    if fast:
        return orjson.dumps(data)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def _span_ref(span_id: str | None, role: str | None) -> SpanRef:
    """The span a request names in its headers; what is absent or not a valid name stays at the root agent's."""
    fields: dict[str, str] = {}
    if name := as_name(span_id):
        fields["span_id"] = name
    if isinstance(role, str) and 0 < len(role) <= 64:
        fields["role"] = role
    return SpanRef(**fields)


def choices(n: Any) -> int | None:
    """The number of choices a request's ``n`` asks for (1 when absent; ``true`` is 1, as vLLM reads it), or
    ``None`` for anything but a whole number from 1 to :data:`MAX_CHOICES`."""
    if n is None:
        return 1
    if isinstance(n, int) and 1 <= n <= MAX_CHOICES:
        return int(n)
    return None


class Capture:
    """One proxied request being captured: what was asked, what the client wanted back, the answer so far."""

    def __init__(
        self,
        kind: Kind,
        payload: dict[str, Any],
        project: str,
        session_id: str | None,
        span: tuple[str | None, str | None] = (None, None),
        n: int = 1,
    ):
        """``n``: the request's number of choices, as :meth:`begin` read it (:func:`choices`)."""
        self.kind = kind
        self.project = project
        self.started = time.monotonic()
        self.request = request_fields(kind, payload)
        self.request.pop("prompt_texts", None)  # a batch of text prompts: only the choices' own prompts are kept
        self.n = n
        self.ids = [uuid7() for _ in range(self.n)]
        self.session_id = as_name(session_id) or f"router-{self.ids[0]}"
        self.span = _span_ref(*span)
        self.keep_token_ids = given(payload.get("return_token_ids")) and payload["return_token_ids"] is not False
        logprobs = payload.get("logprobs")
        self.keep_logprobs = given(logprobs) and logprobs is not False
        self.stream = StreamAccumulator(kind)
        self.redacted = 0
        """Completions whose token data redaction dropped."""
        self._sse_tail = b""

    @classmethod
    def begin(
        cls,
        path: str,
        payload: dict[str, Any],
        project: str,
        session_id: str | None,
        span: tuple[str | None, str | None] = (None, None),
    ) -> Capture | None:
        """A capture of this request, after asking vLLM in ``payload`` for token ids and logprobs; None
        for a request that cannot be recorded as one completion per choice (a batch of prompts, too many choices).

        ``span``: the agent span's id and role from the request (``x-flywheel-span-id``,
        ``x-flywheel-agent-role``); absent or malformed, the session's root agent."""
        kind: Kind = "chat" if path.endswith("/chat/completions") else "text"
        prompt = payload.get("prompt")
        if kind == "text" and not isinstance(prompt, str):
            return None  # token-id prompts or a batch: no text to record against each choice
        n = choices(payload.get("n"))
        if n is None:
            return None
        capture = cls(kind, payload, project, session_id, span, n)
        payload["return_token_ids"] = True
        if not capture.keep_logprobs:
            if kind == "chat":
                payload["logprobs"] = True
                payload.setdefault("top_logprobs", 0)
            else:
                payload["logprobs"] = 0
        return capture

    @property
    def header(self) -> tuple[bytes, bytes]:
        """``x-flywheel-completion-ids``: the completion ids, one per choice in index order."""
        return COMPLETION_IDS_HEADER, ",".join(str(i) for i in self.ids).encode()

    # -- the answer ------------------------------------------------------------------------

    def whole(self, body: bytes) -> tuple[bytes, list[dict[str, Any]]]:
        """A whole JSON answer: the body the client gets (what it did not ask for taken out), and the
        fields of its choices."""
        data, fast = _loads(body)
        if not isinstance(data, dict):
            raise ValueError("the answer is not a JSON object")
        parse = parse_chat_completion if self.kind == "chat" else parse_text_completion
        results = parse(as_object(data))
        self._strip(data)
        return _dumps(data, fast), results

    def stream_chunk(self, chunk: bytes) -> bytes:
        """Some bytes of an SSE answer: the bytes the client gets, every complete event read and rewritten."""
        data = self._sse_tail + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._sse_tail = data
            return b""
        self._sse_tail = data[end + 2 :]
        out = []
        for event in data[: end + 2].split(b"\n\n")[:-1]:
            out.append(self._sse_event(event) + b"\n\n")
        return b"".join(out)

    def stream_rest(self) -> bytes:
        """What is left of a stream after its last complete event (sent as it came)."""
        rest, self._sse_tail = self._sse_tail, b""
        return rest

    def _sse_event(self, event: bytes) -> bytes:
        prefix = b"data: "
        if not event.startswith(prefix) or event.startswith(b"data: [DONE]"):
            return event
        try:
            data, fast = _loads(event[len(prefix) :])
        except ValueError:
            return event
        if not isinstance(data, dict) or "error" in data:
            return event
        self.stream.add(as_object(data))
        self._strip(data)
        return prefix + _dumps(data, fast)

    def _strip(self, data: dict[str, Any]) -> None:
        """Take out of one answer (or chunk) the fields the router asked for and the client did not."""
        if not self.keep_token_ids:
            if "prompt_token_ids" in data:
                data["prompt_token_ids"] = None
            for choice in data.get("choices") or ():
                if isinstance(choice, dict):
                    for key in ("token_ids", "prompt_token_ids"):
                        if key in choice:
                            choice[key] = None
        if not self.keep_logprobs:
            for choice in data.get("choices") or ():
                if isinstance(choice, dict) and "logprobs" in choice:
                    choice["logprobs"] = None

    # -- the events ------------------------------------------------------------------------

    def events(
        self,
        results: list[dict[str, Any]],
        policy_version: str,
        model: str | None,
        served_by: str | None,
        redactor: RedactFn | None = None,
    ) -> list[Completion]:
        """One ``completion`` event per choice (in index order) of the answer; with ``redactor``, its texts
        redacted and the token data of every text it changed dropped (counted in :attr:`redacted`)."""
        latency_ms = (time.monotonic() - self.started) * 1000.0
        events = []
        for position, fields in enumerate(results):
            index = fields.pop("index", position)
            if not isinstance(index, int) or not 0 <= index < len(self.ids):
                continue
            completion_id = self.ids[index]
            content = {**copy.deepcopy(self.request), "model": self.request.get("model") or model or "", **fields}
            if redactor is not None and redact_completion(content, redactor):
                self.redacted += 1
            events.append(
                Completion(
                    event_id=completion_id,
                    completion_id=completion_id,
                    project=self.project,
                    session_id=self.session_id,
                    sdk=PRODUCER,
                    policy_version=as_name(policy_version) or "unknown",
                    served_by=served_by,
                    span=self.span,
                    latency_ms=min(latency_ms, 86_400_000.0),
                    **content,
                )
            )
        return events

    def stream_events(
        self, policy_version: str, served_by: str | None, redactor: RedactFn | None = None
    ) -> list[Completion]:
        """The events of a stream that ended (whole or cut short: what was received)."""
        return self.events(self.stream.results(), policy_version, self.stream.model, served_by, redactor)


class CaptureSink:
    """A bounded buffer of captured events and the thread that sends them to Kafka.

    ``offer`` never blocks: a full buffer drops the event and counts it. The producer is made
    lazily by the thread (a broker down at start delays capture, never the router).
    """

    def __init__(
        self,
        settings: Settings,
        on_drop: Callable[[str, int], None],
        on_sent: Callable[[int], None],
        make_producer: Callable[[], Any] | None = None,
    ):
        self.cfg = settings.serving.capture
        self.topic = events_topic(settings.kafka.topic_prefix)
        self._settings = settings
        self._make = make_producer or self._default_producer
        self._on_drop = on_drop
        self._on_sent = on_sent
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(maxsize=self.cfg.buffer_events)
        self._thread: threading.Thread | None = None
        self._producer: Any = None

    def _default_producer(self) -> Any:
        settings = self._settings
        return kafka_clients.producer(
            kafka_bootstrap(settings),
            security=settings.kafka.security(),
            client_id="flywheel-router-capture",
            acks="all",
            linger_ms=5,
            max_request_size=max(self.cfg.max_event_bytes + 4096, 1 << 20),
        )

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="router-capture", daemon=True)
            self._thread.start()

    def offer(self, events: list[Completion]) -> None:
        """Queue the events for Kafka; drops (counted) what does not fit, never waits."""
        for event in events:
            value = dump_event(event)
            if len(value) > self.cfg.max_event_bytes:
                self._on_drop("too_large", 1)
                continue
            try:
                self._queue.put_nowait((event.kafka_key.encode(), value))
            except queue.Full:
                self._on_drop("buffer_full", 1)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            self._send(item)
        if self._producer is not None:
            try:
                self._producer.flush(10)
                self._producer.close(10)
            except Exception as err:  # noqa: BLE001 - shutting down: say so, nothing else to do
                log.warning("capture: closing the producer failed: %r", err)

    def _send(self, item: tuple[bytes, bytes]) -> None:
        key, value = item
        while self._producer is None:
            try:
                self._producer = self._make()
            except Exception as err:  # noqa: BLE001 - the broker may come later: keep the buffer, retry
                log.warning("capture: no Kafka producer yet (%r); retrying in 2 s", err)
                time.sleep(2.0)

        def done(_metadata: Any) -> None:
            self._on_sent(1)

        def failed(err: BaseException) -> None:
            log.warning("capture: Kafka refused a captured event: %r", err)
            self._on_drop("kafka_error", 1)

        try:
            self._producer.send(self.topic, key=key, value=value).add_callback(done).add_errback(failed)
        except Exception as err:  # noqa: BLE001 - one bad record must not stop the thread
            failed(err)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is buffered (within ``timeout_s``), then stop the thread."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("capture: buffer still full at shutdown; %d events not sent", self._queue.qsize())
            return
        self._thread.join(timeout_s)
        self._thread = None


def completion_ids(header: str | None) -> list[uuid.UUID]:
    """The completion ids of ``x-flywheel-completion-ids`` (empty when absent or malformed)."""
    if not header:
        return []
    try:
        return [uuid.UUID(part.strip()) for part in header.split(",") if part.strip()]
    except ValueError:
        return []
