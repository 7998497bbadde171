"""A session's events, accumulated idempotently, and the read-only view extractors score.

:class:`SessionState` is what the faust table holds per session: every event's JSON keyed
by event id (a replayed or retried event is a no-op), a few times that decide when the
session is due for scoring, and markers of what has been scored and published. It is a
plain JSON-ready value, so the table's changelog can restore it after a crash.

:class:`Session` is the parsed, ordered view of one state (or of raw events replayed from
Postgres). Extractors see only this view, so a reward is a pure function of the events
and the configuration: :func:`Session.input_hash` names that input.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from flywheel.core.contracts.events import (
    BudgetEnforcement,
    Completion,
    ContextUpdate,
    Event,
    Feedback,
    Outcome,
    SessionEnd,
    SessionStart,
    SpanEnd,
    SpanStart,
    Turn,
    dump_event,
    parse_event,
)


@dataclass(frozen=True)
class Windows:
    """The times that decide when a session is due (from :class:`~flywheel.core.settings.RewardingSettings`)."""

    feedback_window_s: float
    session_timeout_s: float
    rescore_delay_s: float


@dataclass
class SessionState:
    """One session's accumulated events plus its scoring bookkeeping (times are Unix seconds)."""

    project: str
    session_id: str
    events: dict[str, str] = field(default_factory=dict)
    """Event id -> the event's JSON."""
    ended_at: float | None = None
    """When the session ended: SessionEnd's time, but never later than when it arrived here."""
    last_event_at: float = 0.0
    """Latest event time seen (arrival-capped like ``ended_at``)."""
    last_arrival: float = 0.0
    """When the latest new event arrived here."""
    pending_since: float | None = None
    """Arrival of the first event not covered by the latest scored version; None when all are covered."""
    scored_n: int = 0
    """Events covered by the latest version this worker scored (0: never scored)."""
    scored_version: int = 0
    """That version's number."""
    published_version: int = 0
    """Newest version whose samples were published on the scored topic."""
    due_at: float | None = None
    """When the session should be scored next; None when nothing is pending."""

    def add(
        self, event: Event, arrived_at: float, windows: Windows, raw: str | None = None, key: str | None = None
    ) -> bool:
        """Record ``event`` (``raw``: its JSON as received; ``key``: ``str(event.event_id)`` when the
        caller has it); False (and no change) when its id is known."""
        key = key or str(event.event_id)
        if key in self.events:
            return False
        self.events[key] = raw if raw is not None else dump_event(event).decode("utf-8")
        occurred = min(event.occurred_at.timestamp(), arrived_at)
        self.last_event_at = max(self.last_event_at, occurred)
        self.last_arrival = max(self.last_arrival, arrived_at)
        if isinstance(event, SessionEnd):
            self.ended_at = occurred if self.ended_at is None else min(self.ended_at, occurred)
        if self.pending_since is None:
            self.pending_since = arrived_at
        self.due_at = self.next_due(windows)
        return True

    @property
    def n_events(self) -> int:
        """Events recorded."""
        return len(self.events)

    def next_due(self, windows: Windows) -> float | None:
        """When this session should next be scored, or None when every event is covered."""
        if self.pending_since is None:
            return None
        if self.scored_n == 0:
            if self.ended_at is not None:
                return self.ended_at + windows.feedback_window_s
            return self.last_event_at + windows.session_timeout_s
        late = self.pending_since + windows.rescore_delay_s
        if self.ended_at is not None:
            return max(late, self.ended_at + windows.feedback_window_s)
        return late

    def mark_scored(self, n_events: int, version: int, published: bool, windows: Windows) -> None:
        """Record that a version covering the first ``n_events`` events exists (and maybe was published)."""
        self.scored_n = max(self.scored_n, n_events)
        self.scored_version = max(self.scored_version, version)
        if published:
            self.published_version = max(self.published_version, version)
        if self.n_events <= self.scored_n:
            self.pending_since = None
        self.due_at = self.next_due(windows)

    def marks(self) -> list[int]:
        """What the small ``marks`` table keeps: [scored_n, scored_version, published_version]."""
        return [self.scored_n, self.scored_version, self.published_version]

    def merge_marks(self, marks: list[int] | None, windows: Windows) -> None:
        """Take in marks written after this state was (they only grow, so the larger value wins)."""
        if not marks:
            return
        n, version, published = marks
        if n <= self.scored_n and version <= self.scored_version and published <= self.published_version:
            return
        self.scored_n = max(self.scored_n, n)
        self.scored_version = max(self.scored_version, version)
        self.published_version = max(self.published_version, published)
        if self.n_events <= self.scored_n:
            self.pending_since = None
        self.due_at = self.next_due(windows)

    def reason(self) -> str:
        """Why the next version exists: ``finalized``, ``timeout`` or ``late_feedback``."""
        if self.scored_n > 0:
            return "late_feedback"
        return "finalized" if self.ended_at is not None else "timeout"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (a new dict: the table's changelog serialises it later)."""
        return {
            "project": self.project,
            "session_id": self.session_id,
            "events": dict(self.events),
            "ended_at": self.ended_at,
            "last_event_at": self.last_event_at,
            "last_arrival": self.last_arrival,
            "pending_since": self.pending_since,
            "scored_n": self.scored_n,
            "scored_version": self.scored_version,
            "published_version": self.published_version,
            "due_at": self.due_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionState:
        """The state that :meth:`to_dict` wrote."""
        return cls(**{**data, "events": dict(data["events"])})

    def view(self, cache: EventCache | None = None) -> Session:
        """The parsed, ordered view of the recorded events."""
        events = []
        for key, text in self.events.items():
            event = cache.get(key) if cache is not None else None
            events.append(event if event is not None else parse_event(text))
        return Session.from_events(self.project, self.session_id, events)


class EventCache:
    """Parsed events by id, least recently used dropped first (saves re-parsing at scoring)."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self._data: OrderedDict[str, Event] = OrderedDict()

    def put(self, event: Event, key: str | None = None) -> None:
        """Remember ``event`` (``key``: ``str(event.event_id)`` when the caller has it)."""
        if self.max_size <= 0:
            return
        self._data[key or str(event.event_id)] = event
        if len(self._data) > self.max_size:
            self._data.popitem(last=False)

    def get(self, key: str) -> Event | None:
        """The parsed event with id ``key``, if remembered."""
        return self._data.get(key)

    def drop(self, keys: Iterable[str]) -> None:
        """Forget these events."""
        for key in keys:
            self._data.pop(key, None)


def _order(event: Event) -> tuple[datetime, uuid.UUID]:
    return (event.occurred_at, event.event_id)


@dataclass(frozen=True)
class Session:
    """One session's events, deduplicated and ordered by (time, event id), split by type."""

    project: str
    session_id: str
    events: tuple[Event, ...]
    start: SessionStart | None
    end: SessionEnd | None
    completions: tuple[Completion, ...]
    turns: tuple[Turn, ...]
    span_starts: tuple[SpanStart, ...]
    span_ends: tuple[SpanEnd, ...]
    contexts: tuple[ContextUpdate, ...]
    feedback: tuple[Feedback, ...]
    outcomes: tuple[Outcome, ...]
    budgets: tuple[BudgetEnforcement, ...] = ()
    """What token budgets enforced (``budget`` events), in order."""

    @classmethod
    def from_events(cls, project: str, session_id: str, events: Iterable[Event]) -> Session:
        """Build the view; events of another session or project are refused (ValueError)."""
        unique: dict[uuid.UUID, Event] = {}
        for event in events:
            if event.project != project or event.session_id != session_id:
                raise ValueError(f"event {event.event_id} belongs to {event.project}/{event.session_id}")
            unique.setdefault(event.event_id, event)
        ordered = tuple(sorted(unique.values(), key=_order))

        def of(kind: type) -> tuple:
            return tuple(e for e in ordered if isinstance(e, kind))

        starts, ends = of(SessionStart), of(SessionEnd)
        return cls(
            project=project,
            session_id=session_id,
            events=ordered,
            start=starts[0] if starts else None,
            end=ends[0] if ends else None,
            completions=of(Completion),
            turns=of(Turn),
            span_starts=of(SpanStart),
            span_ends=of(SpanEnd),
            contexts=of(ContextUpdate),
            feedback=of(Feedback),
            outcomes=of(Outcome),
            budgets=of(BudgetEnforcement),
        )

    @property
    def task(self) -> str | None:
        """The task kind from SessionStart."""
        return self.start.task if self.start else None

    @property
    def started_at(self) -> datetime | None:
        """The session's start: SessionStart's time, else its first event's."""
        if self.start is not None:
            return self.start.occurred_at
        return self.events[0].occurred_at if self.events else None

    @property
    def ended_at(self) -> datetime | None:
        """SessionEnd's time, if the session ended."""
        return self.end.occurred_at if self.end else None

    @property
    def event_ids(self) -> list[str]:
        """Every event id, sorted."""
        return sorted(str(e.event_id) for e in self.events)

    def input_hash(self) -> str:
        """SHA-256 over every event's canonical JSON in event-id order: the reward's input."""
        digest = hashlib.sha256()
        for event in sorted(self.events, key=lambda e: e.event_id):
            digest.update(dump_event(event))
            digest.update(b"\n")
        return digest.hexdigest()

    def policy_version(self) -> str | None:
        """The policy version of most completions (ties: the latest one among them)."""
        if not self.completions:
            return None
        counts = Counter(c.policy_version for c in self.completions)
        best = max(counts.values())
        for completion in reversed(self.completions):
            if counts[completion.policy_version] == best:
                return completion.policy_version
        return None

    def latest_outcomes(self) -> dict[str, Outcome]:
        """The latest Outcome per name (a later one corrects an earlier one)."""
        latest: dict[str, Outcome] = {}
        for outcome in self.outcomes:
            latest[outcome.name] = outcome
        return latest
