"""Parallel orchestration, after Kimi K2.5's PARL reward.

``r = r_perf + a(t) * lambda_parallel * r_parallel + a(t) * lambda_finish * r_finish - c * critical_steps``

- ``r_perf``: the task outcome (outcome rules of ``perf_outcomes``);
- ``r_parallel = min(spawned, cap) / cap``: rewards spawning sub-agents, against collapse
  into one serial agent;
- ``r_finish = completed / spawned``: rewards sub-tasks actually completed, against spawning
  pointless sub-agents;
- ``a(t)``: the anneal factor, so both auxiliary terms reach zero and the final policy
  optimises the outcome alone;
- critical steps: the longest chain through the sub-agent tree. A span's critical length is
  its own steps (completions) plus, for every stage, the longest child spawned in that
  stage, where a child's stage is how many of its parent's completions came before its
  SpanStart. Children of one stage run in parallel; stages run one after another. With one
  level this is K2.5's ``sum_t (S_main(t) + max_i S_sub,i(t))``.
"""

from __future__ import annotations

from collections import defaultdict

from pydantic import BaseModel, Field

from flywheel.core.contracts.events import Completion, SpanStart
from rewarding.anneal import AnnealSettings, anneal_factor
from rewarding.extractors.base import BuildContext, Components, Extractor, mean
from rewarding.extractors.outcome import OutcomeExtractor, OutcomeExtractorSettings, outcome_terms
from rewarding.session_state import Session

ROOT = "root"


class ParlSettings(BaseModel):
    """Kimi K2.5 PARL: r_perf + lambda1 r_parallel + lambda2 r_finish, minus a critical-steps cost."""

    perf_outcomes: list[str] = Field(default_factory=lambda: ["task_solved"], min_length=1)
    """Outcomes (mapped by the outcome rules) that make r_perf."""
    lambda_parallel: float = Field(0.1, ge=0.0, le=10.0)
    """Initial coefficient of r_parallel (spawning sub-agents, against serial collapse)."""
    lambda_finish: float = Field(0.1, ge=0.0, le=10.0)
    """Initial coefficient of r_finish (sub-tasks completed, against pointless spawning)."""
    parallel_cap: int = Field(4, ge=1, le=1024)
    """Sub-agents at which r_parallel saturates at 1."""
    critical_step_cost: float = Field(0.01, ge=0.0, le=10.0)
    """Cost per critical step (longest chain through the sub-agent tree)."""
    anneal: AnnealSettings = Field(default_factory=AnnealSettings)
    """Schedule of lambda_parallel and lambda_finish."""


def span_steps(session: Session) -> dict[str, int]:
    """Completions per span id."""
    steps: dict[str, int] = defaultdict(int)
    for completion in session.completions:
        steps[completion.span.span_id] += 1
    return dict(steps)


def child_stages(session: Session) -> dict[str, dict[int, list[str]]]:
    """Parent span -> stage index -> child spans started in that stage."""
    done: dict[str, int] = defaultdict(int)
    stages: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for event in session.events:
        if isinstance(event, Completion):
            done[event.span.span_id] += 1
        elif isinstance(event, SpanStart) and event.span_id != ROOT:
            stages[event.parent_span_id][done[event.parent_span_id]].append(event.span_id)
    return stages


def critical_steps(session: Session) -> int:
    """The longest chain of steps through the sub-agent tree, starting at the root span."""
    steps = span_steps(session)
    stages = child_stages(session)

    def length(span: str, seen: frozenset[str]) -> int:
        own = steps.get(span, 0)
        for children in stages.get(span, {}).values():
            own += max((length(c, seen | {c}) for c in children if c not in seen), default=0)
        return own

    return length(ROOT, frozenset({ROOT}))


class ParlExtractor(Extractor):
    """PARL terms and the critical-steps cost."""

    name = "parl"
    version = "1"
    Settings = ParlSettings

    def __init__(self, settings: ParlSettings, outcomes: OutcomeExtractorSettings):
        self.settings = settings
        self.outcomes = outcomes

    @classmethod
    def build(cls, settings: ParlSettings, context: BuildContext) -> ParlExtractor:
        """r_perf maps outcomes by the outcome extractor's rules."""
        return cls(settings, context.settings_of(OutcomeExtractor.name, OutcomeExtractorSettings))

    def extract(self, session: Session) -> Components:
        s = self.settings
        spawned = sorted({e.span_id for e in session.span_starts if e.span_id != ROOT})
        completed = {e.span_id for e in session.span_ends if e.status == "completed"} & set(spawned)
        r_parallel = min(len(spawned), s.parallel_cap) / s.parallel_cap
        r_finish = len(completed) / len(spawned) if spawned else 0.0
        critical = critical_steps(session)
        metrics = {
            "critical_steps": float(critical),
            "total_steps": float(len(session.completions)),
            "subagents": float(len(spawned)),
            "subagents_completed": float(len(completed)),
        }
        perf = outcome_terms(session, self.outcomes.rules, s.perf_outcomes)
        if not perf:
            return Components(value=None, metrics=metrics, details={"missing": "r_perf"})
        factor = anneal_factor(s.anneal, session.started_at)
        terms = {
            "r_perf": mean(perf.values()),
            "r_parallel": factor * s.lambda_parallel * r_parallel,
            "r_finish": factor * s.lambda_finish * r_finish,
            "critical_steps_cost": -s.critical_step_cost * critical,
        }
        metrics.update({"anneal_factor": factor, "r_parallel_raw": r_parallel, "r_finish_raw": r_finish})
        return Components(value=sum(terms.values()), terms=terms, metrics=metrics)
