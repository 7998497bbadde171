"""Which token-data fields the OpenAI wrapper asks for, and how it reads a server's refusal.

The refusal and retry against a real HTTP server are in
``tests/integration/test_sdk_openai_servers.py``.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import openai._base_client
import pytest

from flywheel.sdk import Flywheel
from flywheel.sdk.openai import (
    TokenDataPolicy,
    injected_fields,
    prepare_request,
    refused_fields,
    token_data_policy,
    vendor_host,
    without_fields,
    wrap,
)
from flywheel.sdk.transports.memory import MemoryTransport

httpx2 = getattr(openai._base_client, "httpx2", None) or openai._base_client.httpx
"""The HTTP library of the installed openai client (httpx2 from 3.x, httpx before)."""


def test_vendor_hosts(monkeypatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert vendor_host("https://api.openai.com/v1") and vendor_host("https://my-org.openai.azure.com/openai")
    assert vendor_host(openai.OpenAI(api_key="x").base_url)  # the client's default
    assert not vendor_host("http://127.0.0.1:18000/v1")
    assert not vendor_host("https://api.openai.com.example.net/v1")
    assert not vendor_host("https://openai.azure.com.evil.test/v1")
    assert not vendor_host("https://notapi.openai.com/v1")


def test_policy_options_by_mode_and_host() -> None:
    local, vendor = "http://127.0.0.1:8000/v1", "https://api.openai.com/v1"
    assert TokenDataPolicy("auto", local).options("m") == {
        "request_token_data": True,
        "vllm_fields": True,
        "logprobs": True,
    }
    assert TokenDataPolicy("auto", vendor).options("m")["vllm_fields"] is False
    assert TokenDataPolicy(True, vendor).options("m")["vllm_fields"] is True
    assert TokenDataPolicy(False, local).options("m")["request_token_data"] is False
    with pytest.raises(ValueError, match="request_token_data must be True, False or 'auto', got 'yes'"):
        TokenDataPolicy("yes", local)  # type: ignore[arg-type]


def test_prepare_request_without_vllm_fields_keeps_logprobs() -> None:
    out, _ = prepare_request("chat", {"model": "m"}, request_token_data=True, vllm_fields=False)
    assert "extra_body" not in out and (out["logprobs"], out["top_logprobs"]) == (True, 0)
    out, _ = prepare_request("text", {"model": "m"}, request_token_data=True, logprobs=False)
    assert out["extra_body"] == {"return_token_ids": True} and "logprobs" not in out


def error(status: int, body: dict[str, Any]) -> openai.APIStatusError:
    response = httpx2.Response(
        status, json=body, request=httpx2.Request("POST", "http://x.invalid/v1/chat/completions")
    )
    data = body.get("error", body)
    cls = {400: openai.BadRequestError, 422: openai.UnprocessableEntityError}.get(status, openai.APIStatusError)
    return cls(f"Error code: {status} - {json.dumps(data)}", response=response, body=data)


def test_refused_fields_are_the_injected_ones_the_error_names() -> None:
    injected = frozenset({"return_token_ids", "logprobs", "top_logprobs"})
    unrecognized = error(400, {"error": {"message": "Unrecognized request argument supplied: return_token_ids"}})
    assert refused_fields(unrecognized, injected) == {"return_token_ids"}
    unsupported = error(400, {"error": {"message": "Unsupported parameter", "param": "logprobs"}})
    assert refused_fields(unsupported, injected) == {"logprobs", "top_logprobs"}  # "logprobs" names the group
    responses = error(400, {"error": {"message": "'message.output_text.logprobs' is not supported with this model"}})
    assert refused_fields(responses, frozenset({"include", "top_logprobs", "enable_response_messages"})) == {
        "include",
        "top_logprobs",
    }
    other = error(400, {"error": {"message": "Unknown parameter: 'my_logprobs_flag'"}})
    assert refused_fields(other, injected) == frozenset()  # whole names only
    pydantic_style = error(422, {"detail": [{"type": "extra_forbidden", "loc": ["body", "top_logprobs"]}]})
    assert refused_fields(pydantic_style, injected) == {"top_logprobs"}
    assert refused_fields(unrecognized, frozenset({"logprobs"})) == frozenset()  # the agent's own field
    assert refused_fields(error(500, {"error": {"message": "return_token_ids"}}), injected) == frozenset()
    assert refused_fields(error(400, {"error": {"message": "bad messages"}}), injected) == frozenset()


def test_without_fields_restores_what_the_agent_gave() -> None:
    given = {"model": "m", "extra_body": {"top_k": 5}}
    prepared, _ = prepare_request("chat", given, request_token_data=True)
    assert injected_fields(given, prepared) == {"return_token_ids", "logprobs", "top_logprobs"}
    out = without_fields(prepared, given, frozenset({"return_token_ids"}))
    assert out["extra_body"] == {"top_k": 5} and out["logprobs"] is True
    out = without_fields(prepared, given, frozenset({"logprobs"}))
    assert "logprobs" not in out and "top_logprobs" not in out and out["extra_body"]["return_token_ids"] is True
    bare = {"model": "m"}
    prepared, _ = prepare_request("chat", bare, request_token_data=True)
    assert "extra_body" not in without_fields(prepared, bare, frozenset({"return_token_ids"}))
    mine = {"model": "m", "logprobs": False, "extra_body": {"return_token_ids": True}}
    prepared, _ = prepare_request("chat", mine, request_token_data=True)
    assert injected_fields(mine, prepared) == frozenset()  # the agent chose: nothing to take back


def test_a_client_of_openai_is_not_asked_for_vllm_fields(tmp_path) -> None:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        bodies.append(json.loads(request.content))
        answer = {
            "id": "c",
            "object": "chat.completion",
            "created": 1,
            "model": "gpt-x",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        }
        return httpx2.Response(200, json=answer)

    fw = Flywheel(project="openai-test", transport=MemoryTransport(), spool_dir=tmp_path)
    try:
        client = openai.OpenAI(
            api_key="x",
            base_url="https://api.openai.com/v1",
            http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
        )
        wrap(client, fw)
        with fw.session():
            client.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "hi"}])
        assert token_data_policy(client).mode == "auto"
    finally:
        fw.close(2)
    (body,) = bodies
    assert "return_token_ids" not in body and (body["logprobs"], body["top_logprobs"]) == (True, 0)
