"""Pure extractors on hand-built sessions, with exact expected numbers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from flywheel.core.contracts.events import ToolCall
from rewarding.anneal import AnnealSettings, anneal_factor
from rewarding.extractors.outcome import OutcomeExtractor, OutcomeExtractorSettings, OutcomeRule
from rewarding.extractors.parl import ParlExtractor, ParlSettings, critical_steps
from rewarding.extractors.retrieval import RetrievalExtractor, RetrievalSettings, f_beta
from rewarding.extractors.shaping import ShapingExtractor, ShapingSettings
from rewarding.extractors.summary import SummaryExtractor, SummarySettings
from rewarding.extractors.user_signal import UserSignalExtractor, UserSignalSettings
from rewarding.session_state import Session
from rewarding.synthetic import SessionBuilder

T0 = datetime.now(UTC) - timedelta(hours=2)


def view(b: SessionBuilder) -> Session:
    return Session.from_events(b.project, b.session_id, b.events)


# ---------------------------------------------------------------- outcome


def test_outcome_bool_maps_task_solved_to_one_or_zero() -> None:
    ex = OutcomeExtractor(OutcomeExtractorSettings())
    b = SessionBuilder(at=T0)
    b.outcome("task_solved", True)
    assert ex.extract(view(b)).value == 1.0
    b.outcome("task_solved", False)  # a later outcome corrects the earlier one
    assert ex.extract(view(b)).value == 0.0


def test_outcome_rules_combine_and_ignore_unconfigured() -> None:
    rules = {
        "tests_passed": OutcomeRule(kind="bool"),
        "latency_ms": OutcomeRule(kind="linear", scale=-0.001, offset=1.0, clip_min=0.0),
        "coverage": OutcomeRule(kind="threshold", threshold=0.8, above_value=1.0, below_value=-1.0),
    }
    ex = OutcomeExtractor(OutcomeExtractorSettings(rules=rules, combine="mean"))
    b = SessionBuilder(at=T0)
    b.outcome("tests_passed", True)
    b.outcome("latency_ms", 250.0)
    b.outcome("coverage", 0.5)
    b.outcome("unknown_metric", 3.0)
    c = ex.extract(view(b))
    assert c.terms == {"tests_passed": 1.0, "latency_ms": pytest.approx(0.75), "coverage": -1.0}
    assert c.value == pytest.approx((1.0 + 0.75 - 1.0) / 3)
    assert c.details == {"ignored": ["unknown_metric"]}
    assert OutcomeExtractor(OutcomeExtractorSettings(rules=rules, combine="min")).extract(view(b)).value == -1.0


def test_outcome_absent_has_no_value_not_zero() -> None:
    b = SessionBuilder(at=T0)
    b.completion()
    assert OutcomeExtractor(OutcomeExtractorSettings()).extract(view(b)).value is None


# ---------------------------------------------------------------- user signal


def test_accept_inside_window_and_revert_outside_its_window() -> None:
    ex = UserSignalExtractor(UserSignalSettings())
    b = SessionBuilder(at=T0)
    b.completion()
    end = b.end()
    b.feedback("accept", at=end.occurred_at + timedelta(seconds=30))
    assert ex.extract(view(b)).value == 1.0
    b.feedback("revert", at=end.occurred_at + timedelta(minutes=11))  # revert window is 10 minutes
    c = ex.extract(view(b))
    assert c.value == 1.0 and c.metrics == {"outside_window": 1.0}
    b.feedback("revert", at=end.occurred_at + timedelta(minutes=9))
    assert ex.extract(view(b)).value == 0.0


def test_edit_persisted_follow_up_score_and_no_stacking() -> None:
    settings = UserSignalSettings(score={"weight": 0.1})
    ex = UserSignalExtractor(settings)
    b = SessionBuilder(at=T0)
    c1 = b.completion()
    b.end()
    b.feedback("edit", edit_ratio=0.4)
    b.feedback("persisted", persisted_minutes=10)  # under 30 minutes: no signal
    b.feedback("follow_up", dissatisfied=True, text="that is wrong")
    b.feedback("score", score=3.0)
    b.feedback("accept", completion_id=c1.completion_id)
    b.feedback("accept", completion_id=c1.completion_id)  # same target: counts once
    c = ex.extract(view(b))
    assert c.terms == {
        "edit": pytest.approx(-0.2),
        "follow_up": -0.5,
        "score": pytest.approx(0.3),
        "accept": 1.0,
    }
    assert c.value == pytest.approx(0.6)
    b.feedback("persisted", persisted_minutes=45)
    assert ex.extract(view(b)).terms["persisted"] == 0.5


def test_user_signal_is_clipped_and_absent_without_feedback() -> None:
    ex = UserSignalExtractor(UserSignalSettings(clip=1.5))
    b = SessionBuilder(at=T0)
    one, two = b.completion(), b.completion()
    assert ex.extract(view(b)).value is None
    b.feedback("accept", completion_id=one.completion_id)
    b.feedback("accept", completion_id=two.completion_id)
    assert ex.extract(view(b)).value == 1.5


# ---------------------------------------------------------------- shaping and annealing


def test_anneal_schedules() -> None:
    start = T0
    linear = AnnealSettings(kind="linear", start_at=start, duration_s=100.0)
    cosine = AnnealSettings(kind="cosine", start_at=start, duration_s=100.0)
    step = AnnealSettings(kind="step", start_at=start, duration_s=100.0)
    at = lambda s: start + timedelta(seconds=s)  # noqa: E731
    assert [anneal_factor(linear, at(s)) for s in (-5, 0, 25, 50, 100, 200)] == [1.0, 1.0, 0.75, 0.5, 0.0, 0.0]
    assert anneal_factor(cosine, at(50)) == pytest.approx(0.5)
    assert anneal_factor(cosine, at(25)) == pytest.approx(0.8535533905932737)
    assert [anneal_factor(step, at(s)) for s in (99, 100)] == [1.0, 0.0]
    assert anneal_factor(AnnealSettings(start_at=None), at(10_000)) == 1.0
    assert anneal_factor(AnnealSettings(kind="constant", start_at=start, duration_s=1.0), at(50)) == 1.0


def test_shaping_penalties_anneal_to_zero() -> None:
    b = SessionBuilder(at=T0)
    b.start()
    b.completion(latency_ms=3000.0, completion_ids=list(range(600)), logprobs=[-0.1] * 600)
    b.completion(latency_ms=5000.0, completion_ids=list(range(400)), logprobs=[-0.1] * 400)
    half = AnnealSettings(kind="linear", start_at=T0 - timedelta(seconds=50), duration_s=100.0)
    s = ShapingSettings(latency_coef=0.1, latency_free_s=2.0, length_coef=0.2, length_free_tokens=500, anneal=half)
    c = ShapingExtractor(s).extract(view(b))
    # mean latency 4 s -> 2 s over; 1000 tokens -> 500 over; factor 0.5
    assert c.terms == {"latency": pytest.approx(-0.5 * 0.1 * 2.0), "length": pytest.approx(-0.5 * 0.2 * 0.5)}
    assert c.value == pytest.approx(-0.15)
    done = s.model_copy(update={"anneal": AnnealSettings(start_at=T0 - timedelta(days=30), duration_s=100.0)})
    assert ShapingExtractor(done).extract(view(b)).value == 0.0


# ---------------------------------------------------------------- PARL


def parl_session(solved: bool = True) -> SessionBuilder:
    """root spawns A and B (stage 1) and C (stage 2); A spawns A1; B fails."""
    b = SessionBuilder(at=T0)
    b.start(task="parl")
    b.completion("plan", role="orchestrator")
    b.span_start("A")
    b.span_start("B")
    b.completion("a1", span="A", role="subagent")
    b.span_start("A1", parent="A")
    b.completion("x1", span="A1", role="subagent")
    b.completion("x2", span="A1", role="subagent")
    b.span_end("A1")
    b.completion("a2", span="A", role="subagent")
    b.completion("b1", span="B", role="subagent")
    b.span_end("A")
    b.span_end("B", status="failed")
    b.completion("merge", role="orchestrator")
    b.span_start("C")
    b.completion("c1", span="C", role="subagent")
    b.completion("c2", span="C", role="subagent")
    b.span_end("C")
    b.completion("answer", role="orchestrator")
    b.outcome("task_solved", solved)
    b.end()
    return b


def test_critical_steps_is_the_longest_chain_not_the_total() -> None:
    session = view(parl_session())
    # root 3 own + stage 1 max(A = 2 + A1's 2, B = 1) + stage 2 (C = 2) = 9; 10 completions in all
    assert critical_steps(session) == 9
    assert len(session.completions) == 10


def test_parl_terms_exact() -> None:
    ex = ParlExtractor(ParlSettings(), OutcomeExtractorSettings())
    c = ex.extract(view(parl_session()))
    assert c.terms == {
        "r_perf": 1.0,
        "r_parallel": pytest.approx(0.1 * 4 / 4),
        "r_finish": pytest.approx(0.1 * 3 / 4),
        "critical_steps_cost": pytest.approx(-0.01 * 9),
    }
    assert c.value == pytest.approx(1.085)
    assert c.metrics["critical_steps"] == 9.0 and c.metrics["total_steps"] == 10.0
    assert c.metrics["subagents"] == 4.0 and c.metrics["subagents_completed"] == 3.0


def test_parl_auxiliary_terms_anneal_and_serial_collapse_earns_nothing() -> None:
    halfway = AnnealSettings(kind="linear", start_at=T0 - timedelta(days=7), duration_s=14 * 86400.0)
    ex = ParlExtractor(ParlSettings(anneal=halfway), OutcomeExtractorSettings())
    assert ex.extract(view(parl_session())).value == pytest.approx(1.0 + 0.05 + 0.0375 - 0.09)
    serial = SessionBuilder(at=T0)
    for _ in range(5):
        serial.completion(role="orchestrator")
    serial.outcome("task_solved", True)
    c = ParlExtractor(ParlSettings(), OutcomeExtractorSettings()).extract(view(serial))
    assert c.terms["r_parallel"] == 0.0 and c.terms["r_finish"] == 0.0
    assert c.value == pytest.approx(1.0 - 0.05)


def test_parl_without_outcome_has_no_value() -> None:
    b = parl_session()
    b.events = [e for e in b.events if e.type != "outcome"]
    c = ParlExtractor(ParlSettings(), OutcomeExtractorSettings()).extract(view(b))
    assert c.value is None and c.metrics["critical_steps"] == 9.0


# ---------------------------------------------------------------- retrieval


def retrieval_session() -> SessionBuilder:
    b = SessionBuilder(at=T0)
    b.start(task="retrieval")
    b.completion("search 1", tool_calls=[ToolCall(id="s1", name="search", arguments="q1")])
    b.tool_result("s1", "...", documents=["d1", "d2", "d4"])
    b.completion("search 2", tool_calls=[ToolCall(id="s2", name="search", arguments="q2")])
    b.tool_result("s2", "...", documents=["d5"])
    b.prune(["d2", "d4"])  # a relevant document (d2) is pruned
    b.completion("final")
    b.outcome("retrieval_returned", 1.0, documents=["d1", "d5"])
    b.outcome("retrieval_gold", 3.0, documents=["d1", "d2", "d3"])
    b.end()
    return b


def test_f_beta() -> None:
    assert f_beta({"d1", "d5"}, {"d1", "d2", "d3"}, 4.0) == pytest.approx((0.5, 1 / 3, 17 / 50))
    assert f_beta(set(), {"d1"}, 4.0) == (0.0, 0.0, 0.0)
    assert f_beta({"d1"}, {"d1"}, 1.0) == (1.0, 1.0, 1.0)


def test_retrieval_fbeta_with_pruned_relevant_document_gets_process_credit() -> None:
    c = RetrievalExtractor(RetrievalSettings()).extract(view(retrieval_session()))
    assert c.terms == {
        "f_beta": pytest.approx(0.34),
        "encountered_recall": pytest.approx(0.2 * 2 / 3),  # d1 and the pruned d2
        "prune_penalty": 0.0,
        "search_turn_penalty": 0.0,
    }
    assert c.value == pytest.approx(0.34 + 0.4 / 3)
    assert c.metrics["pruned_relevant"] == 1.0 and c.metrics["search_turns"] == 2.0


def test_retrieval_penalises_repeated_pruning_and_many_searches() -> None:
    s = RetrievalSettings(free_prunes=0, prune_penalty=0.05, max_search_turns=1, search_turn_penalty=0.02)
    b = retrieval_session()
    b.prune(["d5"])
    c = RetrievalExtractor(s).extract(view(b))
    assert c.terms["prune_penalty"] == pytest.approx(-0.10)
    assert c.terms["search_turn_penalty"] == pytest.approx(-0.02)


def test_retrieval_without_gold_has_no_value() -> None:
    b = SessionBuilder(at=T0)
    b.outcome("retrieval_returned", 1.0, documents=["d1"])
    assert RetrievalExtractor(RetrievalSettings()).extract(view(b)).value is None


# ---------------------------------------------------------------- summary


def summary_session(solved: bool) -> tuple[SessionBuilder, str]:
    b = SessionBuilder(at=T0)
    b.start(task="long")
    b.completion("<calc>2+2</calc>", tool_calls=[ToolCall(id="t1", name="calc", arguments="2+2")])
    b.tool_result("t1", "4")
    writer = b.completion("summary: 2+2 is 4")
    b.summary(writer.completion_id, "2+2 is 4")
    b.completion("<calc>2+2</calc>", tool_calls=[ToolCall(id="t2", name="calc", arguments="2+2")])  # redone
    b.completion("<calc>3+3</calc>", tool_calls=[ToolCall(id="t3", name="calc", arguments="3+3")])
    b.completion("answer: 10")
    b.outcome("task_solved", solved)
    b.end()
    return b, str(writer.completion_id)


def test_summary_inherits_downstream_credit() -> None:
    ex = SummaryExtractor(SummarySettings(), OutcomeExtractorSettings())
    good, writer = summary_session(solved=True)
    c = ex.extract(view(good))
    # (1 - 0.5) - 0.5 * (1 of 2 later calls repeats one from before the summary)
    assert c.per_completion == {writer: {"summary_credit": pytest.approx(0.25)}}
    assert c.value is None and c.metrics["redo_share"] == 0.5
    bad, writer = summary_session(solved=False)
    assert ex.extract(view(bad)).per_completion == {writer: {"summary_credit": pytest.approx(-0.75)}}
