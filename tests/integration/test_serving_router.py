"""The router in front of two real vLLM replicas, with its routing table in a real Postgres.

The replicas serve the project's base model; the "canary" is the same weights under a
second policy version (set through ``/update_weight_version``), which is all the router
looks at. The replicas and deployments rows are written here directly. The router runs
in-process (uvicorn in a thread) so the test can read its counters. A client of the router
knows a replica only by its id (``x-flywheel-replica``): ``Fleet.ids`` maps it to the URL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from conftest import WARMUP_TIMEOUT_S, ReplicaPair, free_port
from prometheus_client import generate_latest
from sqlalchemy import Engine, delete, select, update
from sqlalchemy.orm import Session

from flywheel.core import vllm_admin
from flywheel.core.auth import create_key
from flywheel.core.db import migrate
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import Checkpoint, Deployment, Replica
from flywheel.core.settings import Settings
from flywheel.stack import endpoints
from flywheel.stack.base import load_state
from flywheel.stack.stack import up
from serving.proxy.router import Router, create_app, uvicorn_config

pytestmark = pytest.mark.integration

FLEET = "router-test"
CANARY = "canary-same-weights"


@dataclass
class Fleet:
    """Two replicas, their stack settings, and the database the router reads."""

    settings: Settings
    urls: list[str]
    base_version: str
    engine: Engine
    model_dir: Path
    key: str
    """A product key (rate limit out of the way: these tests load the router on purpose)."""
    ids: dict[str, str] = field(default_factory=dict)
    """Each replica's public id (its ``replicas`` row, as the router's clients see it) to its URL."""

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def id_of(self, url: str) -> str:
        """The public id of the replica at ``url`` (as ``configure`` last recorded it)."""
        [replica_id] = [i for i, u in self.ids.items() if u == url]
        return replica_id


class RouterThread:
    """The router app served by uvicorn in a background thread."""

    def __init__(self, settings: Settings, engine: Engine):
        self.port = free_port()
        self.app = create_app(settings, engine)
        config = uvicorn_config(self.app, "127.0.0.1", self.port)
        config.loop = "asyncio"  # keep uvloop's global policy out of the test process
        import uvicorn

        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="router", daemon=True)

    @property
    def router(self) -> Router:
        return self.app.router

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RouterThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def warm(url: str, model: str) -> None:
    httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "warm up", "max_tokens": 4},
               timeout=WARMUP_TIMEOUT_S).raise_for_status()  # fmt: skip


@pytest.fixture(scope="module")
def fleet(pg_url: str, replica_pair: ReplicaPair) -> Iterator[Fleet]:
    """The session's two warmed-up replicas of the base model and a fresh, migrated database naming them."""
    settings, base, base_model_dir = replica_pair.settings, replica_pair.base_version, replica_pair.model_dir
    db_url = endpoints.with_database(pg_url, f"router_{uuid.uuid4().hex[:10]}")
    endpoints.ensure_database(db_url)
    migrate.upgrade(db_url)
    engine = get_engine(db_url)
    try:
        replica_pair.reset()
        with Session(engine) as s:
            for version, parent in ((base, None), (CANARY, base)):
                s.add(Checkpoint(id=version, policy_version=version, parent_id=parent, base_model=str(base_model_dir),
                                 path=str(base_model_dir), format="full", status="deployed"))  # fmt: skip
                s.flush()
            _, key = create_key(s, name="router-test", role="product", project="router-test", rate_per_s=1e6,
                                burst=1_000_000)  # fmt: skip
            s.commit()
        yield Fleet(settings, list(replica_pair.urls), base, engine, base_model_dir, key)
    finally:
        engine.dispose()
        endpoints.drop_database(db_url)


def configure(fleet: Fleet, versions: list[str], canary_weight: float | None, states: list[str] | None = None) -> None:
    """Replica ``i`` reports and is recorded as ``versions[i]``; stable = base, canary = CANARY at ``canary_weight``."""
    for url, version in zip(fleet.urls, versions):
        vllm_admin.update_weight_version(url, version)
    with Session(fleet.engine) as s:
        s.execute(delete(Replica))
        s.execute(update(Deployment).values(status="superseded"))
        s.add(Deployment(fleet=FLEET, checkpoint_id=fleet.base_version, role="stable", weight=1.0, status="active"))
        if canary_weight is not None:
            s.add(Deployment(fleet=FLEET, checkpoint_id=CANARY, role="canary", weight=canary_weight, status="active"))
        for i, (url, version) in enumerate(zip(fleet.urls, versions)):
            state = states[i] if states else "serving"
            s.add(Replica(fleet=FLEET, url=url, state=state, policy_version=version, checkpoint_id=version))
        s.commit()
        fleet.ids = {str(r.id): r.url for r in s.scalars(select(Replica).where(Replica.fleet == FLEET))}


def router_settings(fleet: Fleet, /, **serving_fields: Any) -> Settings:
    serving = fleet.settings.serving.model_copy(
        update={
            "fleet": FLEET,
            "refresh_s": 0.2,
            "health_interval_s": 0.3,
            "health_timeout_s": 2.0,
            "eject_after_failures": 2,
            **serving_fields,
        }
    )
    return fleet.settings.model_copy(update={"serving": serving})


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def routable_urls(router: Router) -> set[str]:
    return {v.url for views in router.routes.by_version.values() for v in views}


@pytest.fixture
def stable_router(fleet: Fleet) -> Iterator[RouterThread]:
    """Both replicas on the base version (no canary), the router ready on both."""
    configure(fleet, [fleet.base_version] * 2, None)
    with RouterThread(router_settings(fleet), fleet.engine) as rt:
        wait_for(lambda: routable_urls(rt.router) == set(fleet.urls), 20, "both replicas routable")
        yield rt


def test_openai_client_through_the_router(fleet: Fleet, stable_router: RouterThread) -> None:
    client = openai.OpenAI(api_key=fleet.key, base_url=f"{stable_router.url}/v1", max_retries=0)
    messages = [{"role": "user", "content": "2+3="}]

    raw = client.chat.completions.with_raw_response.create(model=fleet.base_version, messages=messages, max_tokens=8)
    chat = raw.parse()
    assert raw.headers["x-flywheel-policy-version"] == fleet.base_version
    assert raw.headers["x-flywheel-replica"] in fleet.ids  # the replica's id, not its URL
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0
    assert chat.flywheel == {"policy_version": fleet.base_version, "replica": raw.headers["x-flywheel-replica"]}

    raw = client.completions.with_raw_response.create(model=fleet.base_version, prompt="1+1=", max_tokens=8)
    text = raw.parse()
    assert raw.headers["x-flywheel-policy-version"] == fleet.base_version and text.choices[0].text is not None
    assert text.model == fleet.base_version  # rewritten to what the replica serves

    with client.chat.completions.with_streaming_response.create(
        model=fleet.base_version, messages=messages, max_tokens=12, stream=True, stream_options={"include_usage": True}
    ) as response:
        assert response.headers["x-flywheel-policy-version"] == fleet.base_version
        assert response.headers["x-flywheel-replica"] in fleet.ids
        chunks = list(response.parse())
    assert len(chunks) > 2 and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

    with client.completions.with_streaming_response.create(
        model=fleet.base_version, prompt="7+1=", max_tokens=12, stream=True
    ) as response:
        assert response.headers["x-flywheel-policy-version"] == fleet.base_version
        pieces = [c.choices[0].text for c in response.parse() if c.choices]
    assert len(pieces) > 1

    models = client.models.list()
    assert [m.id for m in models.data] == [fleet.base_version]
    assert httpx.get(f"{stable_router.url}/health").status_code == 200
    ready = httpx.get(f"{stable_router.url}/ready")
    assert ready.status_code == 200 and set(ready.json()["routable"][fleet.base_version]) == set(fleet.ids)
    assert httpx.get(f"{stable_router.url}/router/metrics").status_code == 404  # not on the public port
    metrics = generate_latest(stable_router.router.metrics.registry).decode()
    assert "flywheel_router_requests_total" in metrics and fleet.base_version in metrics
    assert not any(url in metrics for url in fleet.urls)  # replicas are named by id


def url_leaks(text: str, urls: list[str]) -> list[str]:
    """What of the replicas' addresses ``text`` gives away: a URL, a host:port, a host, a socket address."""
    found = []
    for url in urls:
        parts = urlsplit(url)
        found += [s for s in (url, parts.netloc, parts.hostname or "", f"', {parts.port}") if s and s in text]
    return found


def test_a_client_never_sees_a_replica_url(fleet: Fleet, stable_router: RouterThread) -> None:
    """Headers, JSON and streamed bodies, ``/ready``, ``/v1/models`` and the 503 answers of a fleet
    whose replicas time out or are down name replicas by id, never by their internal address."""
    base, auth = fleet.base_version, fleet.auth
    seen: list[str] = []

    def record(response: httpx.Response) -> httpx.Response:
        seen.append(" ".join(f"{k}: {v}" for k, v in response.headers.items()) + "\n" + response.text)
        return response

    chat_body = {"model": base, "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 4}
    chat = record(httpx.post(f"{stable_router.url}/v1/chat/completions", json=chat_body, headers=auth, timeout=60))
    assert chat.status_code == 200 and chat.json()["flywheel"]["replica"] in fleet.ids
    stream_body = {"model": base, "prompt": "1+1=", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{stable_router.url}/v1/completions", json=stream_body, headers=auth,
                      timeout=60) as streamed:  # fmt: skip
        streamed.read()
        record(streamed)
    assert streamed.headers["x-flywheel-replica"] in fleet.ids and "data: [DONE]" in streamed.text
    ready = record(httpx.get(f"{stable_router.url}/ready")).json()["routable"]
    assert list(ready) == [base] and sorted(ready[base]) == sorted(fleet.ids)
    assert record(httpx.get(f"{stable_router.url}/v1/models", headers=auth)).status_code == 200

    # Every attempt times out (0.1 s for a 2 x 200-token answer): 503 naming the last replica tried, by id.
    with RouterThread(router_settings(fleet, request_timeout_s=0.1), fleet.engine) as rt:
        wait_for(lambda: routable_urls(rt.router) == set(fleet.urls), 20, "both replicas routable")
        slow = {"model": base, "prompt": "1", "max_tokens": 200, "n": 2, "ignore_eos": True}
        timed_out = record(httpx.post(f"{rt.url}/v1/completions", json=slow, headers=auth, timeout=60))
    message = timed_out.json()["error"]["message"]
    assert timed_out.status_code == 503 and "tried 2 replica(s)" in message, message
    assert any(f"timeout from replica {i} (" in message for i in fleet.ids), message

    # Replicas that are down (nothing listens at their URLs): 503 naming each by id and why, no address.
    down_fleet = f"{FLEET}-down"
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with Session(fleet.engine) as s:
        s.add(Deployment(fleet=down_fleet, checkpoint_id=base, role="stable", weight=1.0, status="active"))
        rows = [
            Replica(fleet=down_fleet, url=u, state="serving", policy_version=base, checkpoint_id=base) for u in dead
        ]
        s.add_all(rows)
        s.commit()
        dead_ids = [str(r.id) for r in rows]
    try:
        with RouterThread(router_settings(fleet, fleet=down_fleet), fleet.engine) as rt:
            health = rt.router.health
            wait_for(lambda: all(u in health and health[u].ejected for u in dead), 20, "the dead replicas ejected")
            not_ready = record(httpx.get(f"{rt.url}/ready"))
            down = record(httpx.post(f"{rt.url}/v1/completions", json={"model": base, "prompt": "1"}, headers=auth))
            models = record(httpx.get(f"{rt.url}/v1/models", headers=auth))
    finally:
        with Session(fleet.engine) as s:
            s.execute(delete(Replica).where(Replica.fleet == down_fleet))
            s.execute(delete(Deployment).where(Deployment.fleet == down_fleet))
            s.commit()
    assert not_ready.status_code == 503 and down.status_code == 503 and models.json()["data"] == []
    for i in dead_ids:  # which replica, and what happened (the connection refused), for ops
        assert f"replica {i} ejected (ClientConnectorError" in not_ready.json()["reason"], not_ready.text
        assert f"replica {i} ejected (ClientConnectorError" in down.json()["error"]["message"], down.text

    leaks = {text: url_leaks(text, fleet.urls + dead) for text in seen}
    assert not {text: found for text, found in leaks.items() if found}


@pytest.mark.parametrize(
    "method,path",
    [("POST", "/pause"), ("POST", "/resume"), ("POST", "/collective_rpc"), ("POST", "/update_weight_version"),
     ("GET", "/weight_info"), ("GET", "/is_paused"), ("POST", "/v1/load_lora_adapter"), ("GET", "/metrics"),
     ("POST", "/tokenize"), ("GET", "/v1/chat/completions/../../pause"), ("POST", "/v1/embeddings")],
)  # fmt: skip
def test_dev_endpoints_are_not_reachable(fleet: Fleet, stable_router: RouterThread, method: str, path: str) -> None:
    before = {u: vllm_admin.is_paused(u) for u in fleet.urls}
    response = httpx.request(method, stable_router.url + path, json={"method": "reload_weights"})
    assert response.status_code == 404, response.text
    assert "no route" in response.json()["error"]["message"]
    assert {u: vllm_admin.is_paused(u) for u in fleet.urls} == before == {u: False for u in fleet.urls}


def test_bad_requests_get_a_reason(fleet: Fleet, stable_router: RouterThread) -> None:
    url = f"{stable_router.url}/v1/completions"
    auth = fleet.auth
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json", **auth})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    too_big = httpx.post(url, content=b"x" * (2 << 20), headers=auth)
    assert too_big.status_code == 413 and "exceeds" in too_big.json()["error"]["message"]
    unknown = httpx.post(url, json={"model": "gpt-9", "prompt": "x", "max_tokens": 2}, headers=auth)
    assert unknown.status_code == 404 and fleet.base_version in unknown.json()["error"]["message"]
    wrong_method = httpx.get(url)
    assert wrong_method.status_code == 405
    upstream_400 = httpx.post(url, json={"model": fleet.base_version, "prompt": "x", "max_tokens": -1}, headers=auth)
    assert upstream_400.status_code == 400  # vLLM's own validation answer, passed through
    assert upstream_400.headers["x-flywheel-policy-version"] == fleet.base_version


def test_sessions_stay_on_one_version_at_half_canary(fleet: Fleet) -> None:
    configure(fleet, [fleet.base_version, CANARY], 0.5)
    with RouterThread(router_settings(fleet), fleet.engine) as rt:
        wait_for(lambda: len(rt.router.routes.by_version) == 2, 20, "both versions routable")
        client = openai.OpenAI(api_key=fleet.key, base_url=f"{rt.url}/v1", max_retries=0)
        seen: dict[str, set[tuple[str, str]]] = {}

        def session_run(i: int) -> None:
            sid = f"session-{i}"
            for turn in range(4):
                if i % 2:  # half the sessions identify themselves by the header, half by the body's user
                    raw = client.completions.with_raw_response.create(
                        model=fleet.base_version,
                        prompt=f"{turn}+1=",
                        max_tokens=2,
                        extra_headers={"x-flywheel-session-id": sid},
                    )
                else:  # any served name will do: the router rewrites it for the replica it picks
                    raw = client.completions.with_raw_response.create(
                        model=CANARY, prompt=f"{turn}+1=", max_tokens=2, user=sid
                    )
                seen.setdefault(sid, set()).add(
                    (raw.headers["x-flywheel-policy-version"], raw.headers["x-flywheel-replica"])
                )

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(session_run, range(40)))
    assert all(len(pairs) == 1 for pairs in seen.values()), {s: p for s, p in seen.items() if len(p) > 1}
    versions = Counter(next(iter(p))[0] for p in seen.values())
    assert set(versions) == {fleet.base_version, CANARY} and min(versions.values()) >= 8, versions
    expected = {fleet.base_version: fleet.id_of(fleet.urls[0]), CANARY: fleet.id_of(fleet.urls[1])}
    assert all(expected[v] == r for pairs in seen.values() for v, r in pairs)


def test_a_pinned_role_is_served_by_its_frozen_version_and_its_session_stays_on_stable(fleet: Fleet) -> None:
    """Replica 1 serves the pinned version: sub-agent requests go there, the orchestrator's (same session)
    stay on stable; with the pinned replica out of rotation, sub-agent requests get 503 naming the pin."""
    configure(fleet, [fleet.base_version, CANARY], None)
    with Session(fleet.engine) as s:
        s.add(Deployment(fleet=FLEET, checkpoint_id=CANARY, role="pinned", agent_role="subagent", weight=0.0,
                         status="active"))  # fmt: skip
        s.commit()
    try:
        with RouterThread(router_settings(fleet), fleet.engine) as rt:
            wait_for(lambda: len(rt.router.routes.by_version) == 2, 20, "both versions routable")
            client = openai.OpenAI(api_key=fleet.key, base_url=f"{rt.url}/v1", max_retries=0)

            def served(sid: str, role: str | None) -> tuple[str, str]:
                headers = {"x-flywheel-session-id": sid}
                if role:
                    headers["x-flywheel-agent-role"] = role
                raw = client.completions.with_raw_response.create(
                    model="flywheel", prompt="1+1=", max_tokens=2, extra_headers=headers
                )
                return raw.headers["x-flywheel-policy-version"], raw.headers["x-flywheel-replica"]

            stable = (fleet.base_version, fleet.id_of(fleet.urls[0]))
            pinned = (CANARY, fleet.id_of(fleet.urls[1]))
            for i in range(6):
                sid = f"parl-{i}"
                assert served(sid, "orchestrator") == stable
                assert served(sid, "subagent") == pinned
                assert served(sid, None) == stable  # the sub-agent's request never moved the session
            models = {
                m["id"]: m["flywheel"] for m in httpx.get(f"{rt.url}/v1/models", headers=fleet.auth).json()["data"]
            }
            assert models[CANARY]["pinned_roles"] == ["subagent"] and models[fleet.base_version]["pinned_roles"] == []
            pinned_count = generate_latest(rt.router.metrics.registry).decode()
            assert 'flywheel_router_pinned_requests_total{agent_role="subagent"} 6.0' in pinned_count

            with Session(fleet.engine) as s:
                s.execute(update(Replica).where(Replica.url == fleet.urls[1]).values(state="draining"))
                s.commit()
            wait_for(lambda: CANARY not in rt.router.routes.by_version, 20, "the pinned replica out of rotation")
            response = httpx.post(
                f"{rt.url}/v1/completions",
                json={"model": "flywheel", "prompt": "1+1=", "max_tokens": 2},
                headers={**fleet.auth, "x-flywheel-agent-role": "subagent"},
                timeout=60,
            )
            assert response.status_code == 503, response.text
            assert (
                f"agent role 'subagent' is pinned to policy version {CANARY!r}" in response.json()["error"]["message"]
            )
            assert served("parl-0", "orchestrator") == stable
    finally:
        with Session(fleet.engine) as s:
            s.execute(update(Deployment).where(Deployment.role == "pinned").values(status="unpinned"))
            s.commit()


def test_a_draining_replica_gets_no_new_requests(fleet: Fleet) -> None:
    configure(fleet, [fleet.base_version] * 2, None, states=["serving", "draining"])
    with RouterThread(router_settings(fleet), fleet.engine) as rt:
        wait_for(lambda: routable_urls(rt.router) == {fleet.urls[0]}, 20, "the serving replica routable")
        replicas = Counter()
        for i in range(20):
            r = httpx.post(
                f"{rt.url}/v1/completions",
                json={"model": fleet.base_version, "prompt": f"{i}", "max_tokens": 2},
                headers=fleet.auth,
                timeout=60,
            )
            assert r.status_code == 200
            replicas[r.headers["x-flywheel-replica"]] += 1
        assert replicas == {fleet.id_of(fleet.urls[0]): 20}
        with Session(fleet.engine) as s:  # the swap is done: it serves again
            s.execute(update(Replica).where(Replica.url == fleet.urls[1]).values(state="serving"))
            s.commit()
        wait_for(lambda: routable_urls(rt.router) == set(fleet.urls), 20, "the drained replica back")


def open_stream(router_url: str, model: str, key: str) -> tuple[Any, str, Iterator[Any]]:
    """A long text stream (32 x 240 tokens) through the router, after its first chunk: (context, replica id, rest).

    Long enough to be still generating when the test kills its replica: with 8 x 240 tokens a
    fast machine had finished one (and the router buffered it whole) before the kill landed.
    """
    client = openai.OpenAI(api_key=key, base_url=f"{router_url}/v1", max_retries=0)
    context = client.completions.with_streaming_response.create(
        model=model, prompt="1", max_tokens=240, n=32, stream=True, extra_body={"ignore_eos": True}
    )
    response = context.__enter__()
    chunks = iter(response.parse())
    next(chunks)
    return context, response.headers["x-flywheel-replica"], chunks


class StreamReader:
    """Reads the rest of a stream in a thread, so the test can see whether it is still generating."""

    def __init__(self, chunks: Iterator[Any]):
        self.chunks = chunks
        self.count = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for _ in self.chunks:
                self.count += 1
        except BaseException as err:  # noqa: BLE001 - the test asserts on it
            self.error = err
        finally:
            self.done.set()

    def stalled(self, quiet_s: float, timeout_s: float) -> bool:
        """True once no chunk has come for ``quiet_s`` while the stream is still open; False if it ended."""
        deadline = time.monotonic() + timeout_s
        last, since = self.count, time.monotonic()
        while time.monotonic() < deadline:
            if self.done.wait(0.1):
                return False
            if self.count != last:
                last, since = self.count, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return True
        raise AssertionError(f"the stream neither ended nor stalled in {timeout_s} s")


def test_a_killed_replica_is_ejected_its_requests_retried_and_it_rejoins(fleet: Fleet, fault_figures) -> None:
    configure(fleet, [fleet.base_version] * 2, None)
    with RouterThread(router_settings(fleet), fleet.engine) as rt:
        wait_for(lambda: routable_urls(rt.router) == set(fleet.urls), 20, "both replicas routable")
        stop = threading.Event()
        results: list[tuple[float, int, str | None]] = []

        def load() -> None:
            with httpx.Client(timeout=120, headers=fleet.auth) as http:
                while not stop.is_set():
                    r = http.post(
                        f"{rt.url}/v1/completions",
                        json={"model": fleet.base_version, "prompt": "3+4=", "max_tokens": 16},
                    )
                    results.append((time.monotonic(), r.status_code, r.headers.get("x-flywheel-replica")))

        workers = [threading.Thread(target=load) for _ in range(6)]
        for w in workers:
            w.start()
        streams = []
        killed = False
        try:
            wait_for(lambda: {r for _, _, r in results} == set(fleet.ids), 60, "load on both replicas")
            # Long streams that have started (first chunk read): the first one's replica survives;
            # the first one landing elsewhere (least outstanding) is the one the kill breaks.
            streams.append(open_stream(rt.url, fleet.base_version, fleet.key))
            survivor = streams[0][1]
            victim = reader = None
            for _ in range(5):
                for _ in range(8):
                    streams.append(open_stream(rt.url, fleet.base_version, fleet.key))
                    if streams[-1][1] != survivor:
                        break
                victim = streams[-1][1]
                assert victim != survivor, "every stream went to the same replica"
                # Frozen first, and the kill only once the stream is seen stalled (still generating): a fast
                # machine generated, sent and buffered a whole 32 x 240-token stream before the kill landed.
                vllm_admin.pause(fleet.ids[victim], mode="keep")
                reader = StreamReader(streams[-1][2])
                if reader.stalled(quiet_s=2.0, timeout_s=60):
                    break
                vllm_admin.resume(fleet.ids[victim])  # it had finished before the pause: another stream
            else:
                pytest.fail("five streams to one replica each finished before the replica was paused")
            assert victim is not None and reader is not None
            victim_url = fleet.ids[victim]
            pid = load_state(fleet.settings).components[f"vllm-{fleet.urls.index(victim_url)}"].pid
            os.killpg(pid, signal.SIGKILL)
            killed = True
            killed_at = time.monotonic()
            assert reader.done.wait(60), "the broken stream did not end"
            # started, so the router ends it with an error event (an APIError), not silence
            assert isinstance(reader.error, openai.APIError), repr(reader.error)
            message = str(reader.error)
            assert "failed mid-stream" in message and f"replica {victim} serving" in message, message
            assert not any(u in message or urlsplit(u).netloc in message for u in fleet.urls)  # by id only
            for _, replica, chunks in streams[:-1]:
                if replica == survivor:
                    assert len(list(chunks)) > 10
            wait_for(lambda: rt.router.health[victim_url].ejected, 20, "the killed replica ejected")
            time.sleep(2.0)
        finally:
            stop.set()
            for w in workers:
                w.join(120)
            for context, _, _ in streams:
                context.__exit__(None, None, None)
            if killed:  # restarted whatever this test's assertions say, so the next test has two replicas
                up(fleet.settings, ["vllm"], model_dir=fleet.model_dir)
        after = [(s, r) for t, s, r in results if t > killed_at + 0.5]
        ok = sum(1 for _, s, _ in results if s == 200)
        fault_figures(unit="requests", sent=len(results), stored=ok, distinct=ok)
        assert all(s == 200 for _, s, _ in results), Counter(s for _, s, _ in results)
        assert after and all(r == survivor for _, r in after)
        assert rt.router.metrics.ejections.labels(victim)._value.get() >= 1

        warm(victim_url, fleet.base_version)
        wait_for(lambda: victim_url in routable_urls(rt.router), 30, "the restarted replica back in rotation")
        served = Counter(
            httpx.post(
                f"{rt.url}/v1/completions",
                json={"model": fleet.base_version, "prompt": "1", "max_tokens": 2},
                headers=fleet.auth,
                timeout=60,
            ).headers["x-flywheel-replica"]  # fmt: skip
            for _ in range(30)
        )
        assert served[victim] > 0 and rt.router.metrics.rejoins.labels(victim)._value.get() >= 1


def _router_process(fleet: Fleet, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """The router as its own process (``flywheel-serving router``), configured through the environment."""
    from flywheel.stack.services import settings_env

    settings = router_settings(fleet)
    env = settings_env(settings, {
        "postgres": {"url": fleet.engine.url.render_as_string(hide_password=False)},
        "serving": {"fleet": FLEET, "refresh_s": 0.2, "health_interval_s": 0.3, "router_port": port},
    })  # fmt: skip
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "serving.main", "router", "--log-level", "warning"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def test_a_router_killed_under_load_restarts_and_no_request_or_session_is_lost(
    fleet: Fleet, tmp_path: Path, fault_figures
) -> None:
    """SIGKILL the router process under load, start it again: clients retrying as the official
    ``openai`` client does see every request answered, and every session keeps its policy version
    (the split is a deterministic hash of the session, so a fresh router agrees with the old one)."""
    configure(fleet, [fleet.base_version, CANARY], 0.5)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "router.log"

    def ready() -> bool:
        try:
            r = httpx.post(
                f"{url}/v1/completions",
                json={"model": fleet.base_version, "prompt": "1", "max_tokens": 1},
                headers=fleet.auth,
                timeout=5,
            )
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    router = _router_process(fleet, port, log_path)
    stop = threading.Event()
    seen: dict[str, list[str]] = {}
    failures: list[str] = []
    answered = Counter[str]()

    def session_loop(i: int) -> None:
        client = openai.OpenAI(api_key=fleet.key, base_url=f"{url}/v1", max_retries=8, timeout=60)
        turn = 0
        while not stop.is_set():
            sid = f"kill-{i}-{turn // 3}"  # three requests per session, then a new session
            try:
                raw = client.completions.with_raw_response.create(
                    model=fleet.base_version,
                    prompt=f"{turn}+1=",
                    max_tokens=4,
                    extra_headers={"x-flywheel-session-id": sid},
                )
                seen.setdefault(sid, []).append(raw.headers["x-flywheel-policy-version"])
                answered["before" if router_generation[0] == 1 else "after"] += 1
            except openai.OpenAIError as err:  # after every retry: a lost request
                failures.append(f"{sid}: {err!r}")
            turn += 1

    router_generation = [1]
    workers = [threading.Thread(target=session_loop, args=(i,)) for i in range(6)]
    restarted = None
    try:
        wait_for(ready, 60, "the router process serving")
        for w in workers:
            w.start()
        wait_for(lambda: answered["before"] >= 30, 60, "load through the first router")
        os.killpg(router.pid, signal.SIGKILL)
        router.wait(10)
        time.sleep(1.0)  # the port stays dark for a moment: clients back off and retry
        router_generation[0] = 2
        restarted = _router_process(fleet, port, log_path)
        wait_for(lambda: answered["after"] >= 30, 90, "load through the restarted router")
    finally:
        stop.set()
        for w in workers:
            w.join(120)
        for proc in (router, restarted):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    answered_total = sum(answered.values())
    fault_figures(unit="requests", sent=answered_total + len(failures), stored=answered_total, distinct=answered_total)
    assert not failures, failures[:5]
    changed = {sid: versions for sid, versions in seen.items() if len(set(versions)) > 1}
    assert not changed, changed
    assert {v for versions in seen.values() for v in versions} == {fleet.base_version, CANARY}
