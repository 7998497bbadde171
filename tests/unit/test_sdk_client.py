"""The client: sessions, spans, context events, feedback and outcomes, invalid input, async, lifecycle."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from flywheel.core.contracts import (
    Completion,
    ContextUpdate,
    Feedback,
    Outcome,
    SessionEnd,
    SessionStart,
    SpanEnd,
    SpanStart,
    Turn,
)
from flywheel.sdk import AsyncSession, Flywheel, Session, current_scope, current_session
from flywheel.sdk.transports.memory import MemoryTransport


@pytest.fixture
def fw(tmp_path):
    client = Flywheel(project="client-test", transport=MemoryTransport(), spool_dir=tmp_path, agent="harness/1")
    yield client
    client.close(2)


def delivered(fw: Flywheel) -> list:
    assert fw.flush(10)
    return fw.transport.events()  # type: ignore[attr-defined]


def test_settings_come_from_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FLYWHEEL_PROJECT", "from-env")
    monkeypatch.setenv("FLYWHEEL_QUEUE_SIZE", "123")
    monkeypatch.setenv("FLYWHEEL_SPOOL_DIR", str(tmp_path))
    client = Flywheel(transport=MemoryTransport(), batch_size=7)
    try:
        assert (client.project, client.settings.queue_size, client.settings.batch_size) == ("from-env", 123, 7)
    finally:
        client.close(1)


def test_timeouts_and_backoff_come_from_the_settings(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FLYWHEEL_KAFKA_CONNECT_TIMEOUT_S", "0.7")
    monkeypatch.setenv("FLYWHEEL_EXIT_FLUSH_TIMEOUT_S", "0")
    client = Flywheel(project="p", kafka_bootstrap="127.0.0.1:9", spool_dir=tmp_path, retry_backoff_max_s=2.5,
                      kafka_request_timeout_s=1.5)  # fmt: skip
    try:
        transport = client.transport
        assert (transport._connect_timeout_s, transport._request_timeout_s) == (0.7, 1.5)  # type: ignore[attr-defined]
        assert client._sender.backoff_max_s == 2.5
        assert client.settings.exit_flush_timeout_s == 0
    finally:
        client.close(0)
    http = Flywheel(project="p", transport="http", write_key="fwk_x", spool_dir=tmp_path, http_timeout_s=3)
    try:
        assert http.transport._client.timeout.read == 3  # type: ignore[attr-defined]
    finally:
        http.close(0)


def test_misconfiguration_fails_at_construction_not_later(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("FLYWHEEL_PROJECT", raising=False)
    with pytest.raises(ValueError, match="project"):
        Flywheel(transport=MemoryTransport(), spool_dir=tmp_path)
    with pytest.raises(ValueError, match="not a valid name"):
        Flywheel(project="has spaces", transport=MemoryTransport(), spool_dir=tmp_path)
    with pytest.raises(ValueError, match="write key"):
        Flywheel(project="p", transport="http", spool_dir=tmp_path)


def test_session_lifecycle_and_turns(fw: Flywheel) -> None:
    with fw.session(user_id="u-1", metadata={"plan": "pro"}, task="fix-bug", group_key="q1") as s:
        assert current_session() is s and current_scope() is s
        s.message("user", "the tests fail")
        call = s.tool_call("run_tests", {"path": "tests/"})
        s.tool_result(call, "1 failed", is_error=True)
        s.turn(messages=[{"role": "assistant", "content": "looking"}], tool_calls=[{"id": "c9", "name": "ls"}])
    assert current_scope() is None
    events = delivered(fw)
    assert [type(e) for e in events] == [SessionStart, Turn, Turn, Turn, Turn, SessionEnd]
    start, _, calls, results, both, end = events
    assert (start.user_id, start.agent, start.task, start.group_key, start.metadata) == (
        "u-1", "harness/1", "fix-bug", "q1", {"plan": "pro"})  # fmt: skip
    assert calls.tool_calls[0].arguments == '{"path": "tests/"}'
    assert results.tool_results[0].tool_call_id == calls.tool_calls[0].id and results.tool_results[0].is_error
    assert both.tool_calls[0].id == "c9"
    assert end.status == "completed"
    assert all(e.session_id == s.session_id and e.project == "client-test" and e.sdk for e in events)
    ids = [e.event_id for e in events]
    assert ids == sorted(ids) and all(i.version == 7 for i in ids)


def test_a_failing_block_ends_the_session_failed(fw: Flywheel) -> None:
    with pytest.raises(KeyError):
        with fw.session() as s:
            raise KeyError("boom")
    end = delivered(fw)[-1]
    assert isinstance(end, SessionEnd) and end.status == "failed" and "KeyError" in (end.error or "")
    resumed = fw.session(s.session_id, resume=True)
    with resumed:
        resumed.message("user", "later")
    assert isinstance(delivered(fw)[-1], Turn)  # a resumed session logs no start and no end


def test_spans_nest_and_carry_their_role(fw: Flywheel) -> None:
    with fw.session(role="orchestrator") as s:
        s.message("user", "plan it")
        with s.span("subagent", "find the bug") as sub:
            assert current_scope() is sub and current_session() is s
            sub.completion(model="m", completion_text="found it", completion_token_ids=[3, 4], logprobs=[-0.5, -0.1])
            with sub.span("critic", span_id="critic-1") as critic:
                critic.message("assistant", "fine")
                critic.result = "approved"
            sub.result = "bug in parser"
        with pytest.raises(ValueError):
            with s.span("subagent", "doomed"):
                raise ValueError("nope")
    events = delivered(fw)
    starts = [e for e in events if isinstance(e, SpanStart)]
    ends = {e.span_id: e for e in events if isinstance(e, SpanEnd)}
    assert [(e.parent_span_id, e.role, e.assignment) for e in starts] == [
        ("root", "subagent", "find the bug"), (starts[0].span_id, "critic", None),
        ("root", "subagent", "doomed")]  # fmt: skip
    assert ends["critic-1"].result == "approved" and ends[starts[0].span_id].result == "bug in parser"
    assert ends[starts[2].span_id].status == "failed"
    completion = next(e for e in events if isinstance(e, Completion))
    assert (completion.span.span_id, completion.span.role) == (starts[0].span_id, "subagent")
    root_turn = next(e for e in events if isinstance(e, Turn))
    assert (root_turn.span.span_id, root_turn.span.role) == ("root", "orchestrator")


def test_context_events(fw: Flywheel) -> None:
    with fw.session() as s:
        s.message("user", "long task")
        through = s.last_event_id
        writer = s.completion(model="m", completion_text="summary: ...")
        s.summary(
            "the user wants X", completion_id=writer, replaced_through=through, tokens_before=900, tokens_after=80
        )
        s.prune(["doc-1", "doc-7"], tokens_before=500, tokens_after=300)
    summary, prune = [e for e in delivered(fw) if isinstance(e, ContextUpdate)]
    assert (summary.kind, summary.summary_completion_id, summary.replaced_through) == ("summary", writer, through)
    assert (prune.kind, prune.pruned_chunk_ids, prune.tokens_after) == ("prune", ["doc-1", "doc-7"], 300)


def test_feedback_and_outcome_targets(fw: Flywheel) -> None:
    with fw.session() as s:
        cid = s.completion(model="m", completion_text="patch")
    fw.feedback(s.session_id, "accept")
    fw.feedback(cid, "revert")  # a completion this process logged: its session is known
    fw.feedback(str(cid), "edit", edit_ratio=0.25)
    other = uuid.uuid4()
    fw.feedback(str(other), "reject", session_id="s-elsewhere")  # from another process: session given
    fw.feedback("s-elsewhere", "persisted", completion_id=other, persisted_minutes=90)
    s.feedback("score", score=0.7)
    fw.outcome(s.session_id, "tests_passed", True, completion_id=cid, details={"passed": 12})
    s.outcome("latency_ok", 0.9)
    assert fw.feedback(uuid.uuid4(), "accept") is None  # not a UUIDv7 and no session: counted invalid
    events = delivered(fw)
    feedback = [(e.session_id, e.kind.value, e.completion_id) for e in events if isinstance(e, Feedback)]
    assert feedback == [
        (s.session_id, "accept", None),
        (s.session_id, "revert", cid),
        (s.session_id, "edit", cid),
        ("s-elsewhere", "reject", other),
        ("s-elsewhere", "persisted", other),
        (s.session_id, "score", None),
    ]
    outcomes = [(e.name, e.value, e.completion_id) for e in events if isinstance(e, Outcome)]
    assert outcomes == [("tests_passed", True, cid), ("latency_ok", 0.9, None)]
    assert fw.stats.invalid == 1


def test_invalid_events_are_counted_never_raised(fw: Flywheel, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="flywheel.sdk"):
        s = fw.session("bad session id!")  # every event of it is invalid
        s.message("user", "x")
        good = fw.session("good")
        good.message("narrator", "x")  # type: ignore[arg-type]
        good.tool_result(None, 42)  # type: ignore[arg-type]
        good.completion(model="m", completion_token_ids=[1, 2], logprobs=[-0.1])  # misaligned
        good.completion(model="m", completion_token_ids=[1], logprobs=[0.5])  # not a log-probability
        good.feedback("thumbs")
        good.feedback("edit")  # edit needs edit_ratio
        good.outcome("n a m e", 1)
        good.summary("")  # a summary needs text
        good.turn()  # empty turn
        fw.session("meta", metadata={"nested": {"no": 1}})
        good.message("user", "this one is fine")
    events = delivered(fw)
    assert [(e.session_id, e.type.value) for e in events] == [("good", "session_start"), ("good", "turn")]
    assert fw.stats.invalid == 12 and fw.stats.errors == 0
    assert any("invalid" in r.getMessage() and "messages.0.role" in r.getMessage() for r in caplog.records)


def test_close_flushes_and_later_calls_are_dropped_quietly(tmp_path) -> None:
    transport = MemoryTransport()
    fw = Flywheel(project="closing", transport=transport, spool_dir=tmp_path)
    s = fw.session()
    s.tool_call("t")
    assert fw.close(5)
    assert len(transport.envelopes) == 2
    s.tool_call("after close")  # must not raise
    assert fw.stats.dropped == 1
    assert fw.close(1)  # idempotent


def test_context_manager_client_and_stats(tmp_path) -> None:
    with Flywheel(project="ctx", transport=MemoryTransport(), spool_dir=tmp_path) as fw:
        fw.session().message("user", "hi")
    stats = fw.stats
    assert (stats.enqueued, stats.sent, stats.queued, stats.dropped, stats.invalid) == (2, 2, 0, 0, 0)


async def test_async_session(fw: Flywheel) -> None:
    async def subagent(parent: AsyncSession, n: int) -> None:
        async with parent.span("subagent", f"part {n}") as sub:
            await asyncio.sleep(0)
            assert current_scope() is sub
            sub.tool_call("search", {"n": n})

    async with fw.asession(user_id="u-async") as s:
        assert isinstance(s, Session) and current_session() is s
        await asyncio.gather(*(subagent(s, n) for n in range(3)))
        assert current_scope() is s  # tasks ran in their own contexts
        assert await s.flush(10)
    with pytest.raises(asyncio.CancelledError):
        async with fw.asession() as cancelled:
            async with cancelled.span("subagent") as sub:
                raise asyncio.CancelledError
    assert await fw.aflush(10)
    events = fw.transport.events()  # type: ignore[attr-defined]
    spans = [e for e in events if isinstance(e, SpanStart) and e.session_id == s.session_id]
    assert len(spans) == 3
    calls = [e for e in events if isinstance(e, Turn) and e.session_id == s.session_id]
    assert {c.span.span_id for c in calls} == {sp.span_id for sp in spans}
    ends = {e.session_id: e.status for e in events if isinstance(e, SessionEnd)}
    assert ends == {s.session_id: "completed", cancelled.session_id: "failed"}
    span_end = next(e for e in events if isinstance(e, SpanEnd) and e.span_id == sub.span_id)
    assert span_end.status == "cancelled"


def test_lazy_top_level_export() -> None:
    import flywheel

    assert flywheel.Flywheel is Flywheel
    with pytest.raises(AttributeError):
        flywheel.NoSuchThing  # noqa: B018


def test_feedback_by_completion_id_alone_from_another_client(fw: Flywheel, tmp_path) -> None:
    with fw.session() as s:
        cid = s.completion(model="m", completion_text="patch")
    assert cid is not None and fw.flush(10)
    other = MemoryTransport()
    later = Flywheel(project="client-test", transport=other, spool_dir=tmp_path / "later")  # no memory of cid
    try:
        event_id = later.feedback(cid, "revert")
        assert event_id is not None
        later.feedback(cid, "edit", edit_ratio=0.5, user_id="u-9")
        later.feedback(str(cid), "accept")  # a str is a session id: this one names a session called str(cid)
        assert later.feedback(uuid.uuid4(), "reject") is None  # not a UUIDv7: cannot be found, counted invalid
        assert later.flush(10)
    finally:
        later.close(2)
    revert, edit, by_text = other.events()
    assert isinstance(revert, Feedback) and revert.event_id == event_id
    assert (revert.session_id, revert.completion_id, revert.kind.value) == (None, cid, "revert")
    assert (edit.session_id, edit.edit_ratio, edit.user_id) == (None, 0.5, "u-9")
    assert by_text.session_id == str(cid) and by_text.completion_id is None
    keys = [envelope.key for envelope in other.envelopes]
    assert keys == [str(cid).encode(), str(cid).encode(), str(cid).encode()]  # keyed by the completion id
    assert later.stats.invalid == 1


def test_feedback_by_completion_id_alone_is_not_sampled(tmp_path) -> None:
    transport = MemoryTransport()
    fw = Flywheel(project="client-test", transport=transport, spool_dir=tmp_path, sample_rate=0.0)
    try:
        cid = uuid.UUID(int=0x0190_0000_0000_7000_8000_0000_0000_0001)  # a UUIDv7 from elsewhere
        assert fw.feedback(cid, "accept") is not None  # no session, so no sampling decision: always sent
        assert fw.feedback("s-1", "accept", completion_id=cid) is None  # the session says: unsampled
        assert fw.flush(10)
    finally:
        fw.close(2)
    [event] = transport.events()
    assert (event.session_id, event.completion_id) == (None, cid)
