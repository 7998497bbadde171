"""Feedback by completion id alone: find its session, publish the resolved copy, retry, report.

The SDK sends feedback that names a completion but no session when the sending process does
not know the session (``fw.feedback(completion_id, "revert")`` hours later, from another
process). Such *unattached* feedback is keyed by its completion id on the events topic. The
consumer keeps it in ``pending_feedback`` (:meth:`ingest.writer.Writer.write`, which also
looks its completion up at once), and :func:`resolve_round` then, in one transaction:

1. claims the rows that are due (``FOR UPDATE SKIP LOCKED``, so several consumers share the
   work without doing it twice);
2. looks up the session of each one still unresolved, from its completion in ``raw_events``
   (index ``ix_raw_events_completion_id``, within ``ingest.completion_window_s`` of the time
   in the UUIDv7 completion id, same project only);
3. produces each resolved copy (same event id, ``session_id`` filled) to the events topic,
   keyed by its session, and waits for Kafka's acknowledgement; the consumer then stores the
   copy in ``raw_events`` like any feedback, and rewarding scores it;
4. marks those published, and reschedules the rest with backoff (``ingest.feedback_retry_s``
   doubling to ``ingest.feedback_retry_max_s``). A row waiting longer than
   ``ingest.feedback_report_after_s`` is reported once (logged, counted) as
   ``unknown_completion`` and listed by ``flywheel-ingest report``; it is still retried, since
   its completion may yet arrive. Nothing is dropped.

If Kafka does not acknowledge, the transaction rolls back and the rows are retried at the next
round. A crash between the acknowledgement and the commit publishes a copy twice: both carry
the same event id, so the second is a no-op in ``raw_events`` and for rewarding.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg

from flywheel.core.contracts.events import dump_event, parse_event
from flywheel.core.settings import IngestSettings
from ingest import metrics
from ingest.writer import COMPLETION_SESSION

log = logging.getLogger(__name__)

CLAIM = """
SELECT event_id, project, completion_id, payload::text, session_id,
       reported_at IS NULL AND received_at <= now() - %(report_after)s AS report_now
FROM pending_feedback
WHERE published_at IS NULL AND next_attempt_at <= now()
ORDER BY next_attempt_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""

RESOLVE = (
    """
WITH found AS (
    SELECT q.event_id, ("""
    + COMPLETION_SESSION.format(alias="q", window="%(window)s")
    + """) AS session_id
    FROM pending_feedback q
    WHERE q.event_id = ANY(%(ids)s) AND q.session_id IS NULL
)
UPDATE pending_feedback p SET session_id = f.session_id, resolved_at = now()
FROM found f
WHERE p.event_id = f.event_id AND f.session_id IS NOT NULL
RETURNING p.event_id, p.session_id
"""
)

MARK_PUBLISHED = """
UPDATE pending_feedback SET published_at = now(), attempts = attempts + 1 WHERE event_id = ANY(%(ids)s)
"""

RESCHEDULE = """
UPDATE pending_feedback
SET attempts = attempts + 1,
    next_attempt_at = now() + least(%(retry_s)s * power(2, least(attempts, 30)), %(retry_max_s)s) * interval '1 second',
    reported_at = CASE WHEN reported_at IS NULL AND received_at <= now() - %(report_after)s THEN now()
                       ELSE reported_at END
WHERE event_id = ANY(%(ids)s)
"""


@dataclass(frozen=True)
class ResolveSettings:
    """The knobs of :func:`resolve_round` (from :class:`flywheel.core.settings.IngestSettings`)."""

    retry_s: float = 5.0
    retry_max_s: float = 300.0
    report_after_s: float = 3600.0
    window_s: float = 86400.0
    limit: int = 500
    ack_timeout_s: float = 30.0

    @classmethod
    def from_ingest(cls, ingest: IngestSettings) -> ResolveSettings:
        return cls(
            retry_s=ingest.feedback_retry_s,
            retry_max_s=ingest.feedback_retry_max_s,
            report_after_s=ingest.feedback_report_after_s,
            window_s=ingest.completion_window_s,
            limit=ingest.feedback_sweep_max,
        )


@dataclass(frozen=True)
class ResolveResult:
    """What one round did."""

    claimed: int = 0
    published: int = 0
    """Resolved copies that Kafka acknowledged (and are marked published)."""
    waiting: int = 0
    """Claimed rows whose completion is still unknown (rescheduled)."""
    reported: int = 0
    """Rows reported as ``unknown_completion`` for the first time in this round."""


def resolve_round(conn: psycopg.Connection, producer: Any, topic: str, conf: ResolveSettings) -> ResolveResult:
    """One round over the due pending feedback (see the module docstring); raises ``KafkaError`` or psycopg errors.

    On any error the transaction is rolled back: nothing is marked, everything is retried.
    """
    window = timedelta(seconds=conf.window_s)
    report_after = timedelta(seconds=conf.report_after_s)
    with conn.transaction(), conn.cursor() as cur:
        rows = cur.execute(CLAIM, {"report_after": report_after, "limit": conf.limit}).fetchall()
        if not rows:
            return ResolveResult()
        unresolved = [event_id for event_id, _p, _c, _pl, session_id, _r in rows if session_id is None]
        found: dict[uuid.UUID, str] = {}
        if unresolved:
            found = dict(cur.execute(RESOLVE, {"ids": unresolved, "window": window}).fetchall())
        resolved: list[tuple[uuid.UUID, str, str]] = []
        waiting: list[tuple[uuid.UUID, str, uuid.UUID, bool]] = []
        for event_id, project, completion_id, payload, session_id, report_now in rows:
            session_id = session_id or found.get(event_id)
            if session_id is None:
                waiting.append((event_id, project, completion_id, report_now))
            else:
                resolved.append((event_id, session_id, payload))
        publish(producer, topic, [resolved_copy(payload, session_id) for _e, session_id, payload in resolved],
                conf.ack_timeout_s)  # fmt: skip
        if resolved:
            cur.execute(MARK_PUBLISHED, {"ids": [event_id for event_id, _s, _p in resolved]})
        if waiting:
            cur.execute(RESCHEDULE, {"ids": [w[0] for w in waiting], "retry_s": conf.retry_s,
                                     "retry_max_s": conf.retry_max_s, "report_after": report_after})  # fmt: skip
    reported = [w for w in waiting if w[3]]
    for event_id, project, completion_id, _ in reported:
        log.warning(
            "feedback %s of project %s names completion %s, which has not arrived after %.0fs: reported as "
            "unknown_completion (kept and still retried; see `flywheel-ingest report`)",
            event_id, project, completion_id, conf.report_after_s,
        )  # fmt: skip
    metrics.FEEDBACK_ATTACHED.inc(len(resolved))
    metrics.UNKNOWN_COMPLETION.inc(len(reported))
    return ResolveResult(len(rows), len(resolved), len(waiting), len(reported))


def resolved_copy(payload: str, session_id: str) -> tuple[bytes, bytes]:
    """(key, value) of the resolved copy of an unattached feedback: same event, ``session_id`` filled."""
    event = parse_event(payload)
    attached = event.model_copy(update={"session_id": session_id})
    return session_id.encode("utf-8"), dump_event(attached)


def publish(producer: Any, topic: str, records: Sequence[tuple[bytes, bytes]], timeout_s: float) -> None:
    """Produce (key, value) records and wait for every acknowledgement (raises ``KafkaError`` otherwise)."""
    if not records:
        return
    futures = [producer.send(topic, key=key, value=value) for key, value in records]
    for future in futures:
        future.get(timeout=timeout_s)
    metrics.PRODUCED.labels(topic=topic).inc(len(records))
