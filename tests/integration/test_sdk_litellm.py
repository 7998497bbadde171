"""The LiteLLM callback (flywheel.sdk.litellm) with LiteLLM calling the real vLLM replica.

Sync, async and streamed chat completions through LiteLLM's ``hosted_vllm`` provider, inside a
Flywheel session, are each logged as one completion event in that session, with the text the
agent received and the sampling parameters sent. A call asking for logprobs and vLLM's token ids
(``extra_body={"return_token_ids": True}``) is logged with them, where LiteLLM passes them through.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the cost map (no network here)
litellm = pytest.importorskip("litellm")

from conftest import logged_completions  # noqa: E402

from flywheel.sdk import Flywheel  # noqa: E402
from flywheel.sdk.litellm import _response_header, session_headers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

MESSAGES = [{"role": "user", "content": "3+4="}]


@pytest.fixture
def fw(litellm_flywheel: Callable[[str], Flywheel]) -> Flywheel:
    return litellm_flywheel("litellm-it")


def call_options(replica: Any) -> dict[str, Any]:
    return {
        "model": f"hosted_vllm/{replica.model}",
        "api_base": f"{replica.url}/v1",
        "api_key": "x",
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0.7,
        "top_p": 0.9,
        "num_retries": 0,
    }


def test_sync_async_and_streamed_calls_are_logged_in_their_session(vllm_replica, fw: Flywheel) -> None:
    options = call_options(vllm_replica)
    texts: list[str] = []
    with fw.session() as s:
        reply = litellm.completion(**options, extra_headers=session_headers())
        texts.append(reply.choices[0].message.content or "")
        chunks = litellm.completion(**options, stream=True)
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))

    async def run() -> str:
        async with fw.session() as other:
            answer = await litellm.acompletion(**options)
            texts.append(answer.choices[0].message.content or "")
            stream = await litellm.acompletion(**options, stream=True)
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            texts.append("".join(parts))
            await asyncio.sleep(1)  # LiteLLM runs the async success hooks as tasks after the call
        return other.session_id

    other_id = asyncio.run(run())
    outside = litellm.completion(**options)  # outside a session: not logged
    assert outside.choices
    events = logged_completions(fw, 4, timeout=30.0)
    time.sleep(1)
    events = logged_completions(fw, 5, timeout=1)
    assert len(events) == 4, [e.completion_text for e in events]
    assert all(t for t in texts)
    by_session: dict[str, list[str]] = {}
    for event in events:
        by_session.setdefault(event.session_id, []).append(event.completion_text)
        assert event.model == vllm_replica.model and event.policy_version
        assert (event.sampling.temperature, event.sampling.top_p, event.sampling.max_tokens) == (0.7, 0.9, 6)
        assert [m.content for m in event.prompt_messages] == ["3+4="]
        assert event.finish_reason in ("stop", "length") and event.latency_ms > 0
    assert sorted(by_session[s.session_id]) == sorted(texts[:2])
    assert sorted(by_session[other_id]) == sorted(texts[2:])


def test_token_data_when_the_agent_asks_for_it(vllm_replica, fw: Flywheel) -> None:
    options = call_options(vllm_replica)
    with fw.session():
        reply = litellm.completion(**options, logprobs=True, top_logprobs=0, extra_body={"return_token_ids": True})
    [event] = logged_completions(fw, 1, timeout=30.0)
    # LiteLLM passes the server's response headers on as llm_provider-<name>, as the callback reads them
    assert _response_header(reply, "content-type") == "application/json"
    assert event.completion_text == reply.choices[0].message.content
    assert event.completion_token_ids, "vLLM's token ids did not come through LiteLLM"
    assert event.prompt_token_ids
    assert event.logprobs is not None and len(event.logprobs) == len(event.completion_token_ids)
