"""Postgres writes: reward versions and their training samples, one transaction per batch.

A new version is ``previous max + 1``, written with its samples in the same transaction,
under a per-session advisory lock, so concurrent writers (two workers during a rebalance,
a recompute beside the stream) serialise per session. Whether to write is decided against
the newest stored version (see :func:`decide`):

- the stream writes only when its events are a strict superset of that version's events
  (``components._meta.event_ids``). Re-finalising the same events after a crash is a
  no-op (``covered``), which is how "scored once" holds under at-least-once processing;
  a stale copy of a session (a worker that lost its partition) can never write an older
  view over a newer one;
- a recompute writes when the input hash or the configuration hash differ (``--force``:
  always).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from psycopg.types.json import Jsonb
from sqlalchemy import text

from flywheel.core.db.engine import get_engine
from rewarding.scorer import ScoredSession


def json_bytes(value: Any) -> bytes:
    """A jsonb column's value as JSON (orjson: ~5x the standard library on the worker's hot path;
    non-string keys become strings, as ``json.dumps`` makes them; NaN and infinities become
    null, which jsonb cannot hold anyway)."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


Mode = Literal["stream", "recompute"]
Decision = Literal["write", "covered", "diverged", "unchanged"]
Key = tuple[str, str]

LOCK_SQL = text(
    """
    SELECT pg_advisory_xact_lock(k) FROM (
        SELECT DISTINCT hashtextextended(p || '/' || s, 0) AS k
        FROM unnest(CAST(:projects AS text[]), CAST(:sids AS text[])) AS t(p, s)
        ORDER BY k
    ) AS locks
    """
)
LATEST_SQL = text(
    """
    SELECT DISTINCT ON (project, session_id)
        project, session_id, version, id, config_hash, reward, components, extractor_versions
    FROM rewards
    WHERE (project, session_id) IN (
        SELECT * FROM unnest(CAST(:projects AS text[]), CAST(:sids AS text[]))
    )
    ORDER BY project, session_id, version DESC
    """
)

NEXT_IDS_SQL = "SELECT nextval(pg_get_serial_sequence('rewards', 'id')) FROM generate_series(1, %s)"
COPY_REWARDS = (
    "COPY rewards (id, project, session_id, version, reward, components, extractor_versions, config_hash, "
    "policy_version, reason) FROM STDIN (FORMAT BINARY)"
)
REWARD_TYPES = ["int8", "varchar", "varchar", "int4", "float8", "jsonb", "jsonb", "varchar", "varchar", "varchar"]
COPY_SAMPLES = (
    "COPY training_samples (project, session_id, completion_id, reward_id, reward_version, policy_version, "
    "group_key, task, agent_role, prompt_token_ids, completion_token_ids, loss_mask, behaviour_logprobs, reward, "
    "components, sampling) FROM STDIN (FORMAT BINARY)"
)
SAMPLE_TYPES = [
    "varchar",
    "varchar",
    "uuid",
    "int8",
    "int4",
    "varchar",
    "varchar",
    "varchar",
    "varchar",
    "int4[]",
    "int4[]",
    "int2[]",
    "float8[]",
    "float8",
    "jsonb",
    "jsonb",
]


@dataclass(frozen=True)
class StoredReward:
    """The newest stored version of one session's reward."""

    version: int
    reward_id: int
    reward: float
    components: dict[str, Any]
    extractor_versions: dict[str, Any]
    config_hash: str

    @property
    def input_hash(self) -> str | None:
        """The input hash recorded in its components."""
        return (self.components.get("_meta") or {}).get("input_hash")

    @property
    def event_ids(self) -> frozenset[str]:
        """The event ids it covered."""
        return frozenset((self.components.get("_meta") or {}).get("event_ids") or ())


@dataclass(frozen=True)
class StoreResult:
    """What happened to one scored session."""

    key: Key
    decision: Decision
    version: int | None
    """The written version, else the newest stored one (None if there is none)."""
    reward_id: int | None
    reason: str | None
    """The written row's reason."""
    identical: bool = False
    """Not written because the newest version has exactly this input and configuration."""

    @property
    def written(self) -> bool:
        """A new version was written."""
        return self.decision == "write"


def decide(new: ScoredSession, latest: StoredReward | None, mode: Mode, force: bool = False) -> Decision:
    """Whether ``new`` becomes a new version over ``latest``."""
    if latest is None or force:
        return "write"
    if mode == "stream":
        ids, old = frozenset(new.event_ids), latest.event_ids
        if ids <= old:
            return "covered"
        return "write" if old <= ids else "diverged"
    if latest.input_hash == new.input_hash and latest.config_hash == new.config_hash:
        return "unchanged"
    return "write"


def version_reason(requested: str, latest: StoredReward | None, mode: Mode) -> str:
    """The reason recorded: ``recompute``, or the stream's own, ``late_feedback`` once a version exists."""
    if mode == "recompute":
        return "recompute"
    return requested if latest is None else "late_feedback"


def _key_params(keys: Sequence[Key]) -> dict[str, list[str]]:
    return {"projects": [k[0] for k in keys], "sids": [k[1] for k in keys]}


class RewardStore:
    """Reads and writes rewards and training samples in one database."""

    def __init__(self, url: str):
        self.url = url
        self.engine = get_engine(url)

    def latest(self, keys: Sequence[Key]) -> dict[Key, StoredReward]:
        """The newest stored version of each session in ``keys``."""
        with self.engine.connect() as conn:
            return self._latest(conn, keys)

    def _latest(self, conn, keys: Sequence[Key]) -> dict[Key, StoredReward]:
        if not keys:
            return {}
        rows = conn.execute(LATEST_SQL, _key_params(keys))
        return {
            (r.project, r.session_id): StoredReward(
                r.version, r.id, r.reward, r.components, r.extractor_versions, r.config_hash
            )
            for r in rows
        }

    def write(self, batch: Sequence[tuple[ScoredSession, str]], mode: Mode, force: bool = False) -> list[StoreResult]:
        """Write the sessions of ``batch`` ((scored, requested reason) pairs) that :func:`decide` admits."""
        if not batch:
            return []
        keys = sorted({s.key for s, _ in batch})
        if len(keys) != len(batch):
            raise ValueError("a batch must hold each session at most once")
        with self.engine.begin() as conn:
            conn.execute(LOCK_SQL, _key_params(keys))
            latest = self._latest(conn, keys)
            results: dict[Key, StoreResult] = {}
            pending: list[tuple[ScoredSession, int, str]] = []
            for scored, reason in batch:
                old = latest.get(scored.key)
                decision = decide(scored, old, mode, force)
                if decision == "write":
                    pending.append((scored, (old.version if old else 0) + 1, version_reason(reason, old, mode)))
                else:
                    version, rid = (old.version, old.reward_id) if old else (None, None)
                    same = old is not None and old.input_hash == scored.input_hash
                    same = same and old.config_hash == scored.config_hash
                    results[scored.key] = StoreResult(scored.key, decision, version, rid, None, same)
            for (scored, version, reason), reward_id in zip(pending, self._insert(conn, pending)):
                results[scored.key] = StoreResult(scored.key, "write", version, reward_id, reason)
        return [results[s.key] for s, _ in batch]

    def _insert(self, conn, pending: list[tuple[ScoredSession, int, str]]) -> list[int]:
        """Insert reward rows and their samples (binary COPY); the new reward ids in ``pending`` order."""
        if not pending:
            return []
        raw = conn.connection.driver_connection
        with raw.cursor() as cur:
            cur.execute(NEXT_IDS_SQL, (len(pending),))
            ids = [row[0] for row in cur.fetchall()]
            with cur.copy(COPY_REWARDS) as copy:
                copy.set_types(REWARD_TYPES)
                for (s, version, reason), reward_id in zip(pending, ids):
                    copy.write_row(
                        (
                            reward_id,
                            s.project,
                            s.session_id,
                            version,
                            s.reward,
                            Jsonb(s.components, json_bytes),
                            Jsonb(s.extractor_versions, json_bytes),
                            s.config_hash,
                            s.policy_version,
                            reason,
                        )
                    )
            with cur.copy(COPY_SAMPLES) as copy:
                copy.set_types(SAMPLE_TYPES)
                for (s, version, _), reward_id in zip(pending, ids):
                    for x in s.samples:
                        copy.write_row(
                            (
                                s.project,
                                s.session_id,
                                x.completion_id,
                                reward_id,
                                version,
                                x.policy_version,
                                x.group_key,
                                x.task,
                                x.agent_role,
                                x.prompt_token_ids,
                                x.completion_token_ids,
                                x.loss_mask,
                                x.behaviour_logprobs,
                                x.reward,
                                Jsonb(x.components, json_bytes),
                                Jsonb(x.sampling.model_dump(mode="json", exclude_defaults=True), json_bytes),
                            )
                        )
        return ids
