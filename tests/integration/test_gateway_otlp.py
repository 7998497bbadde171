"""OTLP intake: the real OpenTelemetry SDK exporting to the gateway's /v1/traces, over a real uvicorn
server, Kafka broker and Postgres, and the events read back from raw_events as the consumer wrote them."""

from __future__ import annotations

import gzip
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg
import pytest
from conftest import running_gateway
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

from flywheel.core.db.migrate import upgrade
from flywheel.core.settings import Settings

pytestmark = pytest.mark.integration


@dataclass
class Gateway:
    url: str
    settings: Settings
    db: str
    project: str
    key: str

    def post(self, body: bytes, content_type: str, **headers: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": content_type, **headers}
        return httpx.post(f"{self.url}/v1/traces", content=body, headers=headers, timeout=30)

    def rows(self, session_id: str) -> list[dict[str, Any]]:
        """The raw_events payloads of one session of the project, by time."""
        with psycopg.connect(self.db) as conn:
            cur = conn.execute(
                "SELECT payload FROM raw_events WHERE project = %s AND session_id = %s ORDER BY occurred_at, event_id",
                (self.project, session_id),
            )
            return [row[0] for row in cur.fetchall()]


@pytest.fixture(scope="module")
def gateway(kafka_bootstrap: str, pg_url: str) -> Iterator[Gateway]:
    """The gateway (uvicorn, real producer, keys in Postgres) and an ingest consumer writing raw_events."""
    upgrade(pg_url)
    ingest = {"max_body_bytes": 200_000, "max_event_bytes": 50_000, "otlp": {"session_attribute": "app.thread_id"}}
    with running_gateway(
        kafka_bootstrap, pg_url, name="otlp", project="otlp", key_name="otlp-test", ingest=ingest, consume=True
    ) as run:
        yield Gateway(run.url, run.settings, run.conninfo, run.project, run.key)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def given(sampling: dict[str, Any]) -> dict[str, Any]:
    """The sampling parameters that were set (the stored JSON also has the empty lists and maps)."""
    return {k: v for k, v in sampling.items() if v not in ([], {})}


class RecordingExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP exporter, remembering what each export returned."""

    results: list[SpanExportResult]

    def export(self, spans):
        result = super().export(spans)
        self.results.append(result)
        return result


def test_the_opentelemetry_sdk_exports_genai_spans_that_become_events_in_raw_events(gateway):
    conversation = f"conv-{uuid.uuid4().hex[:8]}"
    exporter = RecordingExporter(
        endpoint=f"{gateway.url}/v1/traces",
        headers={"authorization": f"Bearer {gateway.key}"},
        compression=Compression.Gzip,
    )
    exporter.results = []
    provider = TracerProvider(resource=Resource.create({"service.name": "support-bot"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracer = provider.get_tracer("test-agent")
    for turn, question in enumerate(("Where is order 7?", "And order 8?")):  # two traces, one conversation
        agent_attrs = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "triage"}
        agent_attrs["gen_ai.conversation.id"] = conversation  # only on the agent span: its children join by trace
        with tracer.start_as_current_span("invoke_agent triage", attributes=agent_attrs):
            chat_attrs = {
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": "policy-v3",
                "gen_ai.response.model": "policy-v3",
                "gen_ai.request.temperature": 0.6,
                "gen_ai.request.top_p": 0.95,
                "gen_ai.request.max_tokens": 128,
            }
            with tracer.start_as_current_span("chat policy-v3", attributes=chat_attrs) as chat:
                chat.add_event("gen_ai.user.message", {"content": question})
                answer = {"content": f"Looking up order {7 + turn}.", "tool_calls": []}
                chat.add_event("gen_ai.choice", {"index": 0, "finish_reason": "stop", "message": json.dumps(answer)})
            tool_attrs = {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "lookup_order",
                "gen_ai.tool.call.id": f"call-{turn}",
                "gen_ai.tool.call.arguments": json.dumps({"order": 7 + turn}),
                "gen_ai.tool.call.result": "shipped",
            }
            with tracer.start_as_current_span("execute_tool lookup_order", attributes=tool_attrs):
                pass
    assert provider.force_flush(30_000)
    provider.shutdown()
    assert exporter.results and all(r is SpanExportResult.SUCCESS for r in exporter.results), exporter.results

    def landed() -> bool:
        return sum(row["type"] == "completion" for row in gateway.rows(conversation)) == 2

    wait_for(landed, "the two completions in raw_events")
    wait_for(lambda: len(gateway.rows(conversation)) == 11, "all of the conversation's events")
    rows = gateway.rows(conversation)
    types = [row["type"] for row in rows]
    assert types.count("session_start") == 1  # both exports named the same session_start: kept once
    assert (types.count("span_start"), types.count("span_end"), types.count("turn")) == (2, 2, 4)
    start = next(row for row in rows if row["type"] == "session_start")
    assert start["agent"] == "triage" and start["occurred_at"] <= min(row["occurred_at"] for row in rows)
    completions = [row for row in rows if row["type"] == "completion"]
    assert sorted(c["completion_text"] for c in completions) == ["Looking up order 7.", "Looking up order 8."]
    assert sorted(c["prompt_messages"][0]["content"] for c in completions) == ["And order 8?", "Where is order 7?"]
    for c in completions:
        assert c["model"] == "policy-v3" and c["policy_version"] == "policy-v3" and c["finish_reason"] == "stop"
        assert given(c["sampling"]) == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 128}
        assert "completion_token_ids" not in c and "logprobs" not in c
    agent_spans = {row["span_id"] for row in rows if row["type"] == "span_start"}
    assert {c["span"]["span_id"] for c in completions} == agent_spans  # each chat logged into its agent's span
    calls = [row["tool_calls"][0] for row in rows if row["type"] == "turn" and row.get("tool_calls")]
    results = [row["tool_results"][0] for row in rows if row["type"] == "turn" and row.get("tool_results")]
    assert sorted((c["id"], c["name"], json.loads(c["arguments"])) for c in calls) == [
        ("call-0", "lookup_order", {"order": 7}),
        ("call-1", "lookup_order", {"order": 8}),
    ]
    assert sorted((r["tool_call_id"], r["content"], r["is_error"]) for r in results) == [
        ("call-0", "shipped", False),
        ("call-1", "shipped", False),
    ]


def _json_export(trace: str, spans: list[dict[str, Any]]) -> bytes:
    now = time.time_ns()
    for n, span in enumerate(spans):
        span.setdefault("traceId", trace)
        span.setdefault("spanId", f"{n + 1:016x}")
        span.setdefault("startTimeUnixNano", str(now + n))
        span.setdefault("endTimeUnixNano", str(now + n + 1_000_000))
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}).encode()


def _attrs(**values: Any) -> list[dict[str, Any]]:
    out = []
    for key, value in values.items():
        kind = "intValue" if isinstance(value, int) else "doubleValue" if isinstance(value, float) else "stringValue"
        out.append({"key": key.replace("__", "."), "value": {kind: value}})
    return out


def test_a_json_export_with_an_unmappable_span_is_a_partial_success_and_keeps_the_others(gateway):
    trace = uuid.uuid4().hex
    thread = f"thread-{trace[:8]}"
    spans = [
        {"name": "GET /orders", "attributes": _attrs(**{"http.method": "GET", "app.thread_id": thread})},
        {
            "name": "LLM",
            "parentSpanId": f"{9:016x}",
            "attributes": _attrs(
                **{
                    "openinference.span.kind": "LLM",
                    "llm.model_name": "mistral-7b",
                    "llm.input_messages.0.message.role": "user",
                    "llm.input_messages.0.message.content": "Hi",
                    "llm.output_messages.0.message.role": "assistant",
                    "llm.output_messages.0.message.content": "Hello!",
                    "llm.invocation_parameters": json.dumps({"temperature": 0.3}),
                    "app.thread_id": thread,
                }
            ),
        },
    ]
    body = _json_export(trace, spans)
    response = gateway.post(body, "application/json")
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
    partial = response.json()["partialSuccess"]
    assert partial["rejectedSpans"] == "1"
    assert "GET /orders" in partial["errorMessage"] and f"{1:016x}" in partial["errorMessage"]
    again = gateway.post(gzip.compress(body), "application/json", **{"Content-Encoding": "gzip"})  # a retry
    assert again.status_code == 200 and again.json() == response.json()

    wait_for(lambda: any(r["type"] == "completion" for r in gateway.rows(thread)), "the LLM span's completion")
    time.sleep(1.0)  # let the retry's copies through too
    rows = gateway.rows(thread)
    assert [r["type"] for r in rows] == ["session_start", "completion"]  # the retry was not doubled
    completion = rows[1]
    assert completion["completion_text"] == "Hello!" and completion["model"] == "mistral-7b"
    assert given(completion["sampling"]) == {"temperature": 0.3} and completion["span"]["span_id"] == f"{9:016x}"


def test_protobuf_answers_in_protobuf_and_bad_bodies_are_400_naming_the_problem(gateway):
    empty = gateway.post(ExportTraceServiceRequest().SerializeToString(), "application/x-protobuf")
    assert empty.status_code == 200 and empty.headers["content-type"] == "application/x-protobuf"
    assert not ExportTraceServiceResponse.FromString(empty.content).HasField("partial_success")

    bad_json = gateway.post(b'{"resourceSpans": 5}', "application/json")
    assert bad_json.status_code == 400
    assert "resourceSpans" in bad_json.json()["detail"] and bad_json.json()["code"] == 3
    bad_hex = gateway.post(_json_export("not-hex", [{"name": "x"}]), "application/json")
    assert bad_hex.status_code == 400 and "traceId" in bad_hex.json()["detail"]
    bad_proto = gateway.post(b"\x0a\xff\xff\xff", "application/x-protobuf")
    assert bad_proto.status_code == 400 and bad_proto.headers["content-type"] == "application/x-protobuf"
    from google.rpc.status_pb2 import Status

    assert "ExportTraceServiceRequest" in Status.FromString(bad_proto.content).message
    bad_gzip = gateway.post(b"nope", "application/x-protobuf", **{"Content-Encoding": "gzip"})
    assert bad_gzip.status_code == 400
    assert gateway.post(b"{}", "text/plain").status_code == 415
    big = gzip.compress(b"\0" * 300_000)  # small on the wire, over max_body_bytes inflated
    assert gateway.post(big, "application/x-protobuf", **{"Content-Encoding": "gzip"}).status_code == 413
    assert gateway.post(b"\0" * 250_000, "application/x-protobuf").status_code == 413


def test_a_missing_or_wrong_key_is_401(gateway):
    body = ExportTraceServiceRequest().SerializeToString()
    headers = {"Content-Type": "application/x-protobuf"}
    assert httpx.post(f"{gateway.url}/v1/traces", content=body, headers=headers).status_code == 401
    headers["Authorization"] = "Bearer fwk_" + "x" * 32
    response = httpx.post(f"{gateway.url}/v1/traces", content=body, headers=headers)
    assert response.status_code == 401 and response.json()["detail"] == "unknown key"


def test_the_docs_snippet_sends_its_spans_through_the_gateway(gateway):
    """docs/ingest.md's OpenTelemetry example, run as written (only the gateway's address changed)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "ingest.md").read_text()
    section = text[text.index("## OpenTelemetry (OTLP) intake") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    line = 'GATEWAY = "http://127.0.0.1:18080"'
    assert line in code
    code = code.replace(line, f'GATEWAY = "{gateway.url}"')
    env = {**os.environ, "FLYWHEEL_WRITE_KEY": gateway.key}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: len(gateway.rows("conv-42")) == 4, "the snippet's four events")
    rows = gateway.rows("conv-42")
    assert [r["type"] for r in rows] == ["session_start", "span_start", "completion", "span_end"]
    assert rows[0]["agent"] == "triage"
    assert rows[2]["completion_text"] == "In transit."
    assert rows[2]["prompt_messages"][0]["content"] == "Where is order 7?"
    assert rows[2]["model"] == "policy-v1" and rows[2]["sampling"]["temperature"] == 0.7
