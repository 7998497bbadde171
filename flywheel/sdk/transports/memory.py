"""An in-memory transport, for a product's own tests and dry runs: events are kept, not sent.

``Flywheel(project=..., transport=MemoryTransport())``; then ``transport.events()`` are
the parsed events in the order they were delivered. Setting ``unavailable`` to a reason
makes it refuse batches as a down broker would (the SDK then spools and retries).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from flywheel.core.contracts.events import Event, parse_event
from flywheel.sdk.transports.base import Envelope, SendResult, Transport, failed


class MemoryTransport(Transport):
    """Keeps every delivered envelope in memory, in delivery order."""

    name = "memory"

    def __init__(self) -> None:
        self.envelopes: list[Envelope] = []
        self.unavailable: str | None = None
        """When set, every batch is refused with this reason (retried later by the SDK)."""
        self.batches = 0
        """Batches delivered."""
        self._lock = threading.Lock()

    def send(self, batch: Sequence[Envelope]) -> SendResult:
        reason = self.unavailable
        if reason is not None:
            return failed(reason)
        with self._lock:
            self.envelopes.extend(batch)
            self.batches += 1
        return SendResult(sent=len(batch))

    def events(self) -> list[Event]:
        """The delivered events, parsed, in delivery order."""
        with self._lock:
            envelopes = list(self.envelopes)
        return [parse_event(envelope.value) for envelope in envelopes]
