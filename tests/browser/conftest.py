"""Browser tests: the integration fixtures (real Postgres, real vLLM), headless Chromium, an admin API server.

The fixtures of tests/integration/conftest.py (``pg_url``, ``base_model_dir``,
``settings_factory``, ... and its leak check) are loaded from that file, so both folders
bring services up the same way. Chromium is Debian's (``/usr/bin/chromium``, or
``FLYWHEEL_CHROMIUM``), driven by Playwright's Python package without its browser download.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

_INTEGRATION = Path(__file__).resolve().parents[1] / "integration" / "conftest.py"
_spec = importlib.util.spec_from_file_location("flywheel_integration_conftest", _INTEGRATION)
assert _spec is not None and _spec.loader is not None
integration = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = integration
_spec.loader.exec_module(integration)

# The integration fixtures, re-exported for this folder (pytest collects fixtures by attribute).
_no_orphans = integration._no_orphans
stack_settings = integration.stack_settings
settings_factory = integration.settings_factory
pg_url = integration.pg_url
base_model_dir = integration.base_model_dir
unused_port = integration.unused_port
kafka_bootstrap = integration.kafka_bootstrap
make_settings = integration.make_settings
free_port = integration.free_port
WARMUP_TIMEOUT_S = integration.WARMUP_TIMEOUT_S

CHROMIUM = Path(os.environ.get("FLYWHEEL_CHROMIUM", "/usr/bin/chromium"))


def pytest_configure(config: pytest.Config) -> None:
    # Until pyproject.toml registers it (the suite runs with --strict-markers).
    config.addinivalue_line("markers", "browser: drives the dashboard in headless Chromium (Debian's chromium)")


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
    """A headless Chromium browser, one per test module.

    Not per session: Playwright's sync API keeps an event loop running in the main thread
    until it stops, and every later ``asyncio.run`` of the suite would fail meanwhile.
    """
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


class ServerThread:
    """A uvicorn server for an ASGI app on a free local port, in a thread of this process."""

    def __init__(self, app: object, port: int):
        import uvicorn

        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{port}", daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server on {self.url} exited during start-up")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code in (200, 503):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server on {self.url} did not answer /health within 30 s")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15.0)


@pytest.fixture
def serve_app(unused_port):
    """Start an ASGI app with uvicorn on a free port: ``with serve_app(app) as server: server.url``."""
    return lambda app: ServerThread(app, unused_port())
