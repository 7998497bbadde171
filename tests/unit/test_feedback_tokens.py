"""Feedback tokens (flywheel.core.feedback_tokens) and the gateway's feedback route without a server or
database: mint and verify, tampering, expiry, wrong and revoked keys, kinds, binding, idempotent ids, CORS."""

from __future__ import annotations

import base64
import json
import math
import time
import uuid

import pytest
from fastapi.testclient import TestClient

from flywheel import Flywheel
from flywheel.core import feedback_tokens as ft
from flywheel.core.contracts import parse_event, uuid7
from flywheel.core.settings import Settings
from ingest.feedback import SigningKey, SigningKeys, authorize, build_event, cors_headers, decode_body, event_id
from ingest.gateway import create_app

KEY = "fwk_" + "a" * 32
OTHER = "fwk_" + "b" * 32
PAGE = "http://127.0.0.1:8123"
NO_DB = "postgresql+psycopg://nobody@127.0.0.1:1/none"


def keys_of(*keys: tuple[str, str, bool]) -> SigningKeys:
    """An in-memory key index (no database): (write key, project, revoked) each."""
    store = SigningKeys(NO_DB)
    fill(store, *keys)
    return store


def fill(store: SigningKeys, *keys: tuple[str, str, bool]) -> None:
    store._index = {}
    for i, (key, project, revoked) in enumerate(keys):
        digest = ft.key_digest(key)
        store._index.setdefault(ft.key_id(digest), []).append(SigningKey(i, project, digest, revoked))
    store._loaded_at = math.inf  # never re-read


def test_a_minted_token_verifies_with_the_keys_digest_and_carries_its_binding():
    cid = uuid7()
    token = ft.mint(KEY, "demo", session_id="s-1", completion_id=cid, user_id="u@x", ttl_s=60, kinds=["accept"])
    assert token.startswith("fwf1.") and KEY not in token and ft.key_digest(KEY) not in token
    grant = ft.verify(token, ft.key_digest(KEY))
    assert (grant.project, grant.session_id, grant.completion_id, grant.user_id) == ("demo", "s-1", cid, "u@x")
    assert grant.kinds == {"accept"} and grant.expires_at - grant.issued_at == 60
    assert grant.allows("accept") and not grant.allows("reject")
    assert ft.verify(ft.mint(KEY, "demo", session_id="s"), ft.key_digest(KEY)).kinds is None  # every kind


def test_two_tokens_for_the_same_session_differ_by_their_nonce():
    assert ft.mint(KEY, "demo", session_id="s", now=1e9) != ft.mint(KEY, "demo", session_id="s", now=1e9)


def _payload(token: str) -> dict:
    part = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))


def _with_payload(token: str, payload: dict) -> str:
    raw = base64.urlsafe_b64encode(json.dumps(payload, separators=(",", ":")).encode()).rstrip(b"=").decode()
    head, _, sig = token.split(".")
    return f"{head}.{raw}.{sig}"


@pytest.mark.parametrize(
    "change",
    [
        {"s": "someone-else"},
        {"e": 4_000_000_000},
        {"f": ["accept", "reject"]},
        {"p": "other"},
    ],
)
def test_a_tampered_payload_fails_the_signature(change):
    token = ft.mint(KEY, "demo", session_id="s-1", kinds=["accept"])
    forged = _with_payload(token, _payload(token) | change)
    with pytest.raises(ft.TokenError, match="signature is invalid") as err:
        ft.verify(forged, ft.key_digest(KEY))
    assert not err.value.expired


def test_a_tampered_signature_or_a_wrong_key_fails():
    token = ft.mint(KEY, "demo", session_id="s-1")
    head, payload, sig = token.split(".")
    flipped = ("A" if sig[0] != "A" else "B") + sig[1:]
    for bad, digest in ((f"{head}.{payload}.{flipped}", ft.key_digest(KEY)), (token, ft.key_digest(OTHER))):
        with pytest.raises(ft.TokenError, match="signature is invalid"):
            ft.verify(bad, digest)


def test_an_expired_token_says_so_but_only_when_its_signature_holds():
    token = ft.mint(KEY, "demo", session_id="s-1", ttl_s=10, now=1_000_000)
    assert ft.verify(token, ft.key_digest(KEY), now=1_000_009).session_id == "s-1"
    with pytest.raises(ft.TokenError, match="^feedback token expired$") as err:
        ft.verify(token, ft.key_digest(KEY), now=1_000_010)
    assert err.value.expired
    with pytest.raises(ft.TokenError, match="signature") as err:
        ft.verify(token, ft.key_digest(OTHER), now=2_000_000)
    assert not err.value.expired


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        (None, "not a feedback token"),
        ("fwk_abc", "not a feedback token"),
        ("fwf1.", "malformed"),
        ("fwf1.abc", "malformed"),
        ("fwf1.a.b.c", "malformed"),
        ("fwf1.!!!.abc", "base64url"),
        ("fwf1." + base64.urlsafe_b64encode(b"[1]").decode().rstrip("=") + ".abc", "no key id"),
        ("fwf1." + "a" * 3000, "over 2048"),
    ],
)
def test_malformed_tokens_are_refused_with_a_reason(token, reason):
    with pytest.raises(ft.TokenError, match=reason):
        ft.verify(token, ft.key_digest(KEY))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"session_id": None}, "session_id"),
        ({"session_id": "has space"}, "session_id"),
        ({"session_id": "s", "user_id": ""}, "user_id"),
        ({"session_id": None, "completion_id": uuid.uuid4()}, "completion_id"),
        ({"session_id": "s", "completion_id": "nope"}, "completion_id"),
        ({"session_id": "s", "ttl_s": 0}, "ttl_s"),
        ({"session_id": "s", "ttl_s": 31 * 86400}, "ttl_s"),
        ({"session_id": "s", "kinds": ["thumbs"]}, "kinds"),
        ({"session_id": "s", "kinds": []}, "kinds"),
    ],
)
def test_minting_refuses_bad_arguments_by_name(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ft.mint(KEY, "demo", **kwargs)


def test_the_sdk_mints_with_its_write_key_and_project_and_needs_one():
    with Flywheel(project="demo", write_key=KEY, transport="http", gateway_url="http://127.0.0.1:1") as fw:
        with fw.session("s-9") as s:
            token = fw.feedback_token(s, kinds=["accept", "reject"], ttl_s=120)
    grant = ft.verify(token, ft.key_digest(KEY))
    assert (grant.project, grant.session_id, grant.kinds) == ("demo", "s-9", {"accept", "reject"})
    with Flywheel(project="demo", transport="kafka", kafka_bootstrap="127.0.0.1:1") as fw:
        with pytest.raises(ValueError, match="^write_key:"):
            fw.feedback_token("s-9")


# --------------------------------------------------------------------------- the route's logic


def test_authorize_checks_the_key_it_names():
    keys = keys_of((KEY, "demo", False), (OTHER, "other", True))
    grant, digest = authorize(keys, ft.mint(KEY, "demo", session_id="s"))
    assert grant.session_id == "s" and digest == ft.key_digest(KEY)
    cases = [
        (ft.mint(OTHER, "other", session_id="s"), 401, "has been revoked"),
        (ft.mint("fwk_" + "c" * 32, "demo", session_id="s"), 401, "unknown key"),
        (ft.mint(KEY, "other", session_id="s"), 403, "scoped to demo"),
        (ft.mint(KEY, "demo", session_id="s", ttl_s=1, now=time.time() - 5), 401, "feedback token expired"),
        ("garbage", 401, "not a feedback token"),
    ]
    for token, status, reason in cases:
        with pytest.raises(Exception) as err:
            authorize(keys, token)
        assert (err.value.status_code, err.value.field) == (status, "token") and reason in err.value.detail


def test_the_event_is_bound_to_the_token_not_the_body():
    cid = uuid7()
    token = ft.mint(KEY, "demo", session_id="s-1", completion_id=cid, user_id="u-1", kinds=["accept", "score"])
    grant = ft.verify(token, ft.key_digest(KEY))
    event = build_event(grant, {"token": token, "kind": "score", "score": 0.5})
    assert (event.project, event.session_id, event.completion_id, event.user_id) == ("demo", "s-1", cid, "u-1")
    assert event.score == 0.5 and event.sdk.startswith("flywheel-browser/") and event.event_id.version == 7
    assert parse_event(event.model_dump(mode="json")) == event
    with pytest.raises(Exception, match="session_id"):  # the body cannot name another session
        decode_body(json.dumps({"token": token, "kind": "accept", "session_id": "other"}).encode())


def test_kinds_and_values_are_refused_by_name():
    token = ft.mint(KEY, "demo", session_id="s", kinds=["accept", "score"])
    grant = ft.verify(token, ft.key_digest(KEY))
    for data, status, field, reason in [
        ({"kind": "reject"}, 403, "kind", "'reject' is not allowed by this feedback token (allowed: accept, score)"),
        ({"kind": "thumbs"}, 422, "kind", "'thumbs' is not a feedback kind"),
        ({"kind": "score"}, 422, "score", "score: required when kind is 'score'"),
        ({"kind": "score", "score": "high"}, 422, "score", "score"),
        ({"kind": "score", "score": 1e9}, 422, "score", "score"),
    ]:
        with pytest.raises(Exception) as err:
            build_event(grant, {"token": token, **data})
        assert (err.value.status_code, err.value.field) == (status, field), data
        assert reason in err.value.detail


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        (b"{", 400, None),
        (b"[]", 400, None),
        (b'{"kind": "accept"}', 422, "token"),
        (b'{"token": "t"}', 422, "kind"),
        (b'{"token": "t", "kind": "accept", "id": ""}', 422, "id"),
        (b'{"token": "t", "kind": "accept", "project": "x"}', 422, "project"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(body, status, field):
    with pytest.raises(Exception) as err:
        decode_body(body)
    assert (err.value.status_code, err.value.field) == (status, field)


def test_event_ids_repeat_for_a_retry_and_differ_otherwise():
    token = ft.mint(KEY, "demo", session_id="s", now=1_800_000_000)
    one = event_id(token, {"token": token, "kind": "accept"}, 1_800_000_000)
    assert one == event_id(token, {"kind": "accept", "token": token}, 1_800_000_000)
    assert one.version == 7 and one.int >> 80 == 1_800_000_000_000
    others = {
        event_id(token, {"token": token, "kind": "reject"}, 1_800_000_000),
        event_id(token, {"token": token, "kind": "accept", "id": "click-2"}, 1_800_000_000),
        event_id(ft.mint(KEY, "demo", session_id="s"), {"kind": "accept"}, 1_800_000_000),
    }
    assert one not in others and len(others) == 3
    with_id = event_id(token, {"token": token, "kind": "accept", "id": "c"}, 1)
    assert with_id == event_id(token, {"token": token, "kind": "reject", "id": "c"}, 1)  # the id decides


def test_cors_headers_only_for_configured_origins():
    allowed = frozenset({PAGE})
    assert cors_headers(PAGE, allowed)["Access-Control-Allow-Origin"] == PAGE
    assert "Access-Control-Allow-Origin" not in cors_headers("http://127.0.0.1:9", allowed)
    assert "Access-Control-Allow-Origin" not in cors_headers(None, allowed)


def test_origins_setting_refuses_what_is_not_an_origin():
    assert Settings(ingest={"feedback_cors_origins": [PAGE, "https://[::1]:8443"]}).ingest.feedback_cors_origins
    for bad in ("*", "https://app.example.com/", "app.example.com", "ftp://x"):
        with pytest.raises(ValueError, match="is not a web origin"):
            Settings(ingest={"feedback_cors_origins": [bad]})


# --------------------------------------------------------------------------- the route in the app


class Ack:
    def get(self, timeout=None):
        return None


class Acked:
    """A producer whose every record is acknowledged at once (kafka-python's future API)."""

    def __init__(self):
        self.sent: list[tuple[str, bytes, bytes]] = []

    def send(self, topic, value=None, key=None):
        self.sent.append((topic, key, value))
        return Ack()

    def close(self, timeout=None):
        pass


@pytest.fixture
def app_client():
    producer = Acked()
    settings = Settings(environment="test", ingest={"feedback_cors_origins": [PAGE]})
    app = create_app(settings, producer=producer, db_url=NO_DB)
    fill(app.state.feedback_keys, (KEY, "demo", False))
    with TestClient(app) as client:
        yield client, producer


def test_the_route_produces_the_bound_event_keyed_by_session_and_answers_cors(app_client):
    client, producer = app_client
    token = ft.mint(KEY, "demo", session_id="s-7", kinds=["accept"])
    answer = client.post("/v1/feedback", json={"token": token, "kind": "accept"}, headers={"Origin": PAGE})
    assert answer.status_code == 202, answer.text
    assert answer.headers["access-control-allow-origin"] == PAGE
    ((topic, key, value),) = producer.sent
    event = parse_event(value)
    assert key == b"s-7" and topic.endswith("events") and str(event.event_id) == answer.json()["event_id"]
    again = client.post("/v1/feedback", json={"token": token, "kind": "accept"})  # no Origin: a backend
    assert again.status_code == 202 and again.json() == answer.json()  # a retry is the same event


def test_the_preflight_allows_the_configured_origin_only_and_events_stay_same_origin(app_client):
    client, producer = app_client
    ask = {"Origin": PAGE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    ok = client.options("/v1/feedback", headers=ask)
    assert ok.status_code == 204 and ok.headers["access-control-allow-origin"] == PAGE
    assert "content-type" in ok.headers["access-control-allow-headers"]
    other = client.options("/v1/feedback", headers=ask | {"Origin": "http://evil.example"})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    events = client.options("/v1/events", headers=ask)
    assert "access-control-allow-origin" not in events.headers
    token = ft.mint(KEY, "demo", session_id="s")
    refused = client.post("/v1/feedback", json={"token": token, "kind": "accept"},
                          headers={"Origin": "http://evil.example"})  # fmt: skip
    assert refused.status_code == 403 and "origin http://evil.example is not allowed" in refused.json()["detail"]
    plain = client.post("/v1/feedback", content=json.dumps({"token": token, "kind": "accept"}),
                        headers={"Content-Type": "text/plain", "Origin": PAGE})  # fmt: skip
    assert plain.status_code == 415 and plain.headers["access-control-allow-origin"] == PAGE
    assert producer.sent == []


def test_route_errors_carry_the_reason_and_field(app_client):
    client, producer = app_client
    expired = ft.mint(KEY, "demo", session_id="s", ttl_s=1, now=time.time() - 10)
    answer = client.post("/v1/feedback", json={"token": expired, "kind": "accept"}, headers={"Origin": PAGE})
    assert answer.status_code == 401 and answer.json() == {"detail": "feedback token expired", "field": "token"}
    assert answer.headers["access-control-allow-origin"] == PAGE  # the page can read why
    token = ft.mint(KEY, "demo", session_id="s")
    bad = client.post("/v1/feedback", json={"token": token, "kind": "edit", "edit_ratio": 2})
    assert bad.status_code == 422 and bad.json()["field"] == "edit_ratio" and "edit_ratio" in bad.json()["detail"]
    big = client.post("/v1/feedback", json={"token": token, "kind": "follow_up", "text": "x" * 70_000})
    assert big.status_code == 413
    assert producer.sent == []
