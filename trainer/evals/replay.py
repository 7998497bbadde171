"""The replay suite: held-out production sessions re-run against the policy and scored by their outcomes.

**Which sessions.** A fixed hash split holds production sessions out of training: those whose
``sha256("<project>/<session_id>")`` falls below ``trainer.gate.holdout_per_mille`` of 1000
buckets (:func:`trainer.select.holdout_bucket`; sample selection drops their samples). Of the
held-out sessions, those that reported a verifiable outcome (an ``outcome`` event whose name has
a rule in rewarding's outcome settings) and whose task has a verifier
(:mod:`flywheel.task.verify`) qualify; the suite takes the first ``n`` of them in hash order.
The slice is fixed when the gate prepares, so a parent and its candidate replay the same
sessions, and its digest is part of the cache key: a parent's cached result is reused only for
the same slice.

**How.** Each session's task prompt (the opening messages of its first completion, as
recorded) is re-run against the served policy by the task's verifier, whole episodes with tool
calls, at the session's own sampling settings (temperature, top-p, top-k, max tokens; the
serving temperature and ``max_new_tokens`` where the session recorded none), each request
seeded from the session id and the turn. The outcome values the verifier returns are scored by
the rule rewarding scores production with (:func:`flywheel.task.outcome.outcome_reward` over
``rewarding.scoring.extractors.outcome``); ``success_rate`` is their mean (for the default
boolean rules, the share of sessions solved). ``production_rate`` is the same score of the
outcomes the sessions reported in production, for reference.

Fewer than ``min_sessions`` qualifying sessions measure nothing (``n = 0``): the gate passes
the suite with a note rather than judge on a handful.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import text

from flywheel.core import plugins
from flywheel.task import verify
from flywheel.task.outcome import OutcomeSettings, outcome_reward
from trainer.engine import Sampling
from trainer.evals.arith import request_seed
from trainer.evals.base import EvalContext, EvalSuite, Prepared
from trainer.select import BUCKET_SQL

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from trainer.engine import ServedPolicy

VERSION = "replay-v1"
OUTCOME_SECTION = "rewarding.scoring.extractors.outcome"


class ReplaySettings(BaseModel):
    """``trainer.gate.suites.replay``."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(200, ge=1, le=100_000)
    """Held-out sessions replayed: the first ``n`` qualifying ones in hash order."""
    min_sessions: int = Field(30, ge=1, le=100_000)
    """Fewer qualifying held-out sessions than this measure nothing (the suite passes with a note)."""
    projects: list[str] = Field(default_factory=list)
    """Projects whose sessions qualify (empty: every project)."""
    max_new_tokens: int = Field(64, ge=1, le=4096)
    """Longest turn where the session recorded no ``max_tokens``."""
    seed: int = Field(1234, ge=0)
    """Seed of the requests' sampling seeds (with the session id and the turn)."""


@dataclass(frozen=True)
class ReplaySession:
    """One held-out session, as replayed."""

    project: str
    session_id: str
    task: str | None
    group_key: str | None
    prompt: list[dict[str, str]]
    """Opening messages of its first completion."""
    sampling: dict[str, Any]
    """That completion's sampling parameters, as recorded."""
    production: dict[str, float | bool] = field(default_factory=dict)
    """Its latest outcome values by name, as reported in production."""


def outcome_settings(context: EvalContext) -> OutcomeSettings:
    """Rewarding's outcome rules (``rewarding.scoring.extractors.outcome``), validated as rewarding validates them."""
    raw = context.settings.rewarding.scoring.extractors.get("outcome")
    return plugins.plugin_settings(OutcomeSettings, raw, OUTCOME_SECTION)


def held_out_slice(
    session: Session, per_mille: int, n: int, families: list[str], outcome_names: list[str], projects: list[str]
) -> list[tuple[str, str, str | None, str | None]]:
    """``(project, session_id, task, group_key)`` of the first ``n`` qualifying held-out sessions, in hash order."""
    if per_mille <= 0 or not families or not outcome_names:
        return []
    project_filter = "AND s.project = ANY(:projects)" if projects else ""
    query = text(
        f"""
        WITH held AS (
            SELECT s.project, s.session_id, s.task, s.group_key,
                   encode(sha256(convert_to(s.project || '/' || s.session_id, 'UTF8')), 'hex') AS h
            FROM sessions s
            WHERE split_part(coalesce(s.task, ''), ':', 1) = ANY(:families) {project_filter}
        )
        SELECT held.project, held.session_id, held.task, held.group_key
        FROM held
        WHERE {BUCKET_SQL.format(hex="held.h")} < :per_mille
          AND EXISTS (SELECT 1 FROM raw_events e
                      WHERE e.project = held.project AND e.session_id = held.session_id
                        AND e.type = 'outcome' AND e.payload ->> 'name' = ANY(:names))
        ORDER BY held.h
        LIMIT :n
        """
    )
    params = {"families": families, "per_mille": per_mille, "names": outcome_names, "n": n, "projects": projects}
    return [tuple(row) for row in session.execute(query, params)]  # type: ignore[misc]


def load_session(
    session: Session, project: str, session_id: str, task: str | None, group_key: str | None
) -> ReplaySession | None:
    """A held-out session's first completion (prompt, sampling) and its latest outcomes; None without a completion."""
    rows = session.execute(
        text(
            "SELECT type, payload FROM raw_events WHERE project = :p AND session_id = :s "
            "AND type IN ('completion', 'outcome') ORDER BY occurred_at, event_id"
        ),
        {"p": project, "s": session_id},
    )
    completions: list[dict[str, Any]] = []
    production: dict[str, float | bool] = {}
    for kind, payload in rows:
        if kind == "completion":
            completions.append(payload)
        else:
            production[payload["name"]] = payload["value"]  # in time order: the latest of each name wins
    roots = [c for c in completions if (c.get("span") or {}).get("span_id", "root") == "root"]
    first = (roots or completions or [None])[0]
    if first is None or not first.get("prompt_messages"):
        return None
    prompt = [{"role": m["role"], "content": m.get("content") or ""} for m in first["prompt_messages"]]
    return ReplaySession(project, session_id, task, group_key, prompt, dict(first.get("sampling") or {}), production)


class ReplaySuite(EvalSuite):
    """Held-out production sessions with verifiable outcomes, re-run and scored like production."""

    name: ClassVar[str] = "replay"
    version: ClassVar[str] = VERSION
    Settings: ClassVar[type[BaseModel]] = ReplaySettings

    def prepare(self, settings: ReplaySettings, context: EvalContext) -> Prepared:
        """Fix the slice; key e.g. ``replay-v1/p50/n200/<slice digest>/o<rules digest>/t1.0/m64/s1234/vllm``."""
        if context.session is None:
            raise ValueError("the replay suite reads held-out sessions from the registry's database: no session given")
        rules = outcome_settings(context)
        per_mille = context.settings.trainer.gate.holdout_per_mille
        picked = held_out_slice(
            context.session, per_mille, settings.n, verify.families(), sorted(rules.rules), settings.projects
        )
        sessions = [s for s in (load_session(context.session, *row) for row in picked) if s is not None]
        if len(sessions) < settings.min_sessions:
            sessions = []
        digest = hashlib.sha256("\n".join(f"{s.project}/{s.session_id}" for s in sessions).encode()).hexdigest()
        rules_digest = hashlib.sha256(rules.model_dump_json().encode()).hexdigest()
        key = (
            f"{VERSION}/p{per_mille}/n{len(sessions)}/{digest[:12]}/o{rules_digest[:8]}"
            f"/t{context.sampling.temperature}/m{settings.max_new_tokens}/s{settings.seed}/{context.engine_kind}"
        )
        info = {"qualifying": len(picked), "holdout_per_mille": per_mille}
        return Prepared(key=key, items=sessions, settings=settings, info=info)

    def evaluate(self, policy: ServedPolicy, prepared: Prepared, context: EvalContext) -> dict[str, Any]:
        """Mean outcome reward of the replayed sessions (``success_rate``), with the production rate beside it."""
        settings: ReplaySettings = prepared.settings
        rules = outcome_settings(context)
        started = time.perf_counter()
        sessions: list[ReplaySession] = prepared.items

        def replay(s: ReplaySession) -> tuple[float | None, str | None]:
            verifier = verify.verifier_for(s.task)
            if verifier is None:
                return None, "no verifier"
            sampling = self._sampling(s, settings, context)
            turns = 0

            def generate(messages: list[dict[str, str]]) -> str:
                nonlocal turns
                turns += 1
                return policy.chat(
                    messages, sampling.with_seed(request_seed(settings.seed, s.project, s.session_id, turns))
                )

            try:
                values = verifier.replay(verify.ReplayCase(s.task, s.group_key, s.prompt), generate)
            except verify.VerifyError as err:
                return None, str(err)
            return outcome_reward(values, rules), None

        scored = policy.map(replay, sessions)
        rewards = [r for r, _ in scored if r is not None]
        kept = [s for s, (r, _) in zip(sessions, scored) if r is not None]
        production = [outcome_reward(s.production, rules) for s in kept]
        by_task: dict[str, list[float]] = defaultdict(list)
        for s, (r, _) in zip(sessions, scored):
            if r is not None:
                by_task[verify.family(s.task) or "-"].append(r)
        errors = Counter(e for _, e in scored if e is not None)
        n = len(rewards)
        return {
            "success_rate": sum(rewards) / n if n else 0.0,
            "n": n,
            "production_rate": sum(p for p in production if p is not None) / n if n else None,
            "by_task": {k: sum(v) / len(v) for k, v in sorted(by_task.items())},
            "not_replayed": dict(errors),
            "holdout_per_mille": prepared.info.get("holdout_per_mille"),
            "qualifying": prepared.info.get("qualifying"),
            "min_sessions": settings.min_sessions,
            "engine": policy.engine_kind,
            "seconds": round(time.perf_counter() - started, 3),
        }

    @staticmethod
    def _sampling(s: ReplaySession, settings: ReplaySettings, context: EvalContext) -> Sampling:
        recorded = s.sampling
        temperature = recorded.get("temperature")
        return Sampling(
            temperature=float(temperature) if temperature is not None else context.sampling.temperature,
            max_tokens=int(recorded.get("max_tokens") or settings.max_new_tokens),
            top_p=recorded.get("top_p"),
            top_k=recorded.get("top_k"),
        )
