"""``wrap_openai`` on the Responses API and the structured-output helpers, against the real vLLM replica.

vLLM serves ``/v1/responses``: with ``enable_response_messages`` it returns the prompt's and the
output's token ids (``input_messages`` / ``output_messages``), and with
``include=["message.output_text.logprobs"]`` the sampled tokens' logprobs. Each call below is
logged as one ``completion`` event with the prompt, text, finish reason, sampling, token ids
and logprobs, streamed or not, through ``responses.create``, ``responses.stream``,
``responses.parse``, ``chat.completions.parse`` and ``chat.completions.stream``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import openai
import pytest
from conftest import completions_by_id

from flywheel.core.contracts import Completion
from flywheel.sdk import Flywheel
from flywheel.sdk.openai import completion_ids, wrap
from flywheel.task.arith import SYSTEM_PROMPT

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

INPUT = [{"role": "user", "content": "3+4="}]


@pytest.fixture
def fw(memory_flywheel: Callable[[str], Flywheel]) -> Flywheel:
    return memory_flywheel("openai-responses")


def assert_token_data(event: Completion, *, streamed_response: bool = False) -> None:
    assert event.prompt_token_ids and event.completion_token_ids
    if streamed_response and event.logprobs is None:
        # vLLM's streamed Responses leave out the logprob of the stop token its output_messages do list
        assert event.finish_reason == "stop"
        return
    assert event.logprobs is not None and len(event.logprobs) == len(event.completion_token_ids)


def test_responses_create_whole_and_streamed(vllm_replica, fw: Flywheel) -> None:
    client = wrap(openai.OpenAI(base_url=f"{vllm_replica.url}/v1", api_key="unused", max_retries=0), fw)
    # Greedy, under the calculator's own system prompt: the base model answers it (under another
    # instruction it may end at once, and at temperature 1 it sometimes did: an empty output_text).
    common = {"model": vllm_replica.model, "instructions": SYSTEM_PROMPT, "max_output_tokens": 16, "temperature": 0.0}
    with fw.session() as s:
        whole = client.responses.create(input=INPUT, **common)
        stream = client.responses.create(input="2+2=", stream=True, **common)
        events = list(stream)
    assert isinstance(whole, openai.types.responses.Response) and whole.output_text
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type in ("response.completed", "response.incomplete")
    by_id = completions_by_id(fw)
    assert len(by_id) == 2 and {e.session_id for e in by_id.values()} == {s.session_id}
    first = by_id[completion_ids(whole)[0]]
    assert [(m.role, m.content) for m in first.prompt_messages] == [("system", SYSTEM_PROMPT), ("user", "3+4=")]
    assert first.completion_text == whole.output_text
    assert first.finish_reason == ("stop" if whole.status == "completed" else "length")
    assert first.sampling.max_tokens == 16 and first.sampling.temperature == 0.0 and first.latency_ms > 0
    assert_token_data(first)
    second = by_id[completion_ids(stream)[0]]
    assert [(m.role, m.content) for m in second.prompt_messages] == [("system", SYSTEM_PROMPT), ("user", "2+2=")]
    assert second.completion_text == deltas
    assert_token_data(second, streamed_response=True)


def test_responses_stream_and_parse_helpers(vllm_replica, fw: Flywheel) -> None:
    client = wrap(openai.OpenAI(base_url=f"{vllm_replica.url}/v1", api_key="unused", max_retries=0), fw)
    with fw.session():
        with client.responses.stream(model=vllm_replica.model, input=INPUT, max_output_tokens=8) as helper:
            final = helper.get_final_response()
        parsed = client.responses.parse(model=vllm_replica.model, input=INPUT, max_output_tokens=8)
    assert isinstance(parsed, openai.types.responses.ParsedResponse)
    by_id = completions_by_id(fw)
    assert len(by_id) == 2
    streamed = by_id[completion_ids(helper)[0]]
    assert streamed.completion_text == final.output_text
    assert_token_data(streamed, streamed_response=True)
    whole = by_id[completion_ids(parsed)[0]]
    assert whole.completion_text == parsed.output_text and whole.prompt_messages[0].content == "3+4="
    assert_token_data(whole)


def test_chat_parse_and_stream_helpers(vllm_replica, fw: Flywheel) -> None:
    client = wrap(openai.OpenAI(base_url=f"{vllm_replica.url}/v1", api_key="unused", max_retries=0), fw)
    session = fw.session()
    with session as s:
        parsed = client.chat.completions.parse(model=vllm_replica.model, messages=INPUT, max_tokens=32, temperature=0)
    # session= on the helper: the request is made when the block opens, outside any `with fw.session()`
    s2 = fw.session()
    with (
        s2,
        client.chat.completions.stream(model=vllm_replica.model, messages=INPUT, max_tokens=32, temperature=0) as whole,
    ):
        text = "".join(e.delta for e in whole if e.type == "content.delta")
    resumed = fw.session(s.session_id, resume=True)
    with client.chat.completions.stream(
        model=vllm_replica.model, messages=INPUT, max_tokens=8, session=resumed
    ) as early:
        first = next(e for e in early if e.type == "content.delta")  # left early: what was received is logged
    by_id = completions_by_id(fw)
    assert len(by_id) == 3
    event = by_id[completion_ids(parsed)[0]]
    assert event.completion_text == parsed.choices[0].message.content and event.session_id == s.session_id
    assert_token_data(event)
    streamed = by_id[completion_ids(whole)[0]]
    assert streamed.completion_text == text and streamed.session_id == s2.session_id
    assert_token_data(streamed)
    partial = by_id[completion_ids(early)[0]]
    assert partial.session_id == s.session_id and partial.completion_text.startswith(first.delta)


def test_async_responses_stream_helper_and_create(vllm_replica, fw: Flywheel) -> None:
    client = wrap(openai.AsyncOpenAI(base_url=f"{vllm_replica.url}/v1", api_key="unused", max_retries=0), fw)

    async def calls() -> tuple[Any, Any, Any]:
        async with fw.asession():
            whole = await client.responses.create(model=vllm_replica.model, input=INPUT, max_output_tokens=8)
            async with client.responses.stream(model=vllm_replica.model, input=INPUT, max_output_tokens=8) as st:
                final = await st.get_final_response()
            return whole, st, final

    whole, helper, final = asyncio.run(calls())
    by_id = completions_by_id(fw)
    assert by_id[completion_ids(whole)[0]].completion_text == whole.output_text
    streamed = by_id[completion_ids(helper)[0]]
    assert streamed.completion_text == final.output_text
    assert_token_data(streamed, streamed_response=True)
