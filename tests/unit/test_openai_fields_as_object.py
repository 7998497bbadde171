"""``flywheel.core.openai_fields.as_object``: JSON read like the openai client's response objects."""

from __future__ import annotations

import copy

import pytest

from flywheel.core.openai_fields import as_object, parse_chat_completion


def test_keys_read_as_attributes_and_lists_stay_lists():
    chunk = as_object({"choices": [{"index": 0, "delta": {"content": "hi"}}], "extra": {"a": 1}})
    assert chunk.choices[0].delta.content == "hi"
    assert chunk.extra.a == 1  # a key the data has, known or not (vLLM's extras)


def test_a_known_field_the_data_lacks_reads_as_none():
    choice = as_object({"index": 0})
    assert choice.finish_reason is None and choice.logprobs is None and choice.delta is None
    assert getattr(choice, "token_ids", "absent") is None


def test_any_other_name_raises_attribute_error():
    chunk = as_object({"choices": []})
    with pytest.raises(AttributeError, match="'choise'"):
        _ = chunk.choise
    assert not hasattr(chunk, "model_dump")  # so callers that probe for an openai object see it is not one
    assert getattr(chunk, "nope", "default") == "default"
    assert copy.copy(chunk).choices == []


def test_a_chat_completion_without_optional_fields_parses():
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}]}
    (fields,) = parse_chat_completion(as_object(body))
    assert fields["completion_text"] == "4" and fields["tool_calls"] == [] and fields["completion_token_ids"] is None
