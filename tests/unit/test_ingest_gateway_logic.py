"""Gateway validation without a server: per-event verdicts, status codes, body decoding."""

from __future__ import annotations

import json

import pytest
from fastapi import HTTPException

from flywheel.core.contracts import Feedback, Message, Turn, dump_event
from ingest.gateway import decode_batch, validate_batch


def ev(project="demo", **kw) -> dict:
    event = Turn(project=project, session_id="s1", messages=[Message(role="user", content="x")], **kw)
    return json.loads(dump_event(event))


def test_all_valid_is_202():
    verdict = validate_batch([ev(), ev()], "demo", 10_000)
    assert verdict.status == 202 and len(verdict.accepted) == 2 and verdict.rejected == []


def test_mixed_batch_names_each_bad_event_and_keeps_the_good_ones():
    bad_role = ev()
    bad_role["messages"][0]["role"] = "robot"
    items = [ev(), bad_role, {"nope": 1}, "text", ev(project="other"), ev()]
    verdict = validate_batch(items, "demo", 10_000)
    assert verdict.status == 422
    assert [str(e.event_id) for e in verdict.accepted] == [items[0]["event_id"], items[5]["event_id"]]
    by_index = {r.index: r for r in verdict.rejected}
    assert set(by_index) == {1, 2, 3, 4}
    assert by_index[1].field == "messages.0.role" and by_index[1].event_id == bad_role["event_id"]
    assert by_index[2].field == "schema_version" and by_index[2].event_id is None
    assert by_index[3].reason == "an event must be a JSON object, got str"
    assert by_index[4].reason == "write key is scoped to project demo" and by_index[4].field == "project"


def test_an_event_sent_as_a_json_string_is_not_unwrapped():
    verdict = validate_batch([json.dumps(ev())], "demo", 10_000)
    assert verdict.accepted == [] and "JSON object" in verdict.rejected[0].reason


def test_only_foreign_events_is_403_but_foreign_plus_invalid_is_422():
    assert validate_batch([ev(project="other"), ev(project="x")], "demo", 10_000).status == 403
    assert validate_batch([ev(project="other"), {"bad": 1}], "demo", 10_000).status == 422


def test_an_oversize_event_is_rejected_alone():
    big = json.loads(dump_event(Feedback(project="demo", session_id="s1", kind="follow_up", text="y" * 5000)))
    verdict = validate_batch([big, ev()], "demo", 1_000)
    assert verdict.status == 422 and len(verdict.accepted) == 1
    (rejection,) = verdict.rejected
    assert rejection.index == 0 and "over the limit ingest.max_event_bytes = 1000" in rejection.reason


@pytest.mark.parametrize(
    ("body", "status"),
    [(b"{", 400), (b"[]", 400), (b'{"events": 1}', 400), (b'{"events": [], "x": 1}', 400), (b"\xff", 400)],
)
def test_bodies_that_are_not_a_batch_are_400(body, status):
    with pytest.raises(HTTPException) as err:
        decode_batch(body, 10)
    assert err.value.status_code == status


def test_too_many_events_is_413():
    with pytest.raises(HTTPException) as err:
        decode_batch(json.dumps({"events": [{}] * 11}).encode(), 10)
    assert err.value.status_code == 413
    assert decode_batch(b'{"events": [{}, {}]}', 10) == [{}, {}]
