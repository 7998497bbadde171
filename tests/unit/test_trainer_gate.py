"""The eval gate's pure logic: the multi-suite rule, the held-out hash split, the arith suite's seeds.

The arith suite runs here against an in-memory stand-in for a served policy (a scripted chat
backend), to test what it does with answers (episodes, seeds, the summary); the gate through a
real vLLM replica is tested in tests/integration/test_trainer_gate_engine.py.
"""

from __future__ import annotations

import hashlib
import threading
from datetime import UTC, datetime

import pytest

from flywheel.core.settings import Settings
from flywheel.task import arith
from trainer import gate
from trainer.engine import Sampling
from trainer.evals.arith import ArithSettings, ArithSuite, request_seed
from trainer.evals.base import EvalContext
from trainer.select import SampleMeta, SelectionRules, choose, holdout_bucket, is_held_out

# --------------------------------------------------------------------------- the rule over several suites


def test_a_candidate_passes_only_if_no_suite_regresses_beyond_its_own_margin():
    arith_ok = gate.verdict("arith", "k1", {"success_rate": 0.42, "n": 200}, {"success_rate": 0.45, "n": 200}, 0.05)
    replay_bad = gate.verdict("replay", "k2", {"success_rate": 0.30, "n": 80}, {"success_rate": 0.45, "n": 80}, 0.1)
    assert arith_ok.passed and not replay_bad.passed
    assert replay_bad.delta == pytest.approx(-0.15) and replay_bad.margin == 0.1

    passed = gate.decide([arith_ok])
    assert passed.passed and passed.reason.startswith("passed: arith 0.420 vs parent 0.450")

    rejected = gate.decide([arith_ok, replay_bad])
    assert not rejected.passed and [v.suite for v in rejected.failing()] == ["replay"]
    assert rejected.reason.startswith("regressed on replay 0.300 vs parent 0.450 (delta -0.150, margin 0.100, n=80)")
    assert "passed arith 0.420 vs parent 0.450 (delta -0.030, margin 0.050, n=200)" in rejected.reason
    # the top level keeps the first suite's numbers (the headline readers of one suite know)
    assert (rejected.key, rejected.candidate.success_rate, rejected.margin) == ("k1", 0.42, 0.05)
    assert [v.suite for v in rejected.suites] == ["arith", "replay"]


def test_a_suite_exactly_at_its_margin_passes_and_one_just_beyond_fails():
    at = gate.verdict("s", "k", {"success_rate": 0.5, "n": 10}, {"success_rate": 0.75, "n": 10}, 0.25)
    beyond = gate.verdict("s", "k", {"success_rate": 0.5, "n": 10}, {"success_rate": 0.75, "n": 10}, 0.24)
    assert at.passed and not beyond.passed


def test_a_suite_that_measured_nothing_passes_with_a_note():
    empty = gate.verdict("replay", "k", {"success_rate": 0.0, "n": 0}, {"success_rate": 0.0, "n": 0}, 0.05)
    assert empty.passed and empty.note == "nothing measured (n=0)"
    even = gate.verdict("arith", "a", {"success_rate": 0.4, "n": 9}, {"success_rate": 0.4, "n": 9}, 0.0)
    decision = gate.decide([even, empty])
    assert decision.passed and "replay nothing measured (n=0)" in decision.reason
    with pytest.raises(ValueError, match="at least one"):
        gate.decide([])


# --------------------------------------------------------------------------- the held-out split


def test_the_holdout_bucket_is_the_first_56_bits_of_sha256_mod_1000():
    digest = hashlib.sha256(b"demo/s-1").digest()
    assert holdout_bucket("demo", "s-1") == int.from_bytes(digest[:7], "big") % 1000
    assert holdout_bucket("demo", "s-1") == holdout_bucket("demo", "s-1")  # stable
    assert not is_held_out("demo", "s-1", 0)  # 0 holds nothing out
    assert is_held_out("demo", "s-1", 1000)  # 1000 holds everything out
    share = sum(is_held_out("p", f"s{i}", 50) for i in range(20_000)) / 20_000
    assert 0.04 < share < 0.06  # about 50 per mille


def test_selection_drops_and_counts_the_samples_of_held_out_sessions():
    t0 = datetime(2026, 12, 2, tzinfo=UTC)
    sessions = [f"s{i}" for i in range(200)]
    held = {s for s in sessions if is_held_out("demo", s, 100)}
    assert held and len(held) < len(sessions)
    rows = [SampleMeta(i, f"c{i}", 1, "p2", "agent", t0, None, "demo", s) for i, s in enumerate(sessions)]
    rules = SelectionRules(frozenset({"p2"}), frozenset({"agent"}), 1, 1000, holdout_per_mille=100)
    selection = choose(rows, rules)
    assert selection.counts["held_out"] == len(held)
    assert {sessions[i] for i in selection.ids}.isdisjoint(held)
    assert len(selection.ids) == len(sessions) - len(held)
    assert "held_out" not in choose(rows, SelectionRules(frozenset({"p2"}), frozenset({"agent"}), 1, 1000)).counts


# --------------------------------------------------------------------------- the arith suite's episodes


class ScriptedPolicy:
    """A stand-in for a served policy: answers by a rule and records every request's seed."""

    engine_kind = "fake"

    def __init__(self, solve: bool):
        self.solve = solve
        self.seeds: list[tuple[str, int | None]] = []
        self.lock = threading.Lock()

    def chat(self, messages, sampling: Sampling) -> str:
        problem = arith.problem_from_text(messages[1]["content"])
        with self.lock:
            self.seeds.append((problem.id, sampling.seed))
        if messages[-1]["role"] == "tool":
            return arith.format_answer(messages[-1]["content"] if self.solve else "0")
        return arith.format_tool_call(problem.expression)

    def map(self, fn, items):
        return [fn(item) for item in items]


def test_the_arith_suite_runs_whole_episodes_and_seeds_each_turn_alike_for_every_policy():
    settings = Settings()
    context = EvalContext(settings=settings, sampling=Sampling(temperature=1.0), engine_kind="fake")
    suite = ArithSuite()
    prepared = suite.prepare(ArithSettings(n=12, seed=7), context)
    assert prepared.key == "arith-v1/heldout/n12/s7/t1.0/m24/fake"
    assert prepared.items == arith.sample_problems("heldout", 12, 7)

    good, bad = ScriptedPolicy(solve=True), ScriptedPolicy(solve=False)
    won = suite.evaluate(good, prepared, context)
    lost = suite.evaluate(bad, prepared, context)
    assert (won["success_rate"], won["n"], won["tool_call_rate"]) == (1.0, 12, 1.0)
    assert lost["success_rate"] == 0.0 and lost["finish_reasons"] == {"answer": 12}
    assert won["engine"] == "fake"
    # two turns per episode, each with its own seed, the same for both policies
    assert sorted(good.seeds) == sorted(bad.seeds)
    first = prepared.items[0]
    assert (first.id, request_seed(7, first.id, 1)) in good.seeds and (
        first.id,
        request_seed(7, first.id, 2),
    ) in good.seeds
    assert len({s for _, s in good.seeds}) == 24
