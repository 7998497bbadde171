"""The HTTP gateway over a real uvicorn server, with a real Kafka producer and write keys in Postgres."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from conftest import JSON_VALUES, running_gateway, schemathesis_sweep
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from kafka import KafkaConsumer, TopicPartition
from typer.testing import CliRunner

from flywheel.core.auth import create_key, revoke_key
from flywheel.core.contracts import (
    Completion,
    Feedback,
    Message,
    ToolCall,
    Turn,
    dump_event,
    parse_event,
    unknown_fields,
    uuid7,
)
from flywheel.core.contracts.topics import events_topic
from flywheel.core.db.engine import session_factory
from flywheel.core.db.migrate import upgrade
from flywheel.core.settings import Settings
from ingest.cli import app as cli_app
from ingest.gateway import create_app

pytestmark = pytest.mark.integration


@dataclass
class Gateway:
    url: str
    settings: Settings
    pg_url: str
    project: str
    key: str

    def post(self, body, key: str | None = "default", **kw) -> httpx.Response:
        headers = kw.pop("headers", {})
        token = self.key if key == "default" else key
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if not isinstance(body, (bytes, str)) and "content" not in kw:
            kw["json"] = body
        elif "content" not in kw:
            kw["content"] = body
        return httpx.post(f"{self.url}/v1/events", headers=headers, timeout=30, **kw)


def _key(pg_url: str, project: str, role: str = "writer") -> tuple[int, str]:
    with session_factory(pg_url)() as session:
        info, token = create_key(session, name=f"test-{role}", role=role, project=project if role == "writer" else None)
        session.commit()
    return info.id, token


@pytest.fixture(scope="module")
def gateway(kafka_bootstrap: str, pg_url: str) -> Iterator[Gateway]:
    upgrade(pg_url)
    ingest = {"max_body_bytes": 20_000, "max_event_bytes": 4_000, "max_batch_events": 10}
    with running_gateway(
        kafka_bootstrap, pg_url, name="gw", project="proj", key_name="test-writer", ingest=ingest
    ) as run:
        yield Gateway(run.url, run.settings, pg_url, run.project, run.key)


def turn(project: str, session_id: str = "s1", content: str = "hi") -> dict:
    event = Turn(project=project, session_id=session_id, messages=[Message(role="user", content=content)])
    return json.loads(dump_event(event))


def on_topic(gw: Gateway, ids: set[str], timeout_s: float = 30.0) -> dict[str, bytes]:
    """event id → record key of the given events as found on the events topic."""
    return {event_id: key for event_id, (key, _) in records_on_topic(gw, ids, timeout_s).items()}


def records_on_topic(gw: Gateway, ids: set[str], timeout_s: float = 30.0) -> dict[str, tuple[bytes, bytes]]:
    """event id → (record key, record value) of the given events as found on the events topic."""
    topic = events_topic(gw.settings.kafka.topic_prefix)
    consumer = KafkaConsumer(bootstrap_servers=gw.settings.kafka.bootstrap_servers, enable_auto_commit=False)
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        found: dict[str, tuple[bytes, bytes]] = {}
        deadline = time.monotonic() + timeout_s
        while not ids <= set(found) and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                for r in records:
                    found[str(parse_event(r.value).event_id)] = (r.key, r.value)
        return found
    finally:
        consumer.close()


def test_a_valid_batch_is_202_and_on_kafka_keyed_by_session(gateway):
    events = [turn(gateway.project, "a"), turn(gateway.project, "b")]
    response = gateway.post({"events": events})
    assert response.status_code == 202, response.text
    ids = [e["event_id"] for e in events]
    assert response.json() == {"accepted": ids, "rejected": []}
    found = on_topic(gateway, set(ids))
    assert found[ids[0]] == b"a" and found[ids[1]] == b"b"


def test_feedback_by_completion_id_alone_is_accepted_and_keyed_by_the_completion(gateway):
    cid = uuid7()
    unattached = json.loads(dump_event(Feedback(project=gateway.project, kind="revert", completion_id=cid)))
    assert "session_id" not in unattached
    neither = {k: v for k, v in unattached.items() if k != "completion_id"}
    response = gateway.post({"events": [unattached, neither]})
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["accepted"] == [unattached["event_id"]]
    [rejected] = body["rejected"]
    assert (rejected["index"], rejected["field"]) == (1, "session_id")
    assert "required unless completion_id is set" in rejected["reason"]
    found = on_topic(gateway, {unattached["event_id"]})
    assert found[unattached["event_id"]] == str(cid).encode()


def test_a_mixed_batch_is_422_naming_each_bad_event_while_the_good_ones_are_accepted(gateway):
    good = [turn(gateway.project, "m1"), turn(gateway.project, "m2")]
    bad_role = turn(gateway.project)
    bad_role["messages"][0]["role"] = "robot"
    big = json.loads(dump_event(Feedback(project=gateway.project, session_id="m1", kind="follow_up", text="x" * 5000)))
    foreign = turn("someone-else")
    items = [good[0], bad_role, {"type": "turn"}, big, foreign, good[1]]
    response = gateway.post({"events": items})
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["accepted"] == [good[0]["event_id"], good[1]["event_id"]]
    rejected = {r["index"]: r for r in body["rejected"]}
    assert set(rejected) == {1, 2, 3, 4}
    assert rejected[1]["field"] == "messages.0.role" and rejected[1]["event_id"] == bad_role["event_id"]
    assert rejected[2]["field"] == "schema_version" and rejected[2]["event_id"] is None
    assert "over the limit ingest.max_event_bytes = 4000" in rejected[3]["reason"]
    assert rejected[4]["reason"] == f"write key is scoped to project {gateway.project}"
    found = on_topic(gateway, set(body["accepted"]))
    assert set(body["accepted"]) <= set(found)
    assert bad_role["event_id"] not in found and foreign["event_id"] not in found


def test_unknown_fields_of_a_newer_sdk_are_202_and_forwarded_with_the_fields(gateway, caplog):
    """Forward compatibility (docs/contracts.md): unknown fields, top level or nested, are accepted and kept."""
    completion = Completion(
        project=gateway.project,
        session_id="fc",
        model="m",
        policy_version="v1",
        prompt_messages=[Message(role="user", content="2+2?")],
        completion_text="4",
        tool_calls=[ToolCall(id="c1", name="calc")],
    )
    newer = json.loads(dump_event(completion))
    newer["trace_id"] = "abc"
    newer["prompt_messages"][0]["audio"] = {"id": "a1"}
    newer["tool_calls"][0]["index"] = 0
    newer["sampling"]["typical_p"] = 0.9
    newer["span"]["depth"] = 1
    also = turn(gateway.project, "fc")
    also["messages"][0]["annotations"] = [{"kind": "pii", "start": 0}]
    bad = json.loads(json.dumps(newer))  # the same newer event with a known field's value wrong
    bad["event_id"], bad["sampling"]["temperature"] = str(uuid7()), "hot"
    counted = unknown_counted(gateway)
    with caplog.at_level("DEBUG", logger="ingest.gateway"):
        ok = gateway.post({"events": [newer, also]})
    assert ok.status_code == 202, ok.text
    assert ok.json() == {"accepted": [newer["event_id"], also["event_id"]], "rejected": []}
    assert any("trace_id" in r.getMessage() and "sampling.typical_p" in r.getMessage() for r in caplog.records)
    refused = gateway.post({"events": [bad]})
    assert refused.status_code == 422, refused.text
    [rejected] = refused.json()["rejected"]
    assert rejected["field"] == "sampling.temperature" and "valid number" in rejected["reason"]
    found = records_on_topic(gateway, {newer["event_id"], also["event_id"]})
    key, value = found[newer["event_id"]]
    assert key == b"fc" and json.loads(value) == newer  # forwarded with every field it came with
    assert unknown_fields(parse_event(value)) == [
        "trace_id",
        "span.depth",
        "prompt_messages.0.audio",
        "tool_calls.0.index",
        "sampling.typical_p",
    ]
    assert json.loads(found[also["event_id"]][1])["messages"][0]["annotations"] == [{"kind": "pii", "start": 0}]
    assert unknown_counted(gateway) == counted + 2  # both accepted events, not the refused one


def unknown_counted(gw: Gateway) -> float:
    """The gateway's flywheel_ingest_unknown_fields_total{stage="gateway"} (0 before its first count)."""
    _, ops = _key(gw.pg_url, gw.project, role="viewer")
    metrics = httpx.get(f"{gw.url}/metrics", headers={"Authorization": f"Bearer {ops}"}).text
    prefix = 'flywheel_ingest_unknown_fields_total{stage="gateway"} '
    return next((float(line[len(prefix) :]) for line in metrics.splitlines() if line.startswith(prefix)), 0.0)


def test_only_foreign_events_is_403(gateway):
    response = gateway.post({"events": [turn("other-project"), turn("other-project")]})
    assert response.status_code == 403
    assert response.json()["accepted"] == [] and len(response.json()["rejected"]) == 2


def test_missing_unknown_and_revoked_keys_are_401_and_ops_tokens_403(gateway):
    body = {"events": [turn(gateway.project)]}
    assert gateway.post(body, key=None).status_code == 401
    assert gateway.post(body, key="fwk_" + "x" * 32).status_code == 401
    assert gateway.post(body, headers={"Authorization": "Basic abc"}, key=None).status_code == 401
    key_id, token = _key(gateway.pg_url, gateway.project)
    assert gateway.post(body, key=token).status_code == 202
    with session_factory(gateway.pg_url)() as session:
        revoke_key(session, key_id)
        session.commit()
    deadline = time.monotonic() + 10  # the gateway caches keys briefly (1 s here): a revocation shows within it
    status = 202
    while status == 202 and time.monotonic() < deadline:
        status = gateway.post(body, key=token).status_code
        time.sleep(0.5)
    assert status == 401
    _, ops = _key(gateway.pg_url, gateway.project, role="operator")
    response = gateway.post(body, key=ops)
    assert response.status_code == 403 and "cannot write events" in response.json()["detail"]


def test_oversize_bodies_and_batches_are_413(gateway):
    big = {"events": [turn(gateway.project, content="y" * 3000) for _ in range(8)]}  # ~26 KB > 20 KB
    assert gateway.post(big).status_code == 413

    def chunks():  # no Content-Length: the streamed size is what counts
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 4096):
            yield payload[i : i + 4096]

    assert gateway.post(None, content=chunks()).status_code == 413
    many = {"events": [turn(gateway.project) for _ in range(11)]}
    response = gateway.post(many)
    assert response.status_code == 413 and "over the limit ingest.max_batch_events = 10" in response.json()["detail"]
    assert gateway.post(b"{not json", headers={"Content-Type": "application/json"}).status_code == 400


def test_openapi_and_metrics_are_served_behind_a_key(gateway):
    writer = {"Authorization": f"Bearer {gateway.key}"}
    _, ops = _key(gateway.pg_url, gateway.project, role="viewer")
    viewer = {"Authorization": f"Bearer {ops}"}
    spec = httpx.get(f"{gateway.url}/openapi.json", headers=writer).json()
    responses = spec["paths"]["/v1/events"]["post"]["responses"]
    assert {"202", "401", "403", "413", "422"} <= set(responses)
    assert (
        "events"
        in spec["paths"]["/v1/events"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    )
    assert httpx.get(f"{gateway.url}/docs", headers=viewer).status_code == 200
    metrics = httpx.get(f"{gateway.url}/metrics", headers=viewer).text  # they name projects: not for write keys
    assert f'flywheel_ingest_accepted_total{{project="{gateway.project}"}}' in metrics
    assert "flywheel_ingest_rejected_total" in metrics
    refused = httpx.get(f"{gateway.url}/metrics", headers=writer)
    assert refused.status_code == 403 and "ops token" in refused.json()["detail"]


def test_every_route_but_healthz_refuses_a_request_without_a_valid_key(gateway):
    """Enumerates the app's routes, so a route added without the key check fails here."""
    import re

    from ingest.gateway import PUBLIC_PATHS

    app = create_app(gateway.settings, producer=None, db_url=gateway.pg_url)
    routes = [(m, r.path) for r in app.routes for m in sorted(getattr(r, "methods", None) or {"GET"}) if m != "HEAD"]
    checked = 0
    for method, path in routes:
        if path in PUBLIC_PATHS:
            continue
        url = gateway.url + re.sub(r"\{[^}]+\}", "1", path)
        for headers in ({}, {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": "Bearer fwk_" + "x" * 32}):
            response = httpx.request(method, url, headers=headers, json={"events": []}, timeout=30)
            assert response.status_code == 401, (method, path, headers, response.status_code)
            assert response.json()["detail"] and response.headers["www-authenticate"] == "Bearer"
        checked += 1
    assert checked >= 4  # /v1/events, /metrics, /openapi.json, /docs
    assert httpx.get(f"{gateway.url}/healthz").status_code == 200


def test_schemathesis_on_the_gateway_finds_no_5xx_and_every_refusal_says_why(gateway, fault_figures):
    """schemathesis over the gateway's own OpenAPI (served to the key), valid and
    schema-violating input, with the project's write key (see ``conftest.schemathesis_sweep``);
    the valid events it generates are accepted and reach the topic."""
    import schemathesis

    writer = {"Authorization": f"Bearer {gateway.key}"}
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json", headers=writer)
    seen, failures, unnegatable = schemathesis_sweep(schema, writer, max_examples=25, base_url=gateway.url)
    fault_figures(unit="requests", bad_inputs=seen["refused"], server_errors=seen["server_errors"])
    assert not failures, "\n\n".join(failures)
    assert seen["server_errors"] == 0 and seen["refused"] > 10, seen
    assert "/v1/events" not in unnegatable, unnegatable


def test_keys_cli_creates_lists_and_revokes(gateway):
    runner = CliRunner()
    args = ["keys", "create", "--project", gateway.project, "--name", "cli", "--db-url", gateway.pg_url]
    created = runner.invoke(cli_app, args)
    assert created.exit_code == 0, created.output
    token = created.stdout.strip().splitlines()[-1]
    assert token.startswith("fwk_")
    assert gateway.post({"events": [turn(gateway.project)]}, key=token).status_code == 202
    listed = runner.invoke(cli_app, ["keys", "list", "--project", gateway.project, "--db-url", gateway.pg_url])
    line = next(line for line in listed.stdout.splitlines() if " cli " in line)
    assert token not in listed.stdout and token[:12] in line and "active" in line
    key_id = line.split()[0]
    revoked = runner.invoke(cli_app, ["keys", "revoke", key_id, "--db-url", gateway.pg_url])
    assert revoked.exit_code == 0, revoked.output
    listed = runner.invoke(cli_app, ["keys", "list", "--project", gateway.project, "--db-url", gateway.pg_url])
    assert "revoked" in next(line for line in listed.stdout.splitlines() if line.split()[0] == key_id)
    assert runner.invoke(cli_app, ["keys", "revoke", "999999999", "--db-url", gateway.pg_url]).exit_code == 1


# -- bad input, generated: no 5xx, every refusal says why, the valid events get through -------------

FIELDS = ["event_id", "type", "schema_version", "project", "session_id", "occurred_at", "messages"]


def _nested(depth: int) -> object:
    value: object = "deep"
    for _ in range(depth):
        value = [value]
    return value


@st.composite
def bad_item(draw: st.DrawFn, project: str) -> object:
    """One event the gateway must refuse (or, for a few mutations, may accept: a value that happens to be valid)."""
    item = turn(project, f"fz-{uuid.uuid4().hex[:8]}")
    kind = draw(st.sampled_from(["drop", "replace", "version", "future", "past", "foreign", "deep", "scalar", "big"]))
    if kind == "drop":
        del item[draw(st.sampled_from(FIELDS))]
    elif kind == "replace":
        item[draw(st.sampled_from(FIELDS))] = draw(JSON_VALUES)
    elif kind == "version":
        item["schema_version"] = draw(st.integers().filter(lambda v: v != 1) | st.text(max_size=4))
    elif kind == "future":
        item["occurred_at"] = "2999-01-01T00:00:00Z"
    elif kind == "past":
        item["occurred_at"] = draw(st.sampled_from(["0001-01-01T00:00:00Z", "1900-13-40T00:00:00Z", "yesterday"]))
    elif kind == "foreign":
        item["project"] = "another-project"
    elif kind == "deep":
        item["messages"][0]["content"] = _nested(draw(st.integers(50, 400)))
    elif kind == "big":
        item["messages"][0]["content"] = "z" * 5_000  # over max_event_bytes (4,000 here)
    else:
        return draw(JSON_VALUES)
    return item


BAD_BODIES = [
    b"\xff\xfe\x00 not utf-8 \xc3\x28",
    b'{"events": [' * 5_000,  # deeply nested JSON
    b"[" * 100_000,
    b"",
    b"null",
    b'{"events": "not a list"}',
    b'{"events": [], "extra": 1}',
    b'{"events": [{"type": "turn"}]' + b" " * 30_000 + b"}",  # oversize body
]


def _check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    body = response.json()
    if response.status_code in (202, 403, 422):
        assert all(r["reason"] for r in body["rejected"]), body
    elif response.status_code >= 400:
        assert body["detail"], body


def test_generated_bad_input_never_gets_a_5xx_and_valid_events_in_the_batch_are_kept(gateway, fault_figures):
    stats = {"bad": 0, "server_errors": 0, "valid": 0}
    accepted: set[str] = set()
    valid_sent: set[str] = set()

    @hypothesis_settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(batch=st.lists(st.tuples(st.booleans(), st.data()), min_size=1, max_size=8))
    def one_batch(batch: list) -> None:
        items, valid_ids = [], []
        for is_valid, data in batch:
            if is_valid:
                item = turn(gateway.project, f"fz-{uuid.uuid4().hex[:8]}", data.draw(st.text(max_size=40)))
                valid_ids.append(item["event_id"])
            else:
                item = data.draw(bad_item(gateway.project))
                stats["bad"] += 1
            items.append(item)
        response = gateway.post({"events": items})
        stats["server_errors"] += response.status_code >= 500
        _check_answer(response)
        if valid_ids:
            assert response.status_code in (202, 422), response.text
            got = response.json()["accepted"]
            assert set(valid_ids) <= set(got), "a valid event in a mixed batch was dropped"
            accepted.update(got)
            valid_sent.update(valid_ids)
        stats["valid"] += len(valid_ids)

    one_batch()
    for raw in BAD_BODIES:
        response = gateway.post(raw, headers={"Content-Type": "application/json"})
        stats["bad"] += 1
        stats["server_errors"] += response.status_code >= 500
        _check_answer(response)
        assert response.status_code in (400, 413), (raw[:40], response.status_code, response.text)
    found = on_topic(gateway, valid_sent, timeout_s=60)
    fault_figures(unit="events", sent=len(valid_sent), stored=len(valid_sent & set(found)),
                  distinct=len(valid_sent & set(found)), bad_inputs=stats["bad"],
                  server_errors=stats["server_errors"])  # fmt: skip
    assert stats["server_errors"] == 0
    assert valid_sent <= set(found), f"{len(valid_sent - set(found))} accepted valid events are not on Kafka"
    assert stats["bad"] >= 60
