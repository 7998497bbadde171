"""The rewarding consumer's per-message hand-over (``rewarding.transport.Consumer._deliver``):
faust's ``wait_first(callback(message), suspend_flow.wait())`` contract with one task per message;
and its fetch loop, which records no read offset for a delivery a rebalance interrupted."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from types import SimpleNamespace

import pytest

from rewarding.transport import Consumer, _Started


class Host(SimpleNamespace):
    """What ``_deliver`` uses of the consumer: its abort watcher slot, ``suspend_flow`` and a
    ``wait_first`` that ends when any of its events is set (mode's also watches stop and crash)."""

    def __init__(self) -> None:
        super().__init__(_abort=None, suspend_flow=asyncio.Event(), watchers=0)

    async def wait_first(self, *coros):
        self.watchers += 1
        done, pending = await asyncio.wait([asyncio.ensure_future(c) for c in coros], return_when="FIRST_COMPLETED")
        for f in pending:
            f.cancel()
        return done

    async def deliver(self, callback, message):
        return await Consumer._deliver(self, callback, message)


def run(coro):
    return asyncio.run(coro)


def test_deliveries_complete_in_order_and_share_one_watcher() -> None:
    async def go():
        host, seen = Host(), []

        async def callback(message):
            await asyncio.sleep(0)
            seen.append(message)

        for m in range(50):
            await host.deliver(callback, m)
        return host, seen

    host, seen = run(go())
    assert seen == list(range(50))
    assert host.watchers == 1  # not one watcher (three tasks in faust) per message


def test_a_delivery_that_never_waits_runs_at_once_with_no_task_or_watcher() -> None:
    async def go():
        host, seen = Host(), []

        async def callback(message):
            seen.append(message)  # the conductor's put on a queue with room: no wait

        tasks_before = len(asyncio.all_tasks())
        for m in range(5):
            await host.deliver(callback, m)
            assert seen[-1] == m  # delivered before the hand-over returns
        return host, seen, len(asyncio.all_tasks()) - tasks_before

    host, seen, new_tasks = run(go())
    assert seen == list(range(5)) and host.watchers == 0 and host._abort is None and new_tasks == 0


def started(coro):
    """``coro`` run up to its first wait, and a task driving the rest (as ``_deliver`` does)."""
    waiting_on = coro.send(None)
    return asyncio.ensure_future(_Started(coro, waiting_on))


def test_a_started_delivery_finishes_in_its_task_with_its_result() -> None:
    async def go():
        gate, steps = asyncio.Event(), []

        async def delivery():
            steps.append("before")
            await gate.wait()
            await asyncio.sleep(0)
            steps.append("after")
            return "done"

        task = started(delivery())
        assert steps == ["before"]
        await asyncio.sleep(0.01)
        assert not task.done()  # still waiting on the gate
        gate.set()
        return await task, steps

    assert run(go()) == ("done", ["before", "after"])


def test_a_started_delivery_cancelled_before_its_task_ran_is_cancelled_at_its_wait() -> None:
    async def go():
        cleaned = []

        async def delivery():
            try:
                await asyncio.Event().wait()
            finally:
                cleaned.append(True)

        task = started(delivery())
        task.cancel()  # before the task's first step
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled(), cleaned

    assert run(go()) == (True, [True])


def test_a_blocked_delivery_is_abandoned_when_the_flow_is_suspended() -> None:
    async def go():
        host, cancelled = Host(), asyncio.Event()

        async def blocked(message):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        asyncio.get_running_loop().call_later(0.05, host.suspend_flow.set)
        await asyncio.wait_for(host.deliver(blocked, "m"), timeout=5)
        await asyncio.sleep(0)
        # while suspended, a delivery that would block is abandoned at once, with a fresh watcher
        await asyncio.wait_for(host.deliver(blocked, "n"), timeout=5)
        return host, cancelled.is_set()

    host, cancelled = run(go())
    assert cancelled and host.watchers == 2


def test_the_deliverys_exception_is_raised() -> None:
    async def go():
        async def broken(message):
            raise ValueError(f"cannot decode {message}")

        await Host().deliver(broken, "m")

    with pytest.raises(ValueError, match="cannot decode m"):
        run(go())


def message(offset: int, generation: int = 1) -> SimpleNamespace:
    return SimpleNamespace(offset=offset, generation_id=generation, topic="t", key=None, value=None)


class Loop(Host):
    """What ``_drain_messages`` uses besides: one fetched batch from ``getmany``, then a stop."""

    def __init__(self, batch) -> None:
        super().__init__()
        self.batch, self.seen = batch, []
        self.flow_active = True
        self.app = SimpleNamespace(consumer_generation_id=1, topics=SimpleNamespace(acks_enabled_for=lambda t: True))
        self._read_offset = defaultdict(lambda: None)  # as faust keeps them
        self._stopped, self.fetcher = asyncio.Event(), SimpleNamespace(_stopped=asyncio.Event())
        self.diag = SimpleNamespace(set_flag=lambda f: None, unset_flag=lambda f: None)
        self._commit_every, self._n_acked, self.should_stop, self._seeks = None, 0, False, 0
        self.consumer_stopped_errors = ()
        self.log = SimpleNamespace(dev=lambda *a: None, exception=lambda *a: None)

    async def getmany(self, timeout):
        self.fetcher._stopped.set()  # one batch, then the loop ends
        for m in self.batch:
            if not self.flow_active:
                break  # faust's generator checks the flow between two messages
            yield "tp", m

    async def sleep(self, s):
        await asyncio.sleep(s)

    async def _deliver(self, callback, message):
        return await Consumer._deliver(self, callback, message)

    async def callback(self, m):
        self.seen.append(m.offset)
        if m.offset == 21:  # the revoke, as faust's consumer does it: offsets dropped, flow stopped
            self._read_offset.pop("tp", None)
            self.flow_active = False
        if m.offset == 42:  # a seek to the committed offset (40) while the flow stays active
            self._seeks += 1
            self._read_offset["tp"] = 40


def drained(offsets: range) -> Loop:
    """The fetch loop run over one batch of messages at ``offsets``."""

    async def go():
        loop = Loop([message(o) for o in offsets])
        await Consumer._drain_messages(loop, loop.fetcher)
        return loop

    return run(go())


def test_a_delivery_that_ends_after_a_revoke_does_not_record_a_stale_read_offset() -> None:
    loop = drained(range(20, 25))
    assert loop.seen == [20, 21]
    assert "tp" not in loop._read_offset  # faust would record 21 for a partition it no longer holds


def test_deliveries_record_their_read_offsets_when_no_rebalance_intervenes() -> None:
    loop = drained(range(30, 35))
    assert loop.seen == [30, 31, 32, 33, 34]
    assert loop._read_offset == {"tp": 34}


def test_a_delivery_that_ends_after_a_seek_does_not_record_its_offset_over_the_seeks() -> None:
    loop = drained(range(41, 43))
    # 42's hand-over spanned the seek: recording 42 would drop 40 and 41, fetched again, as read
    assert loop.seen == [41, 42] and loop._read_offset == {"tp": 40}
