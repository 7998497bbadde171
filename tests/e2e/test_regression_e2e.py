"""``flywheel demo --inject-regression --keep-up``, short: a damaged canary is rolled back, and the system stays up.

The demo's real loop with its learning target already met at the start (no gain, no
promotion asked), so it goes straight to the regression scene: ops pause the trainer and
the canary controller through the admin API, deploy a damaged copy of the stable as canary
and resume the controller, which must roll it back on the live rewards. With ``keep_up``
the services outlive the demo, the dashboard answers a viewer token, and ``down`` stops
everything.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from flywheel.core.auth import create_key
from flywheel.core.settings import Settings
from flywheel.demo import DemoConfig, run_demo
from flywheel.stack import endpoints
from flywheel.stack.base import pid_alive, port_open
from flywheel.stack.stack import down, status

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

SERVICES = ("ingest", "rewarding", "trainer-worker", "trainer-beat", "router", "admin", "canary")


def test_damaged_canary_is_rolled_back_and_keep_up_leaves_everything_until_down(demo_settings: Settings, tmp_path):
    settings = demo_settings
    seen: dict[str, Any] = {}

    def on_finish(engine: Any, child_settings: Settings, summary: dict[str, Any]) -> None:
        seen["db_url"] = engine.url.render_as_string(hide_password=False)
        with Session(engine) as session:
            _, seen["viewer"] = create_key(session, name=f"e2e-viewer-{uuid.uuid4().hex[:6]}", role="viewer",
                                           created_by="e2e test")  # fmt: skip
            session.commit()
        with engine.connect() as conn:
            seen["ops"] = [
                tuple(r)
                for r in conn.execute(
                    text(
                        "SELECT actor, action, coalesce(details->>'from_checkpoint_id', details->>'checkpoint_id', "
                        "target), success FROM audit_log WHERE action LIKE 'deploy.%' OR action LIKE '%.pause' "
                        "OR action LIKE '%.resume' ORDER BY id"
                    )
                )
            ]

    config = DemoConfig(
        budget_minutes=3.0,
        target_gain_points=0.0,  # met at the start: straight to the regression scene
        target_promotions=0,
        concurrency=4,
        inject_regression=True,
        regression_budget_minutes=6.0,
        report_dir=tmp_path / "report",
        live=False,
        database=f"flywheel_e2e_{uuid.uuid4().hex[:8]}",
        keep_up=True,
        on_finish=on_finish,
    )
    kept: dict[str, Any] = {}
    try:
        summary = run_demo(config, settings)
        rows = {r.name: r for r in status(settings)}
        kept["pids"] = {name: rows[name].pid for name in SERVICES if name in rows}
        kept["unhealthy"] = [r.name for r in rows.values() if not r.healthy]
        admin = f"http://{settings.serving.admin_host}:{settings.serving.admin_port}"
        kept["page"] = httpx.get(f"{admin}/dashboard", timeout=10).status_code
        data = httpx.get(f"{admin}/v1/dashboard", headers={"Authorization": f"Bearer {seen['viewer']}"}, timeout=30)
        kept["data"] = data.status_code
    finally:
        kept["stopped"] = down(settings)
        if "db_url" in seen:
            endpoints.drop_database(seen["db_url"])

    figures = {k: v for k, v in summary.items() if k.startswith("regression_") or k in ("sessions", "failed_requests")}
    print(f"regression scene: {json.dumps(figures)}")
    ops = "\n".join(" ".join(map(str, r)) for r in seen.get("ops", []))
    assert summary["regression_status"] == "rolled_back", f"{figures}\n{ops}"
    assert summary["regression_rolled_back"] is True
    assert summary["regression_rollback_sessions"] > 0 and summary["regression_seconds"] > 0, figures
    assert summary["failed_requests"] == 0, summary
    damaged = summary["regression_checkpoint"]
    rows = [(actor.split(":")[0], action, target, ok) for actor, action, target, ok in seen["ops"]]
    assert ("token", "deploy.canary", damaged, True) in rows, ops  # ops deployed it, through the admin API
    assert ("canary-controller", "deploy.rollback", damaged, True) in rows, ops  # the controller rolled it back
    assert [a for _, a, _, ok in rows if a.endswith(("pause", "resume")) and ok] == [
        "trainer.pause", "canary.pause", "canary.resume", "trainer.resume"
    ], ops  # fmt: skip

    # --keep-up: every service outlived the demo and answered; down stopped them all
    assert set(kept["pids"]) == set(SERVICES) and not kept["unhealthy"], kept
    assert kept["page"] == 200 and kept["data"] == 200, kept
    assert set(SERVICES) <= set(kept["stopped"]), kept
    assert not any(pid_alive(pid) for pid in kept["pids"].values()), kept
    assert not port_open(settings.serving.admin_host, settings.serving.admin_port)
