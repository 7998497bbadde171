"""The rewarding consumer's per-message hand-over (``rewarding.transport.Consumer._deliver``):
faust's ``wait_first(callback(message), suspend_flow.wait())`` contract with one task per message."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rewarding.transport import Consumer


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
