"""Event contracts: round trips, rejections that name the field, UUIDv7 ids."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel.cli.contracts import SCHEMA_PATH, render_schema
from flywheel.core.contracts import (
    BudgetEnforcement,
    Completion,
    ContextUpdate,
    ContractError,
    Feedback,
    FeedbackKind,
    Message,
    Outcome,
    SessionEnd,
    SessionStart,
    SpanEnd,
    SpanRef,
    SpanStart,
    ToolCall,
    ToolResult,
    Turn,
    dump_event,
    parse_event,
    uuid7,
)
from flywheel.core.contracts.ids import uuid7_time_ms

ENV = {"project": "demo", "session_id": "sess-1"}
BUDGET = {
    "schema_version": 1,
    **ENV,
    "type": "budget",
    "kind": "over",
    "budget_tokens": 100,
    "warn_at": 0.8,
    "action": "prune",
    "tokens": 120,
    "state": "over",
}
"""A valid ``budget`` event's record, for rejection cases."""


def examples():
    yield SessionStart(**ENV, user_id="u1", task="mul", group_key="q:37*48", metadata={"plan": "pro", "n": 3})
    yield SpanStart(**ENV, span_id="sub-1", parent_span_id="root", role="subagent", assignment="look up x")
    yield Turn(**ENV, messages=[Message(role="user", content="What is 37*48?")])
    yield Turn(
        **ENV,
        span=SpanRef(span_id="sub-1", role="subagent"),
        tool_calls=[ToolCall(id="c1", name="calc", arguments='{"expr": "37*48"}')],
        tool_results=[ToolResult(tool_call_id="c1", content="1776", document_ids=["d1"])],
    )
    yield Completion(
        **ENV,
        model="base",
        policy_version="base-1234",
        prompt_messages=[Message(role="user", content="hi")],
        completion_text="answer: 1776",
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        logprobs=[-0.5, -0.01],
        latency_ms=12.5,
    )
    yield ContextUpdate(**ENV, kind="summary", summary="so far: x", tokens_before=900, tokens_after=120)
    yield ContextUpdate(**ENV, kind="prune", pruned_chunk_ids=["d1", "d2"])
    yield BudgetEnforcement(
        **ENV, kind="near", budget_tokens=1000, warn_at=0.8, action="prune", tokens=850, state="near"
    )
    yield BudgetEnforcement(
        **ENV,
        kind="refused",
        budget_tokens=1000,
        warn_at=0.8,
        action="summary",
        tokens=1200,
        state="over",
        refused_tool="search",
        tool_call_id="c9",
    )
    yield BudgetEnforcement(
        **ENV,
        kind="reduced",
        budget_tokens=1000,
        warn_at=0.8,
        action="prune",
        tokens=300,
        state="ok",
        reduced_by="prune",
        context_event_id=uuid7(),
        tokens_before=1200,
        state_before="over",
    )
    yield Feedback(**ENV, kind=FeedbackKind.ACCEPT)
    yield Feedback(**ENV, kind=FeedbackKind.EDIT, edit_ratio=0.25, completion_id=uuid7())
    yield Feedback(**ENV, kind=FeedbackKind.FOLLOW_UP, dissatisfied=True, text="that's wrong")
    yield Outcome(**ENV, name="task_solved", value=True)
    yield Outcome(**ENV, name="f_beta", value=0.7, document_ids=["d1"])
    yield SpanEnd(**ENV, span_id="sub-1", status="completed")
    yield SessionEnd(**ENV, status="completed")


@pytest.mark.parametrize("event", list(examples()), ids=lambda e: e.type)
def test_round_trip(event):
    wire = dump_event(event)
    assert parse_event(wire) == event
    assert json.loads(wire)["schema_version"] == 1


def _base(**fields):
    data = {
        "schema_version": 1,
        "event_id": str(uuid7()),
        **ENV,
        "type": "turn",
        "messages": [{"role": "user", "content": "x"}],
    }
    data.update(fields)
    return data


@pytest.mark.parametrize(
    ("record", "field", "needle"),
    [
        (_base(schema_version=2), "schema_version", "unsupported version 2"),
        ({k: v for k, v in _base().items() if k != "schema_version"}, "schema_version", "missing"),
        (_base(schema_version="1"), "schema_version", "unsupported"),
        (_base(type="nope"), "type", "unknown event type 'nope'"),
        (_base(event_id=str(uuid.uuid4())), "event_id", "UUIDv7"),
        (_base(project=""), "project", "at least 1"),
        (_base(session_id="has space"), "session_id", "pattern"),
        (_base(messages=[{"role": "robot"}]), "messages.0.role", "Input should be"),
        (_base(messages=[]), "", "at least one of"),
        (_base(occurred_at="2020-01-01T00:00:00"), "occurred_at", "timezone"),
        (_base(occurred_at=(datetime.now(UTC) + timedelta(days=2)).isoformat()), "occurred_at", "future"),
        (_base(occurred_at="1999-01-01T00:00:00Z"), "occurred_at", "clock error"),
        (
            {"schema_version": 1, **ENV, "type": "feedback", "kind": "score"},
            "score",
            "required when kind is 'score'",
        ),
        (
            {
                "schema_version": 1,
                **ENV,
                "type": "completion",
                "model": "m",
                "policy_version": "v",
                "completion_token_ids": [1, 2],
                "logprobs": [-0.1],
            },
            "logprobs",
            "1 values for 2",
        ),
        (
            {
                "schema_version": 1,
                **ENV,
                "type": "completion",
                "model": "m",
                "policy_version": "v",
                "completion_token_ids": [1],
                "logprobs": [0.5],
            },
            "logprobs",
            "<= 0",
        ),
        ({"schema_version": 1, **ENV, "type": "outcome", "name": "x", "value": "NaN"}, "value", ""),
        ({"schema_version": 1, **ENV, "type": ["turn"]}, "type", "unknown event type"),  # unhashable: was a 500
        ({"schema_version": 1, **ENV, "type": {"a": 1}}, "type", "unknown event type"),
        ({"schema_version": 1, **ENV, "type": "session_start", "metadata": {"a": {"deep": 1}}}, "metadata.a", ""),
        ({**BUDGET, "kind": "refused"}, "refused_tool", "required when kind is 'refused'"),
        ({**BUDGET, "kind": "near"}, "state", "must be 'near' for kind 'near' (got 'over')"),
        ({**BUDGET, "kind": "reduced"}, "reduced_by", "required when kind is 'reduced'"),
        ({**BUDGET, "warn_at": 0}, "warn_at", "greater than 0"),
        ({**BUDGET, "action": "truncate"}, "action", "'prune' or 'summary'"),
    ],
)
def test_rejection_names_the_field(record, field, needle):
    with pytest.raises(ContractError) as info:
        parse_event(json.dumps(record))
    assert info.value.field == field, info.value.errors
    assert needle in info.value.reason


@pytest.mark.parametrize(
    ("raw", "needle"),
    [(b"\xff\xfe{}", "UTF-8"), (b"{not json", "JSON"), (b"[1, 2]", "JSON object"), (b"[" * 100_000, "JSON")],
)
def test_rejects_garbage_bytes(raw, needle):
    with pytest.raises(ContractError) as info:
        parse_event(raw)
    assert needle in info.value.reason


def test_uuid7_is_version_7_and_monotonic():
    ids = [uuid7() for _ in range(5000)]
    assert all(i.version == 7 for i in ids)
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    now_ms = datetime.now(UTC).timestamp() * 1000
    assert abs(uuid7_time_ms(ids[-1]) - now_ms) < 5_000


def test_committed_json_schema_is_current():
    assert SCHEMA_PATH.read_text() == render_schema(), "run `flywheel contracts export` and commit docs/schema"


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "schema_version",
                "type",
                "project",
                "session_id",
                "event_id",
                "kind",
                "messages",
                "logprobs",
                "completion_token_ids",
                "model",
                "policy_version",
                "value",
                "name",
            ]
        ),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
            max_leaves=10,
        ),
    )
)
def test_arbitrary_records_are_accepted_or_rejected_cleanly(record):
    try:
        raw = json.dumps(record)
    except ValueError:
        return
    try:
        event = parse_event(raw)
    except ContractError as exc:
        assert exc.reason
        assert all("field" in e and "reason" in e for e in exc.errors)
    else:
        assert parse_event(dump_event(event)) == event


def test_feedback_may_name_its_completion_alone():
    cid = uuid7()
    unattached = Feedback(project="demo", kind=FeedbackKind.REVERT, completion_id=cid)
    wire = dump_event(unattached)
    assert "session_id" not in json.loads(wire)
    back = parse_event(wire)
    assert back == unattached and back.session_id is None and not back.attached
    assert back.kafka_key == str(cid)  # keyed by the completion id until ingest attaches it
    attached = back.model_copy(update={"session_id": "sess-1"})
    assert parse_event(dump_event(attached)).kafka_key == "sess-1" and attached.attached
    assert Turn(**ENV, messages=[Message(role="user", content="x")]).kafka_key == "sess-1"
    assert wire.startswith(b'{"schema_version":1,')  # same version: the change is additive


@pytest.mark.parametrize(
    ("record", "field", "needle"),
    [
        ({"project": "demo", "kind": "accept"}, "session_id", "required unless completion_id is set"),
        ({"project": "demo", "kind": "accept", "session_id": None}, "session_id", "required unless completion_id"),
        ({"project": "demo", "kind": "accept", "completion_id": str(uuid.uuid4())}, "completion_id", "UUIDv7"),
        ({"project": "demo", "kind": "edit", "completion_id": str(uuid7())}, "edit_ratio", "required when kind"),
    ],
)
def test_feedback_without_a_session_is_refused_naming_the_field(record, field, needle):
    with pytest.raises(ContractError) as info:
        parse_event({"schema_version": 1, "type": "feedback", **record})
    assert info.value.field == field, info.value.errors
    assert needle in info.value.reason


def test_only_feedback_may_omit_the_session():
    for kind in ("turn", "completion", "outcome", "session_start"):
        with pytest.raises(ContractError) as info:
            parse_event({"schema_version": 1, "type": kind, "project": "demo", "completion_id": str(uuid7())})
        assert info.value.field == "session_id" or "session_id" in {e["field"] for e in info.value.errors}
    schema = json.loads(render_schema())
    required = {name: set(d.get("required", [])) for name, d in schema["$defs"].items() if "properties" in d}
    assert "session_id" not in required["Feedback"]
    assert all("session_id" in required[name] for name in ("Turn", "Completion", "Outcome", "SessionStart"))


def _careful(text: str):
    """parse_event without its fast path: the event, or the ContractError's (field, reason)."""
    try:
        return parse_event(json.loads(text))
    except ContractError as exc:
        return (exc.field, exc.reason)
    except ValueError:
        return "not JSON"


def _either(text: str):
    try:
        return parse_event(text)
    except ContractError as exc:
        return (exc.field, exc.reason)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([dump_event(e).decode() for e in examples()]),
    st.sampled_from(
        [
            "schema_version",
            "type",
            "project",
            "session_id",
            "event_id",
            "occurred_at",
            "kind",
            "messages",
            "logprobs",
            "completion_token_ids",
            "value",
            "name",
            "role",
            "status",
        ]
    ),
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.lists(st.integers(), max_size=2),
)
def test_the_fast_path_decides_exactly_as_the_careful_one(text, name, value):
    """Text written by dump_event is validated straight from JSON (no dict first); any field
    replaced by any value must give the same event, or the same field and reason, as the
    careful path, which parses the JSON first."""
    from flywheel.core.contracts.events import FAST_PREFIX

    data = json.loads(text)
    data[name] = value
    mutated = FAST_PREFIX + json.dumps(data, separators=(",", ":"))[1:].replace('"schema_version":1,', "", 1)
    if not mutated.startswith(FAST_PREFIX):  # pragma: no cover - the prefix is always rebuilt
        return
    expected = _careful(mutated)
    if expected == "not JSON":
        return
    assert _either(mutated) == expected


@pytest.mark.parametrize("served_by", ["3", "http://10.0.0.5:8000"])
def test_served_by_takes_a_replica_id_and_still_an_old_url(served_by):
    """The router names a replica by its id now; completions stored while it named the URL still parse."""
    record = {
        "schema_version": 1,
        "event_id": str(uuid7()),
        **ENV,
        "type": "completion",
        "model": "base",
        "policy_version": "base-1234",
        "completion_text": "x",
        "served_by": served_by,
    }
    assert parse_event(json.dumps(record).encode()).served_by == served_by
