"""Postgres batch writes of the consumer: raw events, session rows and dead letters in one transaction.

The hot path is psycopg 3 used directly, one multi-row statement per table per batch
(``INSERT ... SELECT FROM unnest(...)``); the SQLAlchemy models in :mod:`flywheel.core.db.models`
remain the schema's source of truth.

Idempotence: ``raw_events`` and ``pending_feedback`` rows conflict on ``event_id`` and
``dead_letters`` rows on their Kafka position, and all conflicts are no-ops. Session counters are built only from the
events this transaction newly inserted (the insert's ``RETURNING``), so a replayed batch
changes nothing.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import errors as pgerrors

from flywheel.core.contracts.events import EventType

log = logging.getLogger(__name__)

FEEDBACK_TYPES = frozenset({EventType.FEEDBACK.value, EventType.OUTCOME.value})
"""Event types that may arrive before (or without) their session."""
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (psycopg.OperationalError, psycopg.InterfaceError)
"""Errors worth retrying after reconnecting (server restart, lost connection, deadlock, serialization)."""


@dataclass(slots=True)
class EventRow:
    """One valid event, ready for ``raw_events``; read-only by convention.

    Not ``frozen``: one is built per consumed record, and a frozen dataclass's ``__init__``
    (``object.__setattr__`` per field) costs several times as much.
    """

    event_id: uuid.UUID
    project: str
    session_id: str
    type: str
    schema_version: int
    occurred_at: datetime
    payload: str
    """The event's JSON text, as received."""
    topic: str | None
    partition: int | None
    offset: int | None
    event: Any
    """The parsed event (a member of :data:`flywheel.core.contracts.events.Event`)."""


@dataclass(slots=True)
class UnattachedRow:
    """Feedback by completion id alone (no session), for ``pending_feedback``; read-only by convention."""

    event_id: uuid.UUID
    project: str
    completion_id: uuid.UUID
    completion_at: datetime
    """The time in the UUIDv7 completion id."""
    occurred_at: datetime
    payload: str
    """The event's JSON text, as received."""
    topic: str | None
    partition: int | None
    offset: int | None

    @property
    def key(self) -> str:
        """Its record key: the completion id."""
        return str(self.completion_id)


@dataclass(frozen=True, slots=True)
class DeadLetterRow:
    """One record that could not be accepted, with why; for the DLQ topic and ``dead_letters``."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    field: str
    reason: str
    project: str | None
    kind: str
    """Fault: ``contract`` (not a valid event), ``key`` (key is not the session id), ``database`` (refused)."""


@dataclass
class SessionUpdate:
    """What one batch's new events say about one session."""

    project: str
    session_id: str
    n_events: int = 0
    last_event_at: datetime | None = None
    started_at: datetime | None = None
    user_id: str | None = None
    agent: str | None = None
    task: str | None = None
    group_key: str | None = None
    metadata: dict[str, object] | None = None
    ended_at: datetime | None = None
    status: str | None = None
    policy_versions: list[str] = field(default_factory=list)
    n_feedback: int = 0
    """Feedback/outcome events among ``n_events`` (reported when the session has no start)."""


@dataclass(frozen=True)
class WriteResult:
    """What a batch write changed."""

    inserted: int
    duplicates: int
    dead_letters: int
    """Dead letters newly recorded (a replayed one is not counted again)."""
    orphan_feedback: int
    """Newly inserted feedback/outcome events whose session has no session_start yet."""
    refused: list[DeadLetterRow] = field(default_factory=list)
    """Valid events that Postgres refused (now dead letters of kind ``database``)."""
    unattached: int = 0
    """Feedback by completion id alone newly kept in ``pending_feedback``."""
    attached_at_once: int = 0
    """Of those, how many found their completion's session at once (the rest are retried)."""


def session_updates(rows: Iterable[EventRow]) -> list[SessionUpdate]:
    """Fold events into one update per session, sorted by (project, session_id) for a stable lock order."""
    updates: dict[tuple[str, str], SessionUpdate] = {}
    for row in rows:
        key = (row.project, row.session_id)
        update = updates.get(key)
        if update is None:
            update = updates[key] = SessionUpdate(row.project, row.session_id)
        _fold(update, row)
    return [updates[key] for key in sorted(updates)]


def _fold(update: SessionUpdate, row: EventRow) -> None:
    update.n_events += 1
    if update.last_event_at is None or row.occurred_at > update.last_event_at:
        update.last_event_at = row.occurred_at
    event = row.event
    if row.type == EventType.SESSION_START:
        update.started_at = row.occurred_at
        update.user_id = event.user_id
        update.agent = event.agent
        update.task = event.task
        update.group_key = event.group_key
        update.metadata = dict(event.metadata)
    elif row.type == EventType.SESSION_END:
        update.ended_at = row.occurred_at
        update.status = event.status
    elif row.type == EventType.COMPLETION:
        if event.policy_version not in update.policy_versions:
            update.policy_versions.append(event.policy_version)
    elif row.type in FEEDBACK_TYPES:
        update.n_feedback += 1


INSERT_EVENTS = """
INSERT INTO raw_events (event_id, project, session_id, type, schema_version, occurred_at, payload, source,
                        kafka_partition, kafka_offset)
SELECT e.event_id, e.project, e.session_id, e.type, e.schema_version, e.occurred_at, e.payload::jsonb, %b,
       e.kafka_partition, e.kafka_offset
FROM unnest(%b::uuid[], %b::text[], %b::text[], %b::text[], %b::int2[], %b::timestamptz[], %b::text[],
            %b::int4[], %b::int8[])
     AS e(event_id, project, session_id, type, schema_version, occurred_at, payload, kafka_partition, kafka_offset)
ON CONFLICT (event_id) DO NOTHING
RETURNING event_id
"""

UPSERT_SESSIONS = """
INSERT INTO sessions AS s (project, session_id, user_id, agent, task, group_key, metadata, started_at, ended_at,
                           status, policy_versions, n_events, last_event_at)
SELECT u.project, u.session_id, u.user_id, u.agent, u.task, u.group_key, COALESCE(u.metadata::jsonb, '{}'::jsonb),
       u.started_at, u.ended_at, COALESCE(u.status, 'open'),
       ARRAY(SELECT jsonb_array_elements_text(u.policy_versions::jsonb)), u.n_events, u.last_event_at
FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::text[], %b::text[], %b::text[], %b::timestamptz[],
            %b::timestamptz[], %b::text[], %b::text[], %b::int4[], %b::timestamptz[])
     AS u(project, session_id, user_id, agent, task, group_key, metadata, started_at, ended_at, status,
          policy_versions, n_events, last_event_at)
ORDER BY u.project, u.session_id
ON CONFLICT (project, session_id) DO UPDATE SET
    user_id = COALESCE(EXCLUDED.user_id, s.user_id),
    agent = COALESCE(EXCLUDED.agent, s.agent),
    task = COALESCE(EXCLUDED.task, s.task),
    group_key = COALESCE(EXCLUDED.group_key, s.group_key),
    metadata = s.metadata || EXCLUDED.metadata,
    started_at = COALESCE(EXCLUDED.started_at, s.started_at),
    ended_at = COALESCE(EXCLUDED.ended_at, s.ended_at),
    status = CASE WHEN EXCLUDED.ended_at IS NOT NULL THEN EXCLUDED.status ELSE s.status END,
    policy_versions = ARRAY(SELECT v FROM unnest(s.policy_versions || EXCLUDED.policy_versions)
                            WITH ORDINALITY AS t(v, i) GROUP BY v ORDER BY min(i)),
    n_events = s.n_events + EXCLUDED.n_events,
    last_event_at = GREATEST(s.last_event_at, EXCLUDED.last_event_at)
RETURNING project, session_id, started_at IS NOT NULL
"""

COMPLETION_SESSION = """
    SELECT r.session_id FROM raw_events r
    WHERE r.type = 'completion' AND (r.payload ->> 'completion_id') = {alias}.completion_id::text
      AND r.project = {alias}.project
      AND r.occurred_at BETWEEN {alias}.completion_at - {window} AND {alias}.completion_at + {window}
    ORDER BY r.occurred_at LIMIT 1
"""
"""The session of the completion a pending feedback names (``{alias}``: a row with ``project``,
``completion_id``, ``completion_at``), found through ``ix_raw_events_completion_id`` within ``{window}``
(an interval placeholder) of the time in the id."""

INSERT_DEAD_LETTERS = """
INSERT INTO dead_letters (source, topic, kafka_partition, kafka_offset, key, value, field, reason, project)
SELECT %b, d.topic, d.kafka_partition, d.kafka_offset, d.key, d.value, d.field, d.reason, d.project
FROM unnest(%b::text[], %b::int4[], %b::int8[], %b::bytea[], %b::bytea[], %b::text[], %b::text[], %b::text[])
     AS d(topic, kafka_partition, kafka_offset, key, value, field, reason, project)
ON CONFLICT ON CONSTRAINT uq_dead_letters_position DO NOTHING
RETURNING id
"""


INSERT_UNATTACHED = (
    """
INSERT INTO pending_feedback (event_id, project, completion_id, completion_at, occurred_at, payload, session_id,
                              resolved_at)
SELECT u.event_id, u.project, u.completion_id, u.completion_at, u.occurred_at, u.payload::jsonb, c.session_id,
       CASE WHEN c.session_id IS NOT NULL THEN now() END
FROM unnest(%b::uuid[], %b::text[], %b::uuid[], %b::timestamptz[], %b::timestamptz[], %b::text[])
     AS u(event_id, project, completion_id, completion_at, occurred_at, payload)
LEFT JOIN LATERAL ("""
    + COMPLETION_SESSION.format(alias="u", window="%b::interval")
    + """) c ON true
ON CONFLICT (event_id) DO NOTHING
RETURNING event_id, session_id
"""
)


def _event_params(rows: Sequence[EventRow], source: str) -> tuple:
    return (
        source,
        [r.event_id for r in rows],
        [r.project for r in rows],
        [r.session_id for r in rows],
        [r.type for r in rows],
        [r.schema_version for r in rows],
        [r.occurred_at for r in rows],
        [r.payload for r in rows],
        [r.partition for r in rows],
        [r.offset for r in rows],
    )


def _session_params(updates: Sequence[SessionUpdate]) -> tuple:
    return (
        [u.project for u in updates],
        [u.session_id for u in updates],
        [u.user_id for u in updates],
        [u.agent for u in updates],
        [u.task for u in updates],
        [u.group_key for u in updates],
        [None if u.metadata is None else json.dumps(u.metadata) for u in updates],
        [u.started_at for u in updates],
        [u.ended_at for u in updates],
        [u.status for u in updates],
        [json.dumps(u.policy_versions) for u in updates],
        [u.n_events for u in updates],
        [u.last_event_at for u in updates],
    )


def _dead_letter_params(rows: Sequence[DeadLetterRow], source: str) -> tuple:
    return (
        source,
        [d.topic for d in rows],
        [d.partition for d in rows],
        [d.offset for d in rows],
        [d.key for d in rows],
        [d.value for d in rows],
        [d.field for d in rows],
        [d.reason for d in rows],
        [d.project for d in rows],
    )


def _unattached_params(rows: Sequence[UnattachedRow]) -> tuple:
    return (
        [r.event_id for r in rows],
        [r.project for r in rows],
        [r.completion_id for r in rows],
        [r.completion_at for r in rows],
        [r.occurred_at for r in rows],
        [r.payload for r in rows],
    )


class Writer:
    """Writes consumer batches to Postgres over one psycopg connection, reconnecting when it is lost.

    ``completion_window`` bounds the search for the completion of feedback by completion id alone
    (``ingest.completion_window_s``).
    """

    def __init__(
        self,
        conninfo: str,
        *,
        source: str = "kafka",
        connect_timeout_s: int = 5,
        completion_window: timedelta = timedelta(days=1),
    ):
        self.conninfo = conninfo
        self.source = source
        self.connect_timeout_s = connect_timeout_s
        self.completion_window = completion_window
        self._conn: psycopg.Connection | None = None

    def connection(self) -> psycopg.Connection:
        """The open connection, (re)connecting if there is none or it broke."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            self.close()
            self._conn = psycopg.connect(
                self.conninfo,
                connect_timeout=self.connect_timeout_s,
                application_name="flywheel-ingest",
                keepalives=1,
                keepalives_idle=10,
                keepalives_interval=5,
                keepalives_count=3,
            )
        return self._conn

    def close(self) -> None:
        """Close the connection (a later write reconnects)."""
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    def write(
        self,
        events: Sequence[EventRow],
        dead_letters: Sequence[DeadLetterRow],
        unattached: Sequence[UnattachedRow] = (),
    ) -> WriteResult:
        """Insert a batch in one transaction and commit it.

        ``unattached`` feedback goes to ``pending_feedback``, with its session filled at once
        when its completion is already stored (also by this same batch); the consumer's
        resolver publishes the resolved copies and retries the others.

        A valid event that Postgres refuses (a ``DataError``) is isolated and recorded as a
        dead letter instead, so one bad row cannot block the stream. Transient errors
        (:data:`TRANSIENT_ERRORS`) propagate for the caller to retry; the connection is
        dropped so that the retry reconnects.
        """
        try:
            try:
                return self._write(events, dead_letters, unattached, refused=[])
            except pgerrors.DataError as err:
                log.warning("batch refused by Postgres (%s): isolating the offending events", err)
                events, unattached, refused = self._isolate_refused(events, unattached)
                return self._write(events, [*dead_letters, *refused], unattached, refused=refused)
        except TRANSIENT_ERRORS:
            self.close()
            raise

    def _write(
        self,
        events: Sequence[EventRow],
        dead_letters: Sequence[DeadLetterRow],
        unattached: Sequence[UnattachedRow],
        refused: list[DeadLetterRow],
    ) -> WriteResult:
        conn = self.connection()
        with conn.transaction(), conn.cursor() as cur:
            inserted_ids = self._insert_events(cur, events)
            new_events = [row for row in events if row.event_id in inserted_ids]
            orphans = self._upsert_sessions(cur, session_updates(new_events))
            kept = self._insert_unattached(cur, unattached)
            n_dead = self._insert_dead_letters(cur, dead_letters)
        return WriteResult(
            inserted=len(inserted_ids),
            duplicates=len(events) - len(inserted_ids),
            dead_letters=n_dead,
            orphan_feedback=orphans,
            refused=refused,
            unattached=len(kept),
            attached_at_once=sum(1 for session_id in kept.values() if session_id is not None),
        )

    def _insert_unattached(self, cur: psycopg.Cursor, rows: Sequence[UnattachedRow]) -> dict[uuid.UUID, str | None]:
        """Keep new unattached feedback (after this batch's events, so its completions are found); id → session."""
        if not rows:
            return {}
        cur.execute(INSERT_UNATTACHED, self._unattached_bind(rows))
        return {event_id: session_id for event_id, session_id in cur.fetchall()}

    def _unattached_bind(self, rows: Sequence[UnattachedRow]) -> tuple:
        return (*_unattached_params(rows), self.completion_window, self.completion_window)

    def _insert_events(self, cur: psycopg.Cursor, events: Sequence[EventRow]) -> set[uuid.UUID]:
        if not events:
            return set()
        cur.execute(INSERT_EVENTS, _event_params(events, self.source))
        return {row[0] for row in cur.fetchall()}

    def _upsert_sessions(self, cur: psycopg.Cursor, updates: Sequence[SessionUpdate]) -> int:
        """Upsert session rows; return how many new feedback events landed on sessions without a start."""
        if not updates:
            return 0
        cur.execute(UPSERT_SESSIONS, _session_params(updates))
        unstarted = {(project, session_id) for project, session_id, started in cur.fetchall() if not started}
        return sum(u.n_feedback for u in updates if (u.project, u.session_id) in unstarted)

    def _insert_dead_letters(self, cur: psycopg.Cursor, rows: Sequence[DeadLetterRow]) -> int:
        if not rows:
            return 0
        cur.execute(INSERT_DEAD_LETTERS, _dead_letter_params(rows, self.source))
        return len(cur.fetchall())

    def _isolate_refused(
        self, events: Sequence[EventRow], unattached: Sequence[UnattachedRow]
    ) -> tuple[list[EventRow], list[UnattachedRow], list[DeadLetterRow]]:
        """Try each event alone (in savepoints, all rolled back): split into accepted and refused."""
        conn = self.connection()
        good: list[EventRow] = []
        good_unattached: list[UnattachedRow] = []
        refused: list[DeadLetterRow] = []
        with conn.transaction(force_rollback=True), conn.cursor() as cur:
            for row in events:
                try:
                    with conn.transaction():
                        cur.execute(INSERT_EVENTS, _event_params([row], self.source))
                        cur.execute(UPSERT_SESSIONS, _session_params(session_updates([row])))
                except pgerrors.DataError as err:
                    refused.append(refused_dead_letter(row, str(err)))
                else:
                    good.append(row)
            for pending in unattached:
                try:
                    with conn.transaction():
                        cur.execute(INSERT_UNATTACHED, self._unattached_bind([pending]))
                except pgerrors.DataError as err:
                    refused.append(refused_dead_letter(pending, str(err)))
                else:
                    good_unattached.append(pending)
        return good, good_unattached, refused


def clean_text(text: str, limit: int | None = None) -> str:
    """``text`` as Postgres can store it: NUL characters escaped, cut to ``limit`` characters."""
    text = text.replace("\x00", "\\x00")
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def refused_dead_letter(row: EventRow | UnattachedRow, error: str) -> DeadLetterRow:
    """The dead letter for a valid event that Postgres would not store."""
    return DeadLetterRow(
        topic=row.topic or "",
        partition=row.partition if row.partition is not None else -1,
        offset=row.offset if row.offset is not None else -1,
        key=(row.key if isinstance(row, UnattachedRow) else row.session_id).encode(),
        value=row.payload.encode(),
        field="",
        reason=clean_text(f"Postgres refused the event: {error}"),
        project=row.project,
        kind="database",
    )
