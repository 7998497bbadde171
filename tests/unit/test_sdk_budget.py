"""The token budget context manager: counting, states, nudges, refusals, prunes and summaries, its events."""

from __future__ import annotations

import asyncio

import pytest

from flywheel.core.contracts import BudgetEnforcement, ContextUpdate
from flywheel.sdk import BudgetExceeded, Flywheel, approx_tokens
from flywheel.sdk.budget import message_text
from flywheel.sdk.transports.memory import MemoryTransport


@pytest.fixture
def fw(tmp_path):
    client = Flywheel(project="budget-test", transport=MemoryTransport(), spool_dir=tmp_path)
    yield client
    client.close(2)


def delivered(fw: Flywheel) -> list:
    assert fw.flush(10)
    return fw.transport.events()  # type: ignore[attr-defined]


def words(text: str) -> list[str]:
    """A stand-in tokenizer: one token per word, returned as a list like a tokenizer's encode."""
    return text.split()


def test_states_follow_the_count_and_the_warn_line(fw: Flywheel) -> None:
    with fw.session() as s, s.budget(max_tokens=10, warn_at=0.8, tokenizer=words) as b:
        assert (b.tokens, b.state, b.nudge, b.remaining) == (0, "ok", None, 10)
        assert b.add("one two three four five six seven") == 7 and b.state == "ok"
        b.add("eight")  # 8 = 0.8 * 10: at the warn line
        assert b.state == "near"
        b.add(["nine", {"role": "user", "content": "ten"}])  # 10: at the budget, not over it
        assert (b.tokens, b.state) == (10, "near")
        b.add("eleven")
        assert (b.state, b.remaining) == ("over", -1)
        b.set(3)  # a count may go down without a prune (the harness truncated): nothing is logged
        assert b.state == "ok"
        b.set(11)  # straight to over: logs over only
    events = [e for e in delivered(fw) if isinstance(e, BudgetEnforcement)]
    assert [(e.kind, e.tokens, e.state) for e in events] == [
        ("near", 8, "near"),
        ("over", 11, "over"),
        ("over", 11, "over"),
    ]
    assert {(e.budget_tokens, e.warn_at, e.action, e.span.span_id) for e in events} == {(10, 0.8, "prune", "root")}


def test_over_the_budget_only_the_action_is_allowed_and_a_refusal_is_logged(fw: Flywheel) -> None:
    with fw.session() as s, s.budget(max_tokens=100, action="prune", allowed_tools=["prune_chunks"]) as b:
        assert b.allows("search")
        b.check("search")  # under the budget: anything goes
        b.set(150)
        assert not b.allows("search") and b.allows("prune_chunks")
        b.check("prune_chunks")
        with pytest.raises(BudgetExceeded) as caught:
            b.check("search", tool_call_id="call-7")
    err = caught.value
    assert (err.tool, err.tokens, err.budget_tokens, err.action, err.allowed_tools) == (
        "search",
        150,
        100,
        "prune",
        ("prune_chunks",),
    )
    assert "150 tokens, over its budget of 100" in str(err) and "only 'prune_chunks' is allowed" in str(err)
    (refused,) = [e for e in delivered(fw) if isinstance(e, BudgetEnforcement) and e.kind == "refused"]
    assert (refused.refused_tool, refused.tool_call_id, refused.state, refused.tokens) == (
        "search",
        "call-7",
        "over",
        150,
    )


def test_nudge_asks_for_the_action(fw: Flywheel) -> None:
    with fw.session() as s:
        prune = s.budget(max_tokens=1000, tokens=850)
        assert prune.nudge == (
            "Your context holds 850 of 1000 tokens (85%): prune the documents or chunks you no longer need "
            "with `prune` before going on."
        )
        summary = s.budget(max_tokens=1000, action="summary", tokens=1200)
        assert summary.nudge == (
            "Your context is over its budget (1200 of 1000 tokens): summarise what you need to keep so far "
            "with `summary` now; no other tool is allowed until it is back under 1000."
        )


def test_a_prune_through_the_scope_drops_the_count_and_is_logged_as_a_reduction(fw: Flywheel) -> None:
    with fw.session() as s:
        with s.budget(max_tokens=100, warn_at=0.5) as b:
            b.set(120)
            pruned = s.prune(["d2", "d4"], tokens_after=70)  # over -> near
            assert (b.tokens, b.state) == (70, "near")
            s.prune(["d9"])  # without tokens_after the budget cannot know the size: unchanged, nothing logged
            assert b.tokens == 70
            assert s.prune(["d8"], tokens_after=-5) is not None and b.tokens == 70  # a logging call never raises
            s.prune(["d5"], tokens_after=20)  # near -> ok
            assert b.state == "ok"
            s.prune(["d6"], tokens_after=10)  # already ok: no reduction to log
        assert not b.active and s._budgets == []
        s.prune(["d7"], tokens_after=0)  # after the block: the budget is no longer told
        assert b.tokens == 10
    events = delivered(fw)
    contexts = [e for e in events if isinstance(e, ContextUpdate)]
    assert [c.tokens_before for c in contexts] == [120, 70, 70, 20, None]  # filled in from the active budget
    assert fw.stats.invalid == 1  # the prune with tokens_after=-5
    reductions = [e for e in events if isinstance(e, BudgetEnforcement) and e.kind == "reduced"]
    assert [(r.tokens_before, r.state_before, r.tokens, r.state, r.reduced_by) for r in reductions] == [
        (120, "over", 70, "near", "prune"),
        (70, "near", 20, "ok", "prune"),
    ]
    assert reductions[0].context_event_id == pruned == contexts[0].event_id


def test_a_summary_reduces_a_summary_budget(fw: Flywheel) -> None:
    with fw.session() as s, s.budget(max_tokens=50, action="summary", tokenizer=approx_tokens) as b:
        b.add("x" * 240)  # 60 approximate tokens: over
        assert b.state == "over" and not b.allows("search") and b.allows("summary")
        writer = s.completion(model="m", completion_text="so far: x")
        s.summary("so far: x", completion_id=writer, tokens_after=b.count("so far: x"))
        assert (b.tokens, b.state) == (3, "ok")
    (reduced,) = [e for e in delivered(fw) if isinstance(e, BudgetEnforcement) and e.kind == "reduced"]
    assert (reduced.reduced_by, reduced.state_before, reduced.tokens_before) == ("summary", "over", 60)


def test_a_budget_enforces_in_an_unsampled_session_and_logs_nothing(tmp_path) -> None:
    fw = Flywheel(project="budget-test", transport=MemoryTransport(), spool_dir=tmp_path, sample_rate=0.0)
    try:
        with fw.session() as s, s.budget(max_tokens=5, tokenizer=words) as b:
            b.add("a b c d e f")
            with pytest.raises(BudgetExceeded):
                b.check("search")
            assert s.prune(["d1"], tokens_after=1) is None and b.state == "ok"
        assert delivered(fw) == []
    finally:
        fw.close(2)


def test_a_span_has_its_own_budget(fw: Flywheel) -> None:
    with fw.session(role="orchestrator") as s:
        with s.span("subagent", "read") as sub, sub.budget(max_tokens=10, tokens=20) as b:
            s.prune(["d1"], tokens_after=0)  # the session's prune is not the span's context
            assert b.tokens == 20
            sub.prune(["d1"], tokens_after=0)
            assert b.tokens == 0
    (over, reduced) = [e for e in delivered(fw) if isinstance(e, BudgetEnforcement)]
    assert (over.kind, over.span.span_id, over.span.role) == ("over", sub.span_id, "subagent")
    assert reduced.kind == "reduced" and reduced.span.span_id == sub.span_id


def test_async_with_works_the_same(fw: Flywheel) -> None:
    async def agent() -> str:
        async with fw.asession() as s, s.budget(max_tokens=4, tokenizer=words) as b:
            b.add("a b c d e")
            s.prune(["x"], tokens_after=1)
            return b.state

    assert asyncio.run(agent()) == "ok"
    kinds = [e.kind for e in delivered(fw) if isinstance(e, BudgetEnforcement)]
    assert kinds == ["over", "reduced"]


def test_last_event_id_stays_the_last_content(fw: Flywheel) -> None:
    with fw.session() as s, s.budget(max_tokens=2) as b:
        message = s.message("user", "hi")
        b.set(5)  # logs an over event
        assert s.last_event_id == message


def test_message_text_counts_content_parts_names_and_tool_calls() -> None:
    message = {
        "role": "assistant",
        "name": "agent",
        "content": [{"type": "text", "text": "let me search"}, {"type": "image_url", "image_url": {}}],
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}],
    }
    assert message_text(message) == 'agent\nlet me search\nsearch\n{"q": "x"}'
    assert approx_tokens("") == 0 and approx_tokens("abcde") == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer from 1"),
        ({"max_tokens": 10, "warn_at": 0.0}, "warn_at must be a share of max_tokens in (0, 1]"),
        ({"max_tokens": 10, "warn_at": 1.5}, "warn_at must be a share"),
        ({"max_tokens": 10, "action": "truncate"}, "action must be 'prune' or 'summary'"),
        ({"max_tokens": 10, "tokenizer": "gpt2"}, "tokenizer must be callable"),
        ({"max_tokens": 10, "allowed_tools": []}, "allowed_tools must be non-empty tool names"),
        ({"max_tokens": 10, "tokens": -1}, "token count must be an integer from 0"),
    ],
)
def test_bad_arguments_are_named(fw: Flywheel, kwargs: dict, message: str) -> None:
    with fw.session() as s, pytest.raises(ValueError) as caught:
        s.budget(**kwargs)
    assert message in str(caught.value)


def test_counting_without_a_tokenizer_or_with_a_bad_one_is_a_clear_error(fw: Flywheel) -> None:
    with fw.session() as s:
        with pytest.raises(ValueError, match="no tokenizer: pass tokenizer="):
            s.budget(max_tokens=10).add("text")
        with pytest.raises(TypeError, match="must return token ids or a count, got object"):
            s.budget(max_tokens=10, tokenizer=lambda text: object()).add("text")
        with pytest.raises(TypeError, match="a chat message or a list of them, got int"):
            s.budget(max_tokens=10, tokenizer=words).add(5)
        assert s.budget(max_tokens=10, tokenizer=lambda text: 3).add(["a", "b"]) == 6  # a count works too
