"""Browser feedback end to end: a feedback token minted by the SDK, the JavaScript client from
docs/ingest.md running in headless Chromium on a page of another origin, the real gateway (uvicorn),
a real broker and Postgres, and the real ingest consumer writing ``raw_events``.

The page of an allowed origin sends feedback that lands in ``raw_events`` bound to the token's
session, once even when the click is sent twice, and reads the gateway's reasons (expired token,
kind not allowed). A page of an origin not in ``ingest.feedback_cors_origins`` is refused by CORS:
its ``fetch`` rejects and nothing reaches the topic. Without a browser: a revoked key's tokens stop.
"""

from __future__ import annotations

import functools
import http.server
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from conftest import free_port, running_gateway
from kafka import KafkaConsumer, TopicPartition

from flywheel.core.auth import create_key, revoke_key
from flywheel.core.contracts import parse_event
from flywheel.core.contracts.topics import events_topic
from flywheel.core.db.engine import session_factory
from flywheel.core.settings import Settings
from flywheel.sdk import Flywheel

pytestmark = [pytest.mark.integration, pytest.mark.browser]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
KEY_CACHE_TTL_S = 1.0


def docs_snippet() -> str:
    """The JavaScript block of docs/ingest.md's "Feedback from a browser" section, as written there."""
    text = (ROOT / "docs" / "ingest.md").read_text(encoding="utf-8")
    section = text.split("## Feedback from a browser\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```javascript\n(.*?)```", section, flags=re.S)
    return block


@dataclass
class Stack:
    gateway: str
    settings: Settings
    db_url: str
    conninfo: str
    project: str
    key_id: int
    fw: Flywheel


@dataclass
class Page:
    origin: str
    server: http.server.ThreadingHTTPServer


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Page]]:
    """Two static sites on their own ports (two origins) serving a page that loads the docs' snippet."""
    folder = tmp_path_factory.mktemp("page")
    (folder / "feedback.js").write_text(docs_snippet(), encoding="utf-8")
    (folder / "index.html").write_text(
        '<!doctype html><html><head><script src="feedback.js"></script></head><body>product</body></html>',
        encoding="utf-8",
    )
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    made: dict[str, Page] = {}
    for name in ("allowed", "other"):
        port = free_port()
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        threading.Thread(target=server.serve_forever, name=f"page-{name}", daemon=True).start()
        made[name] = Page(f"http://127.0.0.1:{port}", server)
    yield made
    for page in made.values():
        page.server.shutdown()
        page.server.server_close()


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, db_url: str, pages: dict[str, Page]) -> Iterator[Stack]:
    """The gateway (allowing the "allowed" page's origin only) and a consumer into ``raw_events``."""
    ingest = {"feedback_cors_origins": [pages["allowed"].origin]}
    with running_gateway(kafka_bootstrap, db_url, name="bf", project="web", key_name="browser-feedback",
                         ingest=ingest, consume=True, key_cache_ttl_s=KEY_CACHE_TTL_S) as run:  # fmt: skip
        # the backend's SDK: only its feedback_token() is used here (minting is local)
        fw = Flywheel(project=run.project, write_key=run.key, transport="http", gateway_url=run.url)
        try:
            yield Stack(run.url, run.settings, db_url, run.conninfo, run.project, run.key_id, fw)
        finally:
            fw.close(timeout_s=5)
    assert run.consuming is not None and not run.consuming.is_alive(), "the consumer did not stop"


@pytest.fixture(scope="module")
def chromium(chromium_path: Path) -> Iterator[object]:
    """Debian's Chromium, headless, with no network beyond this machine's loopback needed."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(chromium_path), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def stored_feedback(conninfo: str, project: str, session_id: str) -> list[dict]:
    with psycopg.connect(conninfo) as conn:
        rows = conn.execute(
            "SELECT payload FROM raw_events WHERE project = %s AND session_id = %s AND type = 'feedback'"
            " ORDER BY occurred_at",
            (project, session_id),
        ).fetchall()
    return [row[0] for row in rows]


def wait_for_rows(conninfo: str, project: str, session_id: str, want: int, timeout_s: float = 90.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = stored_feedback(conninfo, project, session_id)
        if len(rows) >= want:
            return rows
        time.sleep(0.2)
    raise AssertionError(f"{len(rows)} feedback rows of session {session_id} in raw_events, not {want}")


def topic_sessions(settings: Settings) -> list[str]:
    """The session id (or key) of every record on the events topic so far."""
    topic = events_topic(settings.kafka.topic_prefix)
    consumer = KafkaConsumer(bootstrap_servers=settings.kafka.bootstrap_servers, enable_auto_commit=False)
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        consumer.assign(partitions)
        ends = consumer.end_offsets(partitions)
        consumer.seek_to_beginning(*partitions)
        found: list[str] = []
        deadline = time.monotonic() + 30
        while any(consumer.position(p) < ends[p] for p in partitions) and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                found.extend(str(parse_event(r.value).session_id or r.key.decode()) for r in records)
        return found
    finally:
        consumer.close()


SEND = "([gateway, token, kind, fields]) => sendFeedback(gateway, token, kind, fields)"
TRY = """async ([gateway, token, kind, fields]) => {
  try { return {ok: await sendFeedback(gateway, token, kind, fields)}; }
  catch (err) { return {error: err.name, message: err.message}; }
}"""


def test_feedback_from_an_allowed_page_lands_once_bound_to_its_session(stack, pages, chromium):
    session_id = f"chat-{uuid.uuid4().hex[:8]}"
    token = stack.fw.feedback_token(session_id, user_id="u-7", kinds=["accept", "score"], ttl_s=600)
    page = chromium.new_page()
    try:
        page.goto(pages["allowed"].origin + "/index.html")
        first = page.evaluate(SEND, [stack.gateway, token, "score", {"score": 0.75}])
        again = page.evaluate(SEND, [stack.gateway, token, "score", {"score": 0.75}])  # a retried click
        accept = page.evaluate(SEND, [stack.gateway, token, "accept", {}])
        refused = page.evaluate(TRY, [stack.gateway, token, "reject", {}])
        expired = stack.fw.feedback_token(session_id, ttl_s=1)
        time.sleep(2.1)
        late = page.evaluate(TRY, [stack.gateway, expired, "accept", {}])
    finally:
        page.close()
    assert first == again and first != accept
    assert refused == {
        "error": "Error",
        "message": "kind: 'reject' is not allowed by this feedback token (allowed: accept, score)",
    }
    assert late == {"error": "Error", "message": "feedback token expired"}  # the page can read the reason
    rows = wait_for_rows(stack.conninfo, stack.project, session_id, 2)
    time.sleep(1.0)  # a duplicate would have been written by now: the consumer keeps up within this
    rows = stored_feedback(stack.conninfo, stack.project, session_id)
    assert sorted(r["event_id"] for r in rows) == sorted([first, accept])
    by_kind = {r["kind"]: r for r in rows}
    assert by_kind["score"]["score"] == 0.75 and by_kind["accept"].get("score") is None
    for row in rows:
        assert row["session_id"] == session_id and row["user_id"] == "u-7" and row["project"] == stack.project
        assert row["sdk"] == "flywheel-browser/1"


def test_a_page_of_another_origin_is_refused_by_cors_and_nothing_is_produced(stack, pages, chromium):
    session_id = f"evil-{uuid.uuid4().hex[:8]}"
    token = stack.fw.feedback_token(session_id)
    page = chromium.new_page()
    try:
        page.goto(pages["other"].origin + "/index.html")
        outcome = page.evaluate(TRY, [stack.gateway, token, "accept", {}])
    finally:
        page.close()
    assert outcome["error"] == "TypeError", outcome  # fetch rejects: the preflight was refused
    assert "fetch" in outcome["message"].lower()
    preflight = httpx.options(f"{stack.gateway}/v1/feedback", headers={"Origin": pages["other"].origin,
                              "Access-Control-Request-Method": "POST"})  # fmt: skip
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    events = httpx.options(f"{stack.gateway}/v1/events", headers={"Origin": pages["allowed"].origin,
                           "Access-Control-Request-Method": "POST"})  # fmt: skip
    assert "access-control-allow-origin" not in events.headers  # only the feedback route is cross-origin
    assert session_id not in topic_sessions(stack.settings)
    assert stored_feedback(stack.conninfo, stack.project, session_id) == []


def test_a_revoked_keys_tokens_are_refused(stack):
    session_id = f"rev-{uuid.uuid4().hex[:8]}"
    with session_factory(stack.db_url)() as session:
        other, other_key = create_key(session, name="to-revoke", role="writer", project=stack.project)
        session.commit()
    with Flywheel(project=stack.project, write_key=other_key, transport="http", gateway_url=stack.gateway) as fw:
        token = fw.feedback_token(session_id)
    ok = httpx.post(f"{stack.gateway}/v1/feedback", json={"token": token, "kind": "accept"}, timeout=30)
    assert ok.status_code == 202, ok.text
    with session_factory(stack.db_url)() as session:
        revoke_key(session, other.id)
        session.commit()
    time.sleep(KEY_CACHE_TTL_S + 0.5)
    refused = httpx.post(f"{stack.gateway}/v1/feedback", json={"token": token, "kind": "reject"}, timeout=30)
    assert refused.status_code == 401
    assert refused.json() == {"detail": "the write key this feedback token is signed with has been revoked",
                              "field": "token"}  # fmt: skip
    head, payload, signature = token.split(".")
    forged = f"{head}.{payload}.{'A' if signature[0] != 'A' else 'B'}{signature[1:]}"
    bad = httpx.post(f"{stack.gateway}/v1/feedback", json={"token": forged, "kind": "accept"}, timeout=30)
    assert bad.status_code == 401 and "signature" in bad.json()["detail"]
    assert [r["kind"] for r in wait_for_rows(stack.conninfo, stack.project, session_id, 1)] == ["accept"]


def test_a_token_past_its_rate_limit_gets_429_and_another_token_is_not_held_up(stack):
    """Per feedback token: ``ingest.feedback_token_burst`` (20) at once, then 1/s; what was accepted lands once."""
    flood, calm = f"flood-{uuid.uuid4().hex[:8]}", f"calm-{uuid.uuid4().hex[:8]}"
    token = stack.fw.feedback_token(flood)
    accepted, started = 0, time.monotonic()
    with httpx.Client(timeout=30) as client:
        for i in range(200):
            answer = client.post(f"{stack.gateway}/v1/feedback", json={"token": token, "kind": "accept", "id": f"c{i}"})
            if answer.status_code == 429:
                break
            assert answer.status_code == 202, answer.text
            accepted += 1
        elapsed = time.monotonic() - started
        assert answer.status_code == 429, "no request was refused"
        assert int(answer.headers["retry-after"]) >= 1
        detail = answer.json()["detail"]
        assert "rate limit of this feedback token exceeded: 1 requests/s, burst 20" in detail, detail
        assert 20 <= accepted <= 20 + elapsed + 1, (accepted, elapsed)
        other = client.post(
            f"{stack.gateway}/v1/feedback", json={"token": stack.fw.feedback_token(calm), "kind": "accept"}
        )
        assert other.status_code == 202, other.text
    assert len(wait_for_rows(stack.conninfo, stack.project, flood, accepted)) == accepted
