"""Session state: idempotent accumulation, due times, serialisation, the ordered view and its hash."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from rewarding.session_state import EventCache, Session, SessionState, Windows
from rewarding.synthetic import SessionBuilder

W = Windows(feedback_window_s=10.0, session_timeout_s=100.0, rescore_delay_s=2.0)
T0 = datetime.now(UTC) - timedelta(minutes=10)


def _state(b: SessionBuilder) -> SessionState:
    return SessionState(b.project, b.session_id)


def test_add_is_idempotent_by_event_id() -> None:
    b = SessionBuilder(at=T0)
    start, done = b.start(), b.completion()
    state = _state(b)
    assert state.add(start, arrived_at=T0.timestamp() + 1, windows=W)
    assert state.add(done, arrived_at=T0.timestamp() + 1, windows=W)
    before = state.to_dict()
    assert not state.add(done, arrived_at=T0.timestamp() + 50, windows=W)
    assert state.to_dict() == before and state.n_events == 2


def test_due_after_end_plus_window_else_timeout() -> None:
    b = SessionBuilder(at=T0)
    state = _state(b)
    state.add(b.start(), arrived_at=T0.timestamp() + 600, windows=W)
    assert state.due_at == pytest.approx(T0.timestamp() + 100.0)  # no end yet: last event + timeout
    end = b.end(at=T0 + timedelta(seconds=5))
    state.add(end, arrived_at=T0.timestamp() + 600, windows=W)
    assert state.ended_at == pytest.approx((T0 + timedelta(seconds=5)).timestamp())
    assert state.due_at == pytest.approx(state.ended_at + 10.0)
    assert state.reason() == "finalized"


def test_end_time_never_later_than_its_arrival() -> None:
    b = SessionBuilder(at=datetime.now(UTC) + timedelta(minutes=30))  # producer clock ahead
    state = _state(b)
    arrived = datetime.now(UTC).timestamp()
    state.add(b.end(), arrived_at=arrived, windows=W)
    assert state.ended_at == pytest.approx(arrived)


def test_late_event_after_scoring_is_due_after_the_rescore_delay() -> None:
    b = SessionBuilder(at=T0)
    state = _state(b)
    for event in (b.start(), b.completion(), b.end()):
        state.add(event, arrived_at=T0.timestamp() + 1, windows=W)
    state.mark_scored(state.n_events, version=1, published=True, windows=W)
    assert state.due_at is None and state.pending_since is None and state.scored_version == 1
    late = T0.timestamp() + 500
    state.add(b.feedback("revert"), arrived_at=late, windows=W)
    assert state.due_at == pytest.approx(late + 2.0)
    assert state.reason() == "late_feedback"
    # A version that covers fewer events than the state holds leaves the rest pending.
    state.mark_scored(3, version=1, published=True, windows=W)
    assert state.pending_since == late


def test_dict_round_trip_is_json() -> None:
    b = SessionBuilder(at=T0)
    state = _state(b)
    state.add(b.start(task="arith"), arrived_at=T0.timestamp(), windows=W)
    data = json.loads(json.dumps(state.to_dict()))
    assert SessionState.from_dict(data) == state


def test_view_orders_and_hash_ignores_arrival_order_and_duplicates() -> None:
    b = SessionBuilder(at=T0)
    events = [b.start(task="t"), b.completion(), b.outcome("task_solved", True), b.end()]
    one = Session.from_events(b.project, b.session_id, events)
    two = Session.from_events(b.project, b.session_id, list(reversed(events)) + events[:2])
    assert one.events == two.events and one.input_hash() == two.input_hash()
    assert [e.type for e in one.events] == ["session_start", "completion", "outcome", "session_end"]
    assert one.task == "t" and one.end is not None and len(one.completions) == 1
    other = SessionBuilder(at=T0)
    with pytest.raises(ValueError):
        Session.from_events(b.project, b.session_id, [other.start()])


def test_view_uses_the_cache_and_reparses_without_it() -> None:
    b = SessionBuilder(at=T0)
    state = _state(b)
    cache = EventCache(10)
    for event in (b.start(), b.completion()):
        state.add(event, arrived_at=T0.timestamp(), windows=W)
        cache.put(event)
    assert state.view(cache).events == state.view(None).events


def test_policy_version_is_the_majority() -> None:
    b = SessionBuilder(at=T0)
    events = [b.completion(policy_version="v1"), b.completion(policy_version="v2"), b.completion(policy_version="v2")]
    assert Session.from_events(b.project, b.session_id, events).policy_version() == "v2"


def test_marks_written_apart_are_merged_into_an_older_state() -> None:
    b = SessionBuilder(at=T0)
    state = _state(b)
    for event in (b.start(), b.end()):
        state.add(event, arrived_at=T0.timestamp() + 1, windows=W)
    stale = SessionState.from_dict(state.to_dict())
    state.mark_scored(2, version=1, published=True, windows=W)
    stale.merge_marks(state.marks(), W)
    assert stale == state and stale.due_at is None
    stale.merge_marks([1, 1, 0], W)  # older marks change nothing
    assert stale == state
