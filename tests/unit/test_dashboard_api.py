"""The dashboard's pure pieces: traffic shares, the canary comparison of a real decision,
the Kafka lag probe against a broker that is not there, and the routes it installs."""

from __future__ import annotations

import re
import socket
from datetime import UTC, datetime

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from flywheel.core.settings import CanarySettings, KafkaSettings, ServingSettings, Settings
from serving.canary.policy import Observations, decide
from serving.canary.stats import ArmStats
from serving.dashboard import (
    DATA_PATH,
    PUBLIC_PATHS,
    STATIC_DIR,
    check_dashboard_routes,
    install_dashboard,
    plotly_js_path,
)
from serving.dashboard.api import KafkaLagProbe, _comparison, traffic


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deployment(role: str, version: str, weight: float, status: str = "active") -> dict:
    return {
        "id": 1,
        "role": role,
        "policy_version": version,
        "checkpoint_id": version,
        "weight": weight,
        "status": status,
    }


def test_traffic_gives_an_active_canary_its_weight_and_stable_the_rest():
    shares = traffic(deployment("stable", "v1", 1.0), deployment("canary", "v2", 0.25))
    assert [(t["role"], t["policy_version"], t["weight"]) for t in shares] == [
        ("stable", "v1", 0.75),
        ("canary", "v2", 0.25),
    ]


def test_a_pending_canary_gets_no_traffic_yet():
    shares = traffic(deployment("stable", "v1", 1.0), deployment("canary", "v2", 0.25, status="pending"))
    assert [t["weight"] for t in shares] == [1.0, 0.0]
    assert traffic(deployment("stable", "v1", 1.0), None) == [
        {"role": "stable", "policy_version": "v1", "checkpoint_id": "v1", "weight": 1.0}
    ]


def arm(successes: int, n: int) -> ArmStats:
    return ArmStats(n=n, total=float(successes), total_sq=float(successes))


def test_comparison_flattens_a_real_decision_with_the_configured_margins():
    cs = CanarySettings()
    decision = decide(
        Observations(canary=arm(40, 80), stable=arm(120, 240), canary_at_step=80, elapsed_s=30.0), 0.05, cs
    )
    details = {
        **decision.to_details(),
        "canary": {"deployment_id": 7, "policy_version": "v2"},
        "stable": {"policy_version": "v1"},
    }
    row = {
        "at": datetime(2026, 12, 2, tzinfo=UTC),
        "target": "deployment:7",
        "details": details,
        "success": True,
    }
    out = _comparison(row, Settings(serving=ServingSettings(canary=cs)), current_id=7)
    assert out["current"] is True and out["deployment_id"] == 7
    assert out["action"] == decision.action and out["reason"] == decision.reason
    assert (out["canary_version"], out["stable_version"]) == ("v2", "v1")
    assert (out["n_canary"], out["n_stable"]) == (80, 240)
    assert out["lower"] < out["estimate"] < out["upper"]
    assert out["estimate"] == pytest.approx(0.0, abs=1e-6)
    assert out["non_inferiority_margin"] == cs.non_inferiority_margin and out["margin"] == decision.margin
    assert _comparison(row, Settings(), current_id=8)["current"] is False


def test_kafka_lag_of_an_unreachable_broker_is_null_with_a_reason():
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{closed_port()}"))
    probe = KafkaLagProbe(settings, timeout_s=1.0, cache_s=0.0, failure_cache_s=0.0)
    try:
        lag = probe.get()
    finally:
        probe.close()
    assert lag["value"] is None
    assert lag["reason"].startswith(("broker unreachable", "broker did not answer")), lag


def test_a_failed_kafka_measurement_is_reused_for_a_while():
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{closed_port()}"))
    probe = KafkaLagProbe(settings, timeout_s=1.0, cache_s=0.0, failure_cache_s=600.0)
    try:
        for _ in range(3):  # on a slow machine the first call may hit the time cap before the client gives up
            first = probe.get()
            if first["reason"].startswith("broker unreachable"):
                break
        assert first["value"] is None and first["reason"].startswith("broker unreachable"), first
        assert probe.get() is first
    finally:
        probe.close()


def fake_requires(role: str):
    def dependency() -> None:
        return None

    dependency.required_role = role  # type: ignore[attr-defined]
    return dependency


def test_install_adds_a_viewer_data_route_and_a_public_shell_without_data():
    app = FastAPI()
    install_dashboard(app, Settings(), engine=None, requires=fake_requires)  # type: ignore[arg-type]
    routes = {getattr(r, "path", None): r for r in app.routes}
    data = routes[DATA_PATH]
    assert isinstance(data, APIRoute)
    assert [getattr(d.call, "required_role", None) for d in data.dependant.dependencies] == ["viewer"]
    assert PUBLIC_PATHS <= set(routes)
    check_dashboard_routes(app)

    client = TestClient(app)
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/dashboard/static/plotly.min.js"' in page.text and "login-form" in page.text
    plotly = client.get("/dashboard/static/plotly.min.js")
    assert plotly.status_code == 200 and plotly.content == plotly_js_path().read_bytes()
    for name in ("app.js", "style.css"):
        response = client.get(f"/dashboard/static/{name}")
        assert response.status_code == 200 and response.content == (STATIC_DIR / name).read_bytes()
    assert client.get("/dashboard/static/nope.js").status_code == 404


def test_the_page_never_reads_data_without_the_bearer_token():
    script = (STATIC_DIR / "app.js").read_text()
    assert 'Authorization: "Bearer " + sent' in script and "sessionStorage.getItem(TOKEN_KEY)" in script
    assert not re.search(r"\.(inner|outer)HTML\b|insertAdjacentHTML|document\.write", script), (
        "API text must go into the DOM through textContent"
    )
    assert "http://" not in script and "https://" not in script, "no CDN or other origin"
    html = (STATIC_DIR / "index.html").read_text()
    assert "http://" not in html and "https://" not in html


def test_check_dashboard_routes_refuses_an_unprotected_data_route():
    app = FastAPI()

    @app.get(DATA_PATH)
    def dashboard() -> dict:
        return {}

    with pytest.raises(RuntimeError, match="no auth dependency"):
        check_dashboard_routes(app)
