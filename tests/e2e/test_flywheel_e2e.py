"""The flywheel end to end, short: ``flywheel demo --inject-regression --keep-up`` in ``make test``.

The same :func:`flywheel.demo.run_demo` as ``make demo`` (Kafka, ingest, faust rewarding,
Celery worker and beat, the eval gate, the router, hot swap, the canary controller, the
admin API; the agent product through the router with the official ``openai`` client), in a
private run folder on free ports, until checkpoints trained, gated, deployed as canary by hot
swap and promoted have lifted the stable's held-out success by at least ``TARGET_GAIN_POINTS``.

Then the regression scene, on the same running system (one stack start for both): ops pause
the trainer and the canary controller through the admin API, deploy a damaged copy of the
stable as canary and resume the controller, which must roll it back on the live rewards.
While the services still run, the dashboard is opened in headless Chromium on the run's own
data and a screenshot is kept. With ``keep_up`` the services outlive the demo, the dashboard
answers a viewer token, and ``down`` stops everything.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
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

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(2700),
]  # learning budget + regression budget + stack start + teardown

BUDGET_MINUTES = 20.0
"""Longest the learning phase may run before the test fails (the bound leaves room for a slower or
busier machine)."""
TARGET_GAIN_POINTS = 5.0
"""The learning phase ends once the stable is this many held-out points above the base, after at
least one promotion: the gain the test asserts."""
SERVICES = ("ingest", "rewarding", "trainer-worker", "trainer-beat", "router", "admin", "canary")
"""The services ``keep_up`` leaves running until ``down``."""


def artifact_path(name: str, env: str) -> Path:
    """Where a test artefact goes: ``$env`` if set, else ``.flywheel/artifacts/<name>`` in the repository."""
    import os

    path = Path(os.environ[env]) if os.environ.get(env) else ROOT / ".flywheel" / "artifacts" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_short_loop_trains_gates_canaries_promotes_and_rolls_back_a_damaged_canary(
    demo_settings: Settings, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    settings = demo_settings
    database = f"flywheel_e2e_{uuid.uuid4().hex[:8]}"
    seen: dict[str, Any] = {}

    def on_finish(engine: Any, child_settings: Settings, summary: dict[str, Any]) -> None:
        seen["db_url"] = engine.url.render_as_string(hide_password=False)
        with Session(engine) as session:
            _, seen["viewer"] = create_key(session, name=f"e2e-viewer-{uuid.uuid4().hex[:6]}", role="viewer",
                                           created_by="e2e test")  # fmt: skip
            session.commit()
        seen["replicas"] = _quiet_fleet(engine, timeout_s=180)
        with engine.connect() as conn:
            seen["audit"] = [
                tuple(r)
                for r in conn.execute(
                    text(
                        "SELECT actor, action, coalesce(details->>'from_checkpoint_id', details->>'checkpoint_id', "
                        "target), success FROM audit_log WHERE action LIKE 'deploy.%' OR action LIKE '%.pause' "
                        "OR action LIKE '%.resume' ORDER BY id"
                    )
                )
            ]
            seen["promoted"] = (
                conn.execute(
                    text(
                        "SELECT c.id, c.parent_id, c.eval, d.status "
                        "FROM deployments d JOIN checkpoints c ON c.id = d.checkpoint_id "
                        "WHERE d.role = 'canary' AND d.status = 'promoted' ORDER BY d.id LIMIT 1"
                    )
                )
                .mappings()
                .first()
            )
            seen["trace"] = [  # printed when an assertion fails: what the cycles and the canary did
                " ".join(str(v) for v in r)
                for r in conn.execute(
                    text(
                        "SELECT started_at AS at, 'cycle ' || id, status || ': ' || coalesce(reason, ''), "
                        "'tokens/s ' || coalesce(round((metrics->>'tokens_per_s')::numeric)::text, '-') "
                        "FROM training_cycles "
                        "UNION ALL SELECT at, action, target, details->>'reason' FROM audit_log "
                        "WHERE action LIKE 'deploy.%' OR action = 'canary.decision' ORDER BY 1"
                    )
                )
            ]
            seen["stable_version"] = conn.execute(
                text(
                    "SELECT c.policy_version FROM deployments d JOIN checkpoints c ON c.id = d.checkpoint_id "
                    "WHERE d.role = 'stable' AND d.status = 'active'"
                )  # fmt: skip
            ).scalar_one()
        seen["dashboard"] = _dashboard(request, engine, child_settings, seen["stable_version"])

    config = DemoConfig(
        budget_minutes=BUDGET_MINUTES,
        target_gain_points=TARGET_GAIN_POINTS,
        target_promotions=1,
        concurrency=4,
        # Under the demo's "lineage" parent the next candidate (trained from the canary) is deployed the
        # moment it is promoted, so the learning phase (which ends with no canary on trial) and the regression
        # scene after it wait for it; "stable" trains the next candidate from the new stable, a cycle later.
        trainer_parent="stable",
        # Twice the demo's non-inferiority margin, as the compose loop test (tests/compose/loop.yml): the
        # test proves the loop trains, gates, canaries and promotes, not a small live effect (bench-canary
        # measures the controller's error rates). In CI a candidate +14.5 held-out points but about +3.5
        # live held "inconclusive" for 7.5 minutes at 0.05, and the test took 882 s.
        canary_margin=0.10,
        # Then the regression scene on the same system (it had a test and a stack start of its own: ~4 min of CI).
        inject_regression=True,
        regression_budget_minutes=6.0,
        keep_up=True,
        report_dir=tmp_path / "report",
        live=False,
        database=database,
        on_finish=on_finish,
    )
    kept: dict[str, Any] = {}
    try:
        summary = run_demo(config, settings)
        services = {r.name: r for r in status(settings)}
        kept["pids"] = {name: services[name].pid for name in SERVICES if name in services}
        kept["unhealthy"] = [r.name for r in services.values() if not r.healthy]
        admin = f"http://{settings.serving.admin_host}:{settings.serving.admin_port}"
        kept["page"] = httpx.get(f"{admin}/dashboard", timeout=10).status_code
        data = httpx.get(f"{admin}/v1/dashboard", headers={"Authorization": f"Bearer {seen['viewer']}"}, timeout=30)
        kept["data"] = data.status_code
    finally:
        kept["stopped"] = down(settings)
        if "db_url" in seen:
            endpoints.drop_database(seen["db_url"])

    # Learning: trained, gated, deployed as canary and promoted, a real held-out gain.
    trace = "\n".join(seen.get("trace", [])[-40:])
    assert summary["promotions"] >= 1, f"{summary}\n{trace}"
    assert summary["minutes"] <= BUDGET_MINUTES, summary
    assert summary["failed_requests"] == 0, summary
    # A real gain: held-out success is a multiple of 1/200, so 1e-9 only absorbs float rounding.
    assert summary["final_success"] - summary["base_success"] >= TARGET_GAIN_POINTS / 100 - 1e-9, f"{summary}\n{trace}"
    promoted = seen["promoted"]
    assert promoted is not None and promoted["parent_id"] is not None, (
        "the promoted checkpoint was trained from a parent"
    )
    assert (promoted["eval"] or {}).get("heldout"), "the promoted checkpoint went through the eval gate"
    ops = "\n".join(" ".join(map(str, r)) for r in seen["audit"])
    rows = [(actor.split(":")[0], action, target, ok) for actor, action, target, ok in seen["audit"]]
    actions = [(actor, action, ok) for actor, action, _, ok in rows]
    assert ("canary-controller", "deploy.canary", True) in actions, ops
    assert ("canary-controller", "deploy.promote", True) in actions, ops
    # Every replica back in service on what the fleet deploys once the scene ended (no replica left failed).
    assert seen["replicas"]["quiet"], seen["replicas"]

    # The regression scene: ops deployed a damaged canary through the admin API; the controller rolled it back.
    figures = {k: v for k, v in summary.items() if k.startswith("regression_") or k in ("sessions", "failed_requests")}
    print(f"regression scene: {json.dumps(figures)}")
    assert summary["regression_status"] == "rolled_back", f"{figures}\n{ops}"
    assert summary["regression_rolled_back"] is True
    assert summary["regression_rollback_sessions"] > 0 and summary["regression_seconds"] > 0, figures
    damaged = summary["regression_checkpoint"]
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

    for name in ("plot", "summary", "decisions"):
        assert Path(summary["report"][name]).stat().st_size > 100
    if seen["dashboard"] is not None:
        assert seen["stable_version"] in seen["dashboard"]["table"]


def _quiet_fleet(engine: Any, timeout_s: float) -> dict[str, Any]:
    """Waits until every replica serves, each the stable's version or an active canary's (the trainer resumes at
    the end of the regression scene, and the controller may deploy its next candidate while the test looks)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with engine.connect() as conn:
            replicas = [tuple(r) for r in conn.execute(text("SELECT state, policy_version FROM replicas"))]
            deployed = {
                r[0]
                for r in conn.execute(
                    text(
                        "SELECT c.policy_version FROM deployments d JOIN checkpoints c ON c.id = d.checkpoint_id "
                        "WHERE d.status = 'active'"
                    )
                )
            }
        quiet = bool(replicas) and all(state == "serving" and version in deployed for state, version in replicas)
        if quiet or time.monotonic() > deadline:
            return {"quiet": quiet, "replicas": replicas, "deployed": sorted(deployed)}
        time.sleep(1.0)


def _dashboard(
    request: pytest.FixtureRequest, engine: Any, settings: Settings, stable_version: str
) -> dict[str, Any] | None:
    """Open the dashboard on the run's data with a viewer token; screenshot; None when Chromium is missing."""
    try:
        browser = request.getfixturevalue("browser")
    except pytest.skip.Exception:
        return None
    from playwright.sync_api import expect
    from sqlalchemy.orm import Session

    from flywheel.core.auth import create_key

    with Session(engine) as session:
        _, token = create_key(session, name=f"e2e-viewer-{uuid.uuid4().hex[:6]}", role="viewer", created_by="e2e test")
        session.commit()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"http://{settings.serving.admin_host}:{settings.serving.admin_port}/dashboard")
        page.fill("#token-input", token)
        page.click("#login-button")
        expect(page.locator("#checkpoints-table")).to_contain_text(stable_version, timeout=30_000)
        for plot in ("#timeline-plot", "#versions-plot"):
            expect(page.locator(f"{plot} svg.main-svg").first).to_be_visible(timeout=30_000)
        shot = artifact_path("dashboard-e2e.png", "FLYWHEEL_E2E_SCREENSHOT")
        page.screenshot(path=str(shot), full_page=True)
        print(f"dashboard screenshot of the end-to-end run: {shot}")
        return {"table": page.text_content("#checkpoints-table") or "", "screenshot": str(shot)}
    finally:
        page.close()
