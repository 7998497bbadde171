"""Named scores on the contract: a feedback of kind ``score`` with a name, a typed value and a comment."""

from __future__ import annotations

import json

import pytest

from flywheel.core.contracts import ContractError, Feedback, dump_event, event_json_schema, parse_event, uuid7


def record(**fields) -> dict:
    return {"schema_version": 1, "type": "feedback", "project": "p", "session_id": "s-1", "kind": "score", **fields}


@pytest.mark.parametrize(
    ("value", "data_type"),
    [
        (0.8, "numeric"),
        (3, "numeric"),
        (-2.5, "numeric"),
        (True, "boolean"),
        (False, "boolean"),
        ("good", "categorical"),
    ],
)
def test_data_type_is_inferred_from_the_value(value, data_type) -> None:
    event = parse_event(json.dumps(record(name="helpfulness", value=value)))
    assert isinstance(event, Feedback)
    assert (event.name, event.value, type(event.value), event.data_type) == (
        "helpfulness",
        value,
        type(value),
        data_type,
    )
    assert json.loads(dump_event(event))["data_type"] == data_type  # written out, so every reader sees it


def test_a_named_score_round_trips_with_its_comment_and_completion() -> None:
    cid = uuid7()
    built = Feedback(project="p", session_id="s-1", kind="score", name="tone", value="rude", completion_id=cid,
                     comment="called the user silly")  # fmt: skip
    read = parse_event(dump_event(built))
    assert read == built
    assert (read.data_type, read.completion_id, read.comment) == ("categorical", cid, "called the user silly")


def test_boolean_takes_one_and_zero_as_langfuse_sends_them() -> None:
    assert parse_event(record(name="correct", value=1, data_type="boolean")).value is True
    assert parse_event(record(name="correct", value=0.0, data_type="boolean")).value is False


def test_a_score_by_completion_id_alone_is_unattached_like_other_feedback() -> None:
    cid = uuid7()
    data = record(name="correct", value=True, completion_id=str(cid))
    del data["session_id"]
    event = parse_event(data)
    assert not event.attached and event.kafka_key == str(cid)


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"name": "tone", "value": "good", "data_type": "numeric"}, "value", "is not numeric"),
        ({"name": "tone", "value": 1.5, "data_type": "categorical"}, "value", "is not categorical"),
        ({"name": "ok", "value": 2, "data_type": "boolean"}, "value", "is not boolean"),
        ({"name": "ok", "value": "yes", "data_type": "boolean"}, "value", "is not boolean"),
        ({"name": "ok", "value": 1, "data_type": "ordinal"}, "data_type", "numeric"),
        ({"name": "tone", "value": ""}, "value", "1 to 256 characters"),
        ({"name": "tone", "value": "x" * 257}, "value", "1 to 256 characters"),
        ({"name": "tone", "value": [1]}, "value", "number, true/false or a text label"),
        ({"name": "tone", "value": {"a": 1}}, "value", "number, true/false or a text label"),
        ({"name": "big", "value": 1e13}, "value", "within"),
        ({"name": "tone"}, "value", "required for a named score"),
        ({"value": 1}, "name", "required with value"),
        ({"data_type": "numeric", "score": 1}, "name", "required with value"),
        ({"name": "bad name", "value": 1}, "name", "pattern"),
        ({"name": "x" * 129, "value": 1}, "name", "at most 128"),
        ({"name": "x", "value": 1, "score": 0.5}, "score", "carries its value in value"),
        ({"name": "x", "value": 1, "comment": "c" * 4097}, "comment", "at most 4096"),
        ({}, "score", "or name and value"),
        ({"kind": "accept", "name": "x", "value": 1}, "name", "only for kind 'score'"),
        ({"kind": "accept", "value": 1}, "value", "only for kind 'score'"),
    ],
)
def test_bad_scores_are_refused_naming_the_field(fields, field, words) -> None:
    with pytest.raises(ContractError) as err:
        parse_event(json.dumps(record(**fields)))
    assert err.value.field == field, err.value
    assert words in err.value.reason


def test_building_a_bad_score_raises_too() -> None:
    with pytest.raises(ValueError, match="is not numeric"):
        Feedback(project="p", session_id="s", kind="score", name="n", value="x", data_type="numeric")
    with pytest.raises(ValueError, match="finite"):
        Feedback(project="p", session_id="s", kind="score", name="n", value=float("nan"))


def test_an_unnamed_score_and_a_comment_on_other_kinds_read_as_before() -> None:
    unnamed = parse_event(record(score=0.5))
    assert (unnamed.score, unnamed.name, unnamed.value, unnamed.data_type) == (0.5, None, None, None)
    assert parse_event(record(kind="reject", comment="wrong file")).comment == "wrong file"


def test_the_json_schema_declares_the_score_fields() -> None:
    schema = event_json_schema()
    feedback = schema["$defs"]["Feedback"]["properties"]
    assert {"name", "value", "data_type", "comment"} <= set(feedback)
    assert "categorical" in json.dumps(feedback["data_type"])
