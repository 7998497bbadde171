"""The configured size limits of an event, checked alike by the gateway and the consumer.

The contract's static caps (:data:`~flywheel.core.contracts.events.MAX_TOKENS`,
:data:`~flywheel.core.contracts.events.MAX_TEXT`) are far above what a deployment accepts;
the deployment's own limits are settings, and every refusal names the setting and its value:

- ``ingest.max_event_bytes``: an event's JSON, in bytes;
- ``ingest.max_completion_tokens``: a completion's ``completion_token_ids`` (its ``logprobs``
  are one per token, which the contract checks);
- ``kafka.max_record_bytes``: a Kafka record, which must hold the largest event
  (:func:`check_record_limit`, at the start of the gateway and the consumer).
"""

from __future__ import annotations

from dataclasses import dataclass

from flywheel.core.contracts.events import Completion, Event
from flywheel.core.settings import Settings
from flywheel.core.settings.ingest import MAX_COMPLETION_TOKENS, MAX_EVENT_BYTES
from flywheel.core.settings.kafka import RECORD_OVERHEAD_BYTES


@dataclass(frozen=True)
class Limits:
    """What one event may be at most."""

    max_event_bytes: int = MAX_EVENT_BYTES
    max_completion_tokens: int = MAX_COMPLETION_TOKENS

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        """The limits of ``settings.ingest``."""
        return cls(settings.ingest.max_event_bytes, settings.ingest.max_completion_tokens)

    def size_problem(self, size: int) -> str | None:
        """Why an event of ``size`` bytes (serialized) is refused, or None."""
        if size > self.max_event_bytes:
            return f"event is {size} bytes serialized, over the limit ingest.max_event_bytes = {self.max_event_bytes}"
        return None

    def event_problem(self, event: Event) -> tuple[str, str] | None:
        """(field, reason) of a valid event that is over a configured limit, or None."""
        if isinstance(event, Completion) and event.completion_token_ids is not None:
            n = len(event.completion_token_ids)
            if n > self.max_completion_tokens:
                return (
                    "completion_token_ids",
                    f"{n} tokens, over the limit ingest.max_completion_tokens = {self.max_completion_tokens}",
                )
        return None


def check_record_limit(settings: Settings) -> int:
    """``kafka.max_record_bytes``, once it is known to hold an event of ``ingest.max_event_bytes``.

    Raises ``ValueError`` naming both settings otherwise (an event the gateway accepts could
    not be produced).
    """
    record, event = settings.kafka.max_record_bytes, settings.ingest.max_event_bytes
    if event + RECORD_OVERHEAD_BYTES > record:
        raise ValueError(
            f"kafka.max_record_bytes ({record}) cannot hold an event of ingest.max_event_bytes ({event}) plus "
            f"{RECORD_OVERHEAD_BYTES} bytes of record overhead: raise kafka.max_record_bytes or lower max_event_bytes"
        )
    return record
