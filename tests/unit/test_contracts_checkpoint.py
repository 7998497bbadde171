"""Checkpoint contracts: the eval column and the sidecar read what is stored today and write it back unchanged."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from flywheel.core.contracts.checkpoint import CheckpointEval, CheckpointSidecar, GateRecord, HeldoutResult
from flywheel.model.eval import EvalResult
from trainer.gate import decide
from trainer.gate import verdict as gate_verdict

KEY = "arith-v1/heldout/n32/s1234/t1.0/m24"
ROOT_KEY = "arith-v1/heldout/n200/s1234/t1.0/m24"


def arith_result(success_rate: float, successes: int) -> dict:
    """An arith eval suite's result, as the gate stores it."""
    by_kind = {"add": 0.5, "sub": 0.3, "mul": 0.4}
    finish = {"answer": 30, "no_answer": 2}
    return EvalResult(success_rate, 32, successes, "heldout", 1234, 1.0, 24, by_kind, finish, 0.9, 0.0, 3.2).to_dict()


def trained_eval() -> dict:
    """``checkpoints.eval`` of a trained checkpoint, as the trainer writes it."""
    candidate, parent = arith_result(0.40625, 13), arith_result(0.375, 12)
    gate = {
        "passed": True,
        "reason": "passed: held-out success 0.406 vs parent 0.375 (delta +0.031, margin 0.020, n=32)",
        "candidate": candidate,
        "parent": parent,
        "margin": 0.02,
        "delta": 0.03125,
        "key": KEY,
    }
    return {"heldout": {KEY: candidate}, "gate": gate}


def root_eval() -> dict:
    """``checkpoints.eval`` of the base model's root checkpoint (its build-time result)."""
    held = {"success_rate": 0.13, "n": 200, "temperature": 1.0, "seed": 1234, "by_kind": {"add": 0.2}}
    return {"heldout": {ROOT_KEY: held | {"tool_call_rate": 0.8, "source": "build"}}}


@pytest.mark.parametrize(
    "stored",
    [
        trained_eval(),
        root_eval(),
        root_eval() | {"heldout": root_eval()["heldout"] | {KEY: arith_result(0.1, 3)}},  # a parent cached by the gate
        {"heldout": {"k": {"success_rate": 0.4}}},  # written by hand (tests, ops)
        {"heldout": {"k": {"success_rate": 0.4, "n": 32}}, "gate": {"passed": True, "reason": "passed", "key": "k",
                                                                    "candidate": {"success_rate": 0.4, "n": 32}}},
        {},
    ],
)  # fmt: skip
def test_a_stored_eval_round_trips_unchanged(stored):
    evaluation = CheckpointEval.parse(stored)
    assert evaluation.to_dict() == stored  # (jsonb keeps no key order: equal objects are equal rows)
    assert CheckpointEval.parse(json.loads(json.dumps(stored))).to_dict() == stored


def test_readers_find_the_gate_and_the_cached_results():
    trained = CheckpointEval.parse(trained_eval())
    assert trained.gated_success == 0.40625 and trained.gate.parent.n == 32 and trained.gate.margin == 0.02
    assert trained.cached(KEY).model_extra["successes"] == 13 and trained.cached("other") is None
    root = CheckpointEval.parse(root_eval())
    assert root.gate is None and root.gated_success is None
    assert root.latest_heldout().success_rate == 0.13 and root.latest_heldout().model_extra["source"] == "build"
    assert CheckpointEval.parse(None).latest_heldout() is None
    with pytest.raises(ValidationError, match="success_rate"):
        CheckpointEval.parse({"heldout": {"k": {"n": 3}}})


def test_caching_a_result_keeps_everything_else():
    stored = trained_eval() | {"note": "kept"}
    parent = HeldoutResult.model_validate(arith_result(0.2, 6))
    updated = CheckpointEval.parse(stored).with_heldout("other-key", parent).to_dict()
    assert updated == stored | {"heldout": stored["heldout"] | {"other-key": arith_result(0.2, 6)}}
    assert list(updated["heldout"]) == [KEY, "other-key"]
    replaced = CheckpointEval.parse(updated).with_heldout(KEY, parent).to_dict()
    assert list(replaced["heldout"]) == [KEY, "other-key"] and replaced["heldout"][KEY]["success_rate"] == 0.2
    assert CheckpointEval.parse({}).with_heldout(KEY, parent).to_dict() == {"heldout": {KEY: arith_result(0.2, 6)}}


def test_the_gate_writes_the_first_suites_numbers_where_readers_of_one_suite_find_them():
    stored = trained_eval()
    verdict = gate_verdict("arith", KEY, arith_result(0.40625, 13), arith_result(0.375, 12), 0.02)
    replay = gate_verdict("replay", "replay-v1/k", {"success_rate": 0.5, "n": 40}, {"success_rate": 0.45, "n": 40}, 0.1)
    decision = decide([verdict, replay])
    assert isinstance(decision, GateRecord) and decision.key == KEY and decision.passed
    written = decision.to_dict()
    old = stored["gate"]
    # What a reader of the one-suite record read is where it was, with the same values.
    assert {k: written[k] for k in ("passed", "candidate", "parent", "margin", "delta", "key")} == {
        k: old[k] for k in ("passed", "candidate", "parent", "margin", "delta", "key")
    }
    assert "arith 0.406 vs parent 0.375 (delta +0.031, margin 0.020, n=32)" in written["reason"]
    assert [v["suite"] for v in written["suites"]] == ["arith", "replay"]
    again = CheckpointEval(heldout={KEY: decision.candidate}, gate=decision)
    assert CheckpointEval.parse(again.to_dict()) == again and again.headline().success_rate == 0.40625


def old_sidecar() -> str:
    """``flywheel_checkpoint.json`` as the trainer wrote it before the sidecar moved to the core."""
    sidecar = {
        "schema_version": 1,
        "checkpoint_id": "c000001-1a2b3c4d",
        "policy_version": "c000001-1a2b3c4d",
        "parent_id": "base-0123abcd",
        "parent_policy_version": "base-0123abcd",
        "format": "full",
        "base_model": "/models/base",
        "cycle_id": 1,
        "data_window_start": None,
        "data_window_end": "2026-01-02T03:04:05Z",
        "n_samples": 2,
        "sample_ids": [1, 2],
        "sample_ids_hash": "ab" * 32,
        "config_hash": "cd" * 32,
        "config": {"mode": "full"},
        "metrics": {"loss_before": 1.5, "loss_after": 1.2},
        "steps": [{"step": 0.0, "loss": 1.5}],
        "baseline_state": {"mean": 0.1},
        "gate": trained_eval()["gate"],
        "status": "candidate",
        "versions": {"torch": "2.9.0"},
        "created_at": "2026-01-02T03:05:00Z",
    }
    return json.dumps(sidecar, indent=2) + "\n"


def test_a_sidecar_written_today_reads_and_writes_back_byte_for_byte():
    text = old_sidecar()
    sidecar = CheckpointSidecar.model_validate_json(text)
    assert sidecar.gate.passed and sidecar.gate.candidate.success_rate == 0.40625
    assert sidecar.model_dump_json(indent=2) + "\n" == text
