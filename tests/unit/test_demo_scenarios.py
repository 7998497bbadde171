"""The demo's scenarios: what each one changes in the services' settings and how its figures are read."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from flywheel.core.settings import Settings
from flywheel.demo.loop import DemoConfig, _local_vllm, _metric_before_after, _with_overrides, service_overrides
from flywheel.demo.scenarios import SCENARIOS, scenario
from flywheel.stack.vllm import served_vllm, server_argv

DB = "postgresql+psycopg://x@h/db"
T0 = datetime(2026, 12, 7, 3, 0, tzinfo=UTC)


def test_arith_changes_nothing_of_the_demos_own_settings(tmp_path):
    config = DemoConfig()
    out = service_overrides(config, Settings(run_dir=tmp_path), DB, T0)
    assert "model" not in out and "gate" not in out["trainer"] and "scoring" not in out["rewarding"]
    assert out["trainer"]["parent"] == config.trainer_parent
    assert out["serving"]["canary"]["non_inferiority_margin"] == config.canary_margin
    assert scenario("arith").anneal_ends_at(config, T0) is None


def test_parl_scores_with_the_parl_extractor_alone_and_gates_on_its_suite(tmp_path):
    config = DemoConfig(scenario="parl", budget_minutes=20.0)
    settings = Settings(run_dir=tmp_path)
    out = service_overrides(config, settings, DB, T0)
    assert out["model"] == {"task": "parl"}
    assert out["trainer"]["gate"] == {"run": ["parl"]}
    assert out["trainer"]["parent"] == "stable" and out["trainer"]["data"]["max_samples"] == 384
    assert out["trainer"]["data"]["min_samples"] == config.min_samples  # merged into the demo's, not replacing it
    canary = out["serving"]["canary"]
    assert canary["non_inferiority_margin"] == 0.10 and canary["variance"] == "empirical"
    assert canary["steps"] == config.canary_steps and canary["auto_deploy"]  # the demo's own canary settings kept
    assert out["trainer"]["schedule"] == {"interval_s": config.cycle_s}  # the demo's own trainer settings kept
    weights = out["rewarding"]["scoring"]["weights"]
    assert weights["parl"] == 1.0 and sum(weights.values()) == 1.0
    assert set(weights) >= set(settings.rewarding.scoring.weights)  # every default weight named (merge keeps none)
    anneal = out["rewarding"]["scoring"]["extractors"]["parl"]["anneal"]
    assert anneal["start_at"] == T0.isoformat() and anneal["duration_s"] == pytest.approx(600.0)
    assert scenario("parl").anneal_ends_at(config, T0) == T0 + timedelta(minutes=10)
    # the services' settings validate, and the parl extractor's section parses as its own model
    child = _with_overrides(settings, out)
    assert child.model.task == "parl" and child.trainer.gate.run == ["parl"]
    assert child.trainer.parent == "stable" and child.serving.canary.cs_target_sessions == 200
    from rewarding.extractors.parl import ParlSettings

    parsed = ParlSettings.model_validate(child.rewarding.scoring.extractors["parl"])
    assert parsed.anneal.start_at == T0 and parsed.anneal.kind == "linear"


def test_parl_needs_a_replica_for_its_pinned_sub_agents():
    plan = SCENARIOS["parl"]
    assert plan.pinned_roles == ("subagent",) and plan.replicas == SCENARIOS["arith"].replicas + 1
    trainable = Settings().trainer.data.trainable_roles
    assert not set(plan.pinned_roles) & set(trainable)  # a pinned role is never trained


def test_unknown_scenario_is_named():
    with pytest.raises(ValueError, match="unknown scenario 'nope'; known: arith, parl"):
        scenario("nope")


@dataclass
class View:
    id: str
    parent_id: str | None
    heldout_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Snap:
    checkpoints: list[View]
    stable: dict[str, Any] | None


def test_metric_before_is_the_bases_and_after_the_stables():
    snap = Snap([View("base", None, {"critical_steps": 5.6}), View("c1", "base", {"critical_steps": 5.1})],
                {"checkpoint_id": "c1"})  # fmt: skip
    assert _metric_before_after(snap, "critical_steps") == {"critical_steps_before": 5.6, "critical_steps_after": 5.1}
    snap.stable = {"checkpoint_id": "base"}  # nothing promoted: after is the base's
    assert _metric_before_after(snap, "critical_steps") == {"critical_steps_before": 5.6, "critical_steps_after": 5.6}
    none = _metric_before_after(Snap([View("base", None)], None), "critical_steps")
    assert none == {"critical_steps_before": None, "critical_steps_after": None}


def test_cli_refuses_an_unknown_scenario():
    from typer.testing import CliRunner

    from flywheel.cli import app

    result = CliRunner().invoke(app, ["demo", "--scenario", "nope"])
    assert result.exit_code == 2 and "unknown scenario 'nope'" in result.output


def test_overview_reads_the_headline_suites_own_metrics():
    from serving.overview import _heldout

    root = {"heldout": {"parl-v2/heldout/x": {"success_rate": 0.3, "n": 200, "metrics": {"critical_steps": 5.4,
                                                                                       "note": "text"}}}}  # fmt: skip
    assert _heldout(root) == (0.3, {"critical_steps": 5.4})
    assert _heldout({"heldout": {"arith-v1/k": {"success_rate": 0.2, "n": 200}}}) == (0.2, {})
    assert _heldout(None) == (None, {})


def test_a_gate_override_keeps_the_stacks_gate_replica(tmp_path, monkeypatch):
    """The stack passes the gate's replica as FLYWHEEL_TRAINER__GATE__ENGINE_URL; the parl scenario's
    ``trainer.gate.run`` must not replace the whole gate section (seen: every cycle failed NotConfigured)."""
    from flywheel.stack.services import settings_env

    settings = Settings(run_dir=tmp_path)
    overrides = service_overrides(DemoConfig(scenario="parl"), settings, DB, T0)
    monkeypatch.setenv("FLYWHEEL_TRAINER__GATE__ENGINE_URL", "http://127.0.0.1:18190")
    env = settings_env(settings, overrides)
    assert env["FLYWHEEL_TRAINER__GATE__RUN"] == '["parl"]' and "FLYWHEEL_TRAINER__GATE" not in env
    assert env["FLYWHEEL_TRAINER__SCHEDULE"] == '{"interval_s": 20.0}'  # no clash: one JSON value, as before
    for name, value in env.items():
        if name.startswith("FLYWHEEL_"):
            monkeypatch.setenv(name, value)
    child = Settings()
    assert child.trainer.gate.run == ["parl"] and child.trainer.gate.engine_url == "http://127.0.0.1:18190"
    assert child.model.task == "parl" and child.rewarding.scoring.weights["parl"] == 1.0


def test_the_parl_replicas_get_longer_to_start() -> None:
    vs = Settings().vllm
    arith = _local_vllm(vs, 2)
    assert (arith.replicas, arith.max_model_len, arith.startup_timeout_s) == (2, vs.max_model_len, vs.startup_timeout_s)
    parl = _local_vllm(vs, 3)
    assert parl.replicas == 3
    assert parl.startup_timeout_s == vs.startup_timeout_s * 4 / 3  # four servers start at once, not three


def test_a_replica_serves_the_context_of_its_task(monkeypatch) -> None:
    """Any replica, the stack's, the demo's and a container's, holds the task's longest episode: the
    parl orchestrator's 384 positions (256 refused its long episodes); a larger setting is kept."""
    assert served_vllm(Settings()).max_model_len == 256
    monkeypatch.setenv("FLYWHEEL_MODEL__TASK", "parl")
    assert served_vllm(Settings()).max_model_len == 384
    monkeypatch.setenv("FLYWHEEL_VLLM__MAX_MODEL_LEN", "1024")
    assert served_vllm(Settings()).max_model_len == 1024
    argv = server_argv(Path("/m"), "v", "h", 1, served_vllm(Settings()), lora=False)
    assert argv[argv.index("--max-model-len") + 1] == "1024"
    monkeypatch.setenv("FLYWHEEL_MODEL__TASK", "nosuchtask")
    with pytest.raises(ValueError, match="unknown model.task 'nosuchtask'"):
        served_vllm(Settings())
