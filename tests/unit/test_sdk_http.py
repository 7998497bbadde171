"""The HTTP transport's handling of every answer the gateway gives (202, 422, 401/403, 413, 400, 5xx)."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx

from flywheel.sdk.transports.base import Envelope
from flywheel.sdk.transports.http import AUTH_RETRY_S, HttpTransport

Handler = Callable[[httpx.Request], httpx.Response]


def batch(n: int) -> list[Envelope]:
    return [Envelope(b"s", json.dumps({"event_id": f"e{i}", "i": i}).encode()) for i in range(n)]


def transport(handler: Handler) -> tuple[HttpTransport, list[list[dict]]]:
    seen: list[list[dict]] = []

    def record(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/events"
        assert request.headers["authorization"] == "Bearer fwk_key"
        events = json.loads(request.content)["events"]
        seen.append(events)
        return handler(request)

    client = httpx.Client(transport=httpx.MockTransport(record))
    return HttpTransport("http://gateway/", "fwk_key", client=client), seen


def ids(request: httpx.Request) -> list[str]:
    return [e["event_id"] for e in json.loads(request.content)["events"]]


def test_202_all_sent_and_the_body_is_the_events_verbatim() -> None:
    t, seen = transport(lambda r: httpx.Response(202, json={"accepted": ids(r), "rejected": []}))
    result = t.send(batch(3))
    assert (result.ok, result.sent, result.rejected) == (True, 3, [])
    assert seen == [[{"event_id": f"e{i}", "i": i} for i in range(3)]]


def test_422_rejected_are_final_the_rest_accepted() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        got = ids(request)
        rejected = [{"index": 1, "event_id": got[1], "field": "messages.0.role", "reason": "bad role"}]
        return httpx.Response(422, json={"accepted": [got[0], got[2]], "rejected": rejected})

    t, seen = transport(answer)
    result = t.send(batch(3))
    assert result.ok and result.sent == 2
    assert [(r.index, r.event_id, r.field) for r in result.rejected] == [(1, "e1", "messages.0.role")]
    assert len(seen) == 1  # never retried


def test_401_and_403_keep_the_batch_for_later_with_a_long_wait() -> None:
    for status, body in [(401, {"detail": "unknown key"}), (403, {"detail": "a viewer token cannot write"})]:
        t, _ = transport(lambda r, s=status, b=body: httpx.Response(s, json=b))
        result = t.send(batch(4))
        assert (result.ok, result.retry_from, result.sent) == (False, 0, 0)
        assert result.retry_after_s == AUTH_RETRY_S and str(status) in (result.error or "")


def test_403_for_a_foreign_project_rejects_the_events() -> None:
    rejected = [{"index": i, "event_id": f"e{i}", "field": "project", "reason": "other project"} for i in range(2)]
    t, _ = transport(lambda r: httpx.Response(403, json={"accepted": [], "rejected": rejected}))
    result = t.send(batch(2))
    assert result.ok and result.sent == 0 and len(result.rejected) == 2


def test_413_splits_until_it_fits_and_rejects_a_lone_giant() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        got = ids(request)
        if len(got) > 2 or "e5" in got:
            return httpx.Response(413, json={"detail": "too big"})
        return httpx.Response(202, json={"accepted": got, "rejected": []})

    t, seen = transport(answer)
    result = t.send(batch(8))
    assert result.ok and result.sent == 7
    assert [(r.index, r.event_id) for r in result.rejected] == [(5, "e5")]
    delivered = [e["event_id"] for events in seen if len(events) <= 2 and "e5" not in [x["event_id"] for x in events]
                 for e in events]  # fmt: skip
    assert delivered == [f"e{i}" for i in range(8) if i != 5]  # in order


def test_413_then_an_outage_retries_from_the_first_unsent_event() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        got = ids(request)
        if len(got) > 2:
            return httpx.Response(413)
        if "e2" in got:
            return httpx.Response(503)
        return httpx.Response(202, json={"accepted": got, "rejected": []})

    t, _ = transport(answer)
    result = t.send(batch(4))
    assert (result.ok, result.sent, result.retry_from) == (False, 2, 2)


def test_5xx_429_and_connection_errors_retry_the_whole_batch() -> None:
    t, _ = transport(lambda r: httpx.Response(503))
    assert t.send(batch(2)).retry_from == 0
    t, _ = transport(lambda r: httpx.Response(429, headers={"Retry-After": "7"}))
    assert t.send(batch(2)).retry_after_s == 7.0

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    t, _ = transport(refuse)
    result = t.send(batch(2))
    assert (result.ok, result.retry_from) == (False, 0) and "unreachable" in (result.error or "")


def test_400_rejects_rather_than_retrying_forever() -> None:
    t, _ = transport(lambda r: httpx.Response(400, json={"detail": "body is not {events: [...]}"}))
    result = t.send(batch(2))
    assert result.ok and [r.event_id for r in result.rejected] == ["e0", "e1"]


def test_a_refused_key_keeps_events_spooled_loudly_until_it_is_fixed(tmp_path, caplog) -> None:
    import logging

    from flywheel.sdk import Flywheel

    state = {"status": 401}

    def answer(request: httpx.Request) -> httpx.Response:
        if state["status"] == 401:
            return httpx.Response(401, json={"detail": "unknown or revoked write key"})
        return httpx.Response(202, json={"accepted": ids(request), "rejected": []})

    t, _ = transport(answer)
    fw = Flywheel(project="http-auth", transport=t, spool_dir=tmp_path)
    with caplog.at_level(logging.ERROR, logger="flywheel.sdk"):
        with fw.session() as s:
            s.tool_call("t")
        assert not fw.flush(1.0)
    stats = fw.stats
    assert stats.sent == 0 and stats.spooled == 3 and stats.send_failures >= 1 and stats.dropped == 0
    assert any("refused the write key" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    state["status"] = 202  # the operator fixed the key
    assert fw.flush(10)
    fw.close()
    assert fw.stats.sent == 3


def test_feedback_by_completion_id_alone_goes_through_the_gateway_without_a_session(tmp_path) -> None:
    from flywheel.core.contracts import uuid7
    from flywheel.sdk import Flywheel

    t, seen = transport(lambda r: httpx.Response(202, json={"accepted": ids(r), "rejected": []}))
    fw = Flywheel(project="http-feedback", transport=t, spool_dir=tmp_path)
    cid = uuid7()
    event_id = fw.feedback(cid, "revert")
    assert fw.flush(10)
    fw.close()
    [[event]] = seen
    assert event["event_id"] == str(event_id) and event["completion_id"] == str(cid)
    assert "session_id" not in event and event["kind"] == "revert"
