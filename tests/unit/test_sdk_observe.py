"""``@observe``: a session outside any session, a span inside one; sync, async, generators, methods;
exceptions propagate unchanged; no client or a failing transport never breaks the function."""

from __future__ import annotations

import asyncio
import inspect
import logging

import pytest

from flywheel.core.contracts import SessionEnd, SessionStart, SpanEnd, SpanStart, Turn
from flywheel.sdk import Flywheel, current_scope, current_session, observe, set_default_client
from flywheel.sdk.transports.memory import MemoryTransport


@pytest.fixture
def fw(tmp_path):
    client = Flywheel(project="observe-test", transport=MemoryTransport(), spool_dir=tmp_path)
    set_default_client(client)
    yield client
    set_default_client(None)
    client.close(2)


def delivered(fw: Flywheel) -> list:
    assert fw.flush(10)
    return fw.transport.events()  # type: ignore[attr-defined]


def kinds(events: list) -> list[str]:
    return [e.type.value for e in events]


def test_bare_outside_a_session_opens_and_ends_one(fw: Flywheel) -> None:
    @observe
    def answer(question: str) -> str:
        """Answers."""
        scope = current_scope()
        assert scope is not None and current_session() is scope
        scope.message("user", question)
        return "42"

    assert answer("the question") == "42"
    assert current_scope() is None
    events = delivered(fw)
    assert kinds(events) == ["session_start", "turn", "session_end"]
    start, turn, end = events
    assert start.agent == answer.__qualname__ and end.status == "completed"
    assert turn.span.role == "agent" and turn.span.span_id == "root"  # the root role stays trainable
    assert len({e.session_id for e in events}) == 1
    answer("again")
    assert len({e.session_id for e in delivered(fw)}) == 2  # a fresh session per call


def test_the_wrapper_keeps_name_doc_and_signature(fw: Flywheel) -> None:
    def original(conversation_id: str, *, depth: int = 2) -> str:
        """Docs."""
        return conversation_id

    bare = observe(original)
    called = observe(name="n", role="r")(original)
    for wrapped in (bare, called):
        assert wrapped.__name__ == "original" and wrapped.__doc__ == "Docs."
        assert wrapped.__wrapped__ is original  # type: ignore[attr-defined]
        assert inspect.signature(wrapped) == inspect.signature(original)


def test_session_id_from_the_named_argument_positional_keyword_or_default(fw: Flywheel) -> None:
    @observe(session_id_arg="conversation_id", task="support")
    def handle(text: str, conversation_id: str | None = "conv-default") -> str:
        return text

    handle("a", "conv-1")
    handle("b", conversation_id="conv-2")
    handle("c")
    handle("d", None)  # no id given: a fresh one
    starts = [e for e in delivered(fw) if isinstance(e, SessionStart)]
    assert [s.session_id for s in starts[:3]] == ["conv-1", "conv-2", "conv-default"]
    assert starts[3].session_id not in {"conv-1", "conv-2", "conv-default"} and len(starts[3].session_id) == 36
    assert {s.task for s in starts} == {"support"}


def test_a_session_id_arg_the_function_lacks_is_refused_at_decoration() -> None:
    def handle(text: str) -> str:
        return text

    with pytest.raises(TypeError, match=r"handle has no parameter 'conversation_id' \(it has text\)"):
        observe(session_id_arg="conversation_id")(handle)

    def star(*ids: str) -> None: ...

    with pytest.raises(TypeError, match="star's 'ids' is \\*args"):
        observe(session_id_arg="ids")(star)

    def loose(**kwargs: str) -> str:
        return kwargs["conversation_id"]

    observe(session_id_arg="conversation_id")(loose)  # may come in **kwargs
    with pytest.raises(TypeError, match="role"):
        observe(role="")
    with pytest.raises(TypeError, match="longer than 64"):
        observe(role="r" * 65)
    with pytest.raises(TypeError, match="must be a Flywheel client, not str"):
        observe(client="fw")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not int"):
        observe(3)  # type: ignore[call-overload]


def test_inside_a_session_spans_nest_with_their_roles(fw: Flywheel) -> None:
    @observe(role="critic")
    def review(patch: str) -> str:
        current_scope().tool_call("lint", patch)  # type: ignore[union-attr]
        return "ok"

    @observe(name="planner")
    def plan(task: str) -> str:
        return review(task + "-patch")

    @observe
    def helper() -> str:
        return plan("t")

    with fw.session(role="orchestrator") as s:
        assert helper() == "ok"
        assert current_scope() is s
    events = delivered(fw)
    assert kinds(events) == ["session_start", "span_start", "span_start", "span_start", "turn",
                             "span_end", "span_end", "span_end", "session_end"]  # fmt: skip
    starts = [e for e in events if isinstance(e, SpanStart)]
    assert [e.role for e in starts] == [helper.__qualname__[-64:], "planner", "critic"]
    assert [e.parent_span_id for e in starts] == ["root", starts[0].span_id, starts[1].span_id]
    turn = next(e for e in events if isinstance(e, Turn))
    assert (turn.span.span_id, turn.span.role) == (starts[2].span_id, "critic")
    ends = [e for e in events if isinstance(e, SpanEnd)]
    assert [e.span_id for e in ends] == [starts[2].span_id, starts[1].span_id, starts[0].span_id]
    assert {e.status for e in ends} == {"completed"}


def test_an_outer_observed_call_is_the_session_and_inner_ones_its_spans(fw: Flywheel) -> None:
    @observe(role="subagent")
    def inner() -> None:
        assert current_scope() is not current_session()

    @observe(name="bot")
    def outer() -> None:
        inner()
        inner()

    outer()
    events = delivered(fw)
    assert kinds(events) == ["session_start", "span_start", "span_end", "span_start", "span_end", "session_end"]
    assert events[0].agent == "bot" and len({e.session_id for e in events}) == 1


def test_exceptions_propagate_unchanged_and_end_the_scope_failed(fw: Flywheel) -> None:
    error = KeyError("boom")

    @observe(role="worker")
    def fail() -> None:
        raise error

    @observe
    def top() -> None:
        fail()

    with pytest.raises(KeyError) as raised:
        top()
    assert raised.value is error
    assert current_scope() is None
    events = delivered(fw)
    span_end, session_end = events[-2], events[-1]
    assert isinstance(span_end, SpanEnd) and span_end.status == "failed" and span_end.result == "KeyError: 'boom'"
    assert isinstance(session_end, SessionEnd) and session_end.status == "failed"
    assert session_end.error == "KeyError: 'boom'"


async def test_async_functions_nest_across_tasks_and_cancellation_abandons(fw: Flywheel) -> None:
    @observe(role="searcher")
    async def search(n: int) -> int:
        await asyncio.sleep(0)
        current_scope().tool_call("search", {"n": n})  # type: ignore[union-attr]
        return n * 2

    @observe(session_id_arg="conversation_id")
    async def handle(conversation_id: str) -> list[int]:
        results = await asyncio.gather(*(search(n) for n in range(3)))
        assert current_scope() is current_session()  # the tasks' spans stayed in their tasks
        return list(results)

    assert await handle("conv-async") == [0, 2, 4]
    assert current_scope() is None

    @observe
    async def hang() -> None:
        await asyncio.sleep(30)

    task = asyncio.create_task(hang())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await fw.aflush(10)
    events = fw.transport.events()  # type: ignore[attr-defined]
    conv = [e for e in events if e.session_id == "conv-async"]
    starts = [e for e in conv if isinstance(e, SpanStart)]
    assert len(starts) == 3 and {e.parent_span_id for e in starts} == {"root"}
    turns = [e for e in conv if isinstance(e, Turn)]
    assert {t.span.span_id for t in turns} == {e.span_id for e in starts}
    ends = {e.session_id: e.status for e in events if isinstance(e, SessionEnd)}
    assert ends["conv-async"] == "completed" and list(ends.values()).count("abandoned") == 1


def test_methods_staticmethods_and_classmethods(fw: Flywheel) -> None:
    class Agent:
        def __init__(self, name: str):
            self.name = name

        @observe(session_id_arg="conversation_id")
        def run(self, conversation_id: str) -> str:
            return self.step()

        @observe(role="step")
        def step(self) -> str:
            return f"{self.name}:{self.kind()}:{self.twice(2)}"

        @observe
        @classmethod
        def kind(cls) -> str:
            return cls.__name__

        @observe
        @staticmethod
        def twice(x: int) -> int:
            return 2 * x

    assert Agent("a").run("conv-method") == "a:Agent:4"
    assert Agent.run.__name__ == "run"
    events = delivered(fw)
    assert {e.session_id for e in events} == {"conv-method"}  # self is not taken for the session id
    roles = [e.role for e in events if isinstance(e, SpanStart)]
    assert roles[0] == "step" and roles[1].endswith("Agent.kind") and roles[2].endswith("Agent.twice")


def test_generators_keep_their_scope_only_while_they_run(fw: Flywheel) -> None:
    @observe(role="streamer")
    def stream(n: int):
        for i in range(n):
            assert current_scope().role == "streamer"  # type: ignore[union-attr]
            got = yield i
            if got is not None:
                current_scope().message("user", got)  # type: ignore[union-attr]
        return "done"

    @observe
    def consume() -> list[int]:
        session = current_scope()
        gen = stream(3)
        first = next(gen)
        assert current_scope() is session  # between steps the caller's scope is current
        second = gen.send("more")
        rest = list(gen)
        return [first, second, *rest]

    assert consume() == [0, 1, 2]
    closed = stream(5)
    next(closed)
    closed.close()  # outside a session: the generator's own session ends abandoned
    events = delivered(fw)
    kinds_first = kinds([e for e in events if e.session_id == events[0].session_id])
    assert kinds_first == ["session_start", "span_start", "turn", "span_end", "session_end"]
    ends = [e for e in events if isinstance(e, SessionEnd)]
    assert [e.status for e in ends] == ["completed", "abandoned"]

    @observe
    def broken():
        yield 1
        raise ValueError("bad chunk")

    with pytest.raises(ValueError, match="bad chunk"):
        list(broken())
    assert delivered(fw)[-1].status == "failed"


async def test_async_generators(fw: Flywheel) -> None:
    @observe(role="streamer")
    async def stream(n: int):
        for i in range(n):
            await asyncio.sleep(0)
            current_scope().tool_call("chunk", {"i": i})  # type: ignore[union-attr]
            yield i

    @observe(session_id_arg="conversation_id")
    async def handle(conversation_id: str) -> list[int]:
        session = current_scope()
        out = []
        async for item in stream(3):
            assert current_scope() is session
            out.append(item)
        return out

    assert await handle("conv-agen") == [0, 1, 2]
    partial = stream(5)
    assert await partial.__anext__() == 0
    await partial.aclose()
    assert await fw.aflush(10)
    events = fw.transport.events()  # type: ignore[attr-defined]
    conv = [e for e in events if e.session_id == "conv-agen"]
    assert kinds(conv) == ["session_start", "span_start", "turn", "turn", "turn", "span_end", "session_end"]
    assert {t.span.role for t in conv if isinstance(t, Turn)} == {"streamer"}
    other = [e for e in events if e.session_id != "conv-agen"]
    assert kinds(other) == ["session_start", "turn", "session_end"] and other[-1].status == "abandoned"


def test_without_a_configured_client_the_function_runs_unobserved(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.delenv("FLYWHEEL_PROJECT", raising=False)
    monkeypatch.chdir(tmp_path)
    set_default_client(None)

    @observe(session_id_arg="conversation_id")
    def handle(conversation_id: str) -> str:
        assert current_scope() is None
        return conversation_id.upper()

    @observe
    async def ahandle() -> int:
        return 7

    with caplog.at_level(logging.WARNING, logger="flywheel.sdk"):
        assert handle("c") == "C"
        assert handle("d") == "D"
        assert asyncio.run(ahandle()) == 7
    warnings = [r.getMessage() for r in caplog.records if "unobserved" in r.getMessage()]
    assert len(warnings) == 1 and "FLYWHEEL_PROJECT" in warnings[0]  # said once, naming what is missing
    set_default_client(None)


def test_the_default_client_comes_from_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FLYWHEEL_PROJECT", "observe-env")
    monkeypatch.setenv("FLYWHEEL_SPOOL_DIR", str(tmp_path))
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", "127.0.0.1:9")
    set_default_client(None)
    from flywheel.sdk.decorators import default_client

    try:
        fw = default_client()
        assert fw is not None and fw.project == "observe-env" and default_client() is fw
    finally:
        if fw is not None:
            fw.close(0)
        set_default_client(None)


def test_a_failing_transport_never_breaks_the_function(fw: Flywheel) -> None:
    fw.transport.unavailable = "broker down"  # type: ignore[attr-defined]

    @observe(session_id_arg="conversation_id")
    def handle(conversation_id: str) -> str:
        return "fine"

    assert handle("conv-down") == "fine"
    assert not fw.flush(0.3)
    assert fw.stats.spooled >= 2 and fw.stats.sent == 0
    fw.transport.unavailable = None  # type: ignore[attr-defined]
    assert kinds(delivered(fw)) == ["session_start", "session_end"]


def test_an_explicit_client_and_an_internal_failure(fw: Flywheel, tmp_path, monkeypatch) -> None:
    other = Flywheel(project="observe-other", transport=MemoryTransport(), spool_dir=tmp_path / "other")
    try:

        @observe(client=other)
        def mine() -> str:
            return current_session().session_id  # type: ignore[union-attr]

        with fw.session("outer-session"):
            inner_id = mine()  # a session of another client: its own session there
        assert inner_id != "outer-session"
        assert {e.session_id for e in delivered(other)} == {inner_id}
        assert {e.session_id for e in delivered(fw)} == {"outer-session"}

        def broken_session(*args, **kwargs):
            raise RuntimeError("internal")

        monkeypatch.setattr(other, "session", broken_session)
        errors = other.stats.errors

        @observe(client=other)
        def still_runs() -> int:
            assert current_scope() is None
            return 5

        assert still_runs() == 5
        assert other.stats.errors == errors + 1
    finally:
        other.close(2)


def test_exported_from_flywheel() -> None:
    import flywheel
    import flywheel.sdk.decorators

    assert flywheel.observe is observe is flywheel.sdk.decorators.observe
