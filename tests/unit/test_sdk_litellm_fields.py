"""The LiteLLM callback (flywheel.sdk.litellm) with LiteLLM's own objects and its ``mock_response``.

``mock_response`` makes LiteLLM answer without a request, through its real callback machinery.
The callback against a real vLLM server is in ``tests/integration/test_sdk_litellm.py``.
Skipped where LiteLLM is not installed (the SDK does not depend on it).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the cost map at import
litellm = pytest.importorskip("litellm")

from conftest import logged_completions  # noqa: E402

import flywheel.sdk.litellm  # noqa: E402
from flywheel.sdk import Flywheel  # noqa: E402
from flywheel.sdk.litellm import FlywheelCallback, call_fields, session_headers  # noqa: E402
from flywheel.sdk.transports.memory import MemoryTransport  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4="}]


@pytest.fixture
def fw(litellm_flywheel: Callable[[str], Flywheel]) -> Flywheel:
    return litellm_flywheel("litellm-test")


def wait_until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_call_fields_map_a_model_response() -> None:
    response = litellm.ModelResponse(
        model="ckpt-7",
        choices=[
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "ok",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{}"}}],
                },
                "logprobs": {
                    "content": [
                        {"token": "o", "logprob": -0.5, "top_logprobs": []},
                        {"token": "k", "logprob": -0.1, "top_logprobs": []},
                    ]
                },  # fmt: skip
                "token_ids": [5, 6],
            }
        ],
        prompt_token_ids=[1, 2],
    )
    router_id = uuid.UUID("01900000-0000-7000-8000-000000000001")
    response._hidden_params["additional_headers"] = {
        "llm_provider-x-flywheel-policy-version": "v3",
        "llm_provider-x-flywheel-replica": "replica-0",
        "llm_provider-x-flywheel-completion-ids": str(router_id),
    }
    start = datetime(2026, 1, 1, 12, 0, 0)
    kwargs = {
        "model": "m",
        "messages": MESSAGES,
        "optional_params": {"temperature": 0.5, "max_tokens": 7, "stop": "END", "extra_body": {"top_k": 20}},
    }
    [fields] = call_fields(kwargs, response, start, start + timedelta(milliseconds=250))
    assert fields == {
        "completion_id": router_id,
        "model": "ckpt-7",
        "policy_version": "v3",
        "prompt_messages": MESSAGES,
        "sampling": {"temperature": 0.5, "top_k": 20, "max_tokens": 7, "stop": ["END"]},
        "latency_ms": 250.0,
        "served_by": "replica-0",
        "completion_text": "ok",
        "tool_calls": [{"id": "c1", "name": "run", "arguments": "{}"}],
        "finish_reason": "tool_calls",
        "prompt_token_ids": [1, 2],
        "completion_token_ids": [5, 6],
        "logprobs": [-0.5, -0.1],
    }


def test_call_fields_without_token_data_or_router() -> None:
    response = litellm.ModelResponse(
        model="some/model", choices=[{"index": 0, "finish_reason": "stop", "message": {"content": "hi"}}]
    )
    [fields] = call_fields({"model": "x", "messages": MESSAGES}, response, None, None)
    assert fields["completion_id"] is None and fields["policy_version"] == "some/model"
    assert (fields["completion_token_ids"], fields["logprobs"], fields["served_by"]) == (None, None, None)
    assert fields["sampling"] == {} and fields["latency_ms"] == 0.0


def test_sync_call_in_a_session_is_logged(fw: Flywheel) -> None:
    with fw.session() as s:
        reply = litellm.completion(model="openai/m", messages=MESSAGES, mock_response="7", temperature=0.2,
                                   max_tokens=5, api_key="x")  # fmt: skip
    assert reply.choices[0].message.content == "7"
    [event] = logged_completions(fw, 1)
    assert (event.session_id, event.completion_text, event.finish_reason) == (s.session_id, "7", "stop")
    assert event.model == "m" and event.policy_version == "m"
    assert event.sampling.temperature == 0.2 and event.sampling.max_tokens == 5
    assert [m.content for m in event.prompt_messages] == ["Be brief.", "3+4="]
    assert event.latency_ms > 0


def test_sync_stream_is_logged_in_the_session_it_started_in(fw: Flywheel) -> None:
    with fw.session() as s, s.span("subagent") as span:
        chunks = litellm.completion(model="openai/m", messages=MESSAGES, mock_response="seven", stream=True,
                                    api_key="x")  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    [event] = logged_completions(fw, 1)
    assert text == "seven" and event.completion_text == "seven"
    assert event.session_id == s.session_id and event.span.span_id == span.span_id


def test_async_calls_streamed_or_not_are_logged(fw: Flywheel) -> None:
    async def run() -> tuple[str, str]:
        async with fw.session() as s:
            await litellm.acompletion(model="openai/m", messages=MESSAGES, mock_response="a", api_key="x")
            stream = await litellm.acompletion(model="openai/m", messages=MESSAGES, mock_response="b c",
                                               stream=True, api_key="x")  # fmt: skip
            async for _ in stream:
                pass
            await asyncio.sleep(0.5)  # LiteLLM runs the async success hooks as tasks after the call
        return s.session_id, "done"

    session_id, _ = asyncio.run(run())
    events = logged_completions(fw, 2)
    assert sorted(e.completion_text for e in events) == ["a", "b c"]
    assert {e.session_id for e in events} == {session_id}


def test_calls_outside_a_session_and_failures_log_nothing(fw: Flywheel) -> None:
    litellm.completion(model="openai/m", messages=MESSAGES, mock_response="out", api_key="x")
    with fw.session(), pytest.raises(litellm.exceptions.APIError):
        litellm.completion(model="openai/m", messages=MESSAGES, api_key="x", num_retries=0,
                           mock_response=litellm.exceptions.APIError(500, "boom", "openai", "m"))  # fmt: skip
    wait_until(lambda: not flywheel.sdk.litellm._pending)
    assert logged_completions(fw, 1, timeout=1.0) == []
    assert not flywheel.sdk.litellm._pending  # the failed call's scope is forgotten
    assert fw.stats.errors == 0


def test_session_headers() -> None:
    assert session_headers() == {}
    fw = Flywheel(project="litellm-test", transport=MemoryTransport())
    try:
        with fw.session() as s, s.span("critic"):
            assert session_headers() == {"x-flywheel-session-id": s.session_id}
    finally:
        fw.close(2)


def test_callback_is_a_custom_logger_and_the_sdk_does_not_import_litellm() -> None:
    from litellm.integrations.custom_logger import CustomLogger

    assert issubclass(FlywheelCallback, CustomLogger)
    code = "import sys, flywheel.sdk, flywheel; assert 'litellm' not in sys.modules, 'litellm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
