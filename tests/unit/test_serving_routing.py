"""The router's pure decisions: split, stickiness, LRU/TTL, ejection, least outstanding, body splicing."""

from __future__ import annotations

import json
import random

import pytest

from serving.proxy.router import redact, splice_tag, sse_error
from serving.proxy.routing import (
    DeploymentEntry,
    PinEntry,
    ReplicaHealth,
    ReplicaRow,
    RoutingTable,
    StickyTable,
    build_routes,
    decide,
    least_outstanding,
    pick_role,
    routable,
    served_model_name,
    session_bucket,
)

A, B, C = "http://a:1", "http://b:2", "http://c:3"


def table(canary_weight: float | None = 0.5, replicas: list[tuple[str, str, str | None]] | None = None) -> RoutingTable:
    deployments = {"stable": DeploymentEntry("stable", "v1", 1.0, 1)}
    if canary_weight is not None:
        deployments["canary"] = DeploymentEntry("canary", "v2", canary_weight, 2)
    rows = replicas if replicas is not None else [(A, "serving", "v1"), (B, "serving", "v2")]
    return RoutingTable(deployments=deployments, replicas=tuple(ReplicaRow(u, s, v) for u, s, v in rows))


def healthy(t: RoutingTable, reported: dict[str, str | None] | None = None) -> dict[str, ReplicaHealth]:
    out = {}
    for row in t.replicas:
        h = ReplicaHealth(2)
        h.probe_ok((reported or {}).get(row.url, row.policy_version))
        out[row.url] = h
    return out


def test_buckets_are_deterministic_and_roughly_uniform() -> None:
    assert session_bucket("s-1") == session_bucket("s-1") != session_bucket("s-2")
    buckets = [session_bucket(f"session-{i}") for i in range(20_000)]
    assert all(0.0 <= b < 1.0 for b in buckets)
    share = sum(b < 0.25 for b in buckets) / len(buckets)
    assert 0.23 < share < 0.27


def test_raising_the_canary_weight_only_moves_sessions_from_stable_to_canary() -> None:
    sessions = [f"s{i}" for i in range(5000)]
    weights = [0.0, 0.05, 0.25, 0.5, 1.0]
    roles = {w: [pick_role(session_bucket(s), w) for s in sessions] for w in weights}
    for low, high in zip(weights, weights[1:]):
        moved_back = sum(a == "canary" and b == "stable" for a, b in zip(roles[low], roles[high]))
        assert moved_back == 0
    assert roles[0.0].count("canary") == 0 and roles[1.0].count("stable") == 0
    assert 0.45 < roles[0.5].count("canary") / len(sessions) < 0.55


def test_a_replica_serving_its_version_as_a_lora_adapter_is_routable() -> None:
    """A LoRA swap loads the adapter beside the base: the weight version stays the base's, and the
    replica serves the row's version under the adapter's name (listed by ``/v1/models``)."""
    t = table(replicas=[(A, "serving", "c1-lora"), (B, "serving", "c1-lora")])
    with_adapter, without = ReplicaHealth(2), ReplicaHealth(2)
    with_adapter.probe_ok("base-1", ["base-1", "c1-lora"])
    without.probe_ok("base-1", ["base-1"])
    assert routable(t.replicas[0], with_adapter)
    assert not routable(t.replicas[1], without)


def test_a_lora_canary_loaded_beside_the_base_gets_routes() -> None:
    """A LoRA swap leaves the row's version on the base and lists the adapter in /v1/models."""
    t = table(replicas=[(A, "serving", "v1"), (B, "serving", "v1")])  # canary v2 is an adapter on B
    health = healthy(t)
    health[B].probe_ok("v1", ["v1", "v2", "old-adapter"])
    routes = build_routes(t, health)
    assert {v: [r.url for r in views] for v, views in routes.by_version.items()} == {"v1": [A, B], "v2": [B]}
    assert routes.role_of("v2") == "canary"


def test_the_served_base_name_is_not_an_adapter() -> None:
    """A full swap reloads weights under the same served name: that replica must not take the stable's traffic."""
    t = table(replicas=[(A, "serving", "v1"), (B, "serving", "v2")])
    health = healthy(t)
    health[B].probe_ok("v2", ["v1"])  # served as "v1" (the base name), weights of v2
    routes = build_routes(t, health)
    assert {v: [r.url for r in views] for v, views in routes.by_version.items()} == {"v1": [A], "v2": [B]}


def test_routable_needs_serving_row_passing_probe_and_matching_weight_version() -> None:
    t = table(replicas=[(A, "serving", "v1"), (B, "draining", "v1"), (C, "serving", "v1")])
    health = healthy(t, {C: "v0"})
    assert [routable(r, health[r.url]) for r in t.replicas] == [True, False, False]
    assert not routable(t.replicas[0], None)
    assert not routable(t.replicas[0], ReplicaHealth(2))  # never probed


def test_ejection_state_machine() -> None:
    h = ReplicaHealth(eject_after=3)
    h.probe_ok("v1")
    assert h.healthy
    assert not h.failure("refused") and not h.failure("refused") and h.healthy
    h.request_ok()  # a real answer resets the count
    assert not h.failure("x") and not h.failure("x")
    assert h.failure("x") and h.ejected and not h.healthy  # third consecutive failure ejects
    assert not h.failure("x")  # already ejected: no second ejection
    h.request_ok()
    assert h.ejected  # only a probe brings it back
    assert h.probe_ok("v1") and h.healthy and h.failures == 0
    assert not h.probe_ok("v1")  # not a rejoin when it was not ejected
    with pytest.raises(ValueError):
        ReplicaHealth(0)


def test_sticky_table_lru_and_ttl() -> None:
    sticky = StickyTable(ttl_s=10.0, max_sessions=3)
    for i, s in enumerate("abc"):
        sticky.put(s, f"v{i}", now=0.0)
    assert sticky.get("a", now=1.0) == "v0"  # touch a: b is now the least recently used
    sticky.put("d", "v3", now=2.0)
    assert len(sticky) == 3 and sticky.get("b", now=2.0) is None
    assert sticky.get("a", now=10.5) == "v0"  # touched at 1.0 (+10), again now
    assert sticky.get("c", now=10.5) is None  # last used at 0.0: expired
    sticky.put("e", "v4", now=30.0)  # everything older expires on the way
    assert len(sticky) == 1 and sticky.get("e", now=30.0) == "v4"
    sticky.put("e", "v5", now=31.0)
    assert sticky.get("e", now=31.0) == "v5"


def test_sessions_stay_on_their_version_while_the_weight_changes() -> None:
    sticky = StickyTable(3600, 1000)
    routes = build_routes(table(0.5), healthy(table(0.5)))
    first = {f"s{i}": decide(routes, f"s{i}", sticky, 0.0).policy_version for i in range(400)}
    assert set(first.values()) == {"v1", "v2"}
    for weight in (0.0, 1.0, 0.3):
        t = table(weight)
        routes = build_routes(t, healthy(t))
        for s, version in first.items():
            d = decide(routes, s, sticky, 1.0)
            assert d.policy_version == version and d.sticky


def test_a_rolled_back_canary_moves_its_sessions_to_stable() -> None:
    sticky = StickyTable(3600, 1000)
    t = table(1.0)
    decision = decide(build_routes(t, healthy(t)), "s", sticky, 0.0)
    assert (decision.policy_version, decision.role) == ("v2", "canary")
    rolled_back = table(None, replicas=[(A, "serving", "v1"), (B, "serving", "v1")])
    decision = decide(build_routes(rolled_back, healthy(rolled_back)), "s", sticky, 1.0)
    assert (decision.policy_version, decision.role, decision.sticky) == ("v1", "stable", False)
    assert sticky.get("s", 2.0) == "v1"


def test_requests_without_a_session_are_split_per_request() -> None:
    t = table(0.25)
    routes = build_routes(t, healthy(t))
    rng = random.Random(7)
    picks = [decide(routes, None, StickyTable(10, 100), 0.0, rng).policy_version for _ in range(4000)]
    assert 0.22 < picks.count("v2") / len(picks) < 0.28


def test_fallbacks_when_a_version_has_no_routable_replica() -> None:
    sticky = StickyTable(3600, 1000)
    t = table(1.0, replicas=[(A, "serving", "v1"), (B, "swapping", "v2")])
    d = decide(build_routes(t, healthy(t)), "s", sticky, 0.0)
    assert d.policy_version == "v1"  # canary has no replica: stable
    t = table(0.0, replicas=[(A, "serving", "v0")])  # mid-promotion: only an old version answers
    assert decide(build_routes(t, healthy(t)), None, sticky, 0.0).policy_version == "v0"
    t = table(0.0, replicas=[(A, "failed", "v1")])
    assert decide(build_routes(t, healthy(t)), "x", sticky, 0.0) is None


def test_canary_weight_is_zero_without_a_distinct_canary() -> None:
    assert table(None).canary_weight == 0.0
    same = RoutingTable(
        deployments={"stable": DeploymentEntry("stable", "v1", 1.0), "canary": DeploymentEntry("canary", "v1", 0.5)},
        replicas=(),
    )
    assert same.canary_weight == 0.0
    assert table(1.7).canary_weight == 1.0


def pinned_table(replicas: list[tuple[str, str, str | None]] | None = None) -> RoutingTable:
    rows = replicas if replicas is not None else [(A, "serving", "v1"), (B, "serving", "v2"), (C, "serving", "v0")]
    pins = {"subagent": PinEntry("subagent", "v0", 3)}
    return RoutingTable(
        deployments=table(0.5).deployments, replicas=tuple(ReplicaRow(u, s, v) for u, s, v in rows), pins=pins
    )


def test_a_pinned_role_gets_its_version_and_leaves_the_session_where_it_was() -> None:
    t = pinned_table()
    routes = build_routes(t, healthy(t))
    sticky = StickyTable(ttl_s=60, max_sessions=100)
    sessions = [f"s{i}" for i in range(200)]
    first = {s: decide(routes, s, sticky, 0.0).policy_version for s in sessions}
    assert set(first.values()) == {"v1", "v2"}  # the split, never the pinned version
    for s in sessions:
        pinned = decide(routes, s, sticky, 1.0, agent_role="subagent")
        assert (pinned.policy_version, pinned.pin, pinned.sticky) == ("v0", t.pins["subagent"], False)
        assert decide(routes, s, sticky, 2.0, agent_role="orchestrator").policy_version == first[s]
        assert decide(routes, s, sticky, 3.0).policy_version == first[s]
    assert decide(routes, None, sticky, 4.0, agent_role="subagent").policy_version == "v0"


def test_a_pinned_role_without_a_routable_replica_is_not_sent_elsewhere() -> None:
    t = pinned_table([(A, "serving", "v1"), (B, "serving", "v2"), (C, "draining", "v0")])
    routes = build_routes(t, healthy(t))
    assert "v0" not in routes.by_version
    decision = decide(routes, "s1", StickyTable(ttl_s=60, max_sessions=100), 0.0, agent_role="subagent")
    assert decision.policy_version == "v0" and decision.pin is not None  # the router waits for it, then 503


def test_a_pinned_lora_adapter_loaded_beside_the_base_gets_routes() -> None:
    t = pinned_table([(A, "serving", "v1"), (B, "serving", "v1")])
    health = healthy(t)
    for h in health.values():
        h.probe_ok("v1", ["base", "v0"])
    routes = build_routes(t, health)
    assert sorted(v.url for v in routes.by_version["v0"]) == [A, B]


def test_least_outstanding_within_a_version() -> None:
    t = table(0.0, replicas=[(A, "serving", "v1"), (B, "serving", "v1"), (C, "serving", "v1")])
    views = build_routes(t, healthy(t)).by_version["v1"]
    assert least_outstanding(views, {A: 3, B: 1, C: 2}).url == B
    assert least_outstanding(views, {A: 3, B: 1, C: 2}, exclude={B}).url == C
    assert least_outstanding(views, {}, exclude={A, B, C}) is None
    ties = {least_outstanding(views, {A: 1}, rng=random.Random(i)).url for i in range(50)}
    assert ties == {B, C}


def test_served_model_name() -> None:
    assert served_model_name(["base-1", "ckpt-7"], "ckpt-7") == "ckpt-7"  # a LoRA adapter served by name
    assert served_model_name(["base-1"], "ckpt-7") == "base-1"  # full weights under the base name
    assert served_model_name(None, "ckpt-7") is None


def test_splice_tag_keeps_the_body_valid_json() -> None:
    tag = b',"flywheel":{"policy_version":"v1","replica":"r"}}'
    body = json.loads(splice_tag(b'{"id": "x", "choices": []}\n', tag))
    assert body == {"id": "x", "choices": [], "flywheel": {"policy_version": "v1", "replica": "r"}}
    assert json.loads(splice_tag(b"{ }", tag)) == {"flywheel": {"policy_version": "v1", "replica": "r"}}
    assert splice_tag(b"[1]", tag) == b"[1]"


def test_redact_keeps_replica_addresses_from_clients() -> None:
    refused = "Cannot connect to host 10.0.0.5:8000 ssl:default [Connect call failed ('10.0.0.5', 8000)]"
    assert redact(refused, "http://10.0.0.5:8000", "replica 4") == (
        "Cannot connect to host replica 4 ssl:default [Connect call failed <address>]"
    )
    by_name = "Cannot connect to host vllm-0:8000 ssl:default [Connect call failed ('172.18.0.5', 8000)]"
    assert redact(by_name, "http://vllm-0:8000", "replica 4") == (
        "Cannot connect to host replica 4 ssl:default [Connect call failed <address>]"
    )
    v6 = "Cannot connect to host [::1]:8000 ssl:default [Connect call failed ('::1', 8000, 0, 0)]"
    assert redact(v6, "http://[::1]:8000", "replica 4") == (
        "Cannot connect to host replica 4 ssl:default [Connect call failed <address>]"
    )
    untouched = "HTTP 500: choices[0] failed [Errno 111]; vllm-base is not vllm"
    assert redact(untouched, "http://vllm:8000", "replica 4") == (
        "HTTP 500: choices[0] failed [Errno 111]; vllm-base is not replica 4"
    )


def test_clients_see_replica_ids_never_urls() -> None:
    """Headers, the body tag, ``/ready``, the unroutable reason and a stream's error event name ids."""
    import aiohttp

    from flywheel.core.settings import Settings
    from serving.proxy.router import Router

    up, down = "http://vllm-0:8000", "http://10.1.2.3:8001"
    router = Router(Settings())
    router.table_loaded = True
    rows = (ReplicaRow(up, "serving", "v1", 7), ReplicaRow(down, "serving", "v1", 8))
    router.apply_table(RoutingTable({"stable": DeploymentEntry("stable", "v1", 1.0, 1)}, rows))
    router.health[up].probe_ok("v1", ["v1"])
    for _ in range(router.cfg.eject_after_failures):
        router.health[down].failure(
            "ClientConnectorError: Cannot connect to host 10.1.2.3:8001 ssl:default "
            "[Connect call failed ('10.1.2.3', 8001)]"
        )
    router.rebuild()

    status, body = router.ready_body()
    assert status == 200 and json.loads(body) == {"status": "ready", "routable": {"v1": ["7"]}}
    attempt = router._attempt(up, "v1")
    assert attempt.headers == [(b"x-flywheel-policy-version", b"v1"), (b"x-flywheel-replica", b"7")]
    assert json.loads(splice_tag(b"{}", attempt.tag)) == {"flywheel": {"policy_version": "v1", "replica": "7"}}
    why = router.why_unroutable()
    assert why == (
        "replica 7 tried already; replica 8 ejected (ClientConnectorError: Cannot connect to host replica 8 "
        "ssl:default [Connect call failed <address>])"
    )
    event = sse_error(attempt, aiohttp.ServerDisconnectedError(f"{up} went away"))
    message = json.loads(event.removeprefix(b"data: "))["error"]["message"]
    assert message == (
        "the replica 7 serving policy version v1 failed mid-stream: ServerDisconnectedError: replica 7 went away"
    )


async def test_the_app_answers_only_its_allow_list_with_reasons() -> None:
    """The ASGI app without replicas: the allow-list, keys, size and JSON checks, readiness (no upstream needed)."""
    import httpx
    from prometheus_client import generate_latest

    from flywheel.core.auth import KeyInfo, hash_token
    from flywheel.core.settings import Settings
    from serving.proxy.router import create_app

    base = Settings()
    serving = base.serving.model_copy(update={"refresh_s": 0.05, "health_timeout_s": 0.05, "max_request_bytes": 4096})
    app = create_app(base.model_copy(update={"serving": serving}))
    key = "fwp_" + "k" * 32
    auth = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        for method, path in [("POST", "/pause"), ("POST", "/collective_rpc"), ("GET", "/weight_info"),
                             ("GET", "/metrics"), ("GET", "/router/metrics"), ("POST", "/v1/load_lora_adapter"),
                             ("POST", "/tokenize"), ("GET", "/")]:  # fmt: skip
            response = await client.request(method, path, headers=auth)
            assert response.status_code == 404 and "no route" in response.json()["error"]["message"], path
        assert (await client.get("/v1/completions")).status_code == 405
        assert (await client.post("/health")).status_code == 405
        missing = await client.post("/v1/completions", json={"prompt": "x"})
        assert missing.status_code == 401 and "missing product key" in missing.json()["error"]["message"]
        assert missing.headers["www-authenticate"] == "Bearer"
        assert (await client.get("/v1/models")).status_code == 401
        never_read = await client.post("/v1/completions", json={"prompt": "x"}, headers=auth)
        assert never_read.status_code == 503 and "key table was never read" in never_read.json()["error"]["message"]

        app.router.apply_keys({hash_token(key): KeyInfo(1, "agent", "product", "p", key[:12])})
        too_big = await client.post("/v1/completions", content=b"x" * 4097, headers=auth)
        assert too_big.status_code == 413
        assert "limit of 4096 bytes (serving.max_request_bytes)" in too_big.json()["error"]["message"]
        bad = await client.post("/v1/chat/completions", content=b"[1, 2", headers=auth)
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        assert (await client.post("/v1/completions", content=b"[1]", headers=auth)).status_code == 400
        assert (await client.get("/health")).json() == {"status": "ok"}
        ready = await client.get("/ready")
        assert ready.status_code == 503 and "never read" in ready.json()["reason"]
        unroutable = await client.post("/v1/completions", json={"prompt": "x"}, headers=auth)
        assert unroutable.status_code == 503 and "no routable replica" in unroutable.json()["error"]["message"]
        models = await client.get("/v1/models", headers=auth)
        assert models.status_code == 200 and models.json() == {"object": "list", "data": []}
        unknown = await client.get("/v1/models", headers={"Authorization": "Bearer fwp_" + "u" * 32})
        assert unknown.status_code == 401 and unknown.json()["error"]["message"] == "unknown product key"
    metrics = generate_latest(app.router.metrics.registry).decode()
    assert 'flywheel_router_refused_total{code="missing_api_key"} 2.0' in metrics
    assert "flywheel_router_rejected_total" in metrics
