"""OTLP spans to session events: the OpenTelemetry GenAI semantic conventions and OpenInference.

A pure mapping (no I/O), used by the gateway's ``POST /v1/traces`` (:mod:`ingest.otlp_route`).
Which spans map, and to what:

- an agent span (``gen_ai.operation.name`` ``invoke_agent``, or ``openinference.span.kind``
  ``AGENT`` / ``CHAIN``): ``span_start`` at its start and ``span_end`` at its end;
- a model call (``chat``, ``text_completion``, ``generate_content``; OpenInference ``LLM``;
  OpenLLMetry's ``llm.request.type`` ``chat`` / ``completion``): one ``completion`` (its first
  choice), without token ids, which OpenTelemetry does not carry;
- a tool span (``execute_tool``; OpenInference ``TOOL``): a ``turn`` with the tool call at its
  start and a ``turn`` with the tool result at its end, as the SDK logs them.

Message content is read from span events (``gen_ai.user.message``, ``gen_ai.choice``, ...),
from ``gen_ai.input.messages`` / ``gen_ai.output.messages`` (JSON, on the span or on its
``gen_ai.client.inference.operation.details`` event), from OpenLLMetry's flattened
``gen_ai.prompt.N.*`` / ``gen_ai.completion.N.*``, or from OpenInference's
``llm.input_messages.N.message.*`` / ``llm.output_messages.N.message.*``, whichever a span has.

Sessions: a span's ``gen_ai.conversation.id``, else ``session.id``, else the configured
attribute (``ingest.otlp.session_attribute``); else that of another span of its trace in the
same export; else its trace id (one session per trace). The first time a session is seen in an
export it gets a ``session_start``, whose event id depends on the project and session id only,
so later exports name the same event and ingest keeps one.

Event ids are derived from the project, trace id, span id and what the event is (time field:
the span's time), so a retried export produces the same ids and is not doubled downstream. A
span that cannot be mapped is returned as a :class:`Rejected` with a reason; the others are kept.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from pydantic import ValidationError

from flywheel.core.contracts.events import (
    Completion,
    EventBase,
    SessionStart,
    SpanEnd,
    SpanStart,
    Turn,
    dump_event,
)
from flywheel.core.openai_fields import MESSAGE_ROLES, as_name, content_text, normalize_message, sampling_params
from ingest.limits import Limits

AGENT, COMPLETION, TOOL = "agent", "completion", "tool"
GENAI_OPERATIONS = {
    "invoke_agent": AGENT,
    "chat": COMPLETION,
    "text_completion": COMPLETION,
    "generate_content": COMPLETION,
    "execute_tool": TOOL,
}
"""``gen_ai.operation.name`` values mapped, to what they become."""
OPENINFERENCE_KINDS = {"AGENT": AGENT, "CHAIN": AGENT, "LLM": COMPLETION, "TOOL": TOOL}
"""``openinference.span.kind`` values mapped."""
OPENLLMETRY_REQUEST_TYPES = {"chat": COMPLETION, "completion": COMPLETION}
"""OpenLLMetry's ``llm.request.type``, for its spans without ``gen_ai.operation.name``."""
SESSION_ATTRIBUTES = ("gen_ai.conversation.id", "session.id")
"""Attributes that name a span's session, in order of preference (then the configured one)."""
DETAILS_EVENT = "gen_ai.client.inference.operation.details"
"""A span event whose attributes (``gen_ai.input.messages``, ...) are read as the span's own."""
ROLE = "agent"
"""The span role of every mapped event: OpenTelemetry does not say which agent orchestrates."""
ROLE_ALIASES = {"human": "user", "ai": "assistant", "model": "assistant", "function": "tool"}

REASONS = (
    "not_genai",
    "unsupported_operation",
    "bad_ids",
    "bad_session_id",
    "no_tool_name",
    "invalid",
    "too_large",
)
"""Why a span is rejected (the ``reason`` label of ``flywheel_ingest_otlp_rejected_spans_total``):
no GenAI or OpenInference kind; a kind this mapping does not carry (embeddings, retrievers, ...);
a trace or span id of the wrong length; a session id that is not a valid name; a tool span
without a tool name; an event the contract refused (a time before 2020, ...); an event over
``ingest.max_event_bytes``."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
_INDEXED = re.compile(r"^(\d+)\.(.+)$")
_INT_SAMPLING = ("top_k", "max_tokens", "seed")
_GENAI_SAMPLING = {
    "gen_ai.request.temperature": "temperature",
    "gen_ai.request.top_p": "top_p",
    "gen_ai.request.top_k": "top_k",
    "gen_ai.request.max_tokens": "max_tokens",
    "gen_ai.request.seed": "seed",
    "gen_ai.request.frequency_penalty": "frequency_penalty",
    "gen_ai.request.presence_penalty": "presence_penalty",
    "gen_ai.request.stop_sequences": "stop",
}


@dataclass(frozen=True)
class Rejected:
    """A span that was not mapped, and why."""

    trace_id: str
    span_id: str
    reason: str
    """One of :data:`REASONS`."""
    detail: str
    """What exactly is wrong, for the export's ``partial_success.error_message``."""

    def describe(self) -> str:
        """One line naming the span and what is wrong with it."""
        return f"span {self.span_id or '?'} of trace {self.trace_id or '?'}: {self.detail}"


@dataclass
class ExportMapping:
    """What an export became: the events to produce, in order, and the spans rejected."""

    events: list[EventBase] = field(default_factory=list)
    mapped_spans: int = 0
    rejected: list[Rejected] = field(default_factory=list)

    def error_message(self, most: int = 5) -> str:
        """The partial-success message: how many spans were rejected, and the first ``most`` reasons."""
        if not self.rejected:
            return ""
        lines = [r.describe() for r in self.rejected[:most]]
        more = len(self.rejected) - most
        tail = f"; and {more} more" if more > 0 else ""
        return f"{len(self.rejected)} span(s) could not be mapped to events: " + "; ".join(lines) + tail


class SpanRefused(Exception):
    """A span that cannot be mapped (recoverable: the export's other spans are kept)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


# -- attribute values ------------------------------------------------------------------------


def any_value(value: AnyValue) -> Any:
    """An OTLP ``AnyValue`` as plain Python (kvlists as dicts, arrays as lists)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind)


def attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    """OTLP key/value pairs as a dict (a repeated key: the last wins)."""
    return {kv.key: any_value(kv.value) for kv in pairs}


def _text(value: Any) -> str | None:
    """A value as text: strings as they are, anything else as JSON."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def _json(value: Any) -> Any:
    """A JSON attribute: parsed if it is text that parses, else as it is (arrays and kvlists already are)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return None
    return value


def _indexed(attrs: Mapping[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Flattened lists: ``prefix.N.rest`` attributes as one ``{rest: value}`` dict per N, in N's order."""
    groups: dict[int, dict[str, Any]] = {}
    for key, value in attrs.items():
        if not key.startswith(prefix):
            continue
        match = _INDEXED.match(key[len(prefix) :])
        if match:
            groups.setdefault(int(match.group(1)), {})[match.group(2)] = value
    return [groups[i] for i in sorted(groups)]


# -- messages --------------------------------------------------------------------------------


@dataclass
class Output:
    """A model call's first choice."""

    text: str = ""
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    finish_reason: str | None = None


def _role(value: Any) -> str | None:
    role = ROLE_ALIASES.get(value, value) if isinstance(value, str) else None
    return role if role in MESSAGE_ROLES else None


def _message(role: Any, content: Any, *, name: Any = None, tool_call_id: Any = None) -> dict[str, Any] | None:
    role = _role(role)
    if role is None:
        return None
    message: dict[str, Any] = {"role": role, "content": content_text(_json_content(content))}
    if isinstance(name, str) and name:
        message["name"] = name[:128]
    if isinstance(tool_call_id, str) and tool_call_id:
        message["tool_call_id"] = tool_call_id[:128]
    return message


def _json_content(content: Any) -> Any:
    """Content as text or OpenAI-style parts (a JSON list of parts given as text is read as parts)."""
    if isinstance(content, str) and content.startswith("[{"):
        parsed = _json(content)
        if isinstance(parsed, list):
            return parsed
    if content is None or isinstance(content, (str, list)):
        return content
    return _text(content)


def _tool_call(call_id: Any, name: Any, arguments: Any, fallback_id: str) -> dict[str, str] | None:
    if not isinstance(name, str) or not name:
        return None
    call_id = call_id if isinstance(call_id, str) and call_id else fallback_id
    return {"id": call_id[:128], "name": name[:128], "arguments": _text(arguments) or ""}


def _openai_tool_calls(calls: Any, span_id: str) -> list[dict[str, str]]:
    """OpenAI-shaped ``tool_calls`` (``{id, function: {name, arguments}}`` or flat ``{id, name, arguments}``)."""
    out = []
    for i, call in enumerate(_json(calls) or []):
        if isinstance(call, Mapping):
            function = call.get("function") if isinstance(call.get("function"), Mapping) else call
            made = _tool_call(call.get("id"), function.get("name"), function.get("arguments"), f"{span_id}-{i}")
            if made:
                out.append(made)
    return out


def _parts_message(item: Mapping[str, Any], span_id: str) -> tuple[dict[str, Any] | None, Output]:
    """One message of ``gen_ai.input.messages`` / ``gen_ai.output.messages`` (parts), or OpenAI-shaped."""
    output = Output(finish_reason=item.get("finish_reason") if isinstance(item.get("finish_reason"), str) else None)
    parts = item.get("parts")
    if not isinstance(parts, list):
        message = normalize_message({**item, "role": _role(item.get("role"))})
        output.text = (message or {}).get("content") or ""
        output.tool_calls = _openai_tool_calls(item.get("tool_calls"), span_id)
        return message, output
    texts, call_id = [], None
    for i, part in enumerate(parts):
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("content"), str):
            texts.append(part["content"])
        elif kind == "tool_call":
            made = _tool_call(part.get("id"), part.get("name"), part.get("arguments"), f"{span_id}-{i}")
            if made:
                output.tool_calls.append(made)
        elif kind == "tool_call_response":
            call_id = part.get("id")
            texts.append(_text(part.get("response")) or "")
    output.text = "\n".join(texts)
    return _message(item.get("role"), output.text, name=item.get("name"), tool_call_id=call_id), output


def _system_instructions(value: Any) -> list[dict[str, Any]]:
    parts = _json(value)
    if isinstance(parts, str):
        return [{"role": "system", "content": parts}]
    if isinstance(parts, list):
        texts = [p["content"] for p in parts if isinstance(p, Mapping) and isinstance(p.get("content"), str)]
        if texts:
            return [{"role": "system", "content": "\n".join(texts)}]
    return []


def input_messages(span: SpanView) -> list[dict[str, Any]]:
    """The prompt messages of a model call, from whichever form the span carries."""
    a = span.attrs
    from_events = []
    for event in span.events:
        role = event.name.removeprefix("gen_ai.").removesuffix(".message")
        if event.name.startswith("gen_ai.") and event.name.endswith(".message"):
            e = event.attrs
            message = _message(e.get("role", role), e.get("content"), tool_call_id=e.get("id"))
            if message:
                from_events.append(message)
        elif event.name == "gen_ai.content.prompt":
            from_events.extend(m for m in map(normalize_message, _json(event.attrs.get("gen_ai.prompt")) or []) if m)
    if from_events:
        return from_events
    if "gen_ai.input.messages" in a or "gen_ai.system_instructions" in a:
        items = _json(a.get("gen_ai.input.messages"))
        messages = _system_instructions(a.get("gen_ai.system_instructions"))
        for item in items if isinstance(items, list) else []:
            if isinstance(item, Mapping):
                message, _ = _parts_message(item, span.span_id)
                if message:
                    messages.append(message)
        return messages
    flat = _indexed(a, "gen_ai.prompt.")
    if flat:
        return [
            m
            for m in (_message(f.get("role"), f.get("content"), tool_call_id=f.get("tool_call_id")) for f in flat)
            if m
        ]
    return [
        m
        for m in (
            _message(
                f.get("message.role"),
                f.get("message.content") or _oi_contents(f),
                name=f.get("message.name"),
                tool_call_id=f.get("message.tool_call_id"),
            )
            for f in _indexed(a, "llm.input_messages.")
        )
        if m
    ]


def _oi_contents(flat: Mapping[str, Any]) -> str | None:
    """OpenInference's multi-part ``message.contents.M.message_content.text``, joined."""
    texts = [v for k, v in sorted(flat.items()) if k.startswith("message.contents.") and k.endswith(".text")]
    return "\n".join(t for t in texts if isinstance(t, str)) or None


def output(span: SpanView) -> Output:
    """The first choice of a model call: text, tool calls, finish reason."""
    a, sid = span.attrs, span.span_id
    out = _output_from_events(span) or _output_from_attributes(a, sid)
    if out.finish_reason is None:
        reasons = a.get("gen_ai.response.finish_reasons")
        if isinstance(reasons, list) and reasons and isinstance(reasons[0], str):
            out.finish_reason = reasons[0]
        elif isinstance(reasons, str):
            out.finish_reason = reasons
    if out.finish_reason is not None:
        out.finish_reason = out.finish_reason[:32]
    return out


def _output_from_events(span: SpanView) -> Output | None:
    for event in span.events:
        e = event.attrs
        if event.name == "gen_ai.choice" and e.get("index", 0) in (0, "0"):
            message = _json(e.get("message"))
            message = message if isinstance(message, Mapping) else {}
            content = message.get("content", e.get("content"))
            calls = message.get("tool_calls", e.get("tool_calls"))
            reason = e.get("finish_reason")
            return Output(
                content_text(_json_content(content)) or "",
                _openai_tool_calls(calls, span.span_id),
                reason if isinstance(reason, str) else None,
            )
        if event.name == "gen_ai.content.completion":
            items = _json(e.get("gen_ai.completion"))
            if isinstance(items, list) and items and isinstance(items[0], Mapping):
                first = items[0].get("message", items[0])
                _, out = _parts_message(first if isinstance(first, Mapping) else {}, span.span_id)
                if out.finish_reason is None and isinstance(items[0].get("finish_reason"), str):
                    out.finish_reason = items[0]["finish_reason"]
                return out
    return None


def _output_from_attributes(a: Mapping[str, Any], span_id: str) -> Output:
    items = _json(a.get("gen_ai.output.messages"))
    if isinstance(items, list) and items and isinstance(items[0], Mapping):
        return _parts_message(items[0], span_id)[1]
    flat = _indexed(a, "gen_ai.completion.")
    if flat:
        first = flat[0]
        calls = [
            _tool_call(c.get("id"), c.get("name"), c.get("arguments"), f"{span_id}-{i}")
            for i, c in enumerate(_indexed(first, "tool_calls."))
        ]
        reason = first.get("finish_reason")
        return Output(
            content_text(_json_content(first.get("content"))) or "",
            [c for c in calls if c],
            reason if isinstance(reason, str) else None,
        )
    flat = _indexed(a, "llm.output_messages.")
    if flat:
        first = flat[0]
        calls = [
            _tool_call(
                c.get("tool_call.id"),
                c.get("tool_call.function.name"),
                c.get("tool_call.function.arguments"),
                f"{span_id}-{i}",
            )
            for i, c in enumerate(_indexed(first, "message.tool_calls."))
        ]
        text = first.get("message.content") or _oi_contents(first)
        return Output(content_text(_json_content(text)) or "", [c for c in calls if c])
    return Output()


def sampling(a: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling parameters a model call names (``gen_ai.request.*``, else ``llm.invocation_parameters``)."""
    invocation = _json(a.get("llm.invocation_parameters"))
    kwargs: dict[str, Any] = dict(invocation) if isinstance(invocation, Mapping) else {}
    for attribute, name in _GENAI_SAMPLING.items():
        if a.get(attribute) is not None:
            kwargs[name] = a[attribute]
    for name in _INT_SAMPLING:  # gen_ai.request.top_k is a double in the conventions
        value = kwargs.get(name)
        if isinstance(value, float) and value.is_integer():
            kwargs[name] = int(value)
    return sampling_params(kwargs)


# -- spans -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpanEvent:
    name: str
    attrs: dict[str, Any]


@dataclass
class SpanView:
    """One OTLP span, read: ids as hex, attributes as a dict, times as nanoseconds."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start_ns: int
    end_ns: int
    attrs: dict[str, Any]
    resource: dict[str, Any]
    events: list[SpanEvent]
    failed: bool
    status_message: str

    @classmethod
    def read(cls, span: Span, resource: dict[str, Any]) -> SpanView:
        attrs = attributes(span.attributes)
        for event in span.events:  # newer conventions may put the content attributes on this event instead
            if event.name == DETAILS_EVENT:
                for key, value in attributes(event.attributes).items():
                    attrs.setdefault(key, value)
        return cls(
            trace_id=span.trace_id.hex(),
            span_id=span.span_id.hex(),
            parent_span_id=span.parent_span_id.hex(),
            name=span.name,
            start_ns=span.start_time_unix_nano,
            end_ns=max(span.end_time_unix_nano, span.start_time_unix_nano),
            attrs=attrs,
            resource=resource,
            events=[SpanEvent(e.name, attributes(e.attributes)) for e in span.events],
            failed=span.status.code == Status.STATUS_CODE_ERROR,
            status_message=span.status.message,
        )

    def kind(self) -> str:
        """``agent``, ``completion`` or ``tool``; else raise :class:`SpanRefused`."""
        operation = self.attrs.get("gen_ai.operation.name")
        if isinstance(operation, str):
            if operation in GENAI_OPERATIONS:
                return GENAI_OPERATIONS[operation]
            raise SpanRefused("unsupported_operation", f"gen_ai.operation.name {operation!r} is not mapped")
        oi_kind = self.attrs.get("openinference.span.kind")
        if isinstance(oi_kind, str):
            if oi_kind.upper() in OPENINFERENCE_KINDS:
                return OPENINFERENCE_KINDS[oi_kind.upper()]
            raise SpanRefused("unsupported_operation", f"openinference.span.kind {oi_kind!r} is not mapped")
        request_type = self.attrs.get("llm.request.type")
        if request_type in OPENLLMETRY_REQUEST_TYPES:
            return OPENLLMETRY_REQUEST_TYPES[request_type]
        raise SpanRefused(
            "not_genai",
            f"span {self.name!r} has no gen_ai.operation.name, openinference.span.kind or llm.request.type",
        )

    def own_session(self, configured: str | None) -> str | None:
        """The session this span names itself, if any."""
        for key in (*SESSION_ATTRIBUTES, *((configured,) if configured else ())):
            for attrs in (self.attrs, self.resource):
                value = attrs.get(key)
                if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
                    return str(value)
        return None

    @property
    def parent_ref(self) -> dict[str, str]:
        """The ``SpanRef`` of what this span logs into: its parent span (``root`` when it has none)."""
        return {"span_id": self.parent_span_id or "root", "role": ROLE}


def event_id(project: str, trace_id: str, span_id: str, what: str, at_ns: int) -> uuid.UUID:
    """A UUIDv7 for one event of one span: its time field ``at_ns``'s milliseconds, the rest a hash of
    project, trace id, span id and ``what`` (so a retried export gets the same ids)."""
    digest = hashlib.sha256(f"{project}\0{trace_id}\0{span_id}\0{what}".encode()).digest()
    return _uuid7(at_ns // 1_000_000, int.from_bytes(digest[:10], "big"))


def session_start_id(project: str, session_id: str) -> uuid.UUID:
    """The ``session_start`` of a session seen over OTLP: from the project and session id alone (every
    export names the same event); its time field is zero, since it cannot depend on the export."""
    digest = hashlib.sha256(f"{project}\0{session_id}\0session_start".encode()).digest()
    return _uuid7(0, int.from_bytes(digest[:10], "big"))


def _uuid7(ms: int, bits: int) -> uuid.UUID:
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= ((bits >> 62) & 0xFFF) << 64
    value |= 0b10 << 62
    value |= bits & ((1 << 62) - 1)
    return uuid.UUID(int=value)


def _time(ns: int) -> datetime:
    return datetime.fromtimestamp(ns / 1e9, UTC)


def span_events(span: SpanView, project: str, session_id: str) -> list[EventBase]:
    """The events of one span (raise :class:`SpanRefused` when it cannot be mapped)."""
    kind = span.kind()
    common = {"project": project, "session_id": session_id}

    def build(cls: type[EventBase], what: str, at_ns: int, **fields: Any) -> EventBase:
        eid = event_id(project, span.trace_id, span.span_id, what, at_ns)
        try:
            return cls.model_validate({**common, "event_id": eid, "occurred_at": _time(at_ns), **fields})
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise SpanRefused("invalid", f"its {what} event is refused: {where}: {first['msg']}") from None

    a = span.attrs
    if kind == AGENT:
        assignment = _text(a.get("input.value")) or _last_user_text(span)
        result = _text(a.get("output.value")) or output(span).text or None
        if span.failed and not result:
            result = span.status_message or None
        return [
            build(
                SpanStart,
                "span_start",
                span.start_ns,
                span_id=span.span_id,
                parent_span_id=span.parent_span_id or "root",
                role=ROLE,
                assignment=assignment,
            ),
            build(
                SpanEnd,
                "span_end",
                span.end_ns,
                span_id=span.span_id,
                status="failed" if span.failed else "completed",
                result=result,
            ),
        ]
    if kind == TOOL:
        name = a.get("gen_ai.tool.name") or a.get("tool.name")
        call = _tool_call(
            a.get("gen_ai.tool.call.id"),
            name,
            a.get("gen_ai.tool.call.arguments", a.get("input.value")),
            span.span_id,
        )
        if call is None:
            raise SpanRefused("no_tool_name", "tool span has no gen_ai.tool.name or tool.name")
        content = a.get("gen_ai.tool.call.result", a.get("output.value"))
        if content is None and span.failed:
            content = span.status_message
        tool_result = {"tool_call_id": call["id"], "content": _text(content) or "", "is_error": span.failed}
        return [
            build(Turn, "tool_call", span.start_ns, span=span.parent_ref, tool_calls=[call]),
            build(Turn, "tool_result", span.end_ns, span=span.parent_ref, tool_results=[tool_result]),
        ]
    model = a.get("gen_ai.response.model") or a.get("gen_ai.request.model") or a.get("llm.model_name") or "unknown"
    model = _text(model)[:256]
    messages = input_messages(span)
    text_prompt = a.get("gen_ai.operation.name") == "text_completion" or a.get("llm.request.type") == "completion"
    prompt: dict[str, Any] = {"prompt_messages": messages}
    if text_prompt:
        prompts = a.get("llm.prompts")
        joined = "\n".join(m["content"] or "" for m in messages)
        prompt = {"prompt_text": prompts[0] if isinstance(prompts, list) and prompts else joined}
    out = output(span)
    eid = event_id(project, span.trace_id, span.span_id, "completion", span.start_ns)
    return [
        build(
            Completion,
            "completion",
            span.start_ns,
            completion_id=eid,
            span=span.parent_ref,
            model=model,
            policy_version=as_name(model) or "unknown",
            **prompt,
            completion_text=out.text,
            tool_calls=out.tool_calls,
            finish_reason=out.finish_reason,
            sampling=sampling(a),
            latency_ms=min((span.end_ns - span.start_ns) / 1e6, 86_400_000),
        )
    ]


def _last_user_text(span: SpanView) -> str | None:
    users = [m for m in input_messages(span) if m["role"] == "user" and m.get("content")]
    return users[-1]["content"] if users else None


def _sessions(spans: Sequence[SpanView], configured: str | None) -> dict[str, str]:
    """trace id -> the first session named by a span of that trace in this export."""
    found: dict[str, str] = {}
    for span in spans:
        if span.trace_id not in found:
            own = span.own_session(configured)
            if own is not None:
                found[span.trace_id] = own
    return found


def read_spans(request: ExportTraceServiceRequest) -> list[SpanView]:
    """Every span of an export, in order, with its resource's attributes."""
    spans = []
    for resource_spans in request.resource_spans:
        resource = attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            spans.extend(SpanView.read(span, resource) for span in scope_spans.spans)
    return spans


def map_export(
    request: ExportTraceServiceRequest,
    project: str,
    *,
    session_attribute: str | None = None,
    limits: Limits | None = None,
) -> ExportMapping:
    """The events of an export for ``project``'s write key, and the spans that could not be mapped."""
    limits = limits or Limits()
    spans = read_spans(request)
    by_trace = _sessions(spans, session_attribute)
    result = ExportMapping()
    sessions: dict[str, list[tuple[SpanView, list[EventBase]]]] = {}
    for span in spans:
        try:
            if len(span.trace_id) != 32 or len(span.span_id) != 16 or len(span.parent_span_id) not in (0, 16):
                raise SpanRefused(
                    "bad_ids", "trace id must be 16 bytes, span id and parent span id 8 bytes (parent may be empty)"
                )
            span.kind()  # the span is refused for what it is before its session is looked at
            session_id = span.own_session(session_attribute) or by_trace.get(span.trace_id) or span.trace_id
            if not _NAME.match(session_id):
                raise SpanRefused(
                    "bad_session_id",
                    f"session id {session_id[:80]!r} is not a valid name (1-128 of A-Z a-z 0-9 . _ : @ / -, "
                    "starting with a letter or digit)",
                )
            events = span_events(span, project, session_id)
            for event in events:
                problem = limits.size_problem(len(dump_event(event)))
                if problem:
                    raise SpanRefused("too_large", f"its {event.type} event is refused: {problem}")
        except SpanRefused as refused:
            result.rejected.append(Rejected(span.trace_id, span.span_id, refused.reason, refused.detail))
            continue
        sessions.setdefault(session_id, []).append((span, events))
        result.mapped_spans += 1
    for session_id, mapped in sessions.items():
        result.events.append(_session_start(project, session_id, [span for span, _ in mapped]))
        for _, events in mapped:
            result.events.extend(events)
    return result


def _session_start(project: str, session_id: str, spans: Sequence[SpanView]) -> SessionStart:
    """The session's ``session_start``: at its earliest span's start, its agent the first ``gen_ai.agent.name``
    among them (else the resource's ``service.name``), its user the first ``user.id`` / ``enduser.id``."""

    def first(*keys: str) -> Any:
        return next((span.attrs[k] for span in spans for k in keys if span.attrs.get(k)), None)

    agent = first("gen_ai.agent.name") or spans[0].resource.get("service.name")
    user = first("user.id", "enduser.id")
    return SessionStart(
        event_id=session_start_id(project, session_id),
        project=project,
        session_id=session_id,
        occurred_at=_time(min(span.start_ns for span in spans)),
        user_id=user if isinstance(user, str) and _NAME.match(user) else None,
        agent=_text(agent)[:128] if agent else None,
    )
