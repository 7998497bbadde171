"""Forward-compatible events: a reader of schema version 1 keeps the unknown fields a newer SDK adds.

Every event type, with unknown fields at the top level and inside each nested model it has
(span, messages, tool calls and results, sampling), goes through every reader: parse_event
(bytes, text, dict), its fast path, the ingest consumer's record classifier, the gateway's
batch validation, the SDK's in-memory transport. Each accepts it (never a dead letter), lists
the unknown fields, and writes them back through dump_event. Building an event stays strict.
"""

from __future__ import annotations

import json
from collections import namedtuple
from typing import Any

import pytest
from pydantic import ValidationError

from flywheel.core.contracts import (
    BudgetEnforcement,
    Completion,
    ContextUpdate,
    ContractError,
    Feedback,
    FeedbackKind,
    Message,
    Outcome,
    SamplingParams,
    SessionEnd,
    SessionStart,
    SpanEnd,
    SpanRef,
    SpanStart,
    ToolCall,
    ToolResult,
    Turn,
    dump_event,
    event_json_schema,
    parse_event,
    unknown_fields,
    uuid7,
)
from flywheel.core.contracts.events import EVENT_TYPES, parse_event_fast
from flywheel.sdk.sender import EventBuilder, InvalidEvent
from flywheel.sdk.transports.base import Envelope
from flywheel.sdk.transports.memory import MemoryTransport
from ingest.consumer import classify
from ingest.gateway import validate_batch
from ingest.limits import Limits
from ingest.writer import DeadLetterRow, EventRow

ENV = {"project": "demo", "session_id": "s1"}
Record = namedtuple("Record", "topic partition offset key value")
NEWER = {"str": "x", "num": 1.5, "null_free": [1, {"deep": True}], "obj": {"a": {"b": "c"}}}
"""The value of every unknown field added below: any JSON (null aside, see test_null_unknown_fields)."""


def one_of_each() -> list[Any]:
    """A valid event of every type, with every nested model a type has filled in at least once."""
    return [
        SessionStart(**ENV, user_id="u1", task="mul", metadata={"plan": "pro"}),
        SessionEnd(**ENV, status="failed", error="boom"),
        SpanStart(**ENV, span_id="sub-1", assignment="look up x"),
        SpanEnd(**ENV, span_id="sub-1", result="found"),
        Turn(
            **ENV,
            span=SpanRef(span_id="sub-1", role="subagent"),
            messages=[Message(role="user", content="37*48?")],
            tool_calls=[ToolCall(id="c1", name="calc", arguments="{}")],
            tool_results=[ToolResult(tool_call_id="c1", content="1776")],
        ),
        Completion(
            **ENV,
            model="base",
            policy_version="v1",
            prompt_messages=[Message(role="system", content="be brief"), Message(role="user", content="hi")],
            completion_text="1776",
            tool_calls=[ToolCall(id="c2", name="calc")],
            sampling=SamplingParams(temperature=0.7, top_p=0.9),
            prompt_token_ids=[1, 2],
            completion_token_ids=[3],
            logprobs=[-0.1],
        ),
        ContextUpdate(**ENV, kind="summary", summary="so far", tokens_before=10, tokens_after=2),
        Feedback(**ENV, kind=FeedbackKind.SCORE, score=0.5),
        Outcome(**ENV, name="task_solved", value=True, details={"k": 1}),
        BudgetEnforcement(**ENV, kind="near", budget_tokens=100, warn_at=0.8, action="prune", tokens=85, state="near"),
    ]


def with_unknown_fields(event: Any) -> tuple[dict[str, Any], list[str]]:
    """The event's JSON with an unknown field at the top level and in every nested model, and their paths."""
    record = json.loads(dump_event(event))
    record["added_by_newer_sdk"] = NEWER
    paths = ["added_by_newer_sdk"]
    for name, value in record.items():
        if name in ("metadata", "details", "added_by_newer_sdk"):
            continue  # free-form dicts of the contract, not models
        if isinstance(value, dict):
            value["nested_new"] = NEWER
            paths.append(f"{name}.nested_new")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for index, item in enumerate(value):
                item["nested_new"] = NEWER
                paths.append(f"{name}.{index}.nested_new")
    return record, paths


CASES = [with_unknown_fields(event) for event in one_of_each()]
IDS = [record["type"] for record, _ in CASES]


def test_the_cases_cover_every_type_and_nested_model():
    assert sorted(IDS) == sorted(EVENT_TYPES)
    nested = {path.split(".")[0] for _, paths in CASES for path in paths if "." in path}
    assert nested == {"span", "messages", "tool_calls", "tool_results", "prompt_messages", "sampling"}


@pytest.mark.parametrize(("record", "paths"), CASES, ids=IDS)
def test_every_reader_accepts_and_keeps_unknown_fields(record, paths):
    text = json.dumps(record, separators=(",", ":"))
    assert text.startswith('{"schema_version":1,')  # so the fast path decides it
    readers = {
        "fast": parse_event_fast(text),
        "text": parse_event(text),
        "bytes": parse_event(text.encode()),
        "dict": parse_event(json.loads(text)),
    }
    assert readers["fast"] is not None
    for name, event in readers.items():
        assert unknown_fields(event) == paths, name
        assert json.loads(dump_event(event)) == record, name  # kept, at every level
        assert parse_event(dump_event(event)) == event, name
    assert len({dump_event(event) for event in readers.values()}) == 1  # the fast and careful paths agree

    row = classify(Record("fw.events", 0, 5, record["session_id"].encode(), text.encode()))
    assert isinstance(row, EventRow), row  # not a dead letter
    assert json.loads(row.payload) == record and unknown_fields(row.event) == paths  # stored as it came

    verdict = validate_batch([json.loads(text)], "demo", Limits())
    assert verdict.status == 202 and not verdict.rejected
    assert json.loads(dump_event(verdict.accepted[0])) == record  # what the gateway forwards

    transport = MemoryTransport()
    transport.send([Envelope(record["session_id"].encode(), text.encode())])
    assert unknown_fields(transport.events()[0]) == paths


@pytest.mark.parametrize(("record", "paths"), CASES, ids=IDS)
def test_a_known_field_with_a_bad_value_is_still_a_dead_letter_with_its_reason(record, paths):
    bad = json.loads(json.dumps(record))
    bad["occurred_at"] = "yesterday"
    text = json.dumps(bad, separators=(",", ":"))
    assert parse_event_fast(text) is None
    with pytest.raises(ContractError) as info:
        parse_event(text)
    assert info.value.field == "occurred_at" and "datetime" in info.value.reason
    row = classify(Record("fw.events", 0, 5, b"s1", text.encode()))
    assert isinstance(row, DeadLetterRow) and row.field == "occurred_at" and "datetime" in row.reason


@pytest.mark.parametrize(
    ("change", "field", "needle"),
    [
        ({"type": "session_pause"}, "type", "unknown event type 'session_pause'"),
        ({"schema_version": 2}, "schema_version", "unsupported version 2"),
        ({"sampling": {"temperature": "hot", "typical_p": 0.9}}, "sampling.temperature", "valid number"),
        ({"prompt_messages": [{"role": "robot", "audio": {}}]}, "prompt_messages.0.role", "Input should be"),
        ({"logprobs": [-0.1, -0.2]}, "logprobs", "2 values for 1"),
    ],
)
def test_unknown_fields_never_excuse_what_is_refused(change, field, needle):
    record, _ = CASES[IDS.index("completion")]
    text = json.dumps({**record, **change}, separators=(",", ":"))
    with pytest.raises(ContractError) as info:
        parse_event(text)
    assert info.value.field == field and needle in info.value.reason
    row = classify(Record("fw.events", 0, 5, b"s1", text.encode()))
    assert isinstance(row, DeadLetterRow) and (row.field, row.kind) == (field, "contract")


def test_null_unknown_fields_are_dropped_like_null_known_ones():
    record, _ = CASES[IDS.index("outcome")]
    event = parse_event({**record, "maybe": None})
    assert unknown_fields(event) == ["added_by_newer_sdk", "maybe"]
    assert "maybe" not in json.loads(dump_event(event))  # dump_event leaves out every null


def test_an_unknown_field_cannot_shadow_what_the_event_means():
    record, _ = CASES[IDS.index("feedback")]
    event = parse_event({**record, "kafka_key": "other", "attached": False, "model_config": 1})
    assert event.kafka_key == "s1" and event.attached and event.session_id == "s1"
    assert event.model_extra is not None and event.model_extra["kafka_key"] == "other"


def test_building_an_event_still_refuses_a_misspelt_field():
    with pytest.raises(ValidationError, match="temprature"):
        SamplingParams(temprature=0.7)
    with pytest.raises(ValidationError, match="contnet"):
        Turn(**ENV, messages=[{"role": "user", "contnet": "hi"}])
    with pytest.raises(ValidationError, match="sesion_id"):
        Completion(project="demo", sesion_id="s1", model="m", policy_version="v1")
    with pytest.raises(ValidationError, match=r"tool_calls\.0\.args"):
        Completion.model_validate(
            {**ENV, "model": "m", "policy_version": "v", "tool_calls": [{"id": "c", "name": "f", "args": "{}"}]}
        )
    with pytest.raises(ValidationError, match="typical_p"):
        SamplingParams.model_validate_json('{"typical_p": 0.9}')
    builder = EventBuilder("sdk/1", None)  # what the SDK runs for every record
    fields = {"model": "m", "policy_version": "v1", "completion_txt": "4"}
    with pytest.raises(InvalidEvent, match="completion_txt"):
        builder.build(("completion", "demo", "s1", fields, 0x0188_0000_0000_7000_8000_0000_0000_0001, 1.7e9))


def test_the_exported_schema_stays_the_writers_contract_closed_objects():
    schema = event_json_schema()
    closed = [d.get("additionalProperties") for d in schema["$defs"].values() if "properties" in d]
    assert closed and all(value is False for value in closed)


def test_a_resolved_feedback_copy_keeps_the_unknown_fields():
    from ingest.pending import resolved_copy

    record, paths = CASES[IDS.index("feedback")]
    unattached = {k: v for k, v in record.items() if k != "session_id"} | {"completion_id": str(uuid7())}
    key, value = resolved_copy(json.dumps(unattached), "s9")
    assert key == b"s9" and json.loads(value) == {**unattached, "session_id": "s9"}
    assert unknown_fields(parse_event(value)) == paths


def test_contracts_validate_accepts_unknown_fields_and_names_them(tmp_path):
    from typer.testing import CliRunner

    from flywheel.cli.contracts import app

    record, paths = CASES[IDS.index("turn")]
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(record) + "\n")
    result = CliRunner().invoke(app, ["validate", str(good)])
    assert result.exit_code == 0, result.output
    assert "all events valid" in result.stdout and ", ".join(paths) in result.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**record, "occurred_at": "yesterday"}) + "\n")
    result = CliRunner().invoke(app, ["validate", str(bad)])
    assert result.exit_code == 1 and "occurred_at" in result.stderr
