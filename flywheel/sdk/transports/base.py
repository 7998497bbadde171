"""The transport interface: how serialized events leave the process.

A transport takes a batch of :class:`Envelope` (Kafka key and serialized event, in the
order they were logged) and answers with a :class:`SendResult` that splits the batch in
two at ``retry_from``: everything before it is done (delivered, or rejected for good),
everything from it on must be sent again later, in the same order. That prefix rule is
what keeps a session's events in order across failures, retries and spool replay.

Transports are used from the SDK's sender thread only, never from the agent's threads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


class Envelope(NamedTuple):
    """One serialized event, ready to send."""

    key: bytes
    """Kafka message key: the session id, UTF-8."""
    value: bytes
    """The event as :func:`flywheel.core.contracts.dump_event` wrote it."""


@dataclass(frozen=True)
class Rejection:
    """An event the other side refused for good (retrying would not help)."""

    index: int
    """Position of the event in the batch that was sent."""
    event_id: str | None
    """The event id, when known."""
    field: str
    """Dotted path of the offending field (``""`` for the event itself)."""
    reason: str
    """What is wrong with it."""


@dataclass
class SendResult:
    """What became of a batch."""

    sent: int = 0
    """Events delivered (acknowledged by the broker or accepted by the gateway)."""
    rejected: list[Rejection] = field(default_factory=list)
    """Events refused for good; not retried, counted as invalid."""
    retry_from: int | None = None
    """Index of the first event that must be sent again (``None``: the whole batch is done)."""
    error: str | None = None
    """Why the rest must be retried, for the log."""
    retry_after_s: float | None = None
    """How long to wait before the next attempt, when the other side says (or the error warrants)."""
    needs_operator: bool = False
    """The failure will not go away by itself (a refused key, a wrong URL): logged as an error."""

    @property
    def ok(self) -> bool:
        """Nothing of the batch needs to be sent again."""
        return self.retry_from is None


class TransportUnavailable(ConnectionError):
    """The transport cannot send right now (broker down, gateway unreachable); recoverable by retrying later."""


class Transport(ABC):
    """Sends batches of serialized events; owned and called by the sender thread only."""

    name: str = "transport"
    """Short name for logs and stats."""

    @abstractmethod
    def send(self, batch: Sequence[Envelope]) -> SendResult:
        """Send ``batch`` in order and wait for the other side's acknowledgement.

        Must not raise for a broker or network failure: answer with ``retry_from`` set
        instead. It may block for a bounded time (the transport's own timeouts).
        """

    def close(self, timeout_s: float = 5.0) -> None:
        """Release connections; pending sends may be abandoned after ``timeout_s``."""
        return None  # a default hook, not abstract: a transport that holds no connection has nothing to release


def done(batch_len: int) -> SendResult:
    """A result saying that every event of a batch of ``batch_len`` was delivered."""
    return SendResult(sent=batch_len)


def failed(
    error: str,
    retry_from: int = 0,
    sent: int = 0,
    retry_after_s: float | None = None,
    needs_operator: bool = False,
) -> SendResult:
    """A result saying that the batch must be retried from ``retry_from`` on."""
    return SendResult(
        sent=sent, retry_from=retry_from, error=error, retry_after_s=retry_after_s, needs_operator=needs_operator
    )
