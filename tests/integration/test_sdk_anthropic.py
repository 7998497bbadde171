"""``wrap_anthropic`` with the official ``anthropic`` client against a real local HTTP server.

The server (FastAPI under uvicorn) answers ``POST /v1/messages`` in the Messages API's shapes: a
whole ``message`` JSON, or the server-sent events ``message_start``, ``content_block_start``,
``ping``, ``content_block_delta`` (``text_delta``, ``input_json_delta``), ``content_block_stop``,
``message_delta`` and ``message_stop``. The answer has a text block and a ``tool_use`` block. Each
call is logged as one ``completion`` event; what the client receives is what the server sent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from conftest import completions_by_id
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from flywheel.sdk import Flywheel
from flywheel.sdk.anthropic import completion_ids, wrap_anthropic

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.integration

MESSAGES = [
    {"role": "user", "content": "What is 3+4?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_00", "name": "calculator", "input": {"expression": "3"}}],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_00", "content": "3"}]},
]
TEXT = ["Let me", " check."]
ARGS = ['{"expression":', ' "3+4"}']


def message(model: str) -> dict[str, Any]:
    return {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [
            {"type": "text", "text": "".join(TEXT)},
            {"type": "tool_use", "id": "toolu_01", "name": "calculator", "input": {"expression": "3+4"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 9},
    }


def sse(model: str) -> list[dict[str, Any]]:
    start = {**message(model), "content": [], "stop_reason": None, "usage": {"input_tokens": 12, "output_tokens": 1}}
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": start},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
    ]
    events += [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}} for t in TEXT]
    events += [
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_01", "name": "calculator", "input": {}},
        },
    ]
    events += [
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": p}}
        for p in ARGS
    ]
    events += [
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 9},
        },
        {"type": "message_stop"},
    ]
    return events


def messages_app(seen: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        body = await request.json()
        seen.append(body)
        key = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        if key != "test-key" or not request.headers.get("anthropic-version"):  # the client sends the key either way
            error = {"type": "authentication_error", "message": "invalid x-api-key"}
            return JSONResponse({"type": "error", "error": error}, status_code=401)
        if not body.get("stream"):
            return message(body["model"])

        def events() -> Any:
            for event in sse(body["model"]):
                yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def fw(memory_flywheel: Callable[[str], Flywheel]) -> Flywheel:
    return memory_flywheel("anthropic-test")


def test_messages_create_whole_and_streamed(serve_app, fw: Flywheel) -> None:
    seen: list[dict[str, Any]] = []
    with serve_app(messages_app(seen)) as server:
        client = wrap_anthropic(anthropic.Anthropic(base_url=server.url, api_key="test-key", max_retries=0), fw)
        common = {"model": "claude-test", "max_tokens": 64, "system": "Use the calculator.", "messages": MESSAGES}
        with fw.session() as s:
            whole = client.messages.create(**common, extra_body={"temperature": 0.5, "top_k": 20})
            stream = client.messages.create(**common, stream=True)
            events = list(stream)
        outside = client.messages.create(**common)
    assert whole.content[1].input == {"expression": "3+4"} and whole.stop_reason == "tool_use"  # unchanged
    assert [e.type for e in events] == [e["type"] for e in sse("claude-test") if e["type"] != "ping"]  # as unwrapped
    assert completion_ids(outside) == [] and len(seen) == 3
    assert "session" not in seen[0] and seen[0]["temperature"] == 0.5
    by_id = completions_by_id(fw)
    assert len(by_id) == 2 and {e.session_id for e in by_id.values()} == {s.session_id}
    first = by_id[completion_ids(whole)[0]]
    assert [(m.role, m.content, m.tool_call_id) for m in first.prompt_messages] == [
        ("system", "Use the calculator.", None),
        ("user", "What is 3+4?", None),
        ("assistant", "", None),
        ("tool", "3", "toolu_00"),
    ]
    assert first.completion_text == "Let me check." and first.finish_reason == "tool_calls"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in first.tool_calls] == [
        ("toolu_01", "calculator", {"expression": "3+4"})
    ]
    assert (first.sampling.max_tokens, first.sampling.temperature, first.sampling.top_k) == (64, 0.5, 20)
    assert first.policy_version == "claude-test" and first.completion_token_ids is None and first.latency_ms > 0
    second = by_id[completion_ids(stream)[0]]
    assert second.completion_text == "Let me check." and second.finish_reason == "tool_calls"
    assert [(c.id, c.arguments) for c in second.tool_calls] == [("toolu_01", "".join(ARGS))]


def test_messages_stream_helper_whole_and_left_early(serve_app, fw: Flywheel) -> None:
    with serve_app(messages_app([])) as server:
        client = wrap_anthropic(anthropic.Anthropic(base_url=server.url, api_key="test-key", max_retries=0), fw)
        common = {"model": "claude-test", "max_tokens": 64, "messages": MESSAGES[:1]}
        with fw.session() as s:
            with client.messages.stream(**common) as whole:
                final = whole.get_final_message()
        with client.messages.stream(**common, session=fw.session(s.session_id, resume=True)) as early:
            for event in early:
                if event.type == "text":
                    break  # left after the first text: what was received is logged
    assert final.content[0].text == "Let me check."
    by_id = completions_by_id(fw)
    assert len(by_id) == 2
    done = by_id[completion_ids(whole)[0]]
    assert done.completion_text == "Let me check." and done.finish_reason == "tool_calls" and done.tool_calls
    partial = by_id[completion_ids(early)[0]]
    assert partial.session_id == s.session_id
    assert partial.completion_text == "Let me" and partial.finish_reason is None and not partial.tool_calls


def test_async_client(serve_app, fw: Flywheel) -> None:
    with serve_app(messages_app([])) as server:
        client = wrap_anthropic(anthropic.AsyncAnthropic(base_url=server.url, api_key="test-key", max_retries=0), fw)
        common = {"model": "claude-test", "max_tokens": 64, "messages": MESSAGES[:1]}

        async def calls() -> tuple[Any, Any, Any]:
            async with fw.asession():
                whole = await client.messages.create(**common)
                stream = await client.messages.create(**common, stream=True)
                _ = [event async for event in stream]
                async with client.messages.stream(**common) as helper:
                    await helper.get_final_message()
                return whole, stream, helper

        whole, stream, helper = asyncio.run(calls())
    by_id = completions_by_id(fw)
    assert len(by_id) == 3
    for response in (whole, stream, helper):
        event = by_id[completion_ids(response)[0]]
        assert event.completion_text == "Let me check." and event.finish_reason == "tool_calls"


def test_wrap_anthropic_refuses_other_clients(fw: Flywheel) -> None:
    with pytest.raises(TypeError, match="expected an anthropic.Anthropic or anthropic.AsyncAnthropic client"):
        wrap_anthropic(object(), fw)
    client = anthropic.Anthropic(base_url="http://127.0.0.1:9", api_key="x")
    assert wrap_anthropic(client, fw) is client and wrap_anthropic(client, fw).messages.create is client.messages.create
