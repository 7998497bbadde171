"""Consumer batch logic without a broker or database: splitting, dead-letter decisions, session folding."""

from __future__ import annotations

import json
from collections import namedtuple
from datetime import UTC, datetime, timedelta

import pytest

from flywheel.core.contracts import Completion, Feedback, Message, SessionEnd, SessionStart, Turn, dump_event
from flywheel.core.contracts.events import FAST_PREFIX
from ingest import consumer
from ingest.consumer import DLQ_VALUE_MAX, backoff_delays, dlq_headers, dlq_value, process_batch
from ingest.writer import DeadLetterRow, EventRow, clean_text, session_updates

Record = namedtuple("Record", "topic partition offset key value")
ENV = {"project": "demo", "session_id": "s1"}


def rec(value, *, key=b"s1", offset=0, partition=0, topic="fw.events") -> Record:
    if not isinstance(value, (bytes, type(None))):
        value = dump_event(value)
    return Record(topic, partition, offset, key, value)


def turn(**kw) -> Turn:
    return Turn(**{**ENV, **kw}, messages=[Message(role="user", content="hi")])


def test_valid_events_become_rows_keeping_the_received_json():
    event = turn()
    result = process_batch([rec(event, offset=7)])
    assert result.dead_letters == []
    (row,) = result.events
    assert (row.event_id, row.project, row.session_id, row.type) == (event.event_id, "demo", "s1", "turn")
    assert json.loads(row.payload) == json.loads(dump_event(event))
    assert (row.topic, row.partition, row.offset) == ("fw.events", 0, 7)


@pytest.mark.parametrize(
    ("value", "key", "field", "reason_part"),
    [
        (b"not json", b"s1", "", "not valid JSON"),
        (b"\xff\xfe", b"s1", "", "not valid UTF-8"),
        (b"[1, 2]", b"s1", "", "must be a JSON object"),
        (b'{"type": "turn", "project": "demo", "session_id": "s1"}', b"s1", "schema_version", "missing"),
        (b'{"schema_version": 1, "type": "nope", "project": "p", "session_id": "s1"}', b"s1", "type", "unknown"),
        (None, b"s1", "", "no value"),
    ],
)
def test_malformed_records_are_dead_lettered_with_field_and_reason(value, key, field, reason_part):
    result = process_batch([rec(value, key=key, offset=3)])
    assert result.events == []
    (dead,) = result.dead_letters
    assert dead.field == field and reason_part in dead.reason
    assert (dead.topic, dead.partition, dead.offset, dead.key, dead.value) == ("fw.events", 0, 3, key, value)
    assert dead.kind == "contract"


def _sdk_like(event) -> bytes:
    value = dump_event(event)
    assert value.startswith(FAST_PREFIX.encode())  # what the SDK and the gateway write
    return value


FAST_CASES = [
    _sdk_like(turn()),
    _sdk_like(Completion(**ENV, model="m", policy_version="v1", completion_token_ids=[1, 2], logprobs=[-0.1, -0.2])),
    _sdk_like(Feedback(**ENV, kind="accept")),
    _sdk_like(SessionStart(**ENV, metadata={"a": 1})),
    _sdk_like(turn()).replace(b'"role":"user"', b'"role":"robot"'),  # invalid: the careful path words why
    _sdk_like(turn()).replace(b'"session_id":"s1"', b'"session_id":"s 1"'),
    _sdk_like(turn()).replace(b'"messages":[{"role":"user","content":"hi"}]', b'"messages":[]'),
    _sdk_like(turn()).replace(b'"type":"turn"', b'"type":"nope"'),
    _sdk_like(turn()).replace(b'"content":"hi"', b'"content":"h\\u0000i"'),  # NUL: dead letter after parsing
    _sdk_like(turn())[:-1] + b',"schema_version":2}',  # a later duplicate key wins, in both parsers
    _sdk_like(turn())[:-1],  # truncated
    _sdk_like(Completion(**ENV, model="m", policy_version="v1")).replace(b'"latency_ms":0.0', b'"latency_ms":NaN'),
]


@pytest.mark.parametrize("value", FAST_CASES)
def test_the_fast_parse_decides_exactly_as_the_careful_one(value, monkeypatch):
    fast = process_batch([rec(value, key=b"s1", offset=5)])
    monkeypatch.setattr(consumer, "_parse_fast", lambda text: None)
    careful = process_batch([rec(value, key=b"s1", offset=5)])
    assert fast.dead_letters == careful.dead_letters
    assert [(r.event_id, r.project, r.session_id, r.type, r.occurred_at, r.payload, r.event) for r in fast.events] == [
        (r.event_id, r.project, r.session_id, r.type, r.occurred_at, r.payload, r.event) for r in careful.events
    ]


def test_a_key_that_is_not_the_session_id_is_dead_lettered():
    for key in (b"other", None, b"\xff"):
        (dead,) = process_batch([rec(turn(), key=key)]).dead_letters
        assert dead.kind == "key" and dead.field == "session_id" and "session" in dead.reason and "s1" in dead.reason
        assert dead.project == "demo"


def test_nul_characters_are_dead_lettered_but_an_escaped_backslash_is_not():
    (dead,) = process_batch([rec(Turn(**ENV, messages=[Message(role="user", content="a\x00b")]))]).dead_letters
    assert "NUL" in dead.reason
    fine = process_batch([rec(Turn(**ENV, messages=[Message(role="user", content="a\\u0000b")]))])
    assert len(fine.events) == 1 and fine.dead_letters == []


def test_a_contract_error_names_the_nested_field():
    bad = json.loads(dump_event(turn()))
    bad["messages"][0]["role"] = "robot"
    (dead,) = process_batch([rec(json.dumps(bad).encode())]).dead_letters
    assert dead.field == "messages.0.role"


def test_offsets_cover_every_record_valid_or_not_per_partition():
    records = [
        rec(turn(), offset=10, partition=0),
        rec(b"junk", offset=11, partition=0),
        rec(turn(), offset=4, partition=2),
    ]
    result = process_batch(records)
    assert result.offsets == {("fw.events", 0): 12, ("fw.events", 2): 5}
    assert result.n_records == 3 and len(result.events) == 2 and len(result.dead_letters) == 1


def test_a_repeated_event_id_in_one_batch_is_kept_once():
    event = turn()
    result = process_batch([rec(event, offset=0), rec(event, offset=1)])
    assert len(result.events) == 1 and result.in_batch_duplicates == 1
    assert result.offsets == {("fw.events", 0): 2}


def test_dead_letter_text_is_storable_and_bounded():
    assert clean_text("a\x00b") == "a\\x00b"
    assert len(clean_text("x" * 1000, 256)) == 256
    bad = json.dumps({"schema_version": 1, "type": "turn", "project": "p", "session_id": "s1", "\x00" * 300: 1})
    (dead,) = process_batch([rec(bad.encode())]).dead_letters
    assert "\x00" not in dead.field + dead.reason and len(dead.field) <= 256


def test_dlq_headers_say_why_and_where_and_big_values_are_cut():
    row = DeadLetterRow("fw.events", 3, 42, b"k", b"v" * (DLQ_VALUE_MAX + 10), "type", "missing", None, "contract")
    headers = dict(dlq_headers(row))
    assert headers["reason"] == b"missing" and headers["field"] == b"type"
    source = (headers["source_topic"], headers["source_partition"], headers["source_offset"])
    assert source == (b"fw.events", b"3", b"42")
    assert headers["value_truncated"] == str(DLQ_VALUE_MAX + 10).encode()
    assert len(dlq_value(row)) == DLQ_VALUE_MAX


def test_backoff_doubles_then_caps():
    delays = backoff_delays(0.1, 1.0)
    assert [round(next(delays), 2) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def _rows(*events) -> list[EventRow]:
    return process_batch([rec(e, key=e.session_id.encode(), offset=i) for i, e in enumerate(events)]).events


def test_session_updates_fold_start_end_versions_and_counts():
    t0 = datetime.now(UTC) - timedelta(minutes=5)
    events = [
        SessionStart(**ENV, occurred_at=t0, user_id="u1", task="mul", group_key="g", metadata={"plan": "pro"}),
        Completion(**ENV, occurred_at=t0 + timedelta(seconds=1), model="m", policy_version="v2"),
        Completion(**ENV, occurred_at=t0 + timedelta(seconds=2), model="m", policy_version="v1"),
        Completion(**ENV, occurred_at=t0 + timedelta(seconds=3), model="m", policy_version="v2"),
        SessionEnd(**ENV, occurred_at=t0 + timedelta(seconds=4), status="failed"),
        Feedback(project="demo", session_id="s0", kind="accept", occurred_at=t0),
    ]
    first, second = session_updates(_rows(*events))
    assert (first.session_id, first.n_events, first.n_feedback, first.started_at) == ("s0", 1, 1, None)
    assert second.session_id == "s1" and second.n_events == 5
    assert (second.user_id, second.task, second.group_key, second.metadata) == ("u1", "mul", "g", {"plan": "pro"})
    assert second.started_at == t0 and second.ended_at == t0 + timedelta(seconds=4) and second.status == "failed"
    assert second.policy_versions == ["v2", "v1"]
    assert second.last_event_at == t0 + timedelta(seconds=4)
