"""What the router tells clients when it cannot read its routing table: the error's kind, never its text."""

from __future__ import annotations

import asyncio
import json

from conftest import free_port
from sqlalchemy import create_engine

from flywheel.core.settings import Settings
from serving.proxy.router import Router


def test_ready_names_the_failure_without_the_databases_address_or_user() -> None:
    port = free_port()  # nothing listens there: every read of the table fails
    engine = create_engine(f"postgresql+psycopg://secret_user@127.0.0.1:{port}/flywheel_db", pool_pre_ping=False)
    router = Router(Settings(environment="test"), engine=engine)

    async def refresh_a_few_times() -> None:
        task = asyncio.create_task(router._loop(0.01, router.refresh))
        deadline = asyncio.get_running_loop().time() + 10
        while router.last_refresh_error is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()

    asyncio.run(refresh_a_few_times())
    status, body = router.ready_body()
    reason = json.loads(body)["reason"]
    assert status == 503 and "refresh failed with OperationalError" in reason, reason
    assert "the router's log has why" in reason
    for secret in ("secret_user", str(port), "flywheel_db", "127.0.0.1"):
        assert secret not in reason, reason
    engine.dispose()
