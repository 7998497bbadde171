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


def test_sections_are_read_from_nested_environment_variables(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_TRAINER__SCHEDULE__INTERVAL_S", "30")
    monkeypatch.setenv("FLYWHEEL_TRAINER__LORA__RANK", "16")
    monkeypatch.setenv("FLYWHEEL_TRAINER__MODE", "lora")
    monkeypatch.setenv("FLYWHEEL_TRAINER__GATE__SUITES__ARITH__N", "50")
    t = Settings().trainer
    assert (t.schedule.interval_s, t.lora.rank, t.mode) == (30.0, 16, "lora")
    assert gate.suite_of(t)[1].n == 50


def test_a_flat_name_from_before_the_sections_is_refused(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_TRAINER__GATE_MARGIN", "0.1")
    with pytest.raises(ValidationError, match="gate_margin"):
        Settings()


def test_sample_bounds_are_checked_in_the_data_section():
    with pytest.raises(ValidationError, match="min_samples must not exceed"):
        TrainerSettings(data={"min_samples": 10, "max_samples": 5})


def test_the_default_gate_runs_the_registered_arith_suite_under_the_old_cache_key():
    suite, settings = gate.suite_of(TrainerSettings())
    assert isinstance(suite, ArithSuite) and isinstance(suite, EvalSuite)
    assert settings.model_dump() == {"n": 200, "seed": 1234, "max_new_tokens": 24, "batch_size": 200}
    assert gate.eval_key(TrainerSettings()) == "arith-v1/heldout/n200/s1234/t1.0/m24"
    custom = TrainerSettings(step={"sampling_temperature": 0.7}, gate={"suites": {"arith": {"n": 32}}})
    assert gate.eval_key(custom) == "arith-v1/heldout/n32/s1234/t0.7/m24"


def test_an_unknown_suite_or_invalid_suite_settings_name_the_plug_in():
    with pytest.raises(PluginError, match="no plug-in 'nope' in entry-point group 'flywheel.eval_suites'"):
        gate.suite_of(TrainerSettings(gate={"suite": "nope"}))
    with pytest.raises(PluginError, match=r"trainer\.gate\.suites\.arith\.n"):
        gate.suite_of(TrainerSettings(gate={"suites": {"arith": {"n": 0}}}))
    with pytest.raises(PluginError, match=r"trainer\.gate\.suites\.arith\.typo"):
        gate.suite_of(TrainerSettings(gate={"suites": {"arith": {"typo": 1}}}))
