"""Reports on what ingest kept but could not place: orphan feedback and dead letters.

Feedback and outcomes may arrive hours after their session, from another process, or for a
session that never reached Flywheel. They are always stored (``raw_events``, and a
``sessions`` row is created for them); this module lists the ones still waiting for their
``session_start``:

- ``unknown_session``: the session has no event other than feedback/outcomes;
- ``awaiting_start``: other events of the session arrived, its ``session_start`` did not (yet).

Feedback by completion id alone waits in ``pending_feedback`` until ingest finds its
completion's session (:mod:`ingest.pending`); those still unresolved are listed too:

- ``unknown_completion``: waiting longer than ``ingest.feedback_report_after_s`` (still retried);
- ``awaiting_completion``: waiting less long than that.

It also counts sessions whose feedback arrived before their start (``early_feedback``) and
dead letters by reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg

ORPHANS = """
SELECT f.project, f.session_id, f.event_id::text, f.type, f.occurred_at, f.received_at,
       s.n_events - count(*) OVER (PARTITION BY f.project, f.session_id) AS other_events
FROM raw_events f
JOIN sessions s ON s.project = f.project AND s.session_id = f.session_id
WHERE f.type IN ('feedback', 'outcome') AND s.started_at IS NULL
  AND (%(project)s::text IS NULL OR f.project = %(project)s)
ORDER BY f.received_at
LIMIT %(limit)s
"""

EARLY = """
SELECT count(DISTINCT (f.project, f.session_id))
FROM raw_events f
JOIN raw_events st ON st.project = f.project AND st.session_id = f.session_id AND st.type = 'session_start'
WHERE f.type IN ('feedback', 'outcome') AND f.received_at < st.received_at
  AND (%(project)s::text IS NULL OR f.project = %(project)s)
"""

UNRESOLVED = """
SELECT project, completion_id::text, event_id::text, occurred_at, received_at,
       received_at <= now() - %(report_after)s AS overdue
FROM pending_feedback
WHERE published_at IS NULL AND session_id IS NULL
  AND (%(project)s::text IS NULL OR project = %(project)s)
ORDER BY received_at
LIMIT %(limit)s
"""

DEAD_LETTERS = """
SELECT reason, count(*), max(received_at)
FROM dead_letters
WHERE (%(project)s::text IS NULL OR project = %(project)s)
GROUP BY reason ORDER BY count(*) DESC
LIMIT %(limit)s
"""


@dataclass(frozen=True)
class OrphanEvent:
    """A feedback or outcome event whose session has no session_start, or whose session is not known yet."""

    project: str
    session_id: str | None
    """``None`` for feedback by completion id alone whose completion has not been found."""
    event_id: str
    type: str
    occurred_at: datetime
    received_at: datetime
    status: str
    """``unknown_session``, ``awaiting_start``, ``unknown_completion`` or ``awaiting_completion``."""
    completion_id: str | None = None
    """The completion named by feedback without a session."""


@dataclass
class IngestReport:
    """Orphan feedback, early feedback and dead letters, as of now."""

    orphans: list[OrphanEvent] = field(default_factory=list)
    early_feedback_sessions: int = 0
    """Sessions whose feedback was received before their session_start (now joined)."""
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    """``{"reason", "count", "last_at"}`` per distinct reason."""

    @property
    def unknown_sessions(self) -> list[OrphanEvent]:
        """Orphans whose session sent nothing but feedback/outcomes."""
        return [o for o in self.orphans if o.status == "unknown_session"]

    @property
    def awaiting_start(self) -> list[OrphanEvent]:
        """Orphans whose session sent other events but no session_start."""
        return [o for o in self.orphans if o.status == "awaiting_start"]

    @property
    def unknown_completions(self) -> list[OrphanEvent]:
        """Feedback by completion id alone whose completion did not arrive within the report time."""
        return [o for o in self.orphans if o.status == "unknown_completion"]

    @property
    def awaiting_completion(self) -> list[OrphanEvent]:
        """Feedback by completion id alone still within the report time (retried)."""
        return [o for o in self.orphans if o.status == "awaiting_completion"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (timestamps as ISO strings)."""
        return {
            "orphans": [
                {**asdict(o), "occurred_at": o.occurred_at.isoformat(), "received_at": o.received_at.isoformat()}
                for o in self.orphans
            ],
            "unknown_session_events": len(self.unknown_sessions),
            "awaiting_start_events": len(self.awaiting_start),
            "unknown_completion_events": len(self.unknown_completions),
            "awaiting_completion_events": len(self.awaiting_completion),
            "early_feedback_sessions": self.early_feedback_sessions,
            "dead_letters": [{**d, "last_at": d["last_at"].isoformat()} for d in self.dead_letters],
        }


def build_report(
    conninfo: str, *, project: str | None = None, limit: int = 1000, report_after_s: float = 3600.0
) -> IngestReport:
    """Query the database for orphan feedback, early feedback and dead letters (at most ``limit`` rows each).

    ``report_after_s`` (``ingest.feedback_report_after_s``): how long feedback by completion id
    alone may wait for its completion before it counts as ``unknown_completion``.
    """
    params = {"project": project, "limit": limit, "report_after": timedelta(seconds=report_after_s)}
    with psycopg.connect(conninfo, connect_timeout=5) as conn:
        orphans = [
            OrphanEvent(p, s, e, t, occ, rec, "awaiting_start" if other > 0 else "unknown_session")
            for p, s, e, t, occ, rec, other in conn.execute(ORPHANS, params)
        ]
        orphans += [
            OrphanEvent(p, None, e, "feedback", occ, rec, "unknown_completion" if overdue else "awaiting_completion", c)
            for p, c, e, occ, rec, overdue in conn.execute(UNRESOLVED, params)
        ]
        (early,) = conn.execute(EARLY, params).fetchone()
        dead = [
            {"reason": reason, "count": count, "last_at": last}
            for reason, count, last in conn.execute(DEAD_LETTERS, params)
        ]
    return IngestReport(orphans=orphans, early_feedback_sessions=early, dead_letters=dead)
