"""The configured event limits (ingest.max_completion_tokens, ingest.max_event_bytes, kafka.max_record_bytes)
at every hop that checks them without a broker: settings, the gateway's batch check, the consumer's
batch split, the SDK's event builder and the HTTP transport's request slicing."""

from __future__ import annotations

import json
import math
from collections import namedtuple

import httpx
import pytest
from pydantic import ValidationError

from flywheel.core.contracts import Completion, Message, Turn, dump_event
from flywheel.core.contracts.events import MAX_TEXT, MAX_TOKENS
from flywheel.core.settings import Settings
from flywheel.core.settings import ingest as ingest_settings
from flywheel.core.settings.ingest import IngestSettings
from flywheel.core.settings.kafka import RECORD_OVERHEAD_BYTES
from flywheel.sdk import settings as sdk_settings
from flywheel.sdk.sender import EventBuilder, InvalidEvent
from flywheel.sdk.transports import make_transport
from flywheel.sdk.transports.base import Envelope
from flywheel.sdk.transports.http import HttpTransport, body_slices
from ingest.consumer import process_batch
from ingest.gateway import validate_batch
from ingest.limits import Limits, check_record_limit

Record = namedtuple("Record", "topic partition offset key value")
N = 131_072


def completion(n_tokens: int, session_id: str = "s1", project: str = "demo") -> Completion:
    return Completion(
        project=project,
        session_id=session_id,
        model="m",
        policy_version="p1",
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[i % 50_000 for i in range(n_tokens)],
        logprobs=[-math.pi / (i + 1) for i in range(n_tokens)],
        completion_text="x" * n_tokens,
    )


def test_the_contract_caps_are_above_every_configurable_limit():
    assert MAX_TOKENS >= IngestSettings.model_fields["max_completion_tokens"].metadata[-1].le
    event_bytes_le = max(m.le for m in IngestSettings.model_fields["max_event_bytes"].metadata if hasattr(m, "le"))
    assert MAX_TEXT >= event_bytes_le
    assert IngestSettings().max_completion_tokens >= N


def test_the_sdk_defaults_are_the_services_defaults():
    assert sdk_settings.MAX_COMPLETION_TOKENS == ingest_settings.MAX_COMPLETION_TOKENS
    assert sdk_settings.MAX_EVENT_BYTES == ingest_settings.MAX_EVENT_BYTES
    assert sdk_settings.MAX_BODY_BYTES == ingest_settings.MAX_BODY_BYTES


def test_a_body_limit_that_cannot_hold_one_event_is_refused_naming_both_settings():
    with pytest.raises(ValidationError, match=r"ingest\.max_body_bytes \(2000\).*ingest\.max_event_bytes \(4000\)"):
        IngestSettings(max_body_bytes=2_000, max_event_bytes=4_000)


def test_a_record_limit_below_the_event_limit_is_refused_naming_both_settings():
    settings = Settings(kafka={"max_record_bytes": 2 * 1024 * 1024}, ingest={"max_event_bytes": 2 * 1024 * 1024})
    with pytest.raises(ValueError, match=r"kafka\.max_record_bytes \(2097152\).*ingest\.max_event_bytes"):
        check_record_limit(settings)
    assert check_record_limit(Settings()) >= Settings().ingest.max_event_bytes + RECORD_OVERHEAD_BYTES


def test_the_gateway_takes_a_completion_at_the_limit_and_refuses_one_token_more_naming_the_limit():
    at, over = (json.loads(dump_event(completion(n))) for n in (N, N + 1))
    verdict = validate_batch([at, over], "demo", Limits.from_settings(Settings()))
    assert verdict.status == 422 and [str(e.event_id) for e in verdict.accepted] == [at["event_id"]]
    (rejection,) = verdict.rejected
    assert (rejection.index, rejection.field) == (1, "completion_token_ids")
    assert rejection.reason == f"{N + 1} tokens, over the limit ingest.max_completion_tokens = {N}"


def test_the_consumer_dead_letters_an_over_limit_record_and_keeps_its_neighbours():
    limits = Limits(max_event_bytes=64 * 1024, max_completion_tokens=100)
    before = Turn(project="demo", session_id="s1", messages=[Message(role="user", content="hi")])
    long_one, big_one = completion(101), completion(50)
    big = json.loads(dump_event(big_one))
    big["completion_text"] = "y" * 70_000
    after = Turn(project="demo", session_id="s1", messages=[Message(role="user", content="bye")])
    values = [dump_event(before), dump_event(long_one), json.dumps(big).encode(), dump_event(after)]
    result = process_batch([Record("fw.events", 0, i, b"s1", v) for i, v in enumerate(values)], limits)
    assert [row.event_id for row in result.events] == [before.event_id, after.event_id]
    tokens, size = result.dead_letters
    assert (tokens.offset, tokens.field, tokens.kind) == (1, "completion_token_ids", "limit")
    assert tokens.reason == "101 tokens, over the limit ingest.max_completion_tokens = 100"
    assert (size.offset, size.kind) == (2, "limit")
    assert size.reason.endswith("bytes serialized, over the limit ingest.max_event_bytes = 65536")
    assert result.offsets == {("fw.events", 0): 4}


def test_the_sdk_builds_a_completion_at_the_limit_and_refuses_one_token_more_naming_the_setting():
    builder = EventBuilder("sdk/1", None, max_completion_tokens=N, max_event_bytes=sdk_settings.MAX_EVENT_BYTES)

    def record(n: int):
        fields = {
            "model": "m",
            "policy_version": "p1",
            "prompt_token_ids": [1],
            "completion_token_ids": list(range(n)),
            "logprobs": [-0.5] * n,
        }
        return ("completion", "demo", "s1", fields, 0x0188_0000_0000_7000_8000_0000_0000_0001, 1.7e9)

    envelope = builder.build(record(N))
    assert len(json.loads(envelope.value)["completion_token_ids"]) == N
    with pytest.raises(InvalidEvent, match=rf"{N + 1} tokens, over the limit FLYWHEEL_MAX_COMPLETION_TOKENS"):
        builder.build(record(N + 1))
    small = EventBuilder("sdk/1", None, max_event_bytes=10_000)
    with pytest.raises(InvalidEvent, match=r"over the limit FLYWHEEL_MAX_EVENT_BYTES \(max_event_bytes\) = 10000"):
        small.build(record(5_000))


def test_the_kafka_transport_is_sized_from_the_event_limit():
    settings = sdk_settings.SdkSettings(kafka_bootstrap="127.0.0.1:1", max_event_bytes=20_000_000)
    assert make_transport(settings).max_request_bytes == 20_000_000 + RECORD_OVERHEAD_BYTES


def test_body_slices_keep_each_request_under_the_limit_and_an_oversize_event_alone():
    def env(n: int) -> Envelope:
        return Envelope(b"s", b"x" * n)

    assert body_slices([env(10)] * 5, 13 + 21) == [(0, 2), (2, 4), (4, 5)]
    assert body_slices([env(100), env(10), env(10)], 50) == [(0, 1), (1, 3)]
    assert body_slices([], 50) == []


def test_the_http_transport_sends_a_big_batch_as_several_requests_in_order():
    bodies: list[int] = []
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(len(request.content))
        events = json.loads(request.content)["events"]
        seen.extend(e["event_id"] for e in events)
        if events[0]["event_id"] == "e6":  # the third request fails: the rest is retried from its first event
            return httpx.Response(503)
        return httpx.Response(202, json={"accepted": [e["event_id"] for e in events], "rejected": []})

    batch = [Envelope(b"s", json.dumps({"event_id": f"e{i}", "pad": "z" * 300}).encode()) for i in range(10)]
    client = httpx.Client(transport=httpx.MockTransport(answer))
    result = HttpTransport("http://gw", "k", client=client, max_body_bytes=1_000).send(batch)
    assert max(bodies) <= 1_000 and seen == [f"e{i}" for i in range(8)]
    assert (result.sent, result.retry_from, result.ok) == (6, 6, False)
