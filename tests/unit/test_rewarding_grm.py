"""The judge: strict parsing, aggregation, disagreement, recorded failures, and the HTTP client's
timeouts, retries, concurrency limit and cache (against a real local HTTP server)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rewarding.extractors.grm import (
    GrmExtractor,
    GrmSettings,
    RubricResult,
    RubricSettings,
    aggregate,
    parse_score,
    transcript,
)
from rewarding.grm import JudgeClient, JudgeConfig, JudgeError
from rewarding.session_state import Session
from rewarding.synthetic import SessionBuilder

R5 = RubricSettings(name="r", prompt="{transcript}")


def test_parse_is_strict() -> None:
    assert parse_score(R5, "SCORE: 5") == 1.0
    assert parse_score(R5, "  SCORE: 3\n") == 0.5
    for garbage in ("SCORE: 6", "score: 3", "SCORE: 3 because", "The SCORE: 3", "", "SCORE:", "5"):
        with pytest.raises(ValueError):
            parse_score(R5, garbage)
    ten = RubricSettings(name="t", prompt="x", pattern=r"(\d+)/10", min_score=0, max_score=10)
    assert parse_score(ten, "7/10") == pytest.approx(0.7)
    with pytest.raises(ValueError):
        parse_score(ten, "11/10")


def test_aggregation_rules() -> None:
    scores = [0.2, 0.4, 0.9]
    assert aggregate(scores, "mean") == pytest.approx(0.5)
    assert aggregate(scores, "median") == 0.4
    assert aggregate(scores, "min") == 0.2


def _extractor(**kw) -> GrmExtractor:
    client = JudgeClient(JudgeConfig(base_url="http://127.0.0.1:9"))
    return GrmExtractor(GrmSettings(enabled=True, **kw), client)


def test_disagreement_flag_and_failures_are_recorded_not_zero() -> None:
    ex = _extractor(disagreement_threshold=0.5, aggregation="min")
    c = ex.combine([RubricResult("a", 1.0, "SCORE: 5", None), RubricResult("b", 0.25, "SCORE: 2", None)])
    assert c.value == 0.25 and c.flags == ("disagreement",) and c.metrics["spread"] == 0.75
    c = ex.combine([RubricResult("a", 0.5, "SCORE: 3", None), RubricResult("b", None, "blah", "b: unparsable")])
    assert c.value == 0.5 and c.failures == ("b: unparsable",) and c.flags == ()
    c = ex.combine([RubricResult("a", None, "???", "a: unparsable")])
    assert c.value is None and c.failures == ("a: unparsable",)
    strict = _extractor(min_valid_rubrics=2)
    assert strict.combine([RubricResult("a", 1.0, "SCORE: 5", None), RubricResult("b", None, "", "b: x")]).value is None


def test_transcript_is_cut_to_its_tail() -> None:
    b = SessionBuilder(at=datetime.now(UTC) - timedelta(minutes=1))
    b.completion("answer: 4")
    text = transcript(Session.from_events(b.project, b.session_id, b.events), max_chars=12)
    assert text == "t: answer: 4"[-12:] and len(text) == 12


class Judge:
    """A local OpenAI-compatible chat endpoint whose answers a test scripts."""

    def __init__(self, answer: Callable[[dict, int], tuple[int, str, float]]):
        self.answer = answer
        self.trickle_s = 0.0
        """When set, the answer is written one byte at a time with this pause between bytes."""
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._send(200, json.dumps({"data": [{"id": "judge-model"}]}))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.requests.append(body)
                    n = len(judge.requests)
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                status, content, delay = judge.answer(body, n)
                time.sleep(delay)
                with judge.lock:
                    judge.in_flight -= 1
                reply = {"choices": [{"message": {"role": "assistant", "content": content}}]}
                self._send(status, json.dumps(reply) if status == 200 else "overloaded")

            def _send(self, status: int, text: str) -> None:
                data = text.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if judge.trickle_s:
                        for i in range(len(data)):
                            self.wfile.write(data[i : i + 1])
                            self.wfile.flush()
                            time.sleep(judge.trickle_s)
                    else:
                        self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def judge_factory():
    made: list[Judge] = []

    def make(answer):
        made.append(Judge(answer))
        return made[-1]

    yield make
    for judge in made:
        judge.close()


def _client(url: str, **kw) -> JudgeClient:
    return JudgeClient(JudgeConfig(base_url=url, retry_backoff_s=0.01, **kw))


def test_client_retries_5xx_then_caches_by_content(judge_factory) -> None:
    judge = judge_factory(lambda body, n: (503, "", 0.0) if n == 1 else (200, "SCORE: 4", 0.0))
    client = _client(judge.url, retries=2)

    async def go():
        first = await client.complete("p", max_tokens=4, temperature=0.0, regex="SCORE: ([1-5])")
        second = await client.complete("p", max_tokens=4, temperature=0.0, regex="SCORE: ([1-5])")
        other = await client.complete("q", max_tokens=4, temperature=0.0, regex=None)
        await client.aclose()
        return first, second, other

    assert asyncio.run(go()) == ("SCORE: 4", "SCORE: 4", "SCORE: 4")
    assert len(judge.requests) == 3  # one 503, one answer, one for the other prompt; the repeat is cached
    assert judge.requests[1]["model"] == "judge-model"
    assert judge.requests[1]["structured_outputs"] == {"regex": "SCORE: ([1-5])"}
    assert "structured_outputs" not in judge.requests[2]


def test_client_times_out_and_gives_up_after_its_retries(judge_factory) -> None:
    judge = judge_factory(lambda body, n: (200, "SCORE: 1", 1.0))
    client = _client(judge.url, model="m", timeout_s=0.2, retries=1)

    async def go():
        try:
            await client.complete("p", max_tokens=4, temperature=0.0, regex=None)
        finally:
            await client.aclose()

    with pytest.raises(JudgeError) as err:
        asyncio.run(go())
    assert err.value.retryable and client.calls == 2


def test_timeout_bounds_the_whole_request_not_each_read(judge_factory) -> None:
    """A judge that keeps sending a byte every 20 ms never trips a per-read timeout of 0.3 s,
    but it takes ~1.5 s to answer, so the deadline of 0.3 s per attempt must end each attempt."""
    judge = judge_factory(lambda body, n: (200, "SCORE: 1", 0.0))
    judge.trickle_s = 0.02
    client = _client(judge.url, model="m", timeout_s=0.3, retries=1)

    async def go():
        try:
            await client.complete("p", max_tokens=4, temperature=0.0, regex=None)
        finally:
            await client.aclose()

    started = time.monotonic()
    with pytest.raises(JudgeError) as err:
        asyncio.run(go())
    elapsed = time.monotonic() - started
    assert err.value.retryable and client.calls == 2
    assert "no answer within 0.3s" in str(err.value)
    assert elapsed < 1.2, f"two attempts of 0.3 s took {elapsed:.2f}s"


def test_client_respects_its_concurrency_limit(judge_factory) -> None:
    judge = judge_factory(lambda body, n: (200, "SCORE: 2", 0.1))
    client = _client(judge.url, model="m", concurrency=2)

    async def go():
        answers = await asyncio.gather(
            *(client.complete(f"p{i}", max_tokens=4, temperature=0.0, regex=None) for i in range(6))
        )
        await client.aclose()
        return answers

    assert asyncio.run(go()) == ["SCORE: 2"] * 6
    assert judge.max_in_flight == 2


def test_extractor_against_the_judge_records_garbage_as_failure(judge_factory) -> None:
    answers = {"correctness": "SCORE: 5", "helpfulness": "I think it is fine"}

    def answer(body, n):
        prompt = body["messages"][0]["content"]
        return 200, answers["correctness" if prompt.startswith("Rate how correct") else "helpfulness"], 0.0

    judge = judge_factory(answer)
    ex = GrmExtractor(GrmSettings(enabled=True, structured_output=False), _client(judge.url))
    b = SessionBuilder(at=datetime.now(UTC) - timedelta(minutes=1))
    b.completion("answer: 4")
    c = ex.extract(Session.from_events(b.project, b.session_id, b.events))
    assert c.terms == {"correctness": 1.0} and c.value == 1.0
    assert len(c.failures) == 1 and c.failures[0].startswith("helpfulness: unparsable")
    assert c.details["answers"]["helpfulness"] == "I think it is fine"
