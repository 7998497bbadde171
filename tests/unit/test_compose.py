"""docker-compose.yml: real entry points, healthchecks, no hard-coded secrets, private dev endpoints."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest
import typer
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
SERVICES = COMPOSE["services"]
SECRETISH = re.compile(r"(PASSWORD|SECRET|TOKEN|_KEY$|WRITE_KEY)", re.I)
ENV_REF = re.compile(r"^\$\{[A-Z0-9_]+(:?[-?][^}]*)?\}$")
IMAGE_REF = re.compile(r"^\$\{(?P<var>[A-Z0-9_]+):-(?P<default>[^}]+)\}$")


def image_default(svc) -> str:
    """The production image of a service: the default of its ``${VAR:-image}``."""
    match = IMAGE_REF.match(str(svc.get("image", "")))
    assert match, f"image {svc.get('image')!r} is not ${{VAR:-production image}}"
    return match["default"]


OURS = {name: svc for name, svc in SERVICES.items() if image_default(svc).startswith("flywheel")}


def _click_command(script: str):
    module_name, _, attr = SCRIPTS[script].partition(":")
    module = importlib.import_module(module_name)
    app = getattr(module, "app", None)
    assert isinstance(app, typer.Typer), f"{SCRIPTS[script]}: module has no typer `app`"
    assert callable(getattr(module, attr)), f"{SCRIPTS[script]} is not callable"
    return typer.main.get_command(app)


def test_our_services_exist():
    assert {
        "migrate",
        "ingest-consumer",
        "ingest-gateway",
        "rewarding",
        "trainer-worker",
        "trainer-beat",
        "router",
        "admin-api",
        "canary-controller",
    } <= set(OURS)


def _published(svc) -> list[str]:
    return [str(p) for p in svc.get("ports", [])]


def test_only_the_router_and_the_gateway_are_public():
    public = {name for name, svc in SERVICES.items() if any(not p.startswith("127.0.0.1:") for p in _published(svc))}
    assert public == {"router", "ingest-gateway"}


def test_router_is_published_and_serves_the_fleet():
    router = SERVICES["router"]
    assert router["command"][:2] == ["flywheel-serving", "router"]
    assert _published(router) and "public" in router["networks"] and "backend" in router["networks"]
    assert {"vllm-0", "vllm-1"} <= set(router["depends_on"])


def test_admin_api_is_published_on_loopback_only():
    admin = SERVICES["admin-api"]
    assert admin["command"][:2] == ["flywheel-serving", "admin"]
    ports = _published(admin)
    assert ports and all(p.startswith("127.0.0.1:") for p in ports), ports
    port = admin["command"][admin["command"].index("--port") + 1]
    assert any(p.endswith(f":{port}") for p in ports)
    assert SERVICES["migrate"]["environment"]["FLYWHEEL_SERVING__ADMIN_URL"].endswith(f"admin-api:{port}")


def test_canary_controller_is_private():
    controller = SERVICES["canary-controller"]
    assert controller["command"] == ["flywheel-serving", "canary"]
    assert "ports" not in controller and set(controller["networks"]) == {"backend"}


@pytest.mark.parametrize("name", sorted(OURS))
def test_command_names_a_real_entry_point(name):
    argv = OURS[name]["command"]
    if argv[:2] == ["python", "-m"]:  # a launcher module (the vLLM replicas): it imports and parses the rest
        module = importlib.import_module(argv[2])
        assert callable(module.main) and module.parse(list(argv[3:])) is not None, name
        return
    assert argv[0] in SCRIPTS, f"{name}: {argv[0]!r} is not a [project.scripts] entry point"
    cmd = _click_command(argv[0])
    rest = list(argv[1:])
    while rest and hasattr(cmd, "commands") and not rest[0].startswith("-"):
        sub = rest.pop(0)
        assert sub in cmd.commands, f"{name}: {argv[0]} has no subcommand {sub!r} (has {sorted(cmd.commands)})"
        cmd = cmd.commands[sub]
    assert not hasattr(cmd, "commands"), f"{name}: {' '.join(argv)} names a group, not a command"
    options = {opt for param in cmd.params for opt in param.opts}
    for arg in rest:
        if arg.startswith("--"):
            assert arg.split("=")[0] in options, f"{name}: {' '.join(argv[:2])} has no option {arg}"


def _env_items(svc):
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return env.items()


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_no_hard_coded_secrets(name):
    for key, value in _env_items(SERVICES[name]):
        value = str(value)
        if SECRETISH.search(key):
            assert ENV_REF.match(value), f"{name}: {key} must come from the environment, got {value!r}"
        for creds in re.findall(r"://[^:/@\s]+:([^@\s]+)@", value):
            assert ENV_REF.match(creds), f"{name}: {key} embeds a literal password"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_long_running_services_have_healthchecks_and_valid_dependencies(name):
    svc = SERVICES[name]
    if svc.get("restart") != "no":
        assert "healthcheck" in svc, f"{name}: no healthcheck"
    for dep, cond in (svc.get("depends_on") or {}).items():
        assert dep in SERVICES, f"{name}: depends on unknown service {dep}"
        assert cond["condition"] in {"service_healthy", "service_completed_successfully", "service_started"}
        if cond["condition"] == "service_healthy":
            assert "healthcheck" in SERVICES[dep], f"{name}: waits for {dep} to be healthy, but it has no healthcheck"


@pytest.mark.parametrize("name", ["kafka", "postgres", "redis", "vllm-0", "vllm-1", "canary-controller"])
def test_internal_services_are_private(name):
    svc = SERVICES[name]
    assert "ports" not in svc, f"{name} must not publish ports: its endpoints are internal"
    assert set(svc.get("networks", [])) == {"backend"}
    assert COMPOSE["networks"]["backend"].get("internal") is True


def test_vllm_fleet_has_two_gpu_replicas_started_as_the_local_stack_starts_them():
    """Each replica runs Flywheel's launcher, whose argv and environment are the local stack's: the served
    model name, dtype, processed logprobs, the worker extension that hot swaps call, the dev endpoints."""
    from flywheel.core.settings import Settings
    from flywheel.core.vllm_worker import WORKER_EXTENSION
    from flywheel.stack import replica
    from flywheel.stack.vllm import server_argv, server_env

    fleet = [n for n in SERVICES if n.startswith("vllm-")]
    assert len(fleet) == 2
    for index, name in enumerate(sorted(fleet)):
        svc = SERVICES[name]
        command = svc["command"]
        assert command[:3] == ["python", "-m", "flywheel.stack.replica"], command
        args = replica.parse(command[3:])
        assert (args.index, args.port, args.gate) == (index, 8000, False)
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d["capabilities"] for d in devices)
        assert "ready" in str(svc["healthcheck"]["test"])  # healthy once the initial weight version is set
    gate = replica.parse(SERVICES["gate-vllm"]["command"][3:])
    assert gate.gate and gate.index == 2
    vs = Settings().vllm
    argv = server_argv(Path("/models/base"), "base-v0", "0.0.0.0", 8000, vs, lora=False)
    for flag in ("--served-model-name", "--dtype", "--max-model-len", "--logprobs-mode", "--generation-config"):
        assert flag in argv
    assert argv[argv.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert server_env(vs, 0, lora=False)["VLLM_SERVER_DEV_MODE"] == "1"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_image_is_a_variable_defaulting_to_the_production_image(name):
    svc = SERVICES[name]
    production = {
        "kafka": "apache/kafka:",
        "postgres": "postgres:",
        "redis": "redis:",
    }.get(name, "flywheel:")  # the vLLM replicas too: the services image holds vLLM and the worker extension
    assert image_default(svc).startswith(production), f"{name}: {svc['image']}"
