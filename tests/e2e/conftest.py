"""End-to-end runs: the demo's real loop (``flywheel.demo.run_demo``) in a private run folder, on free ports.

Slow (minutes each, both cores): every test here is marked ``slow``, ``vllm`` and ``integration``.
``browser`` is headless Chromium for a look at the dashboard (the same fixture as
tests/browser/conftest.py's, until one shared conftest holds it for both folders).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from flywheel.core.settings import Settings

CHROMIUM = Path(os.environ.get("FLYWHEEL_CHROMIUM", "/usr/bin/chromium"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_pair(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port + 1))
        except OSError:
            return False
    return True


@pytest.fixture
def demo_settings(tmp_path: Path) -> Settings:
    """Settings of a private demo run: its own run folder, broker, two vLLM replicas, router and admin API ports."""
    vllm = free_port()
    while not _free_pair(vllm):
        vllm = free_port()
    return Settings(
        environment="test",
        run_dir=tmp_path / "run",
        kafka={"local_port": free_port()},
        vllm={"base_port": vllm, "replicas": 2},
        serving={"router_port": free_port(), "admin_port": free_port()},
    )


@pytest.fixture(scope="session")
def chromium_path() -> Path:
    """Debian's Chromium, else the test is skipped with the command that installs it."""
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"{CHROMIUM} is missing: `apt-get install -y chromium` (or set FLYWHEEL_CHROMIUM)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the playwright Python package is missing: `pip install playwright==1.57.0`")
    return CHROMIUM


@pytest.fixture(scope="module")
def browser(chromium_path: Path) -> Iterator[object]:
    """A headless Chromium browser, one per test module (Playwright's sync API holds the main thread's loop)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        args = ["--no-sandbox"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        instance = pw.chromium.launch(
            executable_path=str(chromium_path), headless=True, args=[*args, "--disable-gpu", "--disable-dev-shm-usage"]
        )
        try:
            yield instance
        finally:
            instance.close()
