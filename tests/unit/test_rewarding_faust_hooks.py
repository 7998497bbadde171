"""The worker's faust app uses the project's hooks: awaited changelogs, recovery to the real
end of each changelog, and the bounded fetch wait (no broker needed: nothing connects)."""

from __future__ import annotations

from flywheel.core.settings import Settings
from rewarding.app import RewardingApp
from rewarding.changelog import ChangelogEndRecovery, ChangelogTable
from rewarding.scorer import Scorer
from rewarding.topics import Topics
from rewarding.transport import ConsumerThread


def worker_app(settings: Settings) -> RewardingApp:
    """A rewarding worker built from ``settings`` (nothing connects: no broker, no database)."""
    scorer = Scorer.from_settings(settings.rewarding, lambda: "http://127.0.0.1:1")
    db_url = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    return RewardingApp(settings, "127.0.0.1:1", db_url, scorer, Topics("t.events", "t.scored", 2))


def test_worker_app_uses_the_changelog_and_fetch_hooks(tmp_path) -> None:
    settings = Settings(run_dir=tmp_path)
    settings.rewarding.fetch_max_wait_s = 0.05
    worker = worker_app(settings)
    assert isinstance(worker.table, ChangelogTable) and isinstance(worker.marks, ChangelogTable)
    assert isinstance(worker.app.tables.recovery, ChangelogEndRecovery)
    consumer = worker.app.consumer
    assert isinstance(consumer._thread, ConsumerThread)
    assert consumer.transport.fetch_max_wait_ms == 50


def test_eviction_drops_every_stale_state_in_one_pass(tmp_path, monkeypatch) -> None:
    """More stale states than one chunk: all go in one pass; pending or recent ones stay."""
    import asyncio
    import time
    from types import SimpleNamespace

    from rewarding.session_state import SessionState

    settings = Settings(run_dir=tmp_path)
    settings.rewarding.state_retention_s = 60.0
    settings.rewarding.finalize_batch_max = 7
    worker = worker_app(settings)
    sent: list[tuple[bytes, object]] = []

    def send(self, partition, key, value, *args, **kwargs):  # what the broker would get
        sent.append((key, value))
        return SimpleNamespace(message=SimpleNamespace(partition=0))

    monkeypatch.setattr(ChangelogTable, "send_changelog", send)
    monkeypatch.setattr(worker, "ready", lambda: True)
    monkeypatch.setattr(worker, "owned", lambda: {0, 1})
    now = time.time()

    def put(sid: str, *, last_arrival: float, pending: bool) -> None:
        state = SessionState("p", sid, last_arrival=last_arrival, pending_since=last_arrival if pending else None)
        worker.table.data[sid.encode()] = {"p": state.to_dict()}

    for i in range(30):
        put(f"old-{i}", last_arrival=now - 120, pending=False)
    put("recent", last_arrival=now - 5, pending=False)
    put("old-but-pending", last_arrival=now - 120, pending=True)

    dropped = asyncio.run(worker.evict(now, {0, 1}))

    assert dropped == 30
    assert sorted(worker.table.data.keys()) == [b"old-but-pending", b"recent"]
    assert sorted(k for k, v in sent if v is None) == sorted(f"old-{i}".encode() for i in range(30))  # tombstones


def test_the_watchdog_counts_a_rebalance_but_not_a_recovery(tmp_path, monkeypatch) -> None:
    settings = Settings(run_dir=tmp_path)
    settings.rewarding.rebalance_watchdog_s = 60.0
    worker = worker_app(settings)
    recovering = {"now": False}
    monkeypatch.setattr(type(worker.app), "in_recovery", property(lambda self: recovering["now"]))
    assert worker.rebalance_stuck_for(1000.0) is None  # not rebalancing
    worker.app.rebalancing = True
    assert worker.rebalance_stuck_for(1000.0) is None  # the clock starts
    assert worker.rebalance_stuck_for(1059.0) is None
    assert worker.rebalance_stuck_for(1061.0) == 61.0  # past the limit: the timer exits
    recovering["now"] = True
    assert worker.rebalance_stuck_for(1100.0) is None  # recovering a table is progress: the clock resets
    recovering["now"] = False
    assert worker.rebalance_stuck_for(1101.0) is None and worker.rebalance_stuck_for(1160.0) is None
    worker.app.rebalancing = False
    assert worker.rebalance_stuck_for(2000.0) is None


def _acking(prior_fails: bool = False):
    """Two batches acked through ``RewardingApp._ack_when_written``; the second batch's changelog
    record is acknowledged by the broker before the first's."""
    import asyncio
    from types import SimpleNamespace

    async def go():
        acked, crashed = [], []

        async def ack(event):
            acked.append(event)

        async def crash(err):
            crashed.append(err)

        host = SimpleNamespace(app=SimpleNamespace(crash=crash))
        stream = SimpleNamespace(ack=ack)
        loop = asyncio.get_running_loop()
        first_write, second_write = loop.create_future(), loop.create_future()
        first = asyncio.ensure_future(RewardingApp._ack_when_written(host, stream, ["a1", "a2"], [first_write], None))
        second = asyncio.ensure_future(RewardingApp._ack_when_written(host, stream, ["b1"], [second_write], first))
        second_write.set_result(None)
        await asyncio.sleep(0.01)
        early = list(acked)
        if prior_fails:
            first_write.set_exception(ConnectionError("broker gone"))
        else:
            first_write.set_result(None)
        results = await asyncio.gather(first, second, return_exceptions=True)
        return early, acked, crashed, results

    return asyncio.run(go())


def test_batches_are_acked_in_order_when_their_changelog_writes_complete_out_of_order() -> None:
    # faust commits past one unacked offset at the head of a partition's acks (it takes its
    # committed offset + 1 for contiguous): a later batch acked first could commit the
    # earlier batch's last record before it is written
    early, acked, crashed, results = _acking()
    assert early == []  # the second batch waits for the first
    assert acked == ["a1", "a2", "b1"] and crashed == [] and results == [None, None]


def test_a_failed_changelog_write_leaves_the_later_batches_unacked() -> None:
    early, acked, crashed, results = _acking(prior_fails=True)
    assert acked == [] and len(crashed) == 1
    assert all(isinstance(r, ConnectionError) for r in results)


def test_resuming_an_active_flow_keeps_the_stream_queue(tmp_path) -> None:
    """Recovery resumes the flow a second time after it sought the stream partitions to their
    committed offsets; records delivered in between must stay queued (mode's resume cleared
    them: a hole at each partition's committed offset). A resume after a suspension still clears."""
    from rewarding.app import ResumeKeepsQueues

    worker = worker_app(Settings(run_dir=tmp_path))
    flow, queue = worker.app.flow_control, worker.events.queue
    assert isinstance(flow, ResumeKeepsQueues) and queue._flow_control is flow and queue._clear_on_resume

    flow.suspend()  # a revoke: suspend, then clear
    flow.clear()
    queue.put_nowait("left over")  # a delivery that got past the flow control before the suspension
    flow.resume()  # recovery resumes the flow to read the changelogs
    assert queue.empty() and flow.is_active()

    queue.put_nowait("fetched from the committed offset")
    flow.resume()  # recovery's second resume, once the tables are recovered
    assert flow.is_active() and queue.qsize() == 1 and queue.get_nowait() == "fetched from the committed offset"


def test_the_lean_monitor_keeps_what_the_stall_check_reads(tmp_path) -> None:
    """faust's consumer calls a partition's stream stalled (an error in the log) when its monitor has
    no recent ``stream_inbound_time`` for it while the partition has a backlog."""
    import time

    from faust.types import TP

    from rewarding.app import LeanMonitor

    worker = worker_app(Settings(run_dir=tmp_path))
    monitor, tp = worker.app.monitor, TP("t.events", 1)
    assert isinstance(monitor, LeanMonitor)
    before = time.monotonic()
    assert monitor.on_stream_event_in(tp, 7, None, None) is None
    assert before <= monitor.stream_inbound_time[tp] <= time.monotonic()
    assert monitor.events_total == 0  # the web views' statistics stay off
