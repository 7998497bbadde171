"""Self-summarisation, after Cursor Composer 2: a summary inherits credit from what followed.

When the agent replaces its context with a summary (ContextUpdate ``summary``), the
completion that wrote it (``summary_completion_id``) gets a credit of its own:

``credit = credit_coef * ((downstream - baseline) - redo_penalty * redo_share)``

- downstream: the outcome the session reached after the summary (outcome rules, combined
  as the outcome extractor combines them): summaries that kept what mattered end in
  success and are reinforced, those that lost it end in failure and are pushed down;
- redo_share: the share of tool calls after the summary that repeat (same tool, same
  arguments) one made before it, a sign that the summary dropped a result.

The credit is added to that completion's sample only; the session reward is unchanged.

With a token budget whose action is ``summary`` (``budget`` events, the SDK's ``session.budget``),
two more per-completion terms, present only when the session has such events:

- ``budget_asked``: ``+asked_credit`` to the completion that wrote a summary recorded while
  the budget was near or over (the harness asked for it);
- ``budget_refused``: ``-refusal_penalty`` to the completion whose tool call the budget
  refused while over it (it did not summarise when it had to): the completion whose tool
  calls carry the refused ``tool_call_id``, else the latest one of the same span before the
  refusal.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from flywheel.core.contracts.events import Completion, ContextUpdate, Turn
from rewarding.extractors.base import BuildContext, Components, Extractor
from rewarding.extractors.budgets import budget_events, budget_metrics, refusing_completion
from rewarding.extractors.outcome import OutcomeExtractor, OutcomeExtractorSettings, combine, outcome_terms
from rewarding.session_state import Session


class SummarySettings(BaseModel):
    """Cursor Composer 2 self-summarisation: a summary inherits credit from how the session continued."""

    credit_coef: float = Field(1.0, ge=0.0, le=10.0)
    """Scale of the credit given to the completion that wrote a summary."""
    baseline: float = Field(0.5, ge=-1e6, le=1e6)
    """Downstream outcome that earns zero credit: better pushes the summary up, worse pushes it down."""
    redo_penalty: float = Field(0.5, ge=0.0, le=10.0)
    """Penalty times the share of later tool calls repeating one made before the summary (lost context)."""
    asked_credit: float = Field(0.1, ge=0.0, le=10.0)
    """Credit to the writer of a summary recorded while a ``summary`` token budget was near or over."""
    refusal_penalty: float = Field(0.1, ge=0.0, le=10.0)
    """Penalty to a completion whose tool call a ``summary`` token budget refused while over it."""


def tool_call_keys(events: tuple) -> list[tuple[str, str]]:
    """(tool name, arguments) of every tool call in ``events``, in order, deduplicated by call id."""
    seen: set[str] = set()
    keys: list[tuple[str, str]] = []
    for event in events:
        if isinstance(event, (Completion, Turn)):
            for call in event.tool_calls:
                if call.id not in seen:
                    seen.add(call.id)
                    keys.append((call.name, call.arguments))
    return keys


def redo_share(session: Session, summary: ContextUpdate) -> float:
    """Share of tool calls after ``summary`` that repeat a call made before it."""
    at = session.events.index(summary)
    before = set(tool_call_keys(session.events[:at]))
    after = tool_call_keys(session.events[at + 1 :])
    if not after:
        return 0.0
    return sum(key in before for key in after) / len(after)


class SummaryExtractor(Extractor):
    """Downstream credit for the completions that wrote summaries."""

    name = "summary"
    version = "1"
    Settings = SummarySettings

    def __init__(self, settings: SummarySettings, outcomes: OutcomeExtractorSettings):
        self.settings = settings
        self.outcomes = outcomes

    @classmethod
    def build(cls, settings: SummarySettings, context: BuildContext) -> SummaryExtractor:
        """The downstream outcome is mapped and combined as the outcome extractor does it."""
        return cls(settings, context.settings_of(OutcomeExtractor.name, OutcomeExtractorSettings))

    def extract(self, session: Session) -> Components:
        downstream = self._downstream(session)
        budget = budget_events(session, "summary")
        if not budget:
            return downstream
        s = self.settings
        per_completion = {cid: dict(terms) for cid, terms in downstream.per_completion.items()}
        details = dict(downstream.details)
        writers = {
            c.event_id: str(c.summary_completion_id) for c in session.contexts if c.summary_completion_id is not None
        }
        unattributed = 0
        for event in budget:
            if event.kind == "reduced" and event.reduced_by == "summary" and event.context_event_id in writers:
                slot = per_completion.setdefault(writers[event.context_event_id], {})
                slot["budget_asked"] = slot.get("budget_asked", 0.0) + s.asked_credit
            elif event.kind == "refused":
                completion = refusing_completion(session, event)
                if completion is None:
                    unattributed += 1
                    continue
                slot = per_completion.setdefault(str(completion.completion_id), {})
                slot["budget_refused"] = slot.get("budget_refused", 0.0) - s.refusal_penalty
        if unattributed:
            details["unattributed_refusals"] = unattributed
        metrics = {**downstream.metrics, **budget_metrics(budget)}
        return Components(value=None, per_completion=per_completion, metrics=metrics, details=details)

    def _downstream(self, session: Session) -> Components:
        """The downstream credit of every summary (the whole reward of a session without budget events)."""
        summaries = [c for c in session.contexts if c.kind == "summary" and c.summary_completion_id is not None]
        if not summaries:
            return Components(value=None)
        completion_ids = {str(c.completion_id) for c in session.completions}
        terms = outcome_terms(session, self.outcomes.rules)
        metrics = {"summaries": float(len(summaries))}
        if not terms:
            return Components(value=None, metrics=metrics, details={"missing": "outcome"})
        downstream = combine(list(terms.values()), self.outcomes.combine)
        s = self.settings
        per_completion: dict[str, dict[str, float]] = {}
        orphans = []
        for summary in summaries:
            target = str(summary.summary_completion_id)
            if target not in completion_ids:
                orphans.append(target)
                continue
            redo = redo_share(session, summary)
            credit = s.credit_coef * ((downstream - s.baseline) - s.redo_penalty * redo)
            slot = per_completion.setdefault(target, {"summary_credit": 0.0})
            slot["summary_credit"] += credit
            metrics["redo_share"] = max(metrics.get("redo_share", 0.0), redo)
        metrics["downstream"] = downstream
        details = {"unknown_summary_completions": orphans} if orphans else {}
        return Components(value=None, per_completion=per_completion, metrics=metrics, details=details)
