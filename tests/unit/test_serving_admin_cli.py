"""The serving commands of the ``flywheel`` CLI, where no server is needed: their exit codes and
messages when there is no token or nothing listens at the admin API's address.

Against a real admin API and Postgres: tests/integration/test_serving_cli.py.
"""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.core.settings import get_settings


@pytest.fixture
def dead_url() -> str:
    """An address where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def invoke(*args: str, env: dict[str, str] | None = None):
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(app, list(args), env={"FLYWHEEL_TOKEN": "", **(env or {})})
    finally:
        get_settings.cache_clear()


@pytest.mark.parametrize(
    "args",
    [
        ["checkpoints", "list"],
        ["checkpoints", "show", "x"],
        ["deploy", "ck-1", "--weight", "0.05"],
        ["deploy", "ck-1", "--wait"],
        ["promote"],
        ["rollback", "--to", "ck-0"],
        ["pin", "subagent", "ck-0"],
        ["unpin", "subagent", "--wait"],
        ["canary", "status"],
        ["canary", "weight", "0.25"],
        ["canary", "pause"],
        ["ops", "list"],
        ["ops", "show", "0b5cbb6f-7d4e-4d54-9a5b-0d1b0d3f7a11", "--wait"],
        ["status", "--no-stack"],
        ["status"],
        ["tokens", "list"],
        ["tokens", "revoke", "3"],
        ["audit"],
    ],
)
def test_unreachable_admin_api_exits_2_naming_the_address(args, dead_url):
    result = invoke(*args, "--url", dead_url, env={"FLYWHEEL_TOKEN": "fwo_whatever"})
    assert result.exit_code == 2, result.output
    assert f"cannot reach the admin API at {dead_url}" in result.output


def test_the_url_comes_from_settings(dead_url):
    result = invoke("promote", env={"FLYWHEEL_TOKEN": "fwo_x", "FLYWHEEL_SERVING__ADMIN_URL": dead_url})
    assert result.exit_code == 2 and dead_url in result.output


def test_missing_token_exits_1_saying_how_to_get_one(dead_url):
    result = invoke("promote", "--url", dead_url)
    assert result.exit_code == 1
    assert "no token: set FLYWHEEL_TOKEN or pass --token" in result.output


def test_tokens_create_refuses_a_writer_role(dead_url):
    result = invoke("tokens", "create", "--name", "x", "--role", "writer", "--url", dead_url)
    assert result.exit_code == 1 and "flywheel keys create" in result.output


def test_help_lists_the_serving_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in (
        "checkpoints",
        "deploy",
        "promote",
        "rollback",
        "pin",
        "unpin",
        "canary",
        "status",
        "tokens",
        "audit",
        "ops",
        "up",
        "down",
        "train",
    ):
        assert command in result.output
