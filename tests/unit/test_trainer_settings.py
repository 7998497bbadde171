"""The trainer's settings sections and the gate's eval-suite plug-in."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flywheel.core.plugins import PluginError
from flywheel.core.settings import Settings
from flywheel.core.settings.trainer import TrainerSettings
from trainer import gate
from trainer.evals.arith import ArithSuite
from trainer.evals.base import EvalSuite
from trainer.evals.replay import ReplaySuite


def test_sections_are_read_from_nested_environment_variables(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_TRAINER__SCHEDULE__INTERVAL_S", "30")
    monkeypatch.setenv("FLYWHEEL_TRAINER__LORA__RANK", "16")
    monkeypatch.setenv("FLYWHEEL_TRAINER__MODE", "lora")
    monkeypatch.setenv("FLYWHEEL_TRAINER__GATE__SUITES__ARITH__N", "50")
    t = Settings().trainer
    assert (t.schedule.interval_s, t.lora.rank, t.mode) == (30.0, 16, "lora")
    assert gate.suites_of(t)[0].settings.n == 50


def test_a_flat_name_from_before_the_sections_is_refused(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_TRAINER__GATE_MARGIN", "0.1")
    with pytest.raises(ValidationError, match="gate_margin"):
        Settings()


def test_sample_bounds_are_checked_in_the_data_section():
    with pytest.raises(ValidationError, match="min_samples must not exceed"):
        TrainerSettings(data={"min_samples": 10, "max_samples": 5})


def test_the_default_gate_runs_the_arith_and_replay_suites_with_the_default_margin():
    suites = gate.suites_of(TrainerSettings())
    assert [s.name for s in suites] == ["arith", "replay"]
    arith, replay = suites
    assert isinstance(arith.suite, ArithSuite) and isinstance(arith.suite, EvalSuite)
    assert isinstance(replay.suite, ReplaySuite)
    assert arith.settings.model_dump() == {"n": 200, "seed": 1234, "max_new_tokens": 24}
    assert arith.margin == replay.margin == 0.05


def test_a_suites_margin_comes_from_its_own_section_and_is_not_passed_to_the_suite(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_TRAINER__GATE__RUN", '["arith", "replay"]')
    monkeypatch.setenv("FLYWHEEL_TRAINER__GATE__MARGIN", "0.03")
    monkeypatch.setenv("FLYWHEEL_TRAINER__GATE__SUITES__REPLAY__MARGIN", "0.1")
    monkeypatch.setenv("FLYWHEEL_TRAINER__GATE__SUITES__REPLAY__N", "50")
    arith, replay = gate.suites_of(Settings().trainer)
    assert (arith.margin, replay.margin, replay.settings.n) == (0.03, 0.1, 50)
    assert "margin" not in replay.settings.model_dump()
    with pytest.raises(PluginError, match=r"trainer\.gate\.suites\.replay\.margin: 2\.0 is outside 0\.\.1"):
        gate.suites_of(TrainerSettings(gate={"suites": {"replay": {"margin": 2}}}))


def test_an_unknown_suite_or_invalid_suite_settings_name_the_plug_in():
    with pytest.raises(PluginError, match="no plug-in 'nope' in entry-point group 'flywheel.eval_suites'"):
        gate.suites_of(TrainerSettings(gate={"run": ["arith", "nope"]}))
    with pytest.raises(PluginError, match=r"trainer\.gate\.suites\.arith\.n"):
        gate.suites_of(TrainerSettings(gate={"suites": {"arith": {"n": 0}}}))
    with pytest.raises(PluginError, match=r"trainer\.gate\.suites\.arith\.typo"):
        gate.suites_of(TrainerSettings(gate={"suites": {"arith": {"typo": 1}}}))
    with pytest.raises(PluginError, match=r"sections \['replay'\] of suites that trainer.gate.run \['arith'\]"):
        gate.suites_of(TrainerSettings(gate={"run": ["arith"], "suites": {"replay": {"n": 5}}}))
    with pytest.raises(ValidationError, match=r"names \['arith'\] more than once"):
        TrainerSettings(gate={"run": ["arith", "arith"]})
    with pytest.raises(ValidationError, match="suite"):
        TrainerSettings(gate={"suite": "arith"})  # the one-suite setting of before is refused, not ignored
