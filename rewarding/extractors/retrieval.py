"""Retrieval with a self-editing context, after Chroma Context-1.

``r = F_beta(returned, gold) + encountered_coef * recall(encountered, gold)
      - prune_penalty * max(0, prunes - free_prunes)
      - search_turn_penalty * max(0, search_turns - max_search_turns)``

- returned: ``document_ids`` of the latest ``returned_outcome`` Outcome; gold: of the latest
  ``gold_outcome`` Outcome (without a gold set there is no value);
- F-beta weights recall beta^2 times above precision (an agent that finds every relevant
  document and a few extra beats one that returns one sure document);
- encountered: every document a tool returned in the session, also those the agent later
  pruned from its context: process credit for having found them;
- prunes: ContextUpdate events of kind ``prune`` (pruning over and over is penalised);
- search turns: tool calls named in ``search_tools`` (deduplicated by call id).

With a token budget whose action is ``prune`` (``budget`` events, the SDK's ``session.budget``),
two more terms, present only when the session has such events (so sessions without a budget
score as before):

``+ budget_prune_credit * reductions - budget_refusal_penalty * refusals``

- reductions: prunes recorded while near or over the budget that lowered its state (over to
  near or ok, near to ok): the agent pruned when asked, and got back under;
- refusals: tools the budget refused while over it (the agent did not prune when it had to).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from rewarding.extractors.base import Components, Extractor
from rewarding.extractors.budgets import budget_events, budget_metrics, lowered
from rewarding.session_state import Session


class RetrievalSettings(BaseModel):
    """Chroma Context-1: F-beta over returned documents, credit for relevant ones seen, search penalties."""

    returned_outcome: str = Field("retrieval_returned", min_length=1, max_length=128)
    """Outcome whose ``document_ids`` are the documents the agent finally returned."""
    gold_outcome: str = Field("retrieval_gold", min_length=1, max_length=128)
    """Outcome whose ``document_ids`` are the gold (relevant) documents."""
    beta: float = Field(4.0, gt=0.0, le=100.0)
    """F-beta's beta: recall counts beta^2 times as much as precision."""
    encountered_coef: float = Field(0.2, ge=0.0, le=10.0)
    """Weight of the recall of gold documents seen in tool results, even if later pruned."""
    free_prunes: int = Field(2, ge=0, le=10_000)
    """Prune operations that cost nothing."""
    prune_penalty: float = Field(0.05, ge=0.0, le=10.0)
    """Penalty per prune operation beyond ``free_prunes``."""
    search_tools: list[str] = Field(default_factory=lambda: ["search"])
    """Tool names that count as search turns."""
    max_search_turns: int = Field(8, ge=0, le=10_000)
    """Search turns that cost nothing."""
    search_turn_penalty: float = Field(0.02, ge=0.0, le=10.0)
    """Penalty per search turn beyond ``max_search_turns``."""
    budget_prune_credit: float = Field(0.05, ge=0.0, le=10.0)
    """Credit per prune that lowered a ``prune`` token budget's state (over to near or ok, near to ok)."""
    budget_refusal_penalty: float = Field(0.1, ge=0.0, le=10.0)
    """Penalty per tool a ``prune`` token budget refused while the context was over it."""


def f_beta(returned: set[str], gold: set[str], beta: float) -> tuple[float, float, float]:
    """(precision, recall, F-beta) of ``returned`` against a non-empty ``gold``."""
    hits = len(returned & gold)
    precision = hits / len(returned) if returned else 0.0
    recall = hits / len(gold)
    if precision == 0.0 and recall == 0.0:
        return precision, recall, 0.0
    b2 = beta * beta
    return precision, recall, (1 + b2) * precision * recall / (b2 * precision + recall)


def encountered_documents(session: Session) -> set[str]:
    """Every document id a tool result carried."""
    return {doc for turn in session.turns for result in turn.tool_results for doc in result.document_ids}


def search_turns(session: Session, tools: list[str]) -> int:
    """Distinct tool calls (by id) to a search tool, from completions and turns."""
    names = set(tools)
    calls = [c for completion in session.completions for c in completion.tool_calls]
    calls += [c for turn in session.turns for c in turn.tool_calls]
    return len({c.id for c in calls if c.name in names})


class RetrievalExtractor(Extractor):
    """F-beta outcome plus process credit and search/prune penalties."""

    name = "retrieval"
    version = "1"
    Settings = RetrievalSettings

    def __init__(self, settings: RetrievalSettings):
        self.settings = settings

    def extract(self, session: Session) -> Components:
        s = self.settings
        latest = session.latest_outcomes()
        gold_event = latest.get(s.gold_outcome)
        if gold_event is None or not gold_event.document_ids:
            return Components(value=None, details={"missing": "gold documents"})
        gold = set(gold_event.document_ids)
        returned_event = latest.get(s.returned_outcome)
        returned = set(returned_event.document_ids) if returned_event else set()
        precision, recall, fb = f_beta(returned, gold, s.beta)
        encountered = encountered_documents(session)
        pruned = {doc for c in session.contexts if c.kind == "prune" for doc in c.pruned_chunk_ids}
        prunes = sum(1 for c in session.contexts if c.kind == "prune")
        searches = search_turns(session, s.search_tools)
        terms = {
            "f_beta": fb,
            "encountered_recall": s.encountered_coef * len(encountered & gold) / len(gold),
            "prune_penalty": -s.prune_penalty * max(0, prunes - s.free_prunes),
            "search_turn_penalty": -s.search_turn_penalty * max(0, searches - s.max_search_turns),
        }
        metrics = {
            "precision": precision,
            "recall": recall,
            "encountered_relevant": float(len(encountered & gold)),
            "pruned_relevant": float(len(pruned & gold)),
            "prunes": float(prunes),
            "search_turns": float(searches),
        }
        budget = budget_events(session, "prune")
        if budget:
            reductions = sum(lowered(e) and e.reduced_by == "prune" for e in budget)
            refusals = sum(e.kind == "refused" for e in budget)
            terms["budget_prune_credit"] = s.budget_prune_credit * reductions
            terms["budget_refusal_penalty"] = -s.budget_refusal_penalty * refusals
            metrics.update(budget_metrics(budget))
        return Components(value=sum(terms.values()), terms=terms, metrics=metrics)
