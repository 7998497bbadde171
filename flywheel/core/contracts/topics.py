"""Kafka topic names. Every topic is keyed by session id, so a session's events keep their order."""

from __future__ import annotations


def events_topic(prefix: str) -> str:
    """All session events (the SDK and the gateway produce here)."""
    return f"{prefix}.events"


def dead_letter_topic(prefix: str) -> str:
    """Records that failed validation, with the reason in their headers."""
    return f"{prefix}.events.dlq"


def scored_topic(prefix: str) -> str:
    """Scored training samples published by rewarding."""
    return f"{prefix}.rewards.scored"
