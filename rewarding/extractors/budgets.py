"""Reading the ``budget`` events that the SDK's token budget logs, for the retrieval and summary extractors.

A budget's ``action`` says which extractor reads it: ``prune`` budgets the retrieval extractor,
``summary`` budgets the summary extractor, so no enforcement is counted twice.
"""

from __future__ import annotations

from flywheel.core.contracts.events import BudgetEnforcement, Completion
from rewarding.session_state import Session

RANK = {"ok": 0, "near": 1, "over": 2}


def budget_events(session: Session, action: str) -> list[BudgetEnforcement]:
    """The session's budget events of budgets whose action is ``action``, in order."""
    return [b for b in session.budgets if b.action == action]


def lowered(event: BudgetEnforcement) -> bool:
    """A ``reduced`` event whose prune or summary lowered the state (over to near or ok, near to ok)."""
    return event.kind == "reduced" and event.state_before is not None and RANK[event.state] < RANK[event.state_before]


def budget_metrics(events: list[BudgetEnforcement]) -> dict[str, float]:
    """How often the budget was entered near and over, refused a tool, and was reduced (lowering its state)."""
    return {
        "budget_near": float(sum(e.kind == "near" for e in events)),
        "budget_over": float(sum(e.kind == "over" for e in events)),
        "budget_refused": float(sum(e.kind == "refused" for e in events)),
        "budget_reductions": float(sum(lowered(e) for e in events)),
    }


def refusing_completion(session: Session, refused: BudgetEnforcement) -> Completion | None:
    """The completion that made a refused tool call: the one whose tool calls carry the event's
    ``tool_call_id``, else the latest completion of the same span before the refusal."""
    if refused.tool_call_id is not None:
        for completion in session.completions:
            if any(call.id == refused.tool_call_id for call in completion.tool_calls):
                return completion
    at = session.events.index(refused)
    for event in reversed(session.events[:at]):
        if isinstance(event, Completion) and event.span.span_id == refused.span.span_id:
            return event
    return None
