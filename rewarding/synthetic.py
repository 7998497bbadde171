"""Builders of synthetic sessions (valid contract events) for tests, the benchmark and docs.

Every method appends one event, advances the builder's clock by ``step`` and returns the
event, so a test reads like the session it describes.
"""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from flywheel.core.contracts.events import (
    BudgetEnforcement,
    Completion,
    ContextUpdate,
    Event,
    Feedback,
    FeedbackKind,
    Message,
    Outcome,
    SessionEnd,
    SessionStart,
    SpanEnd,
    SpanRef,
    SpanStart,
    ToolCall,
    ToolResult,
    Turn,
)
from flywheel.task import arith


class SessionBuilder:
    """Events of one session, in order."""

    def __init__(
        self,
        session_id: str | None = None,
        *,
        project: str = "demo",
        at: datetime | None = None,
        step: timedelta = timedelta(milliseconds=10),
        policy_version: str = "base",
    ):
        self.project = project
        self.session_id = session_id or f"s-{uuid.uuid4().hex[:12]}"
        self.clock = at or datetime.now(UTC) - timedelta(minutes=5)
        self.step = step
        self.policy_version = policy_version
        self.events: list[Event] = []

    def _common(self, at: datetime | None) -> dict[str, Any]:
        when = at or self.clock
        self.clock = max(self.clock, when) + self.step
        return {"project": self.project, "session_id": self.session_id, "occurred_at": when}

    def _add(self, event: Event) -> Any:
        self.events.append(event)
        return event

    def start(self, task: str | None = None, group_key: str | None = None, at: datetime | None = None) -> SessionStart:
        """SessionStart."""
        return self._add(SessionStart(**self._common(at), task=task, group_key=group_key))

    def completion(
        self,
        text: str = "answer: 1",
        *,
        span: str = "root",
        role: str = "agent",
        tool_calls: list[ToolCall] | None = None,
        prompt_ids: list[int] | None = None,
        completion_ids: list[int] | None = None,
        logprobs: list[float] | None = None,
        with_logprobs: bool = True,
        latency_ms: float = 100.0,
        policy_version: str | None = None,
        prompt: list[Message] | None = None,
        at: datetime | None = None,
    ) -> Completion:
        """A completion with token ids and logprobs (defaults: 3 prompt and 2 completion tokens)."""
        ids = completion_ids if completion_ids is not None else [7, 8]
        if logprobs is None and with_logprobs:
            logprobs = [-0.5] * len(ids)
        return self._add(
            Completion(
                **self._common(at),
                span=SpanRef(span_id=span, role=role),
                model="tiny",
                policy_version=policy_version or self.policy_version,
                prompt_messages=prompt or [Message(role="user", content="What is 2+2?")],
                completion_text=text,
                tool_calls=tool_calls or [],
                prompt_token_ids=prompt_ids if prompt_ids is not None else [1, 2, 3],
                completion_token_ids=ids,
                logprobs=logprobs,
                latency_ms=latency_ms,
            )
        )

    def tool_result(
        self,
        call_id: str,
        content: str = "",
        *,
        documents: list[str] | None = None,
        error: bool = False,
        span: str = "root",
        at: datetime | None = None,
    ) -> Turn:
        """A turn carrying one tool result."""
        result = ToolResult(tool_call_id=call_id, content=content, is_error=error, document_ids=documents or [])
        return self._add(Turn(**self._common(at), span=SpanRef(span_id=span), tool_results=[result]))

    def user(self, text: str, at: datetime | None = None) -> Turn:
        """A user message turn."""
        return self._add(Turn(**self._common(at), messages=[Message(role="user", content=text)]))

    def span_start(self, span_id: str, parent: str = "root", at: datetime | None = None) -> SpanStart:
        """A sub-agent was spawned."""
        return self._add(SpanStart(**self._common(at), span_id=span_id, parent_span_id=parent, assignment="sub-task"))

    def span_end(self, span_id: str, status: str = "completed", at: datetime | None = None) -> SpanEnd:
        """A sub-agent finished."""
        return self._add(SpanEnd(**self._common(at), span_id=span_id, status=status))

    def summary(self, completion_id: uuid.UUID, text: str = "summary", at: datetime | None = None) -> ContextUpdate:
        """The context was replaced by a summary written by ``completion_id``."""
        return self._add(
            ContextUpdate(**self._common(at), kind="summary", summary=text, summary_completion_id=completion_id)
        )

    def prune(self, chunk_ids: list[str], at: datetime | None = None) -> ContextUpdate:
        """Chunks were pruned from the context."""
        return self._add(ContextUpdate(**self._common(at), kind="prune", pruned_chunk_ids=chunk_ids))

    def budget(
        self,
        kind: str,
        tokens: int,
        state: str,
        *,
        budget_tokens: int = 100,
        warn_at: float = 0.8,
        action: str = "prune",
        span: str = "root",
        at: datetime | None = None,
        **fields: Any,
    ) -> BudgetEnforcement:
        """What a token budget enforced (``kind``: near, over, refused or reduced; other fields as in the contract)."""
        return self._add(
            BudgetEnforcement(
                **self._common(at),
                span=SpanRef(span_id=span),
                kind=kind,
                tokens=tokens,
                state=state,
                budget_tokens=budget_tokens,
                warn_at=warn_at,
                action=action,
                **fields,
            )
        )

    def outcome(
        self, name: str, value: float | bool, documents: list[str] | None = None, at: datetime | None = None
    ) -> Outcome:
        """A verifiable outcome."""
        return self._add(Outcome(**self._common(at), name=name, value=value, document_ids=documents or []))

    def feedback(self, kind: str, at: datetime | None = None, **fields: Any) -> Feedback:
        """User feedback of ``kind``."""
        return self._add(Feedback(**self._common(at), kind=FeedbackKind(kind), **fields))

    def end(self, status: str = "completed", at: datetime | None = None) -> SessionEnd:
        """SessionEnd."""
        return self._add(SessionEnd(**self._common(at), status=status))


def arith_session(
    rng: random.Random,
    *,
    project: str = "demo",
    session_id: str | None = None,
    at: datetime | None = None,
    policy_version: str = "base",
    end: bool = True,
    step: timedelta = timedelta(milliseconds=10),
) -> SessionBuilder:
    """A calculator-agent episode as the demo logs it: a tool call, its result, an answer, an outcome."""
    problem = rng.choice(arith.all_problems("train"))
    solved = rng.random() < 0.5
    b = SessionBuilder(session_id, project=project, at=at, step=step, policy_version=policy_version)
    b.start(task="arith", group_key=problem.id)
    prompt = [
        Message(role="system", content=arith.SYSTEM_PROMPT),
        Message(role="user", content=f"What is {problem.expression}?"),
    ]
    prompt_ids = [rng.randrange(3, 500) for _ in range(40)]
    call = ToolCall(id="c1", name="calc", arguments=problem.expression)
    first = [rng.randrange(3, 500) for _ in range(8)]
    b.completion(
        arith.format_tool_call(problem.expression),
        tool_calls=[call],
        prompt=prompt,
        prompt_ids=prompt_ids,
        completion_ids=first,
        logprobs=[-0.1] * len(first),
    )
    b.tool_result("c1", str(problem.answer))
    answer = problem.answer if solved else problem.answer + 1
    second = [rng.randrange(3, 500) for _ in range(6)]
    b.completion(
        arith.format_answer(answer),
        prompt=prompt,
        prompt_ids=prompt_ids + first + [9, 9, 9],
        completion_ids=second,
        logprobs=[-0.2] * len(second),
    )
    b.outcome("task_solved", solved)
    if end:
        b.end()
    return b
