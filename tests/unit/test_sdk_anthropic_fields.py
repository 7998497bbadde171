"""Completion fields from Anthropic Messages requests and responses (flywheel.sdk.anthropic), on plain JSON.

The wrapper with the official client against a real local server is in
``tests/integration/test_sdk_anthropic.py``. These functions need no ``anthropic`` package.
"""

from __future__ import annotations

import pytest

from flywheel.sdk.anthropic import MessageAccumulator, parse_message, request_fields


def test_request_fields_record_prompt_and_sampling() -> None:
    fields = request_fields(
        {
            "model": "claude-x",
            "max_tokens": 32,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "source": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
            ],
            "stop_sequences": ["END"],
            "tool_choice": {"type": "tool", "name": "run"},
            "output_config": {"format": {"type": "json_schema", "schema": {}}},
            "extra_body": {"top_p": 0.9},
        }
    )
    assert fields["prompt_messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "tool", "content": "ok", "tool_call_id": "t1"},
    ]
    assert fields["sampling"] == {
        "top_p": 0.9,
        "max_tokens": 32,
        "constraints": ["response_format", "tool_choice"],
        "stop": ["END"],
    }
    auto = request_fields({"model": "m", "max_tokens": 8, "messages": [], "tool_choice": {"type": "auto"}})
    assert "constraints" not in auto["sampling"]


def test_stop_reasons_become_finish_reasons() -> None:
    def finish(reason: str | None) -> str | None:
        return parse_message({"content": [{"type": "text", "text": "x"}], "stop_reason": reason})[0]["finish_reason"]

    assert [finish(r) for r in ("end_turn", "stop_sequence", "max_tokens", "tool_use", "refusal", None)] == [
        "stop",
        "stop",
        "length",
        "tool_calls",
        "refusal",
        None,
    ]


def test_accumulator_joins_text_and_tool_input_deltas() -> None:
    acc = MessageAccumulator()
    for event in (
        {"type": "message_start", "message": {"model": "claude-x"}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t", "name": "run"}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"a":'}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "1}"}},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}},
    ):
        acc.add(event)
    (fields,) = acc.results()
    assert acc.model == "claude-x" and fields["completion_text"] == "Hi" and fields["finish_reason"] == "tool_calls"
    assert fields["tool_calls"] == [{"id": "t", "name": "run", "arguments": '{"a":1}'}]
    empty_input = MessageAccumulator()
    empty_input.add(
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "tool_use", "id": "t", "name": "run", "input": {}},
        }
    )
    assert empty_input.results()[0]["tool_calls"][0]["arguments"] == "{}"


def test_the_client_method_wraps_like_the_function(tmp_path) -> None:
    anthropic = pytest.importorskip("anthropic", reason="the SDK does not install anthropic (sdk-compat venvs)")

    from flywheel.sdk import Flywheel
    from flywheel.sdk.transports.memory import MemoryTransport

    fw = Flywheel(project="anthropic-method", transport=MemoryTransport(), spool_dir=tmp_path)
    try:
        client = anthropic.Anthropic(api_key="x", base_url="http://anthropic.invalid")
        assert fw.wrap_anthropic(client) is client and client._flywheel_wrapped is fw  # type: ignore[attr-defined]
        assert fw.stats.token_data_refused == 0
    finally:
        fw.close(1)
