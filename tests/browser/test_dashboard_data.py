"""``GET /v1/dashboard`` against real Postgres (no vLLM, no browser): roles, and every number it reports.

The fleet's rows are written directly (a stable and an active canary deployment, no
replicas): the data route only reads. The canary comparison comes from one real look of
the canary controller (``serving.canary.controller.run_once``) over the rewards written here.
"""

from __future__ import annotations

import json
import socket
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.orm import Session

from flywheel.core.auth import create_key
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import Checkpoint, Deployment
from flywheel.core.settings import CanarySettings, KafkaSettings, ServingSettings, Settings

pytestmark = pytest.mark.integration

PROJECT = "dash"


@pytest.fixture(scope="module")
def engine(db_url: str):
    return get_engine(db_url)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def settings() -> Settings:
    return Settings(
        environment="test",
        kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{closed_port()}"),
        serving=ServingSettings(
            fleet="dash", canary=CanarySettings(min_samples_per_step=100_000, max_canary_sessions=None)
        ),
    )


def checkpoint(
    cid: str,
    parent: str | None,
    status: str,
    heldout: float | None,
    created: datetime,
    window_end: datetime | None = None,
) -> Checkpoint:
    eval_ = {"heldout": {"k": {"success_rate": heldout, "n": 64}}} if heldout is not None else {}
    return Checkpoint(
        id=cid,
        policy_version=cid,
        parent_id=parent,
        base_model="/m",
        path=f"/m/{cid}",
        format="full",
        status=status,
        eval=eval_,
        created_at=created,
        data_window_end=window_end,
    )


def reward(conn, sid: str, version: int, value: float, policy_version: str, ended_ago_min: float = 20.0) -> int:
    conn.execute(
        text(
            "INSERT INTO sessions (project, session_id, ended_at, status) "
            "VALUES (:p, :s, now() - CAST(:m AS float8) * interval '1 minute', 'completed') ON CONFLICT DO NOTHING"
        ),
        {"p": PROJECT, "s": sid, "m": ended_ago_min},
    )
    components = {"outcome": {"value": value, "weight": 1.0, "weighted": value}, "_meta": {"event_ids": [sid]}}
    return conn.execute(
        text(
            "INSERT INTO rewards (project, session_id, version, reward, components, extractor_versions, config_hash, "
            "policy_version) VALUES (:p, :s, :v, :r, CAST(:c AS jsonb), CAST('{}' AS jsonb), 'h', :pv) RETURNING id"
        ),
        {"p": PROJECT, "s": sid, "v": version, "r": value, "c": json.dumps(components), "pv": policy_version},
    ).scalar_one()


@pytest.fixture(scope="module")
def world(engine, settings) -> dict[str, str]:
    """base -> c1 (stable) -> c2 (canary at 20 %), c3 rejected; rewards, backlog, tokens; one controller look."""
    from serving.canary.controller import run_once

    t0 = datetime.now(UTC) - timedelta(hours=1)
    with Session(engine) as session:
        session.add(checkpoint("base", None, "deployed", 0.2, t0))
        session.add(checkpoint("c1", "base", "deployed", 0.4, t0 + timedelta(minutes=10), t0 + timedelta(minutes=9)))
        session.add(checkpoint("c3", "base", "rejected", 0.1, t0 + timedelta(minutes=15), t0 + timedelta(minutes=14)))
        session.add(
            checkpoint(
                "c2",
                "c1",
                "candidate",
                0.5,
                t0 + timedelta(minutes=20),
                datetime.now(UTC) - timedelta(minutes=1),
            )
        )
        session.flush()
        session.add(
            Deployment(fleet="dash", checkpoint_id="c1", role="stable", weight=1.0, strategy="full", status="active")
        )
        session.add(
            Deployment(fleet="dash", checkpoint_id="c2", role="canary", weight=0.2, strategy="full", status="active")
        )
        session.add(  # a role pin on the stable's checkpoint: c1 is still shown as the stable
            Deployment(fleet="dash", checkpoint_id="c1", role="pinned", agent_role="subagent", weight=0.0,
                       strategy="full", status="active")
        )  # fmt: skip
        tokens = {role: create_key(session, name=f"{role}-d", role=role)[1] for role in ("viewer", "operator")}
        tokens["writer"] = create_key(session, name="gw", role="writer", project=PROJECT)[1]
        session.commit()
    with engine.begin() as conn:
        for i in range(10):  # stable: 6 of 10 succeed; session s0's newer version turns it into a failure
            reward(conn, f"s{i}", 1, 1.0 if i < 6 else 0.0, "c1")
        reward(conn, "s0", 2, 0.0, "c1")
        sample_reward = 0
        for i in range(4):  # canary: 3 of 4
            sample_reward = reward(conn, f"k{i}", 1, 1.0 if i < 3 else 0.0, "c2")
        for sid, ago in (("late-1", 30.0), ("late-2", 45.0), ("fresh", 2.0)):  # only the first two are overdue
            conn.execute(
                text(
                    "INSERT INTO sessions (project, session_id, ended_at, status) "
                    "VALUES (:p, :s, now() - CAST(:m AS float8) * interval '1 minute', 'completed')"
                ),
                {"p": PROJECT, "s": sid, "m": ago},
            )
        conn.execute(
            text("INSERT INTO sessions (project, session_id, status) VALUES (:p, 'open-1', 'open')"), {"p": PROJECT}
        )
        for ago in (5.0, 0.2, 0.1):  # the last two are newer than c2's data window (ended a minute ago)
            conn.execute(
                text(
                    "INSERT INTO training_samples (project, session_id, completion_id, reward_id, reward_version, "
                    "policy_version, prompt_token_ids, completion_token_ids, loss_mask, behaviour_logprobs, reward, "
                    "components, created_at) VALUES (:p, 'k0', :c, :r, 1, 'c2', ARRAY[1], ARRAY[2], "
                    "ARRAY[1]::smallint[], ARRAY[-0.1], 1.0, CAST('{}' AS jsonb), "
                    "now() - CAST(:m AS float8) * interval '1 minute')"
                ),
                {"p": PROJECT, "c": uuid.uuid4(), "r": sample_reward, "m": ago},
            )
    decision = run_once(engine, settings)
    assert decision is not None and decision.action == "hold", decision
    return tokens


@pytest.fixture(scope="module")
def client(engine, settings) -> TestClient:
    import serving.admin
    from serving.dashboard import install_dashboard

    app = serving.admin.create_app(settings, engine)
    install_dashboard(app, settings, engine, serving.admin.requires)
    return TestClient(app)


def get(client: TestClient, token: str | None):
    return client.get("/v1/dashboard", headers={"Authorization": f"Bearer {token}"} if token else {})


def test_the_data_route_needs_an_ops_token_and_the_page_does_not(client, world):
    missing = get(client, None)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert "missing token" in missing.json()["reason"]
    assert get(client, "nope").json()["reason"] == "unknown token"
    writer = get(client, world["writer"])
    assert writer.status_code == 403 and "gateway write key" in writer.json()["reason"]
    assert get(client, world["viewer"]).status_code == 200
    page = client.get("/dashboard")
    assert page.status_code == 200 and world["viewer"] not in page.text and "c2" not in page.text


def test_checkpoints_come_with_lineage_status_heldout_and_live_numbers(client, world):
    body = get(client, world["viewer"]).json()
    assert body["viewer"] == {"name": "viewer-d", "role": "viewer"}
    cps = {c["id"]: c for c in body["checkpoints"]}
    assert [c["id"] for c in body["checkpoints"]] == ["base", "c1", "c3", "c2"]
    assert {k: (c["parent_id"], c["status"], c["deployed_as"]) for k, c in cps.items()} == {
        "base": (None, "deployed", None),
        "c1": ("base", "deployed", "stable"),
        "c3": ("base", "rejected", None),
        "c2": ("c1", "candidate", "canary"),
    }
    assert cps["c2"]["heldout"] == 0.5 and cps["c3"]["heldout"] == 0.1
    assert cps["c1"]["live_sessions"] == 10 and cps["c1"]["live_success"] == pytest.approx(0.5)  # s0's newest version
    assert cps["c2"]["live_sessions"] == 4 and cps["c2"]["live_reward"] == pytest.approx(0.75)
    assert cps["base"]["live_sessions"] == 0 and cps["base"]["live_success"] is None


def test_traffic_and_the_canary_comparison(client, world, settings):
    body = get(client, world["viewer"]).json()
    assert [(t["role"], t["policy_version"], t["weight"]) for t in body["traffic"]] == [
        ("stable", "c1", 0.8),
        ("canary", "c2", 0.2),
    ]
    cmp = body["canary_comparison"]
    assert cmp["current"] is True and cmp["deployment_id"] == body["canary"]["id"]
    assert (cmp["canary_version"], cmp["stable_version"], cmp["action"]) == ("c2", "c1", "hold")
    assert (cmp["n_canary"], cmp["n_stable"]) == (4, 10)
    assert cmp["estimate"] == pytest.approx(0.75 - 0.5, abs=1e-6)
    assert cmp["lower"] < cmp["estimate"] < cmp["upper"]
    assert cmp["non_inferiority_margin"] == settings.serving.canary.non_inferiority_margin
    assert len(cmp["history"]) == 1 and cmp["history"][0]["estimate"] == cmp["estimate"]
    assert [e["action"] for e in body["events"]] == ["canary.decision"]


def test_pipeline_lag(client, world):
    lag = get(client, world["viewer"]).json()["lag"]
    rewarding = lag["rewarding"]
    assert rewarding["value"] == 2 and rewarding["unit"] == "sessions"
    assert 44 * 60 - 600 - 60 < rewarding["oldest_overdue_s"] < 45 * 60 - 600 + 60
    trainer = lag["trainer"]
    assert (trainer["value"], trainer["checkpoint_id"]) == (2, "c2")
    assert 0 <= trainer["oldest_waiting_s"] < 60 and trainer["checkpoint_age_s"] > 30 * 60
    kafka = lag["kafka"]
    assert kafka["value"] is None and kafka["reason"].startswith(("broker unreachable", "broker did not answer"))


def test_a_role_pin_is_neither_the_stable_nor_the_canary_of_the_overview(engine, world):
    from serving.overview import snapshot

    snap = snapshot(engine, "dash")
    assert (snap.stable["checkpoint_id"], snap.canary["checkpoint_id"]) == ("c1", "c2")
    assert not hasattr(snap, "pinned")  # the pin on c1 is not read as a deployment role of its own
