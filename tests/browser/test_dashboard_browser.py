"""The ops dashboard in headless Chromium, against a real admin API, real Postgres, a real broker
and two real vLLM replicas of the base model.

The fleet: both replicas on the base weights (``serving.deploy.ensure_fleet``), a second
checkpoint (the base with every weight nudged by seeded noise, HF safetensors, same config
and tokenizer) registered as a ``candidate`` and deployed as canary through the API (a real
hot swap of one replica). Live data as the services write it: ``rewards`` rows for both
versions (the rewarding store's shape), training samples, sessions past their feedback
window without a reward, events on the broker's events topic that the ingest group has not
committed, and one real look of the canary controller (its ``canary.decision`` audit row).

In the browser: a wrong token is refused with the API's reason; a viewer sees the
checkpoints, the canary weight, the comparison and the lag, with Plotly's SVG drawn; the
viewer's promote is refused with the 403 reason; an operator promotes from the page (the
page then shows the new stable); a second canary deployed through the API is rolled back
from the page. A full-page screenshot is saved (``FLYWHEEL_DASHBOARD_SCREENSHOT`` or
``.flywheel/artifacts/dashboard.png``).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ReplicaPair, make_settings
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from flywheel.core import vllm_admin
from flywheel.core.auth import create_key, find_key, revoke_key
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import Checkpoint, Deployment
from flywheel.core.settings import CanarySettings, Settings
from flywheel.stack import endpoints
from flywheel.stack.stack import down, up
from flywheel.stack.vllm import policy_version_of

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.browser]

CANDIDATE = "nudged-1"
SECOND = "nudged-2"
PROJECT = "dashboard-test"
EVENTS_ON_BROKER = 3
OVERDUE_SESSIONS = 2
WAITING_SAMPLES = 3
UI_TIMEOUT_MS = 30_000
SWAP_TIMEOUT_MS = 240_000
ROOT = Path(__file__).resolve().parents[2]


def artifact_path(name: str, env: str) -> Path:
    """Where a test artefact goes: ``$env`` if set, else ``.flywheel/artifacts/<name>`` in the repository."""
    path = Path(os.environ[env]) if os.environ.get(env) else ROOT / ".flywheel" / "artifacts" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory, db_url: str, replica_pair: ReplicaPair) -> Iterator[Settings]:
    """The session's two replicas, one of them for the canary; a controller that holds (it must not act on its own)."""
    settings = make_settings(
        tmp_path_factory.mktemp("dashboard"),
        vllm={
            **replica_pair.settings.vllm.model_dump(include={"replicas", "enable_lora", "max_lora_rank"}),
            "urls": replica_pair.urls,
        },  # fmt: skip
        postgres={"url": db_url},
        serving={
            "drain_timeout_s": 20.0,
            "canary_replicas": 1,
            "canary": CanarySettings(min_samples_per_step=100_000, max_canary_sessions=None),
        },
    )
    yield settings
    down(settings)


@pytest.fixture(scope="module")
def engine(db_url: str):
    return get_engine(db_url)


@pytest.fixture(scope="module")
def replicas(replica_pair: ReplicaPair) -> list[str]:
    """The session's two warmed-up vLLM replicas of the base model, as the module before left them reset."""
    replica_pair.reset()
    return replica_pair.urls


@pytest.fixture(scope="module")
def broker(settings: Settings) -> str:
    """A real Kafka-protocol broker with the ingest topics and a few events nobody consumed."""
    from kafka import KafkaProducer

    from flywheel.core.contracts.topics import events_topic
    from ingest.topics import ensure_topics

    up(settings, ["broker"])
    bootstrap = endpoints.kafka_bootstrap(settings)
    ensure_topics(settings, bootstrap)
    producer = KafkaProducer(bootstrap_servers=bootstrap.split(","), acks="all")
    try:
        for i in range(EVENTS_ON_BROKER):
            producer.send(events_topic(settings.kafka.topic_prefix), key=f"s{i}".encode(), value=b"{}").get(timeout=30)
    finally:
        producer.close()
    return bootstrap


def nudged_copy(base: Path, target: Path, seed: int, scale: float = 0.02) -> Path:
    """The base folder (config, tokenizer) with every weight nudged by seeded noise (``scale`` x its std)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, target)
    weights = load_file(str(base / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    nudged = {}
    for name, tensor in weights.items():
        std = tensor.float().std() if tensor.numel() > 1 else torch.tensor(1.0)
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * std * scale
        nudged[name] = (tensor.float() + noise).to(tensor.dtype).contiguous()
    save_file(nudged, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def add_checkpoint(
    engine, checkpoint_id: str, path: Path, parent: str, base_dir: Path, heldout: float, window_end: datetime
) -> None:
    """A trained-looking candidate: parent, data window, gate evaluation."""
    result = {"success_rate": heldout, "n": 64}
    with Session(engine) as session:
        session.add(
            Checkpoint(
                id=checkpoint_id,
                policy_version=checkpoint_id,
                parent_id=parent,
                base_model=str(base_dir),
                path=str(path),
                format="full",
                status="candidate",
                status_reason="passed the gate (test)",
                n_samples=48,
                data_window_start=window_end - timedelta(minutes=5),
                data_window_end=window_end,
                eval={
                    "heldout": {"test-gate": result},
                    "gate": {"passed": True, "reason": "passed", "key": "test-gate", "candidate": result},
                },
            )
        )
        session.commit()


def write_rewards(engine, version: str, outcomes: list[float], prefix: str) -> list[int]:
    """Reward rows as the rewarding store writes them (version 1 per session, components per extractor)."""
    ids = []
    with engine.begin() as conn:
        for i, value in enumerate(outcomes):
            sid = f"{prefix}-{i}"
            components = {
                "outcome": {"value": value, "weight": 1.0, "weighted": value},
                "_meta": {
                    "input_hash": uuid.uuid4().hex,
                    "n_events": 4,
                    "event_ids": [str(uuid.uuid4())],
                    "stats": {"completions": 1, "tool_results": 0, "tool_errors": 0, "clarifying": 0},
                },
            }
            conn.execute(
                text(
                    "INSERT INTO sessions (project, session_id, task, started_at, ended_at, status, policy_versions, "
                    "n_events) VALUES (:p, :s, 'calc', now() - interval '15 min', now() - interval '12 min', "
                    "'completed', ARRAY[:v], 4)"
                ),
                {"p": PROJECT, "s": sid, "v": version},
            )
            ids.append(
                conn.execute(
                    text(
                        "INSERT INTO rewards (project, session_id, version, reward, components, extractor_versions, "
                        "config_hash, policy_version, reason) VALUES (:p, :s, 1, :r, CAST(:c AS jsonb), "
                        "CAST('{\"outcome\": \"1\"}' AS jsonb), 'test', :v, 'finalized') RETURNING id"
                    ),
                    {"p": PROJECT, "s": sid, "r": value, "c": _json(components), "v": version},
                ).scalar_one()
            )
    return ids


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


def write_backlog(engine, version: str, reward_id: int) -> None:
    """Sessions past their feedback window without a reward, and samples newer than any checkpoint's window."""
    with engine.begin() as conn:
        for i in range(OVERDUE_SESSIONS):
            conn.execute(
                text(
                    "INSERT INTO sessions (project, session_id, started_at, ended_at, status, n_events) "
                    "VALUES (:p, :s, now() - interval '40 min', now() - interval '30 min', 'completed', 3)"
                ),
                {"p": PROJECT, "s": f"unscored-{i}"},
            )
        for _ in range(WAITING_SAMPLES):
            conn.execute(
                text(
                    "INSERT INTO training_samples (project, session_id, completion_id, reward_id, reward_version, "
                    "policy_version, group_key, task, prompt_token_ids, completion_token_ids, loss_mask, "
                    "behaviour_logprobs, reward, components) VALUES (:p, 'stable-0', :c, :r, 1, :v, 'g', 'calc', "
                    "ARRAY[1,2], ARRAY[3], ARRAY[1]::smallint[], ARRAY[-0.5], 1.0, CAST('{}' AS jsonb))"
                ),
                {"p": PROJECT, "c": uuid.uuid4(), "r": reward_id, "v": version},
            )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def active(engine, role: str) -> Deployment | None:
    with Session(engine) as session:
        return session.scalars(select(Deployment).where(Deployment.role == role, Deployment.status == "active")).first()


# --------------------------------------------------------------------------- the test


def test_dashboard_renders_real_data_and_promotes_and_rolls_back(
    browser, serve_app, engine, settings, replicas, broker, base_model_dir, tmp_path_factory
):
    from playwright.sync_api import expect

    import serving.admin
    from serving.canary.controller import run_once
    from serving.dashboard import install_dashboard
    from serving.fleet.registry import ensure_fleet

    expect.set_options(timeout=UI_TIMEOUT_MS)
    base_version = policy_version_of(base_model_dir)
    status = ensure_fleet(engine, settings, replicas, model_dir=base_model_dir)
    base_id = status.stable.checkpoint_id
    root = tmp_path_factory.mktemp("checkpoints")
    now = datetime.now(UTC)
    add_checkpoint(
        engine,
        CANDIDATE,
        nudged_copy(base_model_dir, root / CANDIDATE, seed=101),
        base_id,
        base_model_dir,
        heldout=0.45,
        window_end=now - timedelta(minutes=2),
    )
    with Session(engine) as session:
        tokens = {
            role: create_key(session, name=f"{role}-ui", role=role, created_by="test")[1]
            for role in ("viewer", "operator")
        }
        session.commit()

    # The admin API reads the broker from its settings, as a deployed one is told it.
    settings = settings.model_copy(update={"kafka": settings.kafka.model_copy(update={"bootstrap_servers": broker})})
    app = serving.admin.create_app(settings, engine)
    install_dashboard(app, settings, engine, serving.admin.requires)
    errors: list[str] = []
    with serve_app(app) as server:
        api = httpx.Client(base_url=server.url, timeout=300.0)
        answer = api.post(
            "/v1/canary?wait=true",
            json={"checkpoint_id": CANDIDATE, "weight": 0.25},
            headers=bearer(tokens["operator"]),
        )
        assert answer.status_code == 200, answer.text
        stable_ids = write_rewards(engine, base_version, [1.0, 0.0] * 12, "stable")
        write_rewards(engine, CANDIDATE, [1.0, 0.0, 1.0] * 4, "canary")
        write_backlog(engine, base_version, stable_ids[0])
        decision = run_once(engine, settings)
        assert decision is not None and decision.action == "hold", decision

        for _ in range(10):  # a loaded machine may answer the broker's lag after the dashboard's time cap
            data = api.get("/v1/dashboard", headers=bearer(tokens["viewer"]))
            assert data.status_code == 200, data.text
            lag = data.json()["lag"]
            if "did not answer" not in (lag["kafka"]["reason"] or ""):
                break
            time.sleep(1.0)
        assert lag["kafka"]["value"] == EVENTS_ON_BROKER, lag["kafka"]
        assert lag["rewarding"]["value"] == OVERDUE_SESSIONS and lag["trainer"]["value"] == WAITING_SAMPLES, lag
        assert api.get("/v1/dashboard").status_code == 401

        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page.set_default_timeout(UI_TIMEOUT_MS)
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.on("dialog", lambda dialog: dialog.accept())
        result = page.locator("#action-result")

        # A wrong token: the login form again, with the API's reason.
        page.goto(f"{server.url}/dashboard")
        page.fill("#token-input", "not-a-token")
        page.click("#login-button")
        expect(page.locator("#login-error")).to_contain_text("unknown token")
        assert page.is_visible("#login-form") and not page.is_visible("#app")

        # The viewer sees the real picture.
        page.fill("#token-input", tokens["viewer"])
        page.click("#login-button")
        expect(page.locator("#traffic-canary")).to_be_visible()
        assert page.text_content("#whoami") == "viewer-ui (viewer)"
        assert page.text_content("#traffic-canary .weight") == "25.0 %"
        assert page.text_content("#traffic-stable .weight") == "75.0 %"
        table = page.text_content("#checkpoints-table")
        assert CANDIDATE in table and base_version in table and "45.0 %" in table
        row = page.text_content(f"#checkpoints-table tr[data-checkpoint='{CANDIDATE}']")
        assert base_id in row and "canary" in row
        comparison = page.text_content("#comparison-text")
        assert "current canary" in comparison and "Decision: hold" in comparison and CANDIDATE in comparison
        assert "n canary 12, stable 24" in comparison
        assert "3 records" in page.text_content("#lag-kafka")
        assert f"{OVERDUE_SESSIONS} sessions" in page.text_content("#lag-rewarding")
        assert f"{WAITING_SAMPLES} samples" in page.text_content("#lag-trainer")
        for plot in ("#traffic-plot", "#timeline-plot", "#versions-plot", "#comparison-plot"):
            assert page.locator(f"{plot} svg.main-svg").count() >= 1, f"Plotly drew no SVG in {plot}"
        assert page.locator("#timeline-plot .scatterlayer .point").count() >= 2

        # The viewer's promote: refused with the reason.
        page.click("#promote")
        expect(result).to_have_attribute("data-status", "403")
        refused = result.text_content()
        assert "403 forbidden" in refused and "operator role" in refused, refused
        assert active(engine, "canary").checkpoint_id == CANDIDATE

        # The operator promotes from the page.
        page.click("#logout")
        page.fill("#token-input", tokens["operator"])
        page.click("#login-button")
        expect(page.locator("#whoami")).to_have_text("operator-ui (operator)")
        page.fill("#reason", "promoted from the dashboard test")
        page.click("#promote")
        expect(result).to_have_attribute("data-status", "200", timeout=SWAP_TIMEOUT_MS)
        expect(result).to_contain_text("deploy.promote")
        expect(page.locator("#traffic-stable")).to_contain_text(CANDIDATE)
        expect(page.locator("#traffic-canary")).to_have_count(0)
        expect(page.locator("#traffic-stable .weight")).to_have_text("100.0 %")
        assert active(engine, "stable").checkpoint_id == CANDIDATE and active(engine, "canary") is None
        assert {vllm_admin.weight_info(url) for url in replicas} == {CANDIDATE}

        # A second canary through the API, rolled back from the page.
        add_checkpoint(
            engine,
            SECOND,
            nudged_copy(base_model_dir, root / SECOND, seed=202),
            CANDIDATE,
            base_model_dir,
            heldout=0.5,
            window_end=datetime.now(UTC),
        )
        answer = api.post(
            "/v1/canary?wait=true", json={"checkpoint_id": SECOND, "weight": 0.1}, headers=bearer(tokens["operator"])
        )
        assert answer.status_code == 200, answer.text
        expect(page.locator("#traffic-canary")).to_contain_text(SECOND)
        expect(page.locator("#traffic-canary .weight")).to_have_text("10.0 %")  # pending (0 %) until the swap is done
        expect(page.locator("#traffic-canary")).to_contain_text("active")
        screenshot = artifact_path("dashboard.png", "FLYWHEEL_DASHBOARD_SCREENSHOT")
        page.screenshot(path=str(screenshot), full_page=True)
        print(f"dashboard screenshot: {screenshot}")
        assert screenshot.stat().st_size > 10_000

        page.select_option("#rollback-to", "")
        page.fill("#reason", "rolled back from the dashboard test")
        page.click("#rollback")
        expect(result).to_contain_text("deploy.rollback", timeout=SWAP_TIMEOUT_MS)
        expect(result).to_have_attribute("data-status", "200")
        expect(page.locator("#traffic-canary")).to_have_count(0)
        expect(page.locator("#traffic-stable")).to_contain_text(CANDIDATE)
        assert active(engine, "stable").checkpoint_id == CANDIDATE and active(engine, "canary") is None
        with Session(engine) as session:
            second = session.scalars(select(Deployment).where(Deployment.checkpoint_id == SECOND)).one()
            assert second.status == "rolled_back"
        assert {vllm_admin.weight_info(url) for url in replicas} == {CANDIDATE}
        events = page.locator("#events-table")
        expect(events).to_contain_text("deploy.rollback")
        for words in ("deploy.promote", "deploy.canary", "token:operator-ui", "rolled back from the dashboard test"):
            expect(events).to_contain_text(words)

        # A token revoked while the page is open: the next refresh shows the login with the reason.
        with Session(engine) as session:
            revoke_key(session, find_key(session, tokens["operator"]).id)
            session.commit()
        expect(page.locator("#login-error")).to_contain_text("was revoked")
        expect(page.locator("#app")).to_be_hidden()
        context.close()
        api.close()
    assert not errors, f"errors in the page: {errors}"
