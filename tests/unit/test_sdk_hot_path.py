"""The agent's thread never waits: not on a hanging network, not on a full queue, not on a slow sender."""

from __future__ import annotations

import gc
import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from flywheel.sdk import Flywheel
from flywheel.sdk.transports.base import Envelope, SendResult, Transport
from flywheel.sdk.transports.http import HttpTransport

P99_BUDGET_US = 50.0
"""The SDK's target for one logging call on the agent's thread."""
MAX_CALL_S = 0.1
"""No single call may take this long. Network waits here would be >= the HTTP timeout (seconds);
what remains below it is the interpreter's and the machine's own noise (GIL hand-over every
5 ms, garbage collection, other processes on a loaded CPU)."""


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A TCP port that accepts connections (the kernel does) but never answers a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(128)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def timed_calls(fw: Flywheel, n: int, sessions: int = 50) -> list[float]:
    scopes = [fw.session(f"s-{i}") for i in range(sessions)]
    gc.collect()  # earlier tests' garbage is theirs: measure the SDK's calls, not their collection
    clock = time.perf_counter
    durations = []
    for i in range(n):
        scope = scopes[i % sessions]
        start = clock()
        scope.tool_call("search", '{"q": "flywheel"}', id="c1")
        durations.append(clock() - start)
    return durations


def p99(durations: list[float]) -> float:
    return sorted(durations)[int(len(durations) * 0.99)]


def test_a_hanging_gateway_never_blocks_the_agent(blackhole: str, tmp_path) -> None:
    transport = HttpTransport(blackhole, "fwk_test", timeout_s=30.0)
    fw = Flywheel(project="hot", transport=transport, spool_dir=tmp_path, queue_size=50_000)
    durations = timed_calls(fw, 20_000)
    assert max(durations) < MAX_CALL_S, f"slowest call {max(durations) * 1e3:.1f} ms"
    assert p99(durations) * 1e6 < P99_BUDGET_US, f"p99 {p99(durations) * 1e6:.1f} us"
    assert sum(durations) < 1.0
    assert fw.stats.sent == 0  # the sender is stuck in the hanging request, the agent is not
    assert not fw.flush(0.2)
    transport.close()  # unblock the sender: the request fails, the batch is spooled, nothing lost
    fw.close(2)
    assert fw.stats.dropped == 0


class StuckTransport(Transport):
    """A transport whose send never returns until released (a sender that cannot make progress)."""

    name = "stuck"

    def __init__(self) -> None:
        self.release = threading.Event()

    def send(self, batch: list[Envelope]) -> SendResult:  # type: ignore[override]
        self.release.wait()
        return SendResult(sent=len(batch))


def test_a_full_queue_drops_counted_and_warned_without_waiting(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    transport = StuckTransport()
    fw = Flywheel(project="hot", transport=transport, spool_dir=tmp_path, queue_size=1_000, batch_size=10)
    with caplog.at_level(logging.WARNING, logger="flywheel.sdk"):
        durations = timed_calls(fw, 5_000, sessions=1)
    assert max(durations) < MAX_CALL_S
    stats = fw.stats
    assert stats.dropped >= 5_000 + 1 - 1_000 - 10 and stats.queued == 1_000
    assert any("queue full" in r.getMessage() and "DROPPED" in r.getMessage() for r in caplog.records)
    transport.release.set()
    assert fw.flush(10)
    fw.close()
    assert fw.stats.sent + fw.stats.dropped == 5_001
