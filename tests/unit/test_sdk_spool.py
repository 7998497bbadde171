"""The disk spool: bounded, ordered, durable across restarts; and the sender's use of it."""

from __future__ import annotations

import logging
import time

import pytest

from flywheel.sdk import Flywheel
from flywheel.sdk.spool import Spool, encode
from flywheel.sdk.transports.base import Envelope
from flywheel.sdk.transports.memory import MemoryTransport


def envs(n: int, start: int = 0, size: int = 20) -> list[Envelope]:
    return [Envelope(f"s{i % 3}".encode(), f"{i:0{size}d}".encode()) for i in range(start, start + n)]


def drain(spool: Spool, batch: int = 7) -> list[Envelope]:
    out = []
    while not spool.empty:
        got = spool.peek(batch)
        assert got, "a non-empty spool must return records"
        out.extend(got)
        spool.ack(len(got))
    return out


def test_fifo_across_segments_and_files_removed_after_ack(tmp_path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=256)
    spool.append(envs(50))
    assert len(list(spool.lane.glob("*.spool"))) > 3
    first = spool.peek(5)
    spool.ack(2)  # partial ack: the rest of the peeked records come again
    assert spool.peek(3) == first[2:5]
    spool.append(envs(10, start=50))  # appends while replaying keep their place at the end
    assert [e.value for e in first[:2] + drain(spool)] == [e.value for e in envs(60)]
    assert spool.bytes == 0 and list(spool.lane.glob("*.spool")) == []
    spool.close()


def test_bounded_append_stores_a_contiguous_prefix(tmp_path) -> None:
    record = len(encode(envs(1)[0]))
    spool = Spool(tmp_path, max_bytes=record * 10)
    assert spool.append(envs(25)) == 10
    assert spool.bytes == record * 10
    assert spool.append(envs(1, start=99)) == 0
    assert [e.value for e in drain(spool)] == [e.value for e in envs(10)]
    assert spool.append(envs(3, start=10)) == 3  # room again once replayed
    spool.close()


def test_survives_restart_and_skips_a_torn_tail(tmp_path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append(envs(5))
    spool.close()
    segment = next(tmp_path.glob("lane-0/*.spool"))
    with open(segment, "ab") as f:
        f.write(encode(envs(1, start=5)[0])[:-3])  # a crash in the middle of a write
    again = Spool(tmp_path, max_bytes=1 << 20)
    assert again.lane == spool.lane and not again.empty
    assert [e.value for e in drain(again)] == [e.value for e in envs(5)]
    again.close()


def test_each_client_claims_its_own_lane(tmp_path) -> None:
    a = Spool(tmp_path, max_bytes=1 << 20)
    b = Spool(tmp_path, max_bytes=1 << 20)
    assert a.lane != b.lane
    a.close()
    c = Spool(tmp_path, max_bytes=1 << 20)
    assert c.lane == a.lane  # released lanes are reused (and what they hold is replayed)
    b.close()
    c.close()


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_outage_spools_then_replays_in_order(tmp_path) -> None:
    transport = MemoryTransport()
    transport.unavailable = "broker down"
    fw = Flywheel(project="spool", transport=transport, spool_dir=tmp_path, batch_size=50)
    sessions = [fw.session(f"s-{i}") for i in range(5)]
    logged: dict[str, list[str]] = {s.session_id: [str(s.last_event_id)] for s in sessions}
    for i in range(1000):
        s = sessions[i % 5]
        s.tool_call("t", str(i))
        logged[s.session_id].append(str(s.last_event_id))
    wait_for(lambda: fw.stats.spooled == 1005)
    assert fw.stats.sent == 0 and fw.stats.spool_bytes > 0
    assert not fw.flush(0.5)  # still down: nothing lost, nothing delivered
    transport.unavailable = None
    for s in sessions:  # logged after the outage: must come after everything spooled
        s.end()
        logged[s.session_id].append(str(s.last_event_id))
    assert fw.flush(10)
    fw.close()
    seen: dict[str, list[str]] = {}
    for event in transport.events():
        seen.setdefault(event.session_id, []).append(str(event.event_id))
    assert seen == logged
    stats = fw.stats
    assert (stats.sent, stats.dropped, stats.spool_bytes) == (1010, 0, 0)
    assert stats.replayed >= 1005


def test_full_spool_drops_are_counted_and_warned(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    transport = MemoryTransport()
    transport.unavailable = "broker down"
    fw = Flywheel(project="spool", transport=transport, spool_dir=tmp_path, spool_max_bytes=20_000)
    s = fw.session("s-1")
    with caplog.at_level(logging.WARNING, logger="flywheel.sdk"):
        for _ in range(500):
            s.tool_call("t", "x" * 100)
        wait_for(lambda: fw.stats.spooled + fw.stats.dropped == 501)
    stats = fw.stats
    assert stats.dropped > 0 and stats.spooled > 0 and stats.spool_bytes <= 20_000
    assert any("DROPPED" in r.getMessage() and "spool full" in r.getMessage() for r in caplog.records)
    transport.unavailable = None
    assert fw.flush(10)
    fw.close()
    delivered = [e.event_id for e in transport.events()]
    assert len(delivered) == stats.spooled  # what was kept is delivered, oldest first
    assert delivered == sorted(delivered)


def test_a_restarted_process_replays_what_the_last_one_left(tmp_path) -> None:
    down = MemoryTransport()
    down.unavailable = "broker down"
    fw = Flywheel(project="spool", transport=down, spool_dir=tmp_path)
    with fw.session("s-1") as s:
        s.tool_call("t")
    assert not fw.close(0.5)  # could not deliver: left in the spool
    up = MemoryTransport()
    fw2 = Flywheel(project="spool", transport=up, spool_dir=tmp_path)
    assert fw2.flush(10)
    fw2.close()
    assert [e.type for e in up.events()] == ["session_start", "turn", "session_end"]
