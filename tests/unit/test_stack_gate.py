"""The eval gate's replica in the local stack and in the compose file."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from flywheel.core.settings import Settings
from flywheel.stack.gate import GateReplica
from flywheel.stack.stack import KINDS, _plan, parse_components
from flywheel.stack.vllm import server_argv, server_env

ROOT = Path(__file__).resolve().parents[2]


def test_the_full_stack_plans_a_gate_replica_of_its_own(tmp_path):
    settings = Settings(environment="test", run_dir=tmp_path, vllm={"replicas": 2, "nice": 10},
                        trainer={"gate": {"local_port": 18777}})  # fmt: skip
    assert "gate" in KINDS and parse_components(None) == KINDS
    plan = _plan(settings, parse_components(None), tmp_path)
    [gate] = [c for c in plan if isinstance(c, GateReplica)]
    assert [c.name for c in plan if c.kind == "vllm"] == ["vllm-0", "vllm-1"]
    assert (gate.name, gate.kind, gate.port, gate.lora, gate.configured_url) == (
        "vllm-gate",
        "gate",
        18777,
        False,
        None,
    )
    assert gate.initial_version(tmp_path, "base-x") == str(tmp_path.resolve())  # the engine's weight tag
    assert not [c for c in _plan(settings, ("vllm",), tmp_path) if isinstance(c, GateReplica)]
    # runtime LoRA loading when the trainer writes adapters or the fleet loads them
    assert GateReplica(
        settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"mode": "lora"})})
    ).lora
    assert GateReplica(Settings(environment="test", run_dir=tmp_path, vllm={"enable_lora": True})).lora


def test_a_configured_gate_replica_is_used_and_never_started(tmp_path):
    settings = Settings(environment="test", run_dir=tmp_path, trainer={"gate": {"engine_url": "http://gate:8000/"}})
    record = GateReplica(settings).start_or_locate()
    assert (record.where, record.source, record.started_by_us, record.kind) == (
        "http://gate:8000",
        "config",
        False,
        "gate",
    )


def test_compose_runs_a_private_gate_replica_that_the_trainer_is_told_of():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    gate = services["gate-vllm"]
    assert gate["command"][:3] == ["python", "-m", "flywheel.stack.replica"] and "--gate" in gate["command"]
    assert "ports" not in gate and gate["networks"] == ["backend"]
    # Its launcher's settings (the environment's defaults) load adapters, as the gate needs in lora mode.
    env = {k: re.sub(r"^\$\{[A-Z_]+:-(.*)\}$", r"\1", str(v)) for k, v in gate["environment"].items()}
    settings = Settings(vllm={"enable_lora": env["FLYWHEEL_VLLM__ENABLE_LORA"], "dtype": env["FLYWHEEL_VLLM__DTYPE"]})
    replica = GateReplica(settings, Path("/models/base"))
    assert replica.lora
    argv = server_argv(Path("/models/base"), "base", "0.0.0.0", 8000, settings.vllm, replica.lora)
    assert "--enable-lora" in argv and argv[argv.index("--dtype") + 1] == "auto"
    assert server_env(settings.vllm, 2, replica.lora)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    worker = services["trainer-worker"]
    assert worker["environment"]["FLYWHEEL_TRAINER__GATE__ENGINE_URL"] == "http://gate-vllm:8000"
    assert worker["depends_on"]["gate-vllm"]["condition"] == "service_healthy"
