"""The OpenAI wrapper's request preparation and response parsing, on openai's own response types.

Responses are built the way vLLM answers (``token_ids`` / ``prompt_token_ids`` as extra
fields, sampling logprobs); streams are real ``openai.Stream`` objects over a canned
server-sent-event body. The wrapper against a real vLLM is in the integration tests.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import openai._base_client
import pytest
from openai.types import Completion as TextCompletion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from flywheel.core.contracts import Completion
from flywheel.sdk import Flywheel
from flywheel.sdk.openai import (
    LoggedAsyncStream,
    LoggedStream,
    StreamAccumulator,
    _Call,
    _Observer,
    aligned_logprobs,
    as_name,
    completion_ids,
    normalize_message,
    parse_chat_completion,
    parse_text_completion,
    prepare_request,
    request_fields,
    sampling_params,
    wrap,
)
from flywheel.sdk.transports.memory import MemoryTransport

httpx2 = getattr(openai._base_client, "httpx2", None) or openai._base_client.httpx
"""The HTTP library of the installed openai client (httpx2 from 3.x, httpx before): tests build its responses."""


def chat_response(**extra: Any) -> ChatCompletion:
    return ChatCompletion.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "/models/base-v1",
            "prompt_token_ids": [1, 5, 9],
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "calling",
                        "tool_calls": [
                            {"id": "call_1", "type": "function", "function": {"name": "run", "arguments": '{"a":1}'}}
                        ],
                    },
                    "finish_reason": "tool_calls",
                    "token_ids": [11, 12, 13],
                    "logprobs": {
                        "content": [
                            {"token": t, "logprob": lp, "bytes": [], "top_logprobs": []}
                            for t, lp in (("a", -0.5), ("b", -0.25), ("c", 0.0))
                        ]
                    },
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
            **extra,
        }
    )


def test_parse_chat_completion_reads_vllm_token_data() -> None:
    (fields,) = parse_chat_completion(chat_response())
    assert fields == {
        "completion_text": "calling",
        "tool_calls": [{"id": "call_1", "name": "run", "arguments": '{"a":1}'}],
        "finish_reason": "tool_calls",
        "prompt_token_ids": [1, 5, 9],
        "completion_token_ids": [11, 12, 13],
        "logprobs": [-0.5, -0.25, 0.0],
    }


def test_parse_chat_completion_without_token_data() -> None:
    response = ChatCompletion.model_validate(
        {
            "id": "x", "object": "chat.completion", "created": 1, "model": "gpt",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        }
    )  # fmt: skip
    (fields,) = parse_chat_completion(response)
    assert (fields["completion_token_ids"], fields["logprobs"], fields["prompt_token_ids"]) == (None, None, None)


def test_parse_text_completion() -> None:
    response = TextCompletion.model_validate(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "base",
            "choices": [
                {
                    "index": 0,
                    "text": " 42",
                    "finish_reason": "length",
                    "logprobs": {"tokens": ["4", "2"], "token_logprobs": [-1.0, -0.1], "top_logprobs": None},
                    "token_ids": [52, 50],
                    "prompt_token_ids": [7, 8],
                }
            ],
        }
    )
    (fields,) = parse_text_completion(response)
    assert (fields["completion_text"], fields["completion_token_ids"], fields["logprobs"],
            fields["prompt_token_ids"]) == (" 42", [52, 50], [-1.0, -0.1], [7, 8])  # fmt: skip


def test_logprobs_are_kept_only_when_they_align() -> None:
    assert aligned_logprobs([1, 2], [-0.1, -0.2]) == [-0.1, -0.2]
    assert aligned_logprobs([1, 2], [-0.1]) is None
    assert aligned_logprobs(None, [-0.1]) is None
    assert aligned_logprobs([1], [float("-inf")]) is None
    assert aligned_logprobs([1], [None]) is None
    assert aligned_logprobs([1], [3e-7]) == [0.0]  # rounding noise above zero
    assert aligned_logprobs([1], [0.5]) is None


def test_prepare_request_adds_only_what_the_agent_left_unset() -> None:
    user_extra = {"top_k": 5}
    out, injected = prepare_request(
        "chat", {"model": "m", "stream": True, "extra_body": user_extra}, request_token_data=True
    )
    assert out["extra_body"] == {"top_k": 5, "return_token_ids": True} and user_extra == {"top_k": 5}
    assert (out["logprobs"], out["top_logprobs"], out["stream_options"], injected) == (
        True,
        0,
        {"include_usage": True},
        True,
    )
    out, injected = prepare_request(
        "chat",
        {"model": "m", "stream": True, "logprobs": True, "top_logprobs": 3, "stream_options": {"include_usage": False}},
        request_token_data=True,
    )
    assert (out["top_logprobs"], out["stream_options"], injected) == (3, {"include_usage": False}, False)
    out, _ = prepare_request("text", {"model": "m", "logprobs": openai.Omit()}, request_token_data=True)
    assert out["logprobs"] == 0
    out, injected = prepare_request("chat", {"model": "m"}, request_token_data=False)
    assert out == {"model": "m"} and not injected


def test_request_fields_normalize_messages_and_sampling() -> None:
    prior = chat_response().choices[0].message  # agents often append the response message itself
    fields = request_fields(
        "chat",
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {}}]},
                prior,
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
                {"role": "function", "name": "legacy", "content": "old"},
                {"role": "nonsense"},
            ],
            "temperature": 0.7,
            "top_p": 1.5,  # out of range: left out rather than losing the completion
            "max_completion_tokens": 64,
            "seed": 3,
            "stop": "\n",
            "extra_body": {"top_k": 20},
        },
    )
    assert fields["prompt_messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": "ok", "tool_call_id": "call_1"},
        {"role": "tool", "content": "old", "name": "legacy"},
    ]
    assert fields["sampling"] == {"temperature": 0.7, "max_tokens": 64, "seed": 3, "top_k": 20, "stop": ["\n"]}
    assert request_fields("text", {"model": "m", "prompt": "2+2="})["prompt_text"] == "2+2="
    assert normalize_message("not a message") is None


def test_sampling_records_what_shapes_the_distribution() -> None:
    from flywheel.core.contracts.events import SamplingParams

    fields = sampling_params(
        {
            "temperature": 0.7,
            "top_p": 0.9,
            "presence_penalty": 0.5,
            "frequency_penalty": openai.NOT_GIVEN,
            "logit_bias": {12: 5},
            "response_format": {"type": "json_object"},
            "tool_choice": "auto",
            "extra_body": {
                "top_k": 50,
                "min_p": 0.05,
                "repetition_penalty": 1.1,
                "min_tokens": 2,
                "guided_regex": "a+",
            },
        }
    )
    assert fields == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "logit_bias": {"12": 5.0},
        "constraints": ["structured_outputs", "response_format"],
    }
    SamplingParams.model_validate(fields)  # the contract takes what the SDK records
    forced = sampling_params({"tool_choice": {"type": "function", "function": {"name": "f"}}, "logit_bias": {"x": 1}})
    assert forced == {"constraints": ["logit_bias", "tool_choice"]}  # an unreadable bias still marks the sample
    assert sampling_params({"response_format": {"type": "text"}, "extra_body": {"bad_words": []}}) == {}


def test_policy_versions_become_valid_names() -> None:
    assert as_name("/models/base-v1") == "models/base-v1"
    assert as_name("ckpt 7 (canary)") == "ckpt_7__canary_"
    assert as_name("") is None


def chunk(choices: list[dict], **extra: Any) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate(
        {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "base", "choices": choices, **extra}
    )


def lp(*values: float) -> dict:
    return {"content": [{"token": "x", "logprob": v, "bytes": [], "top_logprobs": []} for v in values]}


CHAT_CHUNKS = [
    chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}], prompt_token_ids=[1, 2]),
    chunk([{"index": 0, "delta": {"content": "He"}, "token_ids": [7], "logprobs": lp(-0.1)}]),
    chunk(
        [
            {
                "index": 0,
                "delta": {
                    "content": "llo",
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "run", "arguments": '{"x"'},
                        }
                    ],
                },
                "token_ids": [8, 9],
                "logprobs": lp(-0.2, -0.3),
            }
        ]
    ),  # fmt: skip
    chunk(
        [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                "token_ids": [10],
                "logprobs": lp(-0.4),
                "finish_reason": "tool_calls",
            }
        ]
    ),  # fmt: skip
    chunk([], usage={"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}),
]


def test_stream_accumulator_rebuilds_the_completion() -> None:
    acc = StreamAccumulator("chat")
    for c in CHAT_CHUNKS:
        acc.add(c)
    (fields,) = acc.results()
    assert fields["completion_text"] == "Hello"
    assert fields["tool_calls"] == [{"id": "call_9", "name": "run", "arguments": '{"x": 1}'}]
    assert (fields["prompt_token_ids"], fields["completion_token_ids"]) == ([1, 2], [7, 8, 9, 10])
    assert fields["logprobs"] == [-0.1, -0.2, -0.3, -0.4] and fields["finish_reason"] == "tool_calls"
    assert acc.usage.total_tokens == 6


def sse(chunks: list[ChatCompletionChunk]) -> bytes:
    return (
        b"".join(f"data: {json.dumps(c.model_dump(exclude_none=True))}\n\n".encode() for c in chunks)
        + b"data: [DONE]\n\n"
    )


@pytest.fixture
def fw(tmp_path):
    client = Flywheel(project="openai-test", transport=MemoryTransport(), spool_dir=tmp_path)
    yield client
    client.close(2)


def stream_over(client: Any, body: bytes, cls: type) -> Any:
    request = httpx2.Request("POST", "http://vllm.invalid/v1/chat/completions")
    if cls is openai.AsyncStream:
        response = httpx2.Response(200, stream=_AsyncBody(body), request=request)
    else:
        response = httpx2.Response(200, content=body, request=request)
    return cls(cast_to=ChatCompletionChunk, response=response, client=client)


class _AsyncBody(httpx2.AsyncByteStream):
    def __init__(self, body: bytes):
        self.body = body

    async def __aiter__(self):
        yield self.body


def make_call(fw: Flywheel, session: Any, **request: Any) -> _Call:
    fields = request_fields("chat", {"model": "base", "messages": [{"role": "user", "content": "hi"}], **request})
    return _Call(fw, session, "chat", fields, 1, 0.0, policy_version="ckpt-7", served_by="replica-0")


def test_logged_stream_hides_the_injected_usage_chunk_and_logs_at_the_end(fw: Flywheel) -> None:
    client = openai.OpenAI(api_key="x", base_url="http://vllm.invalid/v1")
    with fw.session() as s:
        stream = LoggedStream.adopt(
            stream_over(client, sse(CHAT_CHUNKS), openai.Stream), _Observer(make_call(fw, s), True)
        )
        assert isinstance(stream, openai.Stream)
        received = list(stream)
    assert len(received) == len(CHAT_CHUNKS) - 1 and all(c.choices for c in received)
    assert fw.flush(10)
    (completion,) = [e for e in fw.transport.events() if isinstance(e, Completion)]
    assert (completion.policy_version, completion.served_by, completion.completion_text) == (
        "ckpt-7",
        "replica-0",
        "Hello",
    )
    assert completion.completion_token_ids == [7, 8, 9, 10] and completion.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert completion.prompt_messages[0].content == "hi"
    assert completion_ids(stream) == [completion.completion_id]


def test_a_stream_closed_early_logs_what_was_received(fw: Flywheel) -> None:
    client = openai.OpenAI(api_key="x", base_url="http://vllm.invalid/v1")
    with fw.session() as s:
        with LoggedStream.adopt(
            stream_over(client, sse(CHAT_CHUNKS), openai.Stream), _Observer(make_call(fw, s), False)
        ) as st:
            next(st)
            next(st)
    assert fw.flush(10)
    (completion,) = [e for e in fw.transport.events() if isinstance(e, Completion)]
    assert completion.completion_text == "He" and completion.finish_reason is None


async def test_logged_async_stream(fw: Flywheel) -> None:
    client = openai.AsyncOpenAI(api_key="x", base_url="http://vllm.invalid/v1")
    async with fw.asession() as s:
        raw = stream_over(client, sse(CHAT_CHUNKS), openai.AsyncStream)
        stream = LoggedAsyncStream.adopt(raw, _Observer(make_call(fw, s), True))
        received = [c async for c in stream]
    assert len(received) == len(CHAT_CHUNKS) - 1
    assert await fw.aflush(10)
    (completion,) = [e for e in fw.transport.events() if isinstance(e, Completion)]
    assert completion.completion_token_ids == [7, 8, 9, 10]
    await asyncio.sleep(0)


def test_wrap_patches_in_place_once(fw: Flywheel) -> None:
    client = openai.OpenAI(api_key="x", base_url="http://vllm.invalid/v1")
    original = client.chat.completions.create
    assert fw.wrap_openai(client) is client
    patched = client.chat.completions.create
    assert patched is not original and patched.__wrapped__ == original
    assert wrap(client, fw) is client and client.chat.completions.create is patched
    with pytest.raises(TypeError):
        wrap(object(), fw)


def test_with_session_header_adds_the_session_unless_the_agent_set_it() -> None:
    from flywheel.sdk.openai import SESSION_HEADER, with_session_header

    given = {"x-trace": "1"}
    out = with_session_header({"model": "m", "extra_headers": given}, "s-1")
    assert out["extra_headers"] == {"x-trace": "1", SESSION_HEADER: "s-1"} and given == {"x-trace": "1"}
    mine = {"X-Flywheel-Session-Id": "agent-chosen"}
    assert with_session_header({"extra_headers": mine}, "s-1")["extra_headers"] == mine
    assert "extra_headers" not in with_session_header({"model": "m"}, None)
    # the span's id and role go with the session, each unless the agent set it
    out = with_session_header({"extra_headers": {"x-flywheel-agent-role": "mine"}}, "s-1", ("sub-1", "subagent"))
    assert out["extra_headers"] == {
        "x-flywheel-agent-role": "mine", SESSION_HEADER: "s-1", "x-flywheel-span-id": "sub-1",
    }  # fmt: skip


def _recording_client(seen: list[Any]) -> openai.OpenAI:
    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(200, json=chat_response().model_dump(), headers={"x-flywheel-policy-version": "ckpt-7"})

    return openai.OpenAI(
        api_key="x",
        base_url="http://router.invalid/v1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )


def test_wrapped_client_sends_the_session_header_of_its_session(tmp_path) -> None:
    seen: list[Any] = []
    fw = Flywheel(project="openai-test", transport=MemoryTransport(), spool_dir=tmp_path)
    try:
        client = fw.wrap_openai(_recording_client(seen))
        messages = [{"role": "user", "content": "hi"}]
        with fw.session() as s:
            client.chat.completions.create(model="base", messages=messages)
            client.chat.completions.create(
                model="base", messages=messages, extra_headers={"x-flywheel-session-id": "own"}
            )
        client.chat.completions.create(model="base", messages=messages)  # outside a session: no header
        unsampled = Flywheel(
            project="openai-test", transport=MemoryTransport(), spool_dir=tmp_path / "u", sample_rate=0.0
        )
        try:
            other = unsampled.wrap_openai(_recording_client(seen))
            with unsampled.session() as quiet:
                other.chat.completions.create(model="base", messages=messages)
        finally:
            unsampled.close(2)
    finally:
        fw.close(2)
    assert [r.headers.get("x-flywheel-session-id") for r in seen] == [s.session_id, "own", None, quiet.session_id]
    assert [r.headers.get("x-flywheel-span-id") for r in seen] == ["root", "root", None, "root"]
    assert [r.headers.get("x-flywheel-agent-role") for r in seen] == ["agent", "agent", None, "agent"]
