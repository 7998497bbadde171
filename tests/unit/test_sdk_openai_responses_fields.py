"""Completion fields from Responses API requests and responses (flywheel.sdk.openai_responses).

Responses are openai's own ``Response`` objects built from JSON shaped as vLLM answers; the
wrapper against a real vLLM is in ``tests/integration/test_sdk_openai_responses.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from flywheel.sdk.openai_responses import (
    LOGPROBS_INCLUDE,
    ResponsesAccumulator,
    parse_response,
    prepare_request,
    prompt_messages,
    request_fields,
)

responses_types = pytest.importorskip("openai.types.responses")  # the Responses API: openai >= 1.66


def response(output: list[dict[str, Any]], status: str = "completed", **extra: Any) -> Any:
    return responses_types.Response.model_validate(
        {
            "id": "resp_1",
            "object": "response",
            "created_at": 1,
            "model": "base",
            "status": status,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            **extra,
        }
    )


def message(text: str, logprobs: list[float] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = [{"token": "t", "bytes": [], "logprob": lp, "top_logprobs": []} for lp in logprobs]
    return {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed", "content": [part]}


def test_prepare_request_adds_only_what_the_agent_left_unset() -> None:
    out = prepare_request({"model": "m", "include": ["reasoning.encrypted_content"]}, request_token_data=True)
    assert out["include"] == ["reasoning.encrypted_content", LOGPROBS_INCLUDE] and out["top_logprobs"] == 0
    assert out["extra_body"] == {"enable_response_messages": True}
    mine = {"model": "m", "top_logprobs": 3, "include": [LOGPROBS_INCLUDE]}
    assert prepare_request(mine, request_token_data=True, vllm_fields=False) == mine
    assert prepare_request({"model": "m"}, request_token_data=False) == {"model": "m"}


def test_prompt_and_sampling_from_the_request() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "run it"}]},
        {"type": "function_call", "call_id": "c1", "name": "run", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "3 passed"},
        {"type": "reasoning", "summary": []},
    ]
    assert prompt_messages({"instructions": "be short", "input": items}) == [
        {"role": "system", "content": "be short"},
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "3 passed", "tool_call_id": "c1"},
    ]
    fields = request_fields(
        {
            "model": "m",
            "input": "hi",
            "max_output_tokens": 16,
            "temperature": 0.7,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
            "tool_choice": "required",
            "extra_body": {"top_k": 5},
        }
    )
    assert fields["prompt_messages"] == [{"role": "user", "content": "hi"}]
    assert fields["sampling"] == {
        "temperature": 0.7,
        "top_k": 5,
        "max_tokens": 16,
        "constraints": ["response_format", "tool_choice"],
    }


def test_parse_response_reads_vllm_token_data() -> None:
    raw = {"type": "raw_message_tokens", "message": "x"}
    answer = response(
        [message("Hello", [-0.5, -0.25, 0.0])],
        input_messages=[{**raw, "tokens": [1, 2]}],
        output_messages=[{**raw, "tokens": [7, 8, 2]}],
    )
    (fields,) = parse_response(answer)
    assert fields == {
        "completion_text": "Hello",
        "tool_calls": [],
        "finish_reason": "stop",
        "prompt_token_ids": [1, 2],
        "completion_token_ids": [7, 8, 2],
        "logprobs": [-0.5, -0.25, 0.0],
        "index": 0,
    }
    short = response([message("Hel", [-0.5])], status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    (fields,) = parse_response(short)
    assert fields["finish_reason"] == "length" and fields["completion_token_ids"] is None and fields["logprobs"] is None


def test_parse_response_reads_tool_calls() -> None:
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "run", "arguments": '{"a":1}'}
    (fields,) = parse_response(response([message("calling", None), call]))
    assert fields["tool_calls"] == [{"id": "call_1", "name": "run", "arguments": '{"a":1}'}]
    assert fields["finish_reason"] == "tool_calls" and fields["completion_text"] == "calling"


def test_accumulator_takes_the_terminal_response_or_what_was_received() -> None:
    done = response([message("Hi", None)])
    whole = ResponsesAccumulator()
    for event in (
        {"type": "response.output_text.delta", "delta": "Hi"},
        {"type": "response.completed", "response": done},
    ):
        whole.add(event)
    assert whole.results()[0]["completion_text"] == "Hi" and whole.results()[0]["finish_reason"] == "stop"
    early = ResponsesAccumulator()
    early.add({"type": "response.output_text.delta", "delta": "Hel"})
    early.add(
        {
            "type": "response.output_item.done",
            "item": {"type": "function_call", "call_id": "c", "name": "run", "arguments": "{}"},
        }
    )
    (fields,) = early.results()
    assert (fields["completion_text"], fields["finish_reason"], fields["tool_calls"][0]["id"]) == ("Hel", None, "c")
