"""Replay raw events from Postgres through the current extractors into new reward versions.

``flywheel rewards recompute --since 2d`` re-scores every session with an event since
then, from ``raw_events`` (what ingest stored), exactly as the stream scores it. A
session whose newest stored version has the same input hash and configuration hash is
left alone (``unchanged``) unless ``force``; the report says for how many sessions the
recomputed reward reproduces the stored one exactly (reward, components, versions, hash).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import text

from flywheel.core.contracts.events import ContractError, Event, parse_event
from flywheel.core.db.engine import get_engine
from rewarding.scorer import ScoredSession, Scorer
from rewarding.session_state import Session
from rewarding.store import Key, RewardStore, StoredReward

CHUNK = 200
"""Sessions loaded, scored and written per transaction."""

KEYS_SQL = text(
    """
    SELECT DISTINCT project, session_id FROM raw_events
    WHERE occurred_at >= :since AND (CAST(:project AS text) IS NULL OR project = :project)
    ORDER BY project, session_id
    """
)
EVENTS_SQL = text(
    """
    SELECT project, session_id, payload FROM raw_events
    WHERE (project, session_id) IN (SELECT * FROM unnest(CAST(:projects AS text[]), CAST(:sids AS text[])))
    ORDER BY project, session_id
    """
)


@dataclass
class RecomputeReport:
    """What a recompute did."""

    sessions: int = 0
    written: int = 0
    unchanged: int = 0
    reproduced: int = 0
    """Sessions whose recomputed reward equals the newest stored one exactly."""
    differs: list[str] = field(default_factory=list)
    """Sessions (``project/session``) with a stored reward that the recompute does not reproduce."""
    new: int = 0
    """Sessions without any stored reward."""
    invalid_events: int = 0
    """Stored payloads that no longer parse (skipped)."""

    def to_json(self) -> dict:
        """JSON-ready form."""
        return {**self.__dict__, "differs": self.differs[:100]}


def session_keys(db_url: str, since: datetime, project: str | None = None) -> list[Key]:
    """Sessions with an event since ``since``."""
    with get_engine(db_url).connect() as conn:
        return [(r[0], r[1]) for r in conn.execute(KEYS_SQL, {"since": since, "project": project})]


def load_sessions(db_url: str, keys: Sequence[Key]) -> tuple[list[Session], int]:
    """The sessions of ``keys`` rebuilt from raw events, and how many payloads failed to parse."""
    events: dict[Key, list[Event]] = {k: [] for k in keys}
    invalid = 0
    params = {"projects": [k[0] for k in keys], "sids": [k[1] for k in keys]}
    with get_engine(db_url).connect() as conn:
        for project, session_id, payload in conn.execute(EVENTS_SQL, params):
            try:
                events[(project, session_id)].append(parse_event(payload))
            except ContractError:
                invalid += 1
    return [Session.from_events(p, s, evs) for (p, s), evs in events.items() if evs], invalid


def reproduces(scored: ScoredSession, stored: StoredReward) -> bool:
    """True when ``scored`` equals the stored version exactly."""
    return (
        scored.reward == stored.reward
        and scored.components == stored.components
        and scored.extractor_versions == stored.extractor_versions
        and scored.config_hash == stored.config_hash
    )


def chunks(items: Sequence[Key], size: int) -> Iterator[Sequence[Key]]:
    """``items`` in slices of ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


async def recompute(
    scorer: Scorer,
    db_url: str,
    since: datetime,
    *,
    project: str | None = None,
    force: bool = False,
    dry_run: bool = False,
) -> RecomputeReport:
    """Re-score the sessions with events since ``since``; write new versions unless ``dry_run``."""
    store = RewardStore(db_url)
    report = RecomputeReport()
    for keys in chunks(session_keys(db_url, since, project), CHUNK):
        sessions, invalid = load_sessions(db_url, keys)
        report.invalid_events += invalid
        scored = [await scorer.score(s) for s in sessions]
        latest = store.latest([s.key for s in scored])
        for s in scored:
            report.sessions += 1
            old = latest.get(s.key)
            if old is None:
                report.new += 1
            elif reproduces(s, old):
                report.reproduced += 1
            else:
                report.differs.append(f"{s.project}/{s.session_id}")
        if dry_run:
            continue
        for result in store.write([(s, "recompute") for s in scored], "recompute", force=force):
            if result.written:
                report.written += 1
            else:
                report.unchanged += 1
    return report
