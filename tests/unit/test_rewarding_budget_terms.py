"""The retrieval and summary extractors read token-budget events: exact terms, and no change without them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from flywheel.core.contracts.events import ToolCall
from rewarding.extractors.budgets import lowered
from rewarding.extractors.outcome import OutcomeExtractorSettings
from rewarding.extractors.retrieval import RetrievalExtractor, RetrievalSettings
from rewarding.extractors.summary import SummaryExtractor, SummarySettings
from rewarding.session_state import Session
from rewarding.synthetic import SessionBuilder

T0 = datetime.now(UTC) - timedelta(hours=2)


def view(b: SessionBuilder) -> Session:
    return Session.from_events(b.project, b.session_id, b.events)


def search(b: SessionBuilder, call_id: str, documents: list[str]) -> None:
    b.completion(f"search {call_id}", tool_calls=[ToolCall(id=call_id, name="search", arguments=call_id)])
    b.tool_result(call_id, "...", documents=documents)


def retrieval_session(budget: bool) -> SessionBuilder:
    """Context-1-style: the budget is passed, a search refused, a prune brings it back under."""
    b = SessionBuilder(at=T0)
    b.start(task="retrieval")
    search(b, "s1", ["d1", "d2", "d4"])
    if budget:
        b.budget("near", 85, "near")
    search(b, "s2", ["d5"])
    if budget:
        b.budget("over", 120, "over")
        b.completion("search again", tool_calls=[ToolCall(id="s3", name="search", arguments="q3")])
        b.budget("refused", 120, "over", refused_tool="search", tool_call_id="s3")
    pruned = b.prune(["d2", "d4"])
    if budget:
        b.budget("reduced", 60, "ok", reduced_by="prune", context_event_id=pruned.event_id, tokens_before=120,
                 state_before="over")  # fmt: skip
    b.completion("final")
    b.outcome("retrieval_returned", 1.0, documents=["d1", "d5"])
    b.outcome("retrieval_gold", 3.0, documents=["d1", "d2", "d3"])
    b.end()
    return b


def test_retrieval_credits_the_prune_that_got_back_under_and_penalises_the_refusal() -> None:
    c = RetrievalExtractor(RetrievalSettings()).extract(view(retrieval_session(budget=True)))
    assert c.terms == {
        "f_beta": pytest.approx(0.34),
        "encountered_recall": pytest.approx(0.2 * 2 / 3),
        "prune_penalty": 0.0,
        "search_turn_penalty": 0.0,
        "budget_prune_credit": pytest.approx(0.05),
        "budget_refusal_penalty": pytest.approx(-0.1),
    }
    assert c.value == pytest.approx(0.34 + 0.4 / 3 + 0.05 - 0.1)
    budget = {k: v for k, v in c.metrics.items() if k.startswith("budget_")}
    assert budget == {"budget_near": 1.0, "budget_over": 1.0, "budget_refused": 1.0, "budget_reductions": 1.0}


def test_retrieval_without_budget_events_or_with_only_a_summary_budget_is_unchanged() -> None:
    extractor = RetrievalExtractor(RetrievalSettings())
    plain = extractor.extract(view(retrieval_session(budget=False)))
    assert set(plain.terms) == {"f_beta", "encountered_recall", "prune_penalty", "search_turn_penalty"}
    assert not any(k.startswith("budget_") for k in plain.metrics)
    other = retrieval_session(budget=False)
    other.budget("over", 500, "over", action="summary")  # the summary extractor's to read
    assert extractor.extract(view(other)) == plain


def test_a_prune_that_leaves_the_budget_over_earns_no_credit() -> None:
    b = retrieval_session(budget=False)
    b.budget("over", 150, "over")
    pruned = b.prune(["d1"])
    b.budget("reduced", 130, "over", reduced_by="prune", context_event_id=pruned.event_id, tokens_before=150,
             state_before="over")  # fmt: skip
    c = RetrievalExtractor(RetrievalSettings(budget_prune_credit=1.0)).extract(view(b))
    assert c.terms["budget_prune_credit"] == 0.0 and c.terms["budget_refusal_penalty"] == 0.0
    assert not lowered(b.events[-1]) and c.metrics["budget_reductions"] == 0.0


def summary_session(budget: bool) -> tuple[SessionBuilder, dict[str, str]]:
    """Composer-style: over a summary budget, two tool calls are refused before the agent summarises."""
    b = SessionBuilder(at=T0)
    b.start(task="long")
    b.completion("<calc>2+2</calc>", tool_calls=[ToolCall(id="t1", name="calc", arguments="2+2")])
    b.tool_result("t1", "4")
    ids = {}
    if budget:
        b.budget("over", 120, "over", action="summary")
        named = b.completion("<calc>3+3</calc>", tool_calls=[ToolCall(id="t2", name="calc", arguments="3+3")])
        b.budget("refused", 120, "over", action="summary", refused_tool="calc", tool_call_id="t2")
        unnamed = b.completion("<calc>4+4</calc>", tool_calls=[ToolCall(id="t3", name="calc", arguments="4+4")])
        b.budget("refused", 120, "over", action="summary", refused_tool="calc")  # no call id: the latest completion
        b.budget("refused", 120, "over", action="summary", refused_tool="calc", span="sub-1")  # no completion there
        ids = {"named": str(named.completion_id), "unnamed": str(unnamed.completion_id)}
    writer = b.completion("summary: 2+2 is 4")
    summary = b.summary(writer.completion_id, "2+2 is 4")
    if budget:
        b.budget("reduced", 20, "ok", action="summary", reduced_by="summary", context_event_id=summary.event_id,
                 tokens_before=120, state_before="over")  # fmt: skip
    b.completion("answer: 4")
    b.outcome("task_solved", True)
    b.end()
    return b, {**ids, "writer": str(writer.completion_id)}


def test_summary_credits_a_summary_made_when_asked_and_penalises_the_refused_completions() -> None:
    ex = SummaryExtractor(SummarySettings(), OutcomeExtractorSettings())
    b, ids = summary_session(budget=True)
    c = ex.extract(view(b))
    assert c.value is None
    assert c.per_completion == {
        ids["writer"]: {"summary_credit": pytest.approx(0.5), "budget_asked": pytest.approx(0.1)},
        ids["named"]: {"budget_refused": pytest.approx(-0.1)},
        ids["unnamed"]: {"budget_refused": pytest.approx(-0.1)},
    }
    assert c.details == {"unattributed_refusals": 1}
    assert (c.metrics["budget_over"], c.metrics["budget_refused"], c.metrics["budget_reductions"]) == (1.0, 3.0, 1.0)
    assert c.metrics["summaries"] == 1.0 and c.metrics["downstream"] == 1.0


def test_refusals_count_even_without_a_summary_or_an_outcome() -> None:
    b = SessionBuilder(at=T0)
    b.budget("over", 120, "over", action="summary")
    never = b.completion("<calc>1+1</calc>", tool_calls=[ToolCall(id="t1", name="calc", arguments="1+1")])
    b.budget("refused", 120, "over", action="summary", refused_tool="calc", tool_call_id="t1")
    c = SummaryExtractor(SummarySettings(refusal_penalty=0.3), OutcomeExtractorSettings()).extract(view(b))
    assert c.value is None and c.per_completion == {str(never.completion_id): {"budget_refused": pytest.approx(-0.3)}}


def test_summary_without_a_summary_budget_is_unchanged() -> None:
    ex = SummaryExtractor(SummarySettings(), OutcomeExtractorSettings())
    plain, ids = summary_session(budget=False)
    before = ex.extract(view(plain))
    assert before.per_completion == {ids["writer"]: {"summary_credit": pytest.approx(0.5)}}
    plain.budget("over", 500, "over", action="prune")  # the retrieval extractor's to read
    assert ex.extract(view(plain)).per_completion == before.per_completion
    assert not any(k.startswith("budget_") for k in ex.extract(view(plain)).metrics)
