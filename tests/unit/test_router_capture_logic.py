"""Router-side capture's pure logic: what it asks vLLM for, what it gives back, the events, the buffer."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest

from flywheel.core.contracts.events import parse_event
from flywheel.core.settings import Settings
from serving.proxy.capture import MAX_CHOICES, Capture, CaptureSink, choices, completion_ids


def chat_answer(with_token_data: bool = True) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "5"},
        "logprobs": {"content": [{"token": "5", "logprob": -0.25, "bytes": [53], "top_logprobs": []}]}
        if with_token_data
        else None,
        "finish_reason": "stop",
        "token_ids": [17] if with_token_data else None,
    }
    return {"id": "c1", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "prompt_token_ids": [1, 2, 3] if with_token_data else None}  # fmt: skip


def test_begin_asks_for_token_data_only_where_the_client_did_not() -> None:
    payload: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "2+3="}], "n": 2}
    capture = Capture.begin("/v1/chat/completions", payload, "shop", None)
    assert capture is not None and len(capture.ids) == 2
    assert (payload["return_token_ids"], payload["logprobs"], payload["top_logprobs"]) == (True, True, 0)
    assert not capture.keep_logprobs and not capture.keep_token_ids
    assert capture.session_id == f"router-{capture.ids[0]}"  # one session per request
    assert completion_ids(capture.header[1].decode()) == capture.ids

    kept: dict[str, Any] = {"model": "m", "prompt": "1", "logprobs": 3, "return_token_ids": True, "user": "u"}
    capture = Capture.begin("/v1/completions", kept, "shop", "u")
    assert capture is not None and capture.keep_logprobs and capture.keep_token_ids
    assert kept["logprobs"] == 3 and capture.session_id == "u"


@pytest.mark.parametrize(
    "payload",
    [{"prompt": ["a", "b"]}, {"prompt": [1, 2, 3]}, {"prompt": "a", "n": 0}, {"prompt": "a", "n": 1000}],
)
def test_what_cannot_be_one_event_per_choice_is_not_captured(payload: dict[str, Any]) -> None:
    original = dict(payload)
    assert Capture.begin("/v1/completions", payload, "shop", None) is None
    assert payload == original  # nothing asked of vLLM on its behalf


@pytest.mark.parametrize(
    ("n", "expected"),
    [(None, 1), (True, 1), (3, 3), (MAX_CHOICES, MAX_CHOICES), (False, None), (0, None), (MAX_CHOICES + 1, None),
     (2.0, None), ("2", None)],
)  # fmt: skip
def test_the_number_of_choices_is_read_once_by_begin(n: Any, expected: int | None) -> None:
    assert choices(n) == expected
    payload: dict[str, Any] = {"model": "m", "prompt": "a"} if n is None else {"model": "m", "prompt": "a", "n": n}
    capture = Capture.begin("/v1/completions", payload, "shop", None)
    assert (capture is None) if expected is None else (capture is not None and len(capture.ids) == expected)


def test_a_whole_answer_loses_what_the_client_did_not_ask_for_and_keeps_it_in_the_event() -> None:
    payload = {"model": "m", "messages": [{"role": "user", "content": "2+3="}], "temperature": 0.5}
    capture = Capture.begin("/v1/chat/completions", payload, "shop", "s1")
    assert capture is not None
    body, results = capture.whole(json.dumps(chat_answer()).encode())
    assert json.loads(body) == chat_answer(with_token_data=False)
    [event] = capture.events(results, "v7", None, "3")
    assert (event.completion_token_ids, event.logprobs, event.prompt_token_ids) == ([17], [-0.25], [1, 2, 3])
    assert (event.event_id, event.completion_id, event.session_id) == (capture.ids[0], capture.ids[0], "s1")
    assert (event.policy_version, event.served_by, event.sampling.temperature) == ("v7", "3", 0.5)
    assert parse_event(event.model_dump_json()) == event


def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def test_a_stream_is_rewritten_event_by_event_however_its_bytes_are_split() -> None:
    chunks = [
        {"id": "t", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "text": t, "logprobs": {"tokens": [t], "token_logprobs": [lp], "top_logprobs": None,
                                                          "text_offset": [0]},
                      "finish_reason": f, "token_ids": [i], "prompt_token_ids": [9, 8] if i == 4 else None}]}
        for i, t, lp, f in ((4, "1", -0.5, None), (5, "5", -0.1, "length"))
    ]  # fmt: skip
    stream = b"".join(sse(c) for c in chunks) + b"data: [DONE]\n\n"
    for cut in range(1, len(stream), 7):
        capture = Capture.begin("/v1/completions", {"model": "m", "prompt": "7+8="}, "shop", None)
        assert capture is not None
        out = capture.stream_chunk(stream[:cut]) + capture.stream_chunk(stream[cut:]) + capture.stream_rest()
        events = [json.loads(line[6:]) for line in out.decode().split("\n\n") if line.startswith("data: {")]
        assert out.endswith(b"data: [DONE]\n\n")
        for event in events:
            for choice in event["choices"]:
                assert choice["logprobs"] is None and choice["token_ids"] is None and choice["prompt_token_ids"] is None
        [completion] = capture.stream_events("v1", "0")
        assert (completion.completion_text, completion.completion_token_ids) == ("15", [4, 5])
        assert (completion.logprobs, completion.prompt_token_ids, completion.prompt_text) == (
            [-0.5, -0.1],
            [9, 8],
            "7+8=",
        )
        assert completion.finish_reason == "length"


def test_an_error_event_passes_through_untouched() -> None:
    capture = Capture.begin("/v1/completions", {"model": "m", "prompt": "1"}, "shop", None)
    assert capture is not None
    error = b'data: {"error": {"message": "boom", "code": 502}}\n\n'
    assert capture.stream_chunk(error) == error


class SlowProducer:
    """Acknowledges nothing until released: the buffer behind it fills."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sent: list[bytes] = []

    def send(self, topic: str, key: bytes, value: bytes) -> Any:
        self.release.wait(10)
        self.sent.append(value)
        return _Future()

    def flush(self, timeout: float) -> None:
        pass

    def close(self, timeout: float) -> None:
        pass


class _Future:
    def add_callback(self, fn: Any) -> _Future:
        fn(None)
        return self

    def add_errback(self, fn: Any) -> _Future:
        return self


def test_a_full_buffer_drops_and_counts_never_blocks() -> None:
    settings = Settings(serving={"capture": {"projects": ["shop"], "buffer_events": 2, "max_event_bytes": 2048}})
    drops: list[str] = []
    sent: list[int] = []
    producer = SlowProducer()
    sink = CaptureSink(settings, on_drop=lambda r, n: drops.extend([r] * n), on_sent=sent.append,
                       make_producer=lambda: producer)  # fmt: skip
    sink.start()
    capture = Capture.begin("/v1/completions", {"model": "m", "prompt": "1", "n": 6}, "shop", "s")
    assert capture is not None
    results = [{"completion_text": "x", "index": i} for i in range(6)]
    sink.offer(capture.events(results, "v", "m", None))  # one in the producer's hands, two queued, three dropped
    assert drops.count("buffer_full") >= 3
    big = capture.events([{"completion_text": "y" * 4000, "index": 0}], "v", "m", None)
    sink.offer(big)
    assert "too_large" in drops
    producer.release.set()
    sink.close()
    assert len(producer.sent) == 6 - drops.count("buffer_full") and sum(sent) == len(producer.sent)
    ids = {uuid.UUID(json.loads(v)["completion_id"]) for v in producer.sent}
    assert ids <= set(capture.ids)


def test_captured_text_is_redacted_and_the_token_data_of_what_changed_is_dropped() -> None:
    from flywheel.core.redact import Redactor

    payload = {"model": "m", "messages": [{"role": "user", "content": "mail me at ann@example.com"}]}
    capture = Capture.begin("/v1/chat/completions", payload, "shop", "s1")
    assert capture is not None
    answer = chat_answer()
    answer["choices"][0]["message"]["content"] = "sure, bob@example.org"
    _, results = capture.whole(json.dumps(answer).encode())
    [event] = capture.events(results, "v7", None, "3", Redactor())
    assert "@" not in event.completion_text and "@" not in (event.prompt_messages[0].content or "")
    assert (event.prompt_token_ids, event.completion_token_ids, event.logprobs) == (None, None, None)
    assert capture.redacted == 1
    # the request as recorded for the next choice is untouched by this one's redaction
    assert capture.request["prompt_messages"][0]["content"] == "mail me at ann@example.com"

    clean = Capture.begin("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "2+3="}]},
                          "shop", "s2")  # fmt: skip
    assert clean is not None
    _, results = clean.whole(json.dumps(chat_answer()).encode())
    [kept] = clean.events(results, "v7", None, "3", Redactor())
    assert (kept.prompt_token_ids, kept.completion_token_ids, clean.redacted) == ([1, 2, 3], [17], 0)


def test_an_answer_the_fast_parser_refuses_passes_as_vllm_wrote_it() -> None:
    """A kept logprob of -inf (Python's json writes ``-Infinity``, which orjson refuses) is read and
    written back by the standard library, never turned into ``null``; whole and in a stream."""
    payload = {"model": "m", "messages": [{"role": "user", "content": "2+3="}], "logprobs": True}
    capture = Capture.begin("/v1/chat/completions", payload, "shop", "s1")
    assert capture is not None and capture.keep_logprobs
    answer = chat_answer()
    answer["choices"][0]["logprobs"]["content"][0]["logprob"] = float("-inf")
    body, _ = capture.whole(json.dumps(answer).encode())
    assert b"-Infinity" in body and json.loads(body)["choices"][0]["logprobs"] == answer["choices"][0]["logprobs"]
    assert json.loads(body)["prompt_token_ids"] is None  # what it did not ask for still goes
    plain = capture.whole(json.dumps(chat_answer()).encode())[0]  # the fast path writes what vLLM would
    assert json.loads(plain)["choices"][0]["logprobs"] == chat_answer()["choices"][0]["logprobs"]
    streamed = capture.stream_chunk(sse({**answer, "object": "chat.completion.chunk"}))
    assert b"-Infinity" in streamed


def test_the_span_a_request_names_is_recorded_and_a_malformed_one_is_the_root() -> None:
    payload = {"model": "m", "messages": [{"role": "user", "content": "2+3="}]}
    capture = Capture.begin("/v1/chat/completions", dict(payload), "shop", "s1", ("sub-2", "subagent"))
    assert capture is not None
    [event] = capture.events(capture.whole(json.dumps(chat_answer()).encode())[1], "v7", None, "3")
    assert (event.span.span_id, event.span.role) == ("sub-2", "subagent")
    for span in ((None, None), ("", "x" * 65)):
        capture = Capture.begin("/v1/chat/completions", dict(payload), "shop", "s1", span)
        assert capture is not None
        [event] = capture.events(capture.whole(json.dumps(chat_answer()).encode())[1], "v7", None, "3")
        assert (event.span.span_id, event.span.role) == ("root", "agent")
