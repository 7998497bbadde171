"""Router-side capture: a product that only points the official openai client at the router gets its
completions into Kafka as ``completion`` events, with token ids, logprobs and versions.

A real router (uvicorn in a thread) in front of the session's real vLLM replica, its table and keys
in a real Postgres, the events read back from the real broker. The "product" here uses the openai
client and httpx alone: no Flywheel import touches its requests.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import VllmReplica, running_router, wait_for
from sqlalchemy import Engine
from sqlalchemy.orm import Session
from transformers import AutoTokenizer

from flywheel.core import kafka_clients
from flywheel.core.auth import create_key
from flywheel.core.contracts.events import Completion, parse_event
from flywheel.core.contracts.topics import events_topic
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import Checkpoint
from flywheel.core.settings import Settings
from ingest.topics import ensure_topics
from serving.proxy.capture import COMPLETION_IDS_HEADER
from serving.proxy.router import Router

pytestmark = pytest.mark.integration

FLEET = "capture-test"
CAPTURED = "shop"
NOT_CAPTURED = "other"
IDS_HEADER = COMPLETION_IDS_HEADER.decode()


@dataclass
class Served:
    url: str
    router: Router
    engine: Engine
    model: str
    version: str
    replica_url: str
    replica_id: str
    topic: str
    bootstrap: str
    settings: Settings
    keys: dict[str, str]


@pytest.fixture(scope="module")
def served(db_url: str, stack_settings: Settings, vllm_replica: VllmReplica, kafka_bootstrap: str) -> Iterator[Served]:
    engine = get_engine(db_url)
    with Session(engine) as s:
        keys = {}
        for project in (CAPTURED, NOT_CAPTURED):
            _, keys[project] = create_key(s, name=f"product-{project}", role="product", project=project)
        s.commit()
    prefix = f"capture{uuid.uuid4().hex[:8]}"
    kafka = stack_settings.kafka.model_copy(update={"topic_prefix": prefix, "bootstrap_servers": kafka_bootstrap})
    settings = stack_settings.model_copy(update={"kafka": kafka})
    ensure_topics(settings, kafka_bootstrap)
    capture = stack_settings.serving.capture.model_copy(update={"projects": [CAPTURED]})
    with running_router(engine, settings, vllm_replica, fleet=FLEET, name="router-capture", capture=capture) as run:
        yield Served(run.url, run.router, engine, vllm_replica.model, run.version, vllm_replica.url,
                     str(run.replica_id), events_topic(prefix), kafka_bootstrap, run.settings, keys)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(vllm_replica: VllmReplica) -> Any:
    return AutoTokenizer.from_pretrained(vllm_replica.model_dir)


def read_completions(served: Served, ids: list[uuid.UUID], timeout_s: float = 30.0) -> dict[uuid.UUID, Completion]:
    """The captured events of the completions ``ids``, read from the topic (from its start)."""
    consumer = kafka_clients.consumer(
        served.bootstrap, served.topic, security=served.settings.kafka.security(),
        auto_offset_reset="earliest", enable_auto_commit=False, group_id=None, consumer_timeout_ms=500,
    )  # fmt: skip
    found: dict[uuid.UUID, Completion] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not set(ids) <= set(found):
            for record in consumer:
                event = parse_event(record.value)
                assert isinstance(event, Completion)
                found[event.completion_id] = event
    finally:
        consumer.close()
    assert set(ids) <= set(found), f"captured {sorted(map(str, found))}, wanted {sorted(map(str, ids))}"
    return {i: found[i] for i in ids}


def all_events(served: Served) -> list[Completion]:
    """Every event in the topic now."""
    consumer = kafka_clients.consumer(
        served.bootstrap, served.topic, security=served.settings.kafka.security(),
        auto_offset_reset="earliest", enable_auto_commit=False, group_id=None, consumer_timeout_ms=2000,
    )  # fmt: skip
    try:
        return [e for e in (parse_event(r.value) for r in consumer) if isinstance(e, Completion)]
    finally:
        consumer.close()


def header_ids(headers: httpx.Headers) -> list[uuid.UUID]:
    return [uuid.UUID(p) for p in headers[IDS_HEADER].split(",")]


def client(served: Served, project: str = CAPTURED) -> openai.OpenAI:
    return openai.OpenAI(api_key=served.keys[project], base_url=f"{served.url}/v1", max_retries=0)


def test_a_chat_completion_is_captured_with_token_ids_logprobs_versions_and_sampling(
    served: Served, tokenizer: Any
) -> None:
    messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": "2+3="}]
    raw = client(served).chat.completions.with_raw_response.create(
        model=served.model, messages=messages, max_tokens=8, n=2, temperature=0.7, top_p=0.9, seed=7,
        extra_headers={"x-flywheel-session-id": "conversation-1", "x-flywheel-span-id": "planner",
                       "x-flywheel-agent-role": "orchestrator"},
    )  # fmt: skip
    answer = raw.parse()
    ids = header_ids(raw.headers)
    assert len(ids) == 2 and len(answer.choices) == 2
    for choice in answer.choices:  # what the client did not ask for is not in its answer
        assert choice.logprobs is None and getattr(choice, "token_ids", None) is None
    assert getattr(answer, "prompt_token_ids", None) is None
    events = read_completions(served, ids)
    by_text = {}
    for index, completion_id in enumerate(ids):
        event = events[completion_id]
        by_text[index] = event.completion_text
        assert (event.project, event.session_id, event.event_id) == (CAPTURED, "conversation-1", completion_id)
        assert (event.policy_version, event.served_by, event.model) == (served.version, served.replica_id, served.model)
        assert event.sdk is not None and event.sdk.startswith("flywheel-router/")
        assert (event.span.span_id, event.span.role) == ("planner", "orchestrator")
        assert [m.content for m in event.prompt_messages] == ["You add.", "2+3="]
        assert (event.sampling.temperature, event.sampling.top_p, event.sampling.max_tokens) == (0.7, 0.9, 8)
        assert event.sampling.seed == 7
        assert event.completion_token_ids and event.logprobs and event.prompt_token_ids
        assert len(event.logprobs) == len(event.completion_token_ids)
        assert all(lp <= 0 for lp in event.logprobs)
        decoded = tokenizer.decode(event.completion_token_ids, skip_special_tokens=True)
        assert decoded == event.completion_text
        prompt = tokenizer.decode(event.prompt_token_ids)
        assert "2+3=" in prompt and "You add." in prompt
        assert event.latency_ms > 0 and event.finish_reason in {"stop", "length"}
    assert [c.message.content for c in sorted(answer.choices, key=lambda c: c.index)] == [by_text[0], by_text[1]]


def test_a_streamed_text_completion_is_captured_and_streams_unchanged(served: Served, tokenizer: Any) -> None:
    with client(served).completions.with_streaming_response.create(
        model=served.model, prompt="7+8=", max_tokens=12, stream=True, user="user-42"
    ) as response:
        ids = header_ids(response.headers)
        chunks = list(response.parse())
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.logprobs is None and getattr(choice, "token_ids", None) is None
    [event] = read_completions(served, ids).values()
    assert (event.session_id, event.prompt_text, event.completion_text) == ("user-42", "7+8=", text)
    assert event.completion_token_ids and len(event.logprobs or []) == len(event.completion_token_ids)
    assert tokenizer.decode(event.completion_token_ids, skip_special_tokens=True) == text
    assert tokenizer.decode(event.prompt_token_ids).endswith("7+8=")


def _shape(value: Any) -> Any:
    """The keys of a JSON value, recursively (values of lists merged), for comparing answers' structure."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in sorted(value.items()) if k not in {"id", "created", "flywheel"}}
    if isinstance(value, list):
        return [_shape(v) for v in value[:1]]
    return type(value).__name__ if value is not None else None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_client_gets_what_vllm_would_have_answered(served: Served, path: str) -> None:
    """Greedy, so the answers must agree in text too: the router's and vLLM's own, whole and streamed."""
    body: dict[str, Any] = {"model": served.model, "max_tokens": 6, "temperature": 0}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "4+4="}]
    else:
        body["prompt"] = "4+4="
    auth = {"Authorization": f"Bearer {served.keys[CAPTURED]}"}
    direct = httpx.post(served.replica_url + path, json=body, timeout=60).json()
    routed = httpx.post(served.url + path, json=body, headers=auth, timeout=60)
    assert IDS_HEADER in routed.headers
    assert _shape(routed.json()) == _shape(direct)
    assert routed.json()["choices"] == direct["choices"]
    stream = {**body, "stream": True}
    direct_events = _sse(httpx.post(served.replica_url + path, json=stream, timeout=60).text)
    routed_events = _sse(httpx.post(served.url + path, json=stream, headers=auth, timeout=60).text)
    assert [_shape(e) for e in routed_events] == [_shape(e) for e in direct_events]
    assert [e["choices"] for e in routed_events] == [e["choices"] for e in direct_events]


def _sse(text: str) -> list[Any]:
    events = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    return [json.loads(e) for e in events[:-1]]


def test_what_the_client_asked_for_it_keeps_and_the_event_agrees(served: Served) -> None:
    raw = client(served).chat.completions.with_raw_response.create(
        model=served.model, messages=[{"role": "user", "content": "1+1="}], max_tokens=5, logprobs=True,
        top_logprobs=2, extra_body={"return_token_ids": True},
    )  # fmt: skip
    answer = raw.parse()
    choice = answer.choices[0]
    assert choice.logprobs is not None and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    [event] = read_completions(served, header_ids(raw.headers)).values()
    assert event.logprobs == pytest.approx([t.logprob for t in choice.logprobs.content])
    assert event.completion_token_ids == choice.token_ids  # type: ignore[attr-defined]


def test_a_project_without_capture_is_proxied_and_not_captured(served: Served) -> None:
    raw = client(served, NOT_CAPTURED).completions.with_raw_response.create(
        model=served.model, prompt="5+5=", max_tokens=3, user="not-captured-session"
    )
    assert raw.http_response.status_code == 200 and IDS_HEADER not in raw.headers
    assert raw.parse().choices[0].logprobs is None
    # A later captured completion is in the topic; nothing of the other project's is.
    captured = client(served).completions.with_raw_response.create(model=served.model, prompt="5+5=", max_tokens=3)
    read_completions(served, header_ids(captured.headers))
    projects = {e.project for e in all_events(served)}
    assert projects == {CAPTURED}
    assert served.router.metrics.capture_dropped.labels("buffer_full")._value.get() == 0


@pytest.mark.parametrize("stream", [False, True])
def test_the_sdk_and_the_router_record_one_completion_under_one_id(
    served: Served, tmp_path: Path, stream: bool
) -> None:
    """A product that wraps its client too: the SDK's event of each choice takes the router's id, so
    both records of a completion are one event (same event id) to ingest and rewarding."""
    from flywheel.core.contracts import Completion as SdkCompletion
    from flywheel.sdk import Flywheel
    from flywheel.sdk.transports.memory import MemoryTransport

    transport = MemoryTransport()
    with Flywheel(project=CAPTURED, transport=transport, spool_dir=tmp_path) as fw:
        wrapped = fw.wrap_openai(client(served))
        with fw.session() as s, s.span("subagent"):
            messages = [{"role": "user", "content": "3+3="}]
            if stream:
                chunks = wrapped.chat.completions.create(model=served.model, messages=messages, max_tokens=4,
                                                         n=2, stream=True)  # fmt: skip
                text = {0: "", 1: ""}
                for chunk in chunks:
                    for choice in chunk.choices:
                        text[choice.index] += choice.delta.content or ""
            else:
                answer = wrapped.chat.completions.create(model=served.model, messages=messages, max_tokens=4, n=2)
                text = {c.index: c.message.content for c in answer.choices}
        fw.flush()
    sdk = sorted((e for e in transport.events() if isinstance(e, SdkCompletion)), key=lambda e: e.completion_text)
    assert len(sdk) == 2 and all(e.event_id == e.completion_id for e in sdk)
    routed = read_completions(served, [e.completion_id for e in sdk])
    for event in sdk:
        captured = routed[event.completion_id]
        assert captured.event_id == event.event_id and captured.session_id == event.session_id
        assert captured.span == event.span and event.span.role == "subagent"  # the SDK's span headers
        assert (captured.completion_text, captured.completion_token_ids) == (
            event.completion_text, event.completion_token_ids,
        )  # fmt: skip
    assert sorted(text.values()) == [e.completion_text for e in sdk]


def test_captured_text_is_redacted_and_loses_the_token_data_of_what_changed(served: Served) -> None:
    raw = client(served).chat.completions.with_raw_response.create(
        model=served.model, messages=[{"role": "user", "content": "mail ann@example.com: 2+2="}], max_tokens=4
    )
    assert raw.parse().choices[0].message.content is not None
    [event] = read_completions(served, header_ids(raw.headers)).values()
    assert event.prompt_messages[0].content == "mail [REDACTED_EMAIL]: 2+2="
    assert event.prompt_token_ids is None  # the e-mail is one decode away in them
    if "@" not in event.completion_text:  # the model did not write one: its side keeps its token data
        assert event.completion_token_ids and event.logprobs


def test_a_product_that_only_changed_its_base_url_is_trained_on_once_rewards_arrive(
    served: Served, vllm_replica: VllmReplica, gate_engine_url: str, tmp_path: Path
) -> None:
    """Issue 19's "done when": the product sends its requests with the official openai client alone
    (base URL, key and one header); its backend reports each session's outcome and end with the
    SDK's two calls. The real rewarding worker scores the captured sessions into training samples,
    and a real training cycle trains on them, starting on-policy (the router's captured logprobs are
    the trainer's own: importance ratios of 1)."""
    from sqlalchemy import text

    from flywheel.sdk import Flywheel
    from flywheel.task import arith
    from rewarding.harness import WorkerProcess, settings_env
    from trainer.ckpt import read_sidecar
    from trainer.cycle import run_cycle

    tag = uuid.uuid4().hex[:8]
    db_url = served.engine.url.render_as_string(hide_password=False)
    only_outcome = {"outcome": 1.0, "user_signal": 0.0, "grm": 0.0, "shaping": 0.0, "summary": 0.0}
    env = settings_env(
        {
            "run_dir": str(tmp_path / "rw-run"),
            "kafka": {"bootstrap_servers": served.bootstrap, "topic_prefix": served.settings.kafka.topic_prefix},
            "postgres": {"url": db_url},
            "rewarding": {"feedback_window_s": 0.5, "session_timeout_s": 30.0, "rescore_delay_s": 0.3,
                          "timer_interval_s": 0.1, "session_timeout_broker_s": 6, "rebalance_timeout_s": 6,
                          "group_id": f"capture-rw-{tag}", "scoring": {"weights": only_outcome}},
        }
    )  # fmt: skip
    worker = WorkerProcess(env, tmp_path / "rewarding.log").start()
    product = client(served)
    problems = arith.sample_problems("train", 8, seed=19)
    sessions: dict[str, list[uuid.UUID]] = {}
    try:
        with Flywheel(project=CAPTURED, kafka_bootstrap=served.bootstrap, spool_dir=tmp_path / "spool",
                      topic_prefix=served.settings.kafka.topic_prefix) as backend:  # fmt: skip
            for p, problem in enumerate(problems):
                for k in range(4):  # four episodes of each problem: the rewarding's groups (same first prompt)
                    sid = f"captured-{tag}-{p}-{k}"
                    ids: list[uuid.UUID] = []

                    def generate(messages: list[dict[str, Any]], sid: str = sid, ids: list[uuid.UUID] = ids) -> str:
                        raw = product.chat.completions.with_raw_response.create(
                            model=served.model, messages=messages, max_tokens=32, temperature=1.0,
                            extra_headers={"x-flywheel-session-id": sid},
                        )  # fmt: skip
                        ids.extend(header_ids(raw.headers))
                        return raw.parse().choices[0].message.content or ""

                    episode = arith.run_episode(problem, generate)  # calculator calls, then an answer
                    sessions[sid] = ids
                    backend.outcome(sid, "task_solved", episode.success)
                    backend.session(sid, resume=True).end()
            assert backend.flush(30)

        def samples() -> list[Any]:
            with served.engine.connect() as conn:
                return list(
                    conn.execute(
                        text("SELECT id, session_id, completion_id, policy_version, reward FROM training_samples "
                             "WHERE project = :p AND session_id LIKE :s"),
                        {"p": CAPTURED, "s": f"captured-{tag}-%"},
                    )
                )  # fmt: skip

        n_completions = sum(len(ids) for ids in sessions.values())
        rows = wait_for(lambda: (r := samples()) and len(r) >= n_completions and r, 90, "every completion's sample")
    finally:
        worker.stop()
    assert {str(r.completion_id) for r in rows} == {str(i) for ids in sessions.values() for i in ids}
    assert {r.policy_version for r in rows} == {served.version}
    assert len({r.reward for r in rows}) > 1, "every captured session got the same reward: nothing to learn from"

    settings = Settings(
        environment="test",
        run_dir=tmp_path / "run",
        postgres={"url": db_url},
        model=served.settings.model.model_copy(update={"cache_dir": vllm_replica.model_dir.parent}),
        trainer={
            "checkpoints": {"dir": tmp_path / "checkpoints"},
            "metrics": {"textfile": tmp_path / "trainer.prom"},
            "data": {"min_samples": 16, "window_settle_s": 0.0},
            "gate": {"engine_url": gate_engine_url, "suites": {"arith": {"n": 16}}, "holdout_per_mille": 0},
            "step": {
                "learning_rate": 3e-4,
                "epochs": 1,
                "mini_batch_samples": 16,
                "show_progress": False,
                "torch_threads": 2,
            },
        },
    )
    outcome = run_cycle(f"capture:{tag}", "manual", settings)
    assert outcome.status in ("candidate", "rejected"), outcome
    with Session(served.engine) as session:
        sidecar = read_sidecar(Path(session.get(Checkpoint, outcome.checkpoint_id).path))
    assert {r.id for r in rows} <= set(sidecar.sample_ids)
    assert abs(sidecar.steps[0]["ratio_mean"] - 1.0) < 0.05  # the captured logprobs are the policy's own
