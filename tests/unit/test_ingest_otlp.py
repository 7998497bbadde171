"""The OTLP-to-events mapping (ingest.otlp) and the route's decoding (ingest.otlp_route), on built exports."""

from __future__ import annotations

import gzip
import json
import time
import zlib
from typing import Any

import pytest
from fastapi import HTTPException
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from flywheel.core.contracts import Completion, SessionStart, SpanEnd, SpanStart, Turn, dump_event, parse_event
from flywheel.core.contracts.ids import uuid7_time_ms
from ingest.limits import Limits
from ingest.otlp import map_export, session_start_id
from ingest.otlp_route import content_type, decode_export, encode, export_response, inflate

TRACE = bytes.fromhex("0af7651916cd43dd8448eb211c80319c")
NOW_NS = time.time_ns() - 60_000_000_000


def value(v: Any) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[value(x) for x in v]))
    if isinstance(v, dict):
        return AnyValue(kvlist_value=KeyValueList(values=kvs(v)))
    return AnyValue(string_value=str(v))


def kvs(attrs: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=value(v)) for k, v in attrs.items()]


def span(
    n: int,
    attrs: dict[str, Any],
    *,
    parent: int | None = None,
    events: tuple[tuple[str, dict[str, Any]], ...] = (),
    trace: bytes = TRACE,
    error: str | None = None,
    start_ns: int = NOW_NS,
    name: str = "op",
) -> Span:
    return Span(
        trace_id=trace,
        span_id=n.to_bytes(8, "big"),
        parent_span_id=parent.to_bytes(8, "big") if parent else b"",
        name=name,
        start_time_unix_nano=start_ns + n * 1_000_000,
        end_time_unix_nano=start_ns + n * 1_000_000 + 250_000_000,
        attributes=kvs(attrs),
        events=[Span.Event(name=e, time_unix_nano=start_ns, attributes=kvs(a)) for e, a in events],
        status=Status(code=Status.STATUS_CODE_ERROR, message=error) if error else Status(),
    )


def export(*spans: Span, resource: dict[str, Any] | None = None) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    resource_spans = ResourceSpans(scope_spans=[ScopeSpans(spans=list(spans))])
    resource_spans.resource.attributes.extend(kvs(resource or {"service.name": "support-bot"}))
    request.resource_spans.append(resource_spans)
    return request


def sid(n: int) -> str:
    return n.to_bytes(8, "big").hex()


def of(events: list, kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]


CHAT = {
    "gen_ai.operation.name": "chat",
    "gen_ai.request.model": "qwen-small",
    "gen_ai.response.model": "policy-v7",
    "gen_ai.request.temperature": 0.7,
    "gen_ai.request.top_p": 0.9,
    "gen_ai.request.top_k": 40.0,
    "gen_ai.request.max_tokens": 256,
    "gen_ai.response.finish_reasons": ["stop"],
    "gen_ai.usage.input_tokens": 12,
    "gen_ai.response.id": "chatcmpl-1",
}


def test_a_chat_span_with_content_in_events_becomes_a_completion_without_token_ids():
    events = (
        ("gen_ai.system.message", {"content": "Be brief."}),
        ("gen_ai.user.message", {"content": "Where is my parcel?"}),
        ("gen_ai.choice", {"index": 0, "finish_reason": "length", "message": json.dumps({"content": "In Lyon."})}),
    )
    out = map_export(export(span(2, CHAT, parent=1, events=events)), "shop")
    assert not out.rejected and out.mapped_spans == 1
    start, completion = out.events
    assert isinstance(start, SessionStart) and start.session_id == TRACE.hex() and start.agent == "support-bot"
    assert isinstance(completion, Completion)
    assert [(m.role, m.content) for m in completion.prompt_messages] == [
        ("system", "Be brief."),
        ("user", "Where is my parcel?"),
    ]
    assert completion.completion_text == "In Lyon." and completion.finish_reason == "length"
    assert completion.model == "policy-v7" and completion.policy_version == "policy-v7"
    s = completion.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.7, 0.9, 40, 256)
    assert completion.completion_token_ids is None and completion.prompt_token_ids is None
    assert completion.span.span_id == sid(1) and completion.span.role == "agent"
    assert completion.completion_id == completion.event_id
    assert completion.latency_ms == pytest.approx(250.0)
    for event in out.events:  # valid on the wire, as ingest reads it
        assert parse_event(dump_event(event)) == event


def test_content_in_input_and_output_messages_attributes_with_a_tool_call():
    attrs = {
        **CHAT,
        "gen_ai.system_instructions": json.dumps([{"type": "text", "content": "You help with orders."}]),
        "gen_ai.input.messages": json.dumps(
            [
                {"role": "user", "parts": [{"type": "text", "content": "Cancel order 7"}]},
                {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c0", "response": {"ok": True}}]},
            ]
        ),
        "gen_ai.output.messages": json.dumps(
            [
                {
                    "role": "assistant",
                    "parts": [
                        {"type": "text", "content": "Cancelling."},
                        {"type": "tool_call", "id": "c1", "name": "cancel", "arguments": {"order": 7}},
                    ],
                    "finish_reason": "tool_calls",
                }
            ]
        ),
    }
    (completion,) = of(map_export(export(span(1, attrs)), "shop").events, Completion)
    assert [(m.role, m.content, m.tool_call_id) for m in completion.prompt_messages] == [
        ("system", "You help with orders.", None),
        ("user", "Cancel order 7", None),
        ("tool", '{"ok": true}', "c0"),
    ]
    assert completion.completion_text == "Cancelling." and completion.finish_reason == "tool_calls"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in completion.tool_calls] == [("c1", "cancel", {"order": 7})]
    assert completion.span.span_id == "root"


def test_content_attributes_on_the_inference_details_event_are_read_as_the_spans():
    details = {
        "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [{"type": "text", "content": "Hi"}]}]),
        "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": "Hey"}]}]),
    }
    events = (("gen_ai.client.inference.operation.details", details),)
    (completion,) = of(map_export(export(span(1, CHAT, events=events)), "shop").events, Completion)
    assert [m.content for m in completion.prompt_messages] == ["Hi"] and completion.completion_text == "Hey"


def test_openllmetry_flattened_prompt_and_completion_attributes():
    attrs = {
        "llm.request.type": "chat",
        "gen_ai.request.model": "gpt-x",
        "gen_ai.prompt.0.role": "user",
        "gen_ai.prompt.0.content": "Weather in Oslo?",
        "gen_ai.completion.0.role": "assistant",
        "gen_ai.completion.0.content": "",
        "gen_ai.completion.0.finish_reason": "tool_calls",
        "gen_ai.completion.0.tool_calls.0.id": "t1",
        "gen_ai.completion.0.tool_calls.0.name": "weather",
        "gen_ai.completion.0.tool_calls.0.arguments": '{"city": "Oslo"}',
    }
    (completion,) = of(map_export(export(span(1, attrs)), "shop").events, Completion)
    assert [(m.role, m.content) for m in completion.prompt_messages] == [("user", "Weather in Oslo?")]
    assert completion.model == "gpt-x" and completion.finish_reason == "tool_calls"
    assert [(c.id, c.name, c.arguments) for c in completion.tool_calls] == [("t1", "weather", '{"city": "Oslo"}')]


def test_openinference_llm_span_with_invocation_parameters_and_session_id():
    attrs = {
        "openinference.span.kind": "LLM",
        "llm.model_name": "mistral-7b",
        "llm.invocation_parameters": json.dumps({"temperature": 0.2, "max_tokens": 64, "seed": 3}),
        "llm.input_messages.0.message.role": "system",
        "llm.input_messages.0.message.content": "Answer in French.",
        "llm.input_messages.1.message.role": "user",
        "llm.input_messages.1.message.content": "Hello",
        "llm.output_messages.0.message.role": "assistant",
        "llm.output_messages.0.message.content": "Bonjour",
        "session.id": "chat-42",
    }
    out = map_export(export(span(1, attrs)), "shop")
    (completion,) = of(out.events, Completion)
    assert completion.session_id == "chat-42" and completion.model == "mistral-7b"
    assert [m.content for m in completion.prompt_messages] == ["Answer in French.", "Hello"]
    assert completion.completion_text == "Bonjour"
    assert (completion.sampling.temperature, completion.sampling.max_tokens, completion.sampling.seed) == (0.2, 64, 3)


def test_an_agent_span_becomes_span_start_and_end_and_a_failure_is_kept():
    ok = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "triage", "input.value": "route #12"}
    failed = {"openinference.span.kind": "AGENT", "output.value": ""}
    out = map_export(export(span(1, ok), span(2, failed, parent=1, error="quota exceeded")), "shop")
    starts, ends = of(out.events, SpanStart), of(out.events, SpanEnd)
    assert [(s.span_id, s.parent_span_id, s.role, s.assignment) for s in starts] == [
        (sid(1), "root", "agent", "route #12"),
        (sid(2), sid(1), "agent", None),
    ]
    assert [(e.span_id, e.status, e.result) for e in ends] == [
        (sid(1), "completed", None),
        (sid(2), "failed", "quota exceeded"),
    ]
    assert starts[0].occurred_at < ends[0].occurred_at
    assert of(out.events, SessionStart)[0].agent == "triage"


def test_a_tool_span_becomes_a_tool_call_turn_and_a_tool_result_turn():
    genai = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "lookup_order",
        "gen_ai.tool.call.id": "call_9",
        "gen_ai.tool.call.arguments": '{"id": 7}',
        "gen_ai.tool.call.result": "shipped",
    }
    oi = {"openinference.span.kind": "TOOL", "tool.name": "search", "input.value": "q=x"}
    out = map_export(export(span(2, genai, parent=1), span(3, oi, parent=1, error="timeout")), "shop")
    turns = of(out.events, Turn)
    assert [(t.tool_calls[0].id, t.tool_calls[0].name, t.tool_calls[0].arguments) for t in turns if t.tool_calls] == [
        ("call_9", "lookup_order", '{"id": 7}'),
        (sid(3), "search", "q=x"),
    ]
    results = [t.tool_results[0] for t in turns if t.tool_results]
    assert [(r.tool_call_id, r.content, r.is_error) for r in results] == [
        ("call_9", "shipped", False),
        (sid(3), "timeout", True),
    ]
    assert all(t.span.span_id == sid(1) for t in turns)


def test_sessions_join_by_conversation_id_then_session_id_then_the_configured_attribute_then_the_trace():
    other = bytes.fromhex("1" * 32)
    third = bytes.fromhex("2" * 32)
    fourth = bytes.fromhex("3" * 32)
    spans = [
        span(1, {"gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "conv-1", "session.id": "s"}),
        span(2, CHAT, parent=1),  # no attribute: takes its trace's session from span 1
        span(3, {**CHAT, "session.id": "sess-2"}, trace=other),
        span(4, {**CHAT, "app.thread": "thread-3"}, trace=third),
        span(5, CHAT, trace=fourth),
    ]
    out = map_export(export(*spans), "shop", session_attribute="app.thread")
    by_span = {e.completion_id: e.session_id for e in of(out.events, Completion)}
    assert sorted(by_span.values()) == sorted(["conv-1", "sess-2", "thread-3", fourth.hex()])
    assert sorted(s.session_id for s in of(out.events, SessionStart)) == sorted(
        ["conv-1", "sess-2", "thread-3", fourth.hex()]
    )
    unconfigured = map_export(export(span(4, {**CHAT, "app.thread": "t"})), "shop")
    assert of(unconfigured.events, Completion)[0].session_id == TRACE.hex()


def test_unmappable_spans_are_rejected_with_a_reason_and_the_others_kept():
    spans = [
        span(1, {"http.method": "GET"}, name="GET /orders"),
        span(2, {"gen_ai.operation.name": "embeddings"}),
        span(3, {"gen_ai.operation.name": "execute_tool"}),
        span(4, {**CHAT, "gen_ai.conversation.id": "has space"}, trace=bytes.fromhex("4" * 32)),
        span(5, CHAT, start_ns=1_000_000_000),  # 1970: a clock error
        Span(trace_id=b"short", span_id=b"\x01" * 8, attributes=kvs(CHAT)),
        span(6, {**CHAT, "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "x" * 5000}),
        span(7, CHAT),
    ]
    out = map_export(export(*spans), "shop", limits=Limits(max_event_bytes=4000))
    reasons = [(r.span_id, r.reason) for r in out.rejected]
    assert reasons == [
        (sid(1), "not_genai"),
        (sid(2), "unsupported_operation"),
        (sid(3), "no_tool_name"),
        (sid(4), "bad_session_id"),
        (sid(5), "invalid"),
        ((b"\x01" * 8).hex(), "bad_ids"),
        (sid(6), "too_large"),
    ]
    assert out.mapped_spans == 1 and [type(e) for e in out.events] == [SessionStart, Completion]
    message = out.error_message()
    assert message.startswith("7 span(s) could not be mapped")
    assert "GET /orders" in message and "embeddings" in message and "; and 2 more" in message
    assert "occurred_at" in out.rejected[4].detail and "ingest.max_event_bytes" in out.rejected[6].detail


def test_event_ids_are_deterministic_uuid7s_per_project_and_span():
    request = export(
        span(1, {"gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "c"}),
        span(2, CHAT, parent=1),
        span(3, {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "t"}, parent=1),
    )
    first, again = map_export(request, "shop"), map_export(request, "shop")
    ids = [e.event_id for e in first.events]
    assert ids == [e.event_id for e in again.events] and len(set(ids)) == len(ids) == 6
    assert all(i.version == 7 for i in ids)
    completion = of(first.events, Completion)[0]
    assert uuid7_time_ms(completion.event_id) == (NOW_NS + 2_000_000) // 1_000_000
    other_project = {e.event_id for e in map_export(request, "other").events}
    assert not other_project & set(ids)
    later = map_export(export(span(9, {**CHAT, "gen_ai.conversation.id": "c"})), "shop")
    assert later.events[0].event_id == first.events[0].event_id == session_start_id("shop", "c")


def test_content_type_encoding_and_decoding():
    assert content_type("application/x-protobuf") == "protobuf"
    assert content_type("application/json; charset=utf-8") == "json"
    with pytest.raises(HTTPException) as err:
        content_type("text/plain")
    assert err.value.status_code == 415 and "application/x-protobuf" in err.value.detail
    body = export(span(1, CHAT)).SerializeToString()
    assert inflate(gzip.compress(body), "gzip", 10_000) == body
    assert inflate(zlib.compress(body), "deflate", 10_000) == body
    assert inflate(body, None, 10_000) == body
    for data, encoding, status in (
        (gzip.compress(b"\0" * 50_000), "gzip", 413),
        (b"not gzip", "gzip", 400),
        (gzip.compress(body)[:-12], "gzip", 400),
        (body, "br", 415),
    ):
        with pytest.raises(HTTPException) as err:
            inflate(data, encoding, 10_000)
        assert err.value.status_code == status and err.value.detail


def test_otlp_json_with_hex_ids_decodes_like_protobuf():
    request = export(span(1, CHAT, parent=3))
    data = json_format.MessageToDict(request)
    spans = data["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans[0].update(traceId=TRACE.hex(), spanId=sid(1), parentSpanId=sid(3))  # OTLP JSON: hex, not base64
    decoded = decode_export(json.dumps(data).encode(), "json")
    assert decoded == request
    assert decode_export(request.SerializeToString(), "protobuf") == request
    bad = [b"[1, 2]", b"{not json", json.dumps({"resourceSpans": 3}).encode(), b"\xff\xfe"]
    spans[0]["traceId"] = "zz"
    bad.append(json.dumps(data).encode())
    for body in bad:
        with pytest.raises(HTTPException) as err:
            decode_export(body, "json")
        assert err.value.status_code == 400 and err.value.detail
    assert "traceId" in err.value.detail and "hex" in err.value.detail
    with pytest.raises(HTTPException) as err:
        decode_export(b"\x0a\xff\xff\xff", "protobuf")
    assert err.value.status_code == 400 and "ExportTraceServiceRequest" in err.value.detail


def test_the_response_reports_partial_success_in_the_request_encoding():
    out = map_export(export(span(1, {"http.method": "GET"}), span(2, CHAT)), "shop")
    response = export_response(out)
    assert response.partial_success.rejected_spans == 1 and "not_genai" not in response.partial_success.error_message
    assert json.loads(encode(response, "json"))["partialSuccess"]["rejectedSpans"] == "1"
    assert export_response(map_export(export(span(2, CHAT)), "shop")).HasField("partial_success") is False
    assert encode(export_response(map_export(export(span(2, CHAT)), "shop")), "json") == b"{}"
