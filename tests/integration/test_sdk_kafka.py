"""The SDK against real services: a broker that goes away and comes back, and a real vLLM.

1. The broker is down while the agent logs 10,000 events: no call waits on the network,
   the spool fills; the broker comes back (a fresh Tansu on the same port, memory
   storage, so it starts empty) and after ``flush()`` a consumer reads exactly those
   10,000 events, once each, every session's events in the order they were logged.
2. ``@observe`` on async functions: a session and its spans reach the broker.
3. The OpenAI wrapper logs real completions of the project's model served by vLLM, with
   token ids, sampling logprobs and the policy version, straight through Kafka.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from flywheel.core.contracts import Completion, parse_event
from flywheel.core.contracts.topics import events_topic
from flywheel.sdk import Flywheel, current_scope, observe
from flywheel.stack.base import port_open
from flywheel.stack.broker import tansu_binary

pytestmark = pytest.mark.integration

TOPIC = events_topic("flywheel")
PARTITIONS = 4
SESSIONS = 100
EVENTS = 10_000
MAX_CALL_S = 1.5
"""Slowest single logging call allowed. A call that waited on the network would take at least
the producer's connect timeout (2 s); what stays below this bound is the interpreter's and the
machine's own noise (GIL hand-over every 5 ms, garbage collection, a CPU shared with vLLM
replicas: a 0.4 s stall was seen in CI). That no call touched the network or the disk at all is
proved exactly by :class:`ThreadIo`, not by the clock."""
MAX_TOTAL_S = 20.0
"""All 10,000 calls together (each takes microseconds: about 0.1 s in all on this machine)."""


class ThreadIo:
    """The socket and file operations one thread makes, seen through ``sys.addaudithook``.

    Audit hooks cannot be removed, so one hook is installed per process and switched on for a
    thread by :meth:`watch`. The events are CPython's own: ``socket.__new__``, ``socket.connect``,
    ``socket.sendto``, ``socket.getaddrinfo``..., and ``open`` (every ``open``/``os.open``).
    """

    _installed: ThreadIo | None = None

    def __init__(self) -> None:
        self.thread: int | None = None
        self.seen: list[str] = []

    @classmethod
    def instance(cls) -> ThreadIo:
        if cls._installed is None:
            cls._installed = cls()
            sys.addaudithook(cls._installed._hook)
            cls._installed.watch()
            open(os.devnull).close()  # the hook must see what it is there to see
            assert cls._installed.stop() == [f"open {(os.devnull, 'r')!r}"], "the audit hook saw no open()"
        return cls._installed

    def _hook(self, event: str, args: tuple) -> None:
        if self.thread is not None and threading.get_ident() == self.thread:
            if event.startswith("socket.") or event == "open":
                self.seen.append(f"{event} {args[:2]!r}")

    def watch(self) -> None:
        """Record the calling thread's operations from now on (forgetting earlier ones).

        Garbage that earlier tests left is collected first, and the cyclic collector is off
        while watching: a CI run once saw the finaliser of another module's abandoned asyncio
        task ("Task was destroyed but it is pending!") run on this thread and read source
        files for its log's traceback, which is nothing the SDK did.
        """
        gc.collect()
        gc.disable()
        self.thread, self.seen = threading.get_ident(), []

    def stop(self) -> list[str]:
        """Stop recording; what the thread did while watched."""
        self.thread = None
        gc.enable()
        return self.seen


class Tansu:
    """A Tansu broker of this test's own (memory storage), that can be stopped and started again."""

    def __init__(self, port: int, log_path: Path):
        self.port = port
        self.bootstrap = f"127.0.0.1:{port}"
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        url = f"tcp://{self.bootstrap}"
        argv = [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
                "--storage-engine", "memory://tansu/"]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while not port_open("127.0.0.1", self.port):
            assert self.process.poll() is None, f"tansu exited: {self.log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "tansu did not listen within 15 s"
            time.sleep(0.05)
        self.create_topic()

    def create_topic(self) -> None:
        """The events topic (memory storage: gone after every restart)."""
        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap)
        try:
            admin.create_topics([NewTopic(TOPIC, num_partitions=PARTITIONS, replication_factor=1)])
        except TopicAlreadyExistsError:
            pass  # the SDK's producer reconnected first and the broker auto-created it
        finally:
            admin.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None


@pytest.fixture
def tansu(unused_port: Callable[[], int], tmp_path: Path) -> Iterator[Tansu]:
    """A broker on a free port, not started yet; stopped at the end whatever happens."""
    broker = Tansu(unused_port(), tmp_path / "tansu.log")
    yield broker
    broker.stop()


def read_all(bootstrap: str, want: int, timeout_s: float = 60.0) -> list:
    """Every record of the events topic, partition by partition in offset order."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=1000)
    try:
        partitions = [TopicPartition(TOPIC, p) for p in sorted(consumer.partitions_for_topic(TOPIC) or [])]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        records: list = []
        deadline = time.monotonic() + timeout_s
        while len(records) < want and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
        # anything beyond ``want`` (duplicates) must show up too: drain a little longer
        for batch in consumer.poll(timeout_ms=1000).values():
            records.extend(batch)
        return records
    finally:
        consumer.close()


def test_broker_outage_spools_then_replays_everything_in_order(tansu: Tansu, tmp_path: Path, fault_figures) -> None:
    fw = Flywheel(project="sdk-outage", kafka_bootstrap=tansu.bootstrap, spool_dir=tmp_path / "spool")
    try:
        logged: dict[str, list[str]] = {}
        durations: list[float] = []
        clock = time.perf_counter
        agent_io = ThreadIo.instance()
        agent_io.watch()
        started = clock()
        sessions = []
        for i in range(SESSIONS):
            t0 = clock()
            sessions.append(fw.session(f"outage-{i}", user_id=f"user-{i}"))
            durations.append(clock() - t0)
            logged[sessions[-1].session_id] = [str(sessions[-1].last_event_id)]
        for step in range(EVENTS // SESSIONS - 2):
            for s in sessions:
                t0 = clock()
                s.tool_call("search", json.dumps({"step": step}), id=f"call-{step}")
                durations.append(clock() - t0)
                logged[s.session_id].append(str(s.last_event_id))
        for s in sessions:
            t0 = clock()
            s.end()
            durations.append(clock() - t0)
            logged[s.session_id].append(str(s.last_event_id))
        total = clock() - started
        agent_did = agent_io.stop()
        assert len(durations) == EVENTS
        # what is asserted is the behaviour: no call touched a socket or a file on the agent's
        # thread, so none could wait on the unreachable broker or the disk (how fast a call is,
        # p50/p99, is a speed goal measured by bench/ingest.py)
        assert agent_did == [], f"the agent's thread did I/O: {agent_did[:5]}"
        assert max(durations) < MAX_CALL_S, f"slowest call {max(durations) * 1e3:.1f} ms"
        assert total < MAX_TOTAL_S, f"{EVENTS} calls took {total:.2f} s"

        deadline = time.monotonic() + 60
        while fw.stats.spooled < EVENTS:
            assert time.monotonic() < deadline, f"spool did not fill: {fw.stats}"
            time.sleep(0.05)
        stats = fw.stats
        assert (stats.sent, stats.dropped, stats.invalid) == (0, 0, 0)
        assert stats.spool_bytes > EVENTS * 100

        tansu.start()
        assert fw.flush(120), f"not delivered after the broker came back: {fw.stats}"
        stats = fw.stats
        assert (stats.sent, stats.replayed, stats.dropped, stats.spool_bytes) == (EVENTS, EVENTS, 0, 0)
    finally:
        fw.close(5)

    records = read_all(tansu.bootstrap, EVENTS)
    events = [parse_event(r.value) for r in records]
    ids = [str(e.event_id) for e in events]
    logged_ids = {i for per_session in logged.values() for i in per_session}
    fault_figures(sent=EVENTS, stored=len(ids), distinct=len(set(ids) & logged_ids))
    assert len(ids) == EVENTS and len(set(ids)) == EVENTS, f"{len(ids)} records, {len(set(ids))} distinct"
    assert set(ids) == {i for per_session in logged.values() for i in per_session}
    assert all(r.key.decode() == e.session_id for r, e in zip(records, events))
    seen: dict[str, list[str]] = {}
    for event in events:  # records come partition by partition; a session lives in one partition
        seen.setdefault(event.session_id, []).append(str(event.event_id))
    assert seen == logged


def test_events_never_flushed_are_sent_at_interpreter_exit(tansu: Tansu, tmp_path: Path) -> None:
    tansu.start()
    code = f"""
from flywheel import Flywheel
fw = Flywheel(project="sdk-exit", kafka_bootstrap={tansu.bootstrap!r}, spool_dir={str(tmp_path / "spool")!r},
              linger_ms=10_000)  # the idle sender would not look again before exit: the exit hook must
s = fw.session("exit-1")
for i in range(200):
    s.tool_call("t", str(i))
print(fw.stats.sent)  # nothing flushed, no close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "0"
    events = [parse_event(r.value) for r in read_all(tansu.bootstrap, 201, timeout_s=20)]
    assert [e.session_id for e in events] == ["exit-1"] * 201


def test_an_event_too_large_for_kafka_is_counted_invalid_and_the_rest_delivered(tansu: Tansu, tmp_path: Path) -> None:
    tansu.start()
    fw = Flywheel(project="sdk-big", kafka_bootstrap=tansu.bootstrap, spool_dir=tmp_path / "spool", redact=False,
                  max_event_bytes=1_048_576)  # fmt: skip
    try:
        with fw.session("big-1") as s:
            s.message("user", "before")
            s.completion(model="m", prompt_text="p" * 700_000, completion_text="c" * 700_000)  # > 1 MiB serialized
            s.message("user", "after")
        assert fw.flush(30), fw.stats
        stats = fw.stats
        assert (stats.sent, stats.invalid, stats.dropped) == (4, 1, 0)
    finally:
        fw.close(5)
    events = [parse_event(r.value) for r in read_all(tansu.bootstrap, 4, timeout_s=20)]
    assert [e.type.value for e in events] == ["session_start", "turn", "turn", "session_end"]


async def test_observed_async_functions_reach_the_broker_as_a_session_and_spans(tansu: Tansu, tmp_path: Path) -> None:
    tansu.start()
    fw = Flywheel(project="sdk-observe", kafka_bootstrap=tansu.bootstrap, spool_dir=tmp_path / "spool")

    @observe(role="searcher", client=fw)
    async def search(query: str) -> str:
        await asyncio.sleep(0)
        current_scope().tool_call("search", {"q": query}, id="call-1")  # type: ignore[union-attr]
        return "3 results"

    @observe(session_id_arg="conversation_id", name="support-bot", client=fw)
    async def handle(conversation_id: str, text: str) -> str:
        return await search(text)

    try:
        assert await handle("conv-observe-1", "refund policy") == "3 results"
        with pytest.raises(RuntimeError, match="model down"):
            await observe(session_id_arg="conversation_id", client=fw)(_failing_handler)("conv-observe-2")
        assert await fw.aflush(30), fw.stats
    finally:
        await fw.aclose(5)
    events = [parse_event(r.value) for r in read_all(tansu.bootstrap, 8, timeout_s=20)]
    ok = [e for e in events if e.session_id == "conv-observe-1"]
    assert [e.type.value for e in ok] == ["session_start", "span_start", "turn", "span_end", "session_end"]
    start, span_start, turn, span_end, end = ok
    assert start.agent == "support-bot" and end.status == "completed"
    assert (span_start.parent_span_id, span_start.role) == ("root", "searcher")
    assert (turn.span.span_id, turn.span.role, turn.tool_calls[0].name) == (span_start.span_id, "searcher", "search")
    assert (span_end.span_id, span_end.status) == (span_start.span_id, "completed")
    failed = [e for e in events if e.session_id == "conv-observe-2"]
    assert [e.type.value for e in failed] == ["session_start", "session_end"]
    assert failed[-1].status == "failed" and failed[-1].error == "RuntimeError: model down"


async def _failing_handler(conversation_id: str) -> None:
    raise RuntimeError("model down")


@pytest.mark.vllm
def test_wrapper_logs_real_completions_with_token_data(vllm_replica, kafka_bootstrap: str, tmp_path: Path) -> None:
    import openai

    from flywheel.sdk.openai import as_name, completion_ids

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        admin.create_topics([NewTopic(TOPIC, num_partitions=PARTITIONS, replication_factor=1)])
    except (TopicAlreadyExistsError, KafkaError):
        pass
    finally:
        admin.close()
    fw = Flywheel(project="sdk-vllm", kafka_bootstrap=kafka_bootstrap, spool_dir=tmp_path / "spool")
    client = fw.wrap_openai(openai.OpenAI(base_url=f"{vllm_replica.url}/v1", api_key="unused", max_retries=0))
    messages = [{"role": "user", "content": "3+4="}]
    try:
        with fw.session(task="arith") as s:
            chat = client.chat.completions.create(
                model=vllm_replica.model, messages=messages, max_tokens=8, temperature=1.0
            )
            assert chat.choices[0].message is not None  # the agent gets a normal response
            text = client.completions.create(model=vllm_replica.model, prompt="3+4=", max_tokens=8, temperature=1.0)
            stream = client.chat.completions.create(
                model=vllm_replica.model, messages=messages, max_tokens=8, temperature=1.0, stream=True
            )
            chunks = list(stream)
            assert chunks and all(c.choices for c in chunks)  # the usage chunk the SDK asked for is not shown
        outside = client.completions.create(model=vllm_replica.model, prompt="1+1=", max_tokens=2)
        assert completion_ids(outside) == []  # no session: not logged
        assert fw.flush(30), fw.stats
    finally:
        fw.close(5)

    ids = {*completion_ids(chat), *completion_ids(text), *completion_ids(stream)}
    assert len(ids) == 3
    completions = {}
    for record in read_all(kafka_bootstrap, 1000, timeout_s=10):
        event = parse_event(record.value)
        if isinstance(event, Completion) and event.completion_id in ids:
            completions[event.completion_id] = event
    assert set(completions) == ids
    for event in completions.values():
        assert event.session_id == s.session_id
        assert event.policy_version == as_name(vllm_replica.model)  # no router in front: the served model
        assert event.completion_token_ids and event.prompt_token_ids
        assert event.logprobs is not None and len(event.logprobs) == len(event.completion_token_ids)
        assert all(lp <= 0 for lp in event.logprobs)
        assert event.latency_ms > 0 and event.sampling.temperature == 1.0 and event.sampling.max_tokens == 8
    chat_event = completions[completion_ids(chat)[0]]
    assert (
        chat_event.prompt_messages[0].content == "3+4="
        and chat_event.completion_text == chat.choices[0].message.content
    )
    text_event = completions[completion_ids(text)[0]]
    assert text_event.prompt_text == "3+4=" and text_event.completion_text == text.choices[0].text
    stream_event = completions[completion_ids(stream)[0]]
    assert stream_event.completion_text == "".join(c.choices[0].delta.content or "" for c in chunks)
