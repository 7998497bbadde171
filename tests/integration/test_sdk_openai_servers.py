"""``wrap_openai`` against servers other than vLLM, and against vLLM with the default ``"auto"``.

1. A real HTTP server (FastAPI under uvicorn) that refuses unknown request fields the way
   OpenAI's API does (HTTP 400, ``invalid_request_error``, "Unrecognized request argument
   supplied: ...") and, for one model, refuses ``logprobs`` the way OpenAI's reasoning models do
   (``unsupported_parameter``). The wrapped official client gets its answer, the call is made once
   more without the refused field, the next calls no longer send it, and the completion is logged.
2. The real vLLM replica with the default ``"auto"``: vLLM's own fields are still asked for and
   the token ids still come.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from flywheel.core.contracts import Completion
from flywheel.sdk import Flywheel
from flywheel.sdk.openai import completion_ids, token_data_policy, wrap

pytestmark = pytest.mark.integration

CHAT_FIELDS = frozenset(
    "messages model audio frequency_penalty function_call functions logit_bias logprobs max_completion_tokens "
    "max_tokens metadata modalities n parallel_tool_calls prediction presence_penalty prompt_cache_key "
    "reasoning_effort response_format safety_identifier seed service_tier stop store stream stream_options "
    "temperature tool_choice tools top_logprobs top_p user verbosity web_search_options".split()
)
"""The chat completion request fields OpenAI's API accepts."""
NO_LOGPROBS_MODEL = "reasoner-1"


def openai_like_app(seen: list[dict[str, Any]]) -> FastAPI:
    """A chat completions server that validates request fields as OpenAI's API does."""
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        seen.append(body)
        unknown = sorted(set(body) - CHAT_FIELDS)
        if unknown:
            return JSONResponse(
                {
                    "error": {
                        "message": f"Unrecognized request argument supplied: {', '.join(unknown)}",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                },
                status_code=400,
            )
        if body["model"] == NO_LOGPROBS_MODEL and "logprobs" in body:
            return JSONResponse(
                {
                    "error": {
                        "message": "Unsupported parameter: 'logprobs' is not supported with this model.",
                        "type": "invalid_request_error",
                        "param": "logprobs",
                        "code": "unsupported_parameter",
                    }
                },
                status_code=400,
            )
        tokens = [("Hel", -0.5), ("lo", -0.25)]
        logprobs = (
            {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []} for t, lp in tokens]}
            if body.get("logprobs")
            else None
        )
        base = {"id": "chatcmpl-1", "created": 1, "model": body["model"]}
        if body.get("stream"):

            def events() -> Any:
                for i, (text, _) in enumerate(tokens):
                    choice = {
                        "index": 0,
                        "delta": {"role": "assistant", "content": text} if i == 0 else {"content": text},
                    }
                    if logprobs:
                        choice["logprobs"] = {"content": [logprobs["content"][i]]}
                    choice["finish_reason"] = "stop" if i == len(tokens) - 1 else None
                    yield f"data: {json.dumps({**base, 'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
                    chunk = {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return {
            **base,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello"},
                    "finish_reason": "stop",
                    "logprobs": logprobs,
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }

    return app


@pytest.fixture
def fw(memory_flywheel: Callable[[str], Flywheel]) -> Flywheel:
    return memory_flywheel("openai-servers")


def completions(fw: Flywheel) -> list[Completion]:
    assert fw.flush(10)
    return [e for e in fw.transport.events() if isinstance(e, Completion)]


def test_a_server_refusing_vllm_fields_gets_the_call_again_without_them(serve_app, fw: Flywheel, caplog) -> None:
    seen: list[dict[str, Any]] = []
    messages = [{"role": "user", "content": "hi"}]
    with serve_app(openai_like_app(seen)) as server:
        client = wrap(openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0), fw)
        with caplog.at_level("WARNING", logger="flywheel.sdk"), fw.session() as s:
            first = client.chat.completions.create(model="gpt-like", messages=messages, temperature=0.5)
            second = client.chat.completions.create(model="gpt-like", messages=messages)
            streamed = client.chat.completions.create(model="gpt-like", messages=messages, stream=True)
            chunks = list(streamed)
            with pytest.raises(openai.BadRequestError, match="not_a_field"):  # the agent's own mistake: no retry
                client.chat.completions.create(model="gpt-like", messages=messages, extra_body={"not_a_field": 1})
    # the first call was refused for return_token_ids and made again without it; later calls never send it
    assert [("return_token_ids" in body, body.get("logprobs")) for body in seen[:4]] == [
        (True, True),
        (False, True),
        (False, True),
        (False, True),
    ]
    assert len(seen) == 5 and seen[4]["not_a_field"] == 1
    assert first.choices[0].message.content == "Hello" and second.choices[0].message.content == "Hello"
    assert [c.choices[0].delta.content for c in chunks] == ["Hel", "lo"]  # the usage chunk stays hidden
    assert fw._counters.get("token_data_refused") == 1
    assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] == [
        "flywheel: the server refused return_token_ids (HTTP 400); the call is made again without it, and this "
        "client no longer asks for it, so its completions are logged without that token data"
    ]
    policy = token_data_policy(client)
    assert policy is not None and policy.vllm_fields is False
    logged = completions(fw)
    assert len(logged) == 3 and {c.session_id for c in logged} == {s.session_id}
    assert completion_ids(first) == [logged[0].completion_id]
    for event in logged:
        assert event.completion_text == "Hello" and event.completion_token_ids is None and event.logprobs is None
    assert logged[0].sampling.temperature == 0.5


def test_a_model_refusing_logprobs_is_called_without_them_from_then_on(serve_app, fw: Flywheel) -> None:
    seen: list[dict[str, Any]] = []
    messages = [{"role": "user", "content": "hi"}]
    with serve_app(openai_like_app(seen)) as server:
        client = wrap(openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0), fw)

        async def calls() -> list[Any]:
            async with fw.asession():
                return [
                    await client.chat.completions.create(model=NO_LOGPROBS_MODEL, messages=messages),
                    await client.chat.completions.create(model=NO_LOGPROBS_MODEL, messages=messages),
                    await client.chat.completions.create(model="gpt-like", messages=messages),
                ]

        answers = asyncio.run(calls())
    assert [a.choices[0].message.content for a in answers] == ["Hello"] * 3
    fields = [(b["model"], "return_token_ids" in b, "logprobs" in b, "top_logprobs" in b) for b in seen]
    assert fields == [
        (NO_LOGPROBS_MODEL, True, True, True),  # refused: return_token_ids (unknown to OpenAI)
        (NO_LOGPROBS_MODEL, False, True, True),  # refused: logprobs (this model)
        (NO_LOGPROBS_MODEL, False, False, False),
        (NO_LOGPROBS_MODEL, False, False, False),  # remembered for the model
        ("gpt-like", False, True, True),  # other models still give logprobs
    ]
    assert fw._counters.get("token_data_refused") == 2
    assert len(completions(fw)) == 3


def test_true_keeps_asking_for_vllm_fields_without_a_retry(serve_app, fw: Flywheel) -> None:
    seen: list[dict[str, Any]] = []
    messages = [{"role": "user", "content": "hi"}]
    with serve_app(openai_like_app(seen)) as server:
        always = wrap(
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0), fw, request_token_data=True
        )
        with fw.session(), pytest.raises(openai.BadRequestError, match="return_token_ids"):
            always.chat.completions.create(model="gpt-like", messages=messages)  # True: no retry, as before
    assert len(seen) == 1 and fw._counters.get("token_data_refused") == 0


@pytest.mark.vllm
def test_auto_still_gets_token_ids_from_vllm(vllm_replica, fw: Flywheel) -> None:
    client = wrap(openai.OpenAI(base_url=f"{vllm_replica.url}/v1", api_key="unused", max_retries=0), fw)
    with fw.session():
        chat = client.chat.completions.create(
            model=vllm_replica.model, messages=[{"role": "user", "content": "3+4="}], max_tokens=8
        )
    (event,) = completions(fw)
    assert completion_ids(chat) == [event.completion_id]
    assert event.completion_token_ids and event.prompt_token_ids
    assert event.logprobs is not None and len(event.logprobs) == len(event.completion_token_ids)
    assert fw._counters.get("token_data_refused") == 0 and token_data_policy(client).vllm_fields is True
