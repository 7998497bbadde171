"""The SDK's public face: :class:`Flywheel`, sessions, spans, feedback and outcomes.

Every logging call runs on the agent's thread and only appends a small tuple (event
type, project, session id, the type's fields, a UUIDv7 event id, the time) to an
in-memory deque: no validation, no serialization, no I/O, no lock. The background
sender (:mod:`flywheel.sdk.sender`) does everything else. A logging call never raises
for bad input: an invalid event is counted and logged by the sender.

Sampling is decided once per session, from a hash of its id, so every process (also one
sending late feedback hours later) takes the same decision, and an unsampled session
costs one attribute check per call. Feedback by completion id alone cannot be sampled
(the session is not known): it is always sent, and ingest attaches it to its session.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import logging
import os
import re
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar, Token
from enum import Enum
from types import TracebackType
from typing import Any, Literal, TypeVar

from flywheel import __version__
from flywheel.core import feedback_tokens
from flywheel.core.contracts.events import FeedbackKind
from flywheel.core.contracts.ids import uuid7
from flywheel.sdk.budget import Action, Budget, Tokenizer
from flywheel.sdk.redact import RedactFn, Redactor, chain
from flywheel.sdk.sender import Counters, EventBuilder, Fields, RateLimitedLog, Record, SdkStats, Sender
from flywheel.sdk.settings import SdkSettings
from flywheel.sdk.spool import Spool
from flywheel.sdk.transports import Transport, make_transport

log = logging.getLogger("flywheel.sdk")

SDK_ID = f"flywheel-sdk/{__version__}"
"""What every event's ``sdk`` field says."""
DEFAULT_FLUSH_TIMEOUT_S = 10.0
COMPLETION_MEMORY = 100_000
"""Recent completion ids remembered with their session, so feedback may name a completion alone."""
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$")

C = TypeVar("C")
ScopeT = TypeVar("ScopeT", bound="Scope")

_current: ContextVar[Scope | None] = ContextVar("flywheel_scope", default=None)

SESSION_START, SESSION_END = "session_start", "session_end"
SPAN_START, SPAN_END = "span_start", "span_end"
TURN, COMPLETION, CONTEXT = "turn", "completion", "context"
FEEDBACK, OUTCOME = "feedback", "outcome"


def current_scope() -> Scope | None:
    """The innermost session or span entered with ``with`` / ``async with`` in this context."""
    return _current.get()


def current_session() -> Session | None:
    """The session of the innermost entered scope, if any."""
    scope = _current.get()
    return scope.session if scope is not None else None


def is_sampled(session_id: str, rate: float) -> bool:
    """Whether a session is logged at ``rate``: deterministic in the id, the same in every process."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    digest = hashlib.blake2b(session_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < rate * 2**64


def _call_id() -> str:
    return "call_" + os.urandom(8).hex()


def _value(kind: Any) -> Any:
    return kind.value if isinstance(kind, Enum) else kind


def _plain(item: Any) -> Any:
    """A plain dict copy of a message / tool call / tool result given as a dict or a pydantic model."""
    if hasattr(item, "model_dump"):
        return item.model_dump(exclude_none=True)
    return dict(item) if isinstance(item, Mapping) else item


def _plain_list(items: Iterable[Any] | None) -> list[Any]:
    return [_plain(item) for item in items] if items else []


class Scope:
    """What sessions and spans share: the calls that log turns, completions and context events.

    A scope is a session's root agent or one sub-agent span; everything logged through it
    carries its :class:`~flywheel.core.contracts.SpanRef`. ``with scope:`` (or ``async with``)
    makes it the current scope, which the OpenAI wrapper logs into.
    """

    def __init__(self, fw: Flywheel, session: Session | None, session_id: str, sampled: bool, span_id: str, role: str):
        self._fw = fw
        self._session = session
        self.session_id = session_id
        self.sampled = sampled
        """Whether this session is logged at all (decided once, from the session id)."""
        self.span_id = span_id
        self.role = role
        self._span = {"span_id": span_id, "role": role}
        self._tokens: list[Token[Scope | None]] = []
        self._budgets: list[Budget] = []
        self.last_event_id: uuid.UUID | None = None
        """Id of the last event logged through this scope (e.g. for ``summary(replaced_through=...)``)."""

    @property
    def session(self) -> Session:
        """The session this scope belongs to (itself, for a session)."""
        return self._session if self._session is not None else self  # type: ignore[return-value]

    # -- the hot path -----------------------------------------------------------------------

    def _log(self, kind: str, fields: Fields, event_id: uuid.UUID | None = None) -> uuid.UUID | None:
        event_id = self._fw._put(kind, self.session_id, fields, event_id)
        self.last_event_id = event_id
        return event_id

    def tool_call(self, name: str, arguments: str | Mapping[str, Any] = "", *, id: str | None = None) -> str:
        """Log a tool call the agent made; returns its call id (``id``, or a fresh one) for :meth:`tool_result`."""
        call_id = id or _call_id()
        if self.sampled:
            self._log(TURN, ("tool_call", self.span_id, self.role, call_id, name, arguments))
        return call_id

    def tool_result(
        self,
        tool_call_id: str,
        content: str = "",
        *,
        is_error: bool = False,
        document_ids: Sequence[str] | None = None,
    ) -> uuid.UUID | None:
        """Log what a tool returned (``is_error`` feeds the tool-error-rate detector)."""
        if not self.sampled:
            return None
        documents = tuple(document_ids) if document_ids else None
        return self._log(TURN, ("tool_result", self.span_id, self.role, tool_call_id, content, is_error, documents))

    def message(
        self,
        role: Literal["system", "user", "assistant", "tool", "developer"],
        content: str | None,
        *,
        name: str | None = None,
        tool_call_id: str | None = None,
    ) -> uuid.UUID | None:
        """Log one message added to the conversation that is not a logged completion (e.g. the user's)."""
        if not self.sampled:
            return None
        return self._log(TURN, ("message", self.span_id, self.role, role, content, name, tool_call_id))

    def turn(
        self,
        messages: Iterable[Any] | None = None,
        tool_calls: Iterable[Any] | None = None,
        tool_results: Iterable[Any] | None = None,
    ) -> uuid.UUID | None:
        """Log several messages, tool calls and tool results at once (dicts or contract models)."""
        if not self.sampled:
            return None
        fields = {
            "span": self._span,
            "messages": _plain_list(messages),
            "tool_calls": _plain_list(tool_calls),
            "tool_results": _plain_list(tool_results),
        }
        return self._log(TURN, fields)

    def completion(
        self,
        *,
        model: str,
        policy_version: str | None = None,
        completion_text: str = "",
        prompt_messages: Iterable[Any] | None = None,
        prompt_text: str | None = None,
        tool_calls: Iterable[Any] | None = None,
        finish_reason: str | None = None,
        sampling: Mapping[str, Any] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        completion_token_ids: Sequence[int] | None = None,
        logprobs: Sequence[float] | None = None,
        latency_ms: float = 0.0,
        served_by: str | None = None,
        completion_id: uuid.UUID | None = None,
    ) -> uuid.UUID | None:
        """Log one model completion explicitly (the OpenAI wrapper calls this for you); returns its completion id.

        ``policy_version`` defaults to ``model``; ``logprobs`` must align with
        ``completion_token_ids`` (one per token), else the event is counted invalid.
        """
        if not self.sampled:
            return None
        cid = completion_id or uuid7()
        fields: dict[str, Any] = {
            "completion_id": cid,
            "span": self._span,
            "model": model,
            "policy_version": policy_version or model,
            "completion_text": completion_text,
            "latency_ms": latency_ms,
        }
        optional = {
            "prompt_messages": _plain_list(prompt_messages) or None,
            "prompt_text": prompt_text,
            "tool_calls": _plain_list(tool_calls) or None,
            "finish_reason": finish_reason,
            "sampling": dict(sampling) if sampling else None,
            "prompt_token_ids": list(prompt_token_ids) if prompt_token_ids is not None else None,
            "completion_token_ids": list(completion_token_ids) if completion_token_ids is not None else None,
            "logprobs": list(logprobs) if logprobs is not None else None,
            "served_by": served_by,
        }
        fields.update((key, value) for key, value in optional.items() if value is not None)
        self._fw._remember_completion(cid, self.session_id)
        # A completion event's id is its completion id: the router's capture of the same completion
        # (which hands the wrapper its ids) carries the same, so ingest keeps one of the two.
        self._log(COMPLETION, fields, event_id=cid)
        return cid

    def summary(
        self,
        summary: str,
        *,
        completion_id: uuid.UUID | None = None,
        replaced_through: uuid.UUID | None = None,
        tokens_before: int | None = None,
        tokens_after: int | None = None,
    ) -> uuid.UUID | None:
        """Log a self-summary that replaced earlier context (Composer-style).

        ``completion_id``: the completion that wrote it (it inherits credit from what
        followed); ``replaced_through``: the last event id whose content it replaces.
        """
        budgets = self._budgets
        if budgets and tokens_before is None:
            tokens_before = budgets[-1].tokens
        event_id = None
        if self.sampled:
            fields: dict[str, Any] = {"span": self._span, "kind": "summary", "summary": summary}
            _add_optional(fields, summary_completion_id=completion_id, replaced_through=replaced_through,
                          tokens_before=tokens_before, tokens_after=tokens_after)  # fmt: skip
            event_id = self._log(CONTEXT, fields)
        for budget in budgets:
            budget._reduced("summary", tokens_after, event_id)
        return event_id

    def prune(
        self, chunk_ids: Iterable[str], *, tokens_before: int | None = None, tokens_after: int | None = None
    ) -> uuid.UUID | None:
        """Log chunks or documents the agent pruned from its context (Context-1-style ``prune_chunks``).

        Inside an active :meth:`budget` of this scope, ``tokens_after`` becomes the budget's count
        and ``tokens_before`` defaults to it (the same holds for :meth:`summary`); this runs also
        in an unsampled session, which logs nothing.
        """
        budgets = self._budgets
        if budgets and tokens_before is None:
            tokens_before = budgets[-1].tokens
        event_id = None
        if self.sampled:
            fields: dict[str, Any] = {"span": self._span, "kind": "prune", "pruned_chunk_ids": list(chunk_ids)}
            _add_optional(fields, tokens_before=tokens_before, tokens_after=tokens_after)
            event_id = self._log(CONTEXT, fields)
        for budget in budgets:
            budget._reduced("prune", tokens_after, event_id)
        return event_id

    def budget(
        self,
        max_tokens: int,
        *,
        warn_at: float = 0.8,
        action: Action = "prune",
        tokenizer: Tokenizer | None = None,
        allowed_tools: Iterable[str] | None = None,
        tokens: int = 0,
    ) -> Budget:
        """A token budget on this scope's context, active inside ``with`` / ``async with`` (see
        :mod:`flywheel.sdk.budget`): near ``warn_at`` × ``max_tokens`` it asks for ``action``
        (``prune`` or ``summary``), over ``max_tokens`` it allows only ``allowed_tools`` (default:
        the action's name), and it logs what it enforced as ``budget`` events. ``tokenizer`` counts
        :meth:`Budget.add`'s text (a tokenizer's ``encode``, or ``approx_tokens``); ``tokens`` is
        the count to start from. Raises ``ValueError`` naming a bad argument.
        """
        return Budget(self, max_tokens, warn_at=warn_at, action=action, tokenizer=tokenizer,
                      allowed_tools=allowed_tools, tokens=tokens)  # fmt: skip

    def span(self, role: str = "subagent", assignment: str | None = None, *, span_id: str | None = None) -> Span:
        """Start a sub-agent span (a child of this scope) that was given ``assignment``; logs ``span_start``."""
        return Span(self._fw, self.session, self.span_id, role, assignment, span_id or f"span-{uuid7().hex[:16]}")

    def feedback(self, kind: FeedbackKind | str, **fields: Any) -> uuid.UUID | None:
        """Feedback on this session (or, with ``completion_id=``, one of its completions);
        see :meth:`Flywheel.feedback`."""
        return self._fw.feedback(self.session_id, kind, **fields)

    def score(self, name: str, value: float | bool | str, **fields: Any) -> uuid.UUID | None:
        """A named score of this session (or, with ``completion_id=``, one of its completions);
        see :meth:`Flywheel.score`."""
        return self._fw.score(self.session_id, name, value, **fields)

    def outcome(self, name: str, value: float | bool, **fields: Any) -> uuid.UUID | None:
        """A named outcome of this session; see :meth:`Flywheel.outcome`."""
        return self._fw.outcome(self.session_id, name, value, **fields)

    # -- context management -----------------------------------------------------------------

    def activate(self) -> None:
        """Make this the current scope of this context (what ``with`` does on entry)."""
        self._tokens.append(_current.set(self))

    def deactivate(self) -> None:
        """Restore the scope that was current before :meth:`activate`."""
        if not self._tokens:
            return
        token = self._tokens.pop()
        try:
            _current.reset(token)
        except ValueError:  # exited in another context than it was entered in
            _current.set(None)

    def _exit(self, exc: BaseException | None) -> None:
        """End the scope as the ``with`` block ended; subclasses log their end event."""

    def __enter__(self: ScopeT) -> ScopeT:
        self.activate()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.deactivate()
        self._exit(exc)

    async def __aenter__(self: ScopeT) -> ScopeT:
        self.activate()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.deactivate()
        self._exit(exc)


def _add_optional(fields: dict[str, Any], **optional: Any) -> None:
    fields.update((key, value) for key, value in optional.items() if value is not None)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:4096]


class Session(Scope):
    """One agent session; created by :meth:`Flywheel.session`, which logs its ``session_start``.

    ``with fw.session(...) as s:`` ends it on exit (``failed`` with the error if the block
    raised, else ``completed``); without ``with``, call :meth:`end`. A session resumed with
    ``resume=True`` (e.g. the next request of a long conversation, maybe in another
    process) logs no start and is not ended on exit.
    """

    def __init__(self, fw: Flywheel, session_id: str, sampled: bool, *, role: str = "agent", resume: bool = False):
        super().__init__(fw, None, session_id, sampled, "root", role)
        self.resumed = resume
        self.ended = False

    def end(
        self, status: Literal["completed", "failed", "abandoned", "timeout"] = "completed", error: str | None = None
    ) -> uuid.UUID | None:
        """Log ``session_end`` (once); its reward is final after the feedback window closes."""
        if self.ended:
            return None
        self.ended = True
        if not self.sampled:
            return None
        fields: dict[str, Any] = {"status": status}
        if error is not None:
            fields["error"] = error[:4096]
        return self._log(SESSION_END, fields)

    def _exit(self, exc: BaseException | None) -> None:
        if self.resumed:
            return
        if exc is None:
            self.end("completed")
        else:
            self.end("failed", _error_text(exc))

    def __repr__(self) -> str:
        return f"Session({self.session_id!r}, sampled={self.sampled})"


class AsyncSession(Session):
    """The async twin of :class:`Session`: ``async with fw.asession(...) as s:``.

    Logging calls are the same plain methods (they never block, so there is nothing to
    await); :meth:`flush` is awaitable.
    """

    async def flush(self, timeout_s: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Await delivery of everything logged so far (see :meth:`Flywheel.flush`), without blocking the loop."""
        return await self._fw.aflush(timeout_s)


class Span(Scope):
    """A sub-agent of a session (an orchestrator created it and assigned it a task); logs ``span_start`` on creation.

    ``with s.span("subagent", "find the failing test") as sub:`` makes it the current
    scope (completions of a wrapped client inside it belong to it) and logs ``span_end``
    on exit (``failed`` if the block raised); :attr:`result` set inside the block is
    reported. Spans nest: ``sub.span(...)`` creates a grandchild.
    """

    def __init__(
        self, fw: Flywheel, session: Session, parent_span_id: str, role: str, assignment: str | None, span_id: str
    ):
        super().__init__(fw, session, session.session_id, session.sampled, span_id, role)
        self.parent_span_id = parent_span_id
        self.result: str | None = None
        """What the sub-agent reported back (sent with ``span_end``)."""
        self.ended = False
        if self.sampled:
            fields: dict[str, Any] = {"span_id": span_id, "parent_span_id": parent_span_id, "role": role}
            if assignment is not None:
                fields["assignment"] = assignment
            self._log(SPAN_START, fields)

    def end(
        self, status: Literal["completed", "failed", "cancelled"] = "completed", result: str | None = None
    ) -> uuid.UUID | None:
        """Log ``span_end`` (once)."""
        if self.ended:
            return None
        self.ended = True
        if not self.sampled:
            return None
        fields: dict[str, Any] = {"span_id": self.span_id, "status": status}
        reported = result if result is not None else self.result
        if reported is not None:
            fields["result"] = reported
        return self._log(SPAN_END, fields)

    def _exit(self, exc: BaseException | None) -> None:
        if exc is None:
            self.end("completed")
        elif isinstance(exc, asyncio.CancelledError):
            self.end("cancelled", self.result)
        else:
            self.end("failed", self.result if self.result is not None else _error_text(exc))

    def __repr__(self) -> str:
        return f"Span({self.span_id!r}, role={self.role!r}, session={self.session_id!r})"


class Flywheel:
    """The client an agent product embeds: ``fw = Flywheel(project=..., write_key=...)``.

    Settings come from :class:`~flywheel.sdk.settings.SdkSettings` (environment variables
    ``FLYWHEEL_*``), overridden by ``settings=`` and then by keyword arguments named like
    its fields (``transport="http"``, ``kafka_bootstrap=...``, ``spool_dir=...``).
    ``redactor`` is the product's own ``str -> str`` redaction, applied after the default
    one (which ``redact=False`` turns off). ``transport`` is ``"kafka"`` or ``"http"``, or a
    :class:`~flywheel.sdk.transports.Transport` instance that replaces the configured one.

    Construction raises ``ValueError`` for a configuration that could never send (no or
    an invalid project name, the HTTP transport without a write key); nothing after it
    raises into the agent.
    """

    def __init__(
        self,
        project: str | None = None,
        write_key: str | None = None,
        *,
        settings: SdkSettings | None = None,
        transport: Transport | Literal["kafka", "http"] | None = None,
        redactor: RedactFn | None = None,
        agent: str | None = None,
        **overrides: Any,
    ):
        custom = transport if isinstance(transport, Transport) else None
        if isinstance(transport, str):
            overrides["transport"] = transport
        self.settings = _settings(settings, project=project, write_key=write_key, **overrides)
        self.project = _check_project(self.settings.project)
        self.agent = agent
        self.transport = custom or make_transport(self.settings)
        self._queue: deque[Record] = deque()
        self._queue_size = self.settings.queue_size
        self._closed = False
        self._counters = Counters()
        self._say = RateLimitedLog()
        self._completions: OrderedDict[uuid.UUID, str] = OrderedDict()
        self._completions_lock = threading.Lock()
        default = Redactor() if self.settings.redact else None
        builder = EventBuilder(
            SDK_ID,
            chain(default, redactor),
            max_completion_tokens=self.settings.max_completion_tokens,
            max_event_bytes=self.settings.max_event_bytes,
            counters=self._counters,
        )
        self._sender = Sender(
            self._queue,
            builder,
            self.transport,
            _open_spool(self.settings, self.project),
            self._counters,
            queue_size=self._queue_size,
            batch_size=self.settings.batch_size,
            linger_s=self.settings.linger_ms / 1000,
            backoff_max_s=self.settings.retry_backoff_max_s,
        )
        self._sender.start()
        self._exit_hook = _exit_hook(weakref.ref(self), self.settings.exit_flush_timeout_s)
        atexit.register(self._exit_hook)

    # -- sessions ---------------------------------------------------------------------------

    def session(
        self,
        session_id: str | None = None,
        *,
        user_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        agent: str | None = None,
        task: str | None = None,
        group_key: str | None = None,
        role: str = "agent",
        resume: bool = False,
    ) -> Session:
        """A new session (``session_start`` logged now), or with ``resume=True`` an existing one by id."""
        return self._open(Session, session_id, user_id, metadata, agent, task, group_key, role, resume)

    def asession(
        self,
        session_id: str | None = None,
        *,
        user_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        agent: str | None = None,
        task: str | None = None,
        group_key: str | None = None,
        role: str = "agent",
        resume: bool = False,
    ) -> AsyncSession:
        """Like :meth:`session`, for ``async with``."""
        return self._open(AsyncSession, session_id, user_id, metadata, agent, task, group_key, role, resume)

    def _open(
        self,
        cls: type[Session],
        session_id: str | None,
        user_id: str | None,
        metadata: Mapping[str, Any] | None,
        agent: str | None,
        task: str | None,
        group_key: str | None,
        role: str,
        resume: bool,
    ) -> Any:
        sid = session_id or str(uuid7())
        session = cls(self, sid, is_sampled(sid, self.settings.sample_rate), role=role, resume=resume)
        if session.sampled and not resume:
            fields: dict[str, Any] = {"metadata": dict(metadata) if metadata else {}}
            _add_optional(fields, user_id=user_id, agent=agent or self.agent, task=task, group_key=group_key)
            session._log(SESSION_START, fields)
        return session

    # -- late signals -----------------------------------------------------------------------

    def feedback(
        self,
        target: str | uuid.UUID | Scope,
        kind: FeedbackKind | str,
        *,
        session_id: str | None = None,
        completion_id: uuid.UUID | str | None = None,
        score: float | None = None,
        edit_ratio: float | None = None,
        persisted_minutes: float | None = None,
        dissatisfied: bool | None = None,
        text: str | None = None,
        comment: str | None = None,
        user_id: str | None = None,
    ) -> uuid.UUID | None:
        """Log what the user did with the agent's work: ``accept``, ``reject``, ``revert``, ``edit``, ``persisted``, ...

        ``target`` is a session id (a ``str``) or a :class:`Session`, or a completion id (a
        ``uuid.UUID``, as :meth:`Session.completion` and the OpenAI wrapper return it; a
        completion id kept as text is passed as ``uuid.UUID(text)``, since a ``str`` target
        is a session id). May come hours after the session ended, from another process.

        A completion id alone is enough. If this process logged the completion recently,
        the feedback names its session at once. Otherwise it is sent *unattached* (no
        ``session_id``, keyed by the completion id), and ingest finds the session from the
        completion and re-produces it attached, under the same event id. Unattached
        feedback is not sampled (no session, so no sampling decision): it is always
        sent, and feedback on a completion that was never logged (e.g. of an unsampled
        session) is reported by ingest as ``unknown_completion``. Pass
        ``session_id=`` as well to skip the lookup and apply sampling.
        """
        sid, cid = self._resolve_target(target, session_id, completion_id)
        fields: dict[str, Any] = {"kind": _value(kind)}
        _add_optional(fields, score=score, edit_ratio=edit_ratio, persisted_minutes=persisted_minutes,
                      dissatisfied=dissatisfied, text=text, comment=comment, user_id=user_id)  # fmt: skip
        return self._feedback(sid, cid, fields)

    def score(
        self,
        target: str | uuid.UUID | Scope,
        name: str,
        value: float | bool | str,
        *,
        data_type: Literal["numeric", "boolean", "categorical"] | None = None,
        comment: str | None = None,
        session_id: str | None = None,
        completion_id: uuid.UUID | str | None = None,
        user_id: str | None = None,
    ) -> uuid.UUID | None:
        """Log a named score of a session or one completion: a number, ``True``/``False``, or a category.

        ``target`` is chosen as for :meth:`feedback` (a session id, a :class:`Session`, or a completion
        id as ``uuid.UUID``). ``data_type`` (``numeric``, ``boolean``, ``categorical``) is inferred
        from ``value`` when not given and must agree with it (``boolean`` also takes 1 and 0); a
        ``comment`` says why (redacted like other free text). The score is a ``feedback`` event of
        kind ``score``; it becomes reward only where its name has a rule (docs/rewards.md, the
        ``scores`` extractor). Like every logging call it never raises: an invalid score is counted
        in ``stats.invalid`` and logged, naming the field.
        """
        sid, cid = self._resolve_target(target, session_id, completion_id)
        fields: dict[str, Any] = {"kind": FeedbackKind.SCORE.value, "name": name, "value": value}
        _add_optional(fields, data_type=data_type, comment=comment, user_id=user_id)
        return self._feedback(sid, cid, fields)

    def _feedback(self, sid: str | None, cid: uuid.UUID | str | None, fields: dict[str, Any]) -> uuid.UUID | None:
        """Send feedback fields to a resolved target: attached (and sampled) or by completion id alone."""
        if sid is None:
            return self._unattached_feedback(cid, fields)
        if not is_sampled(sid, self.settings.sample_rate):
            return None
        if cid is not None:
            fields["completion_id"] = cid
        return self._put(FEEDBACK, sid, fields)

    def feedback_token(
        self,
        session_id: str | Scope | None = None,
        *,
        completion_id: uuid.UUID | str | None = None,
        user_id: str | None = None,
        ttl_s: float = 3600,
        kinds: Iterable[FeedbackKind | str] | None = None,
    ) -> str:
        """A signed, expiring token that lets a browser send feedback on one session or completion
        to the gateway's ``POST /v1/feedback``, without the write key (docs/sdk.md).

        The token binds the project, ``session_id`` and/or ``completion_id`` (a UUIDv7 when alone),
        ``user_id`` if given, and the allowed ``kinds`` (None: every kind); it expires after
        ``ttl_s`` seconds (at most 30 days) and dies with the write key it is signed with. Needs
        the write key (``write_key=`` or ``FLYWHEEL_WRITE_KEY``); raises ``ValueError`` naming
        a bad argument. Minting is local: no request is made.
        """
        key = self.settings.write_key.get_secret_value() if self.settings.write_key is not None else ""
        sid = session_id.session_id if isinstance(session_id, Scope) else session_id
        return feedback_tokens.mint(key, self.project, session_id=sid, completion_id=completion_id,
                                    user_id=user_id, ttl_s=ttl_s, kinds=kinds)  # fmt: skip

    def _unattached_feedback(self, completion_id: Any, fields: dict[str, Any]) -> uuid.UUID | None:
        """Feedback keyed by its completion id, for ingest to attach to the completion's session."""
        cid = _as_uuid(completion_id)
        if cid is None or cid.version != 7:
            self._counters.add("invalid")
            self._say(logging.WARNING, "feedback-target", "flywheel: feedback %s not logged: %s is not a UUIDv7 "
                      "completion id, and no session_id= was given", fields["kind"], completion_id)  # fmt: skip
            return None
        fields["completion_id"] = cid
        return self._put(FEEDBACK, None, fields)

    def outcome(
        self,
        session_id: str | Scope,
        name: str,
        value: float | bool,
        *,
        completion_id: uuid.UUID | str | None = None,
        document_ids: Sequence[str] | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> uuid.UUID | None:
        """Log a named, verifiable result of a session (``tests_passed``, ``task_solved``, a metric)."""
        sid = session_id.session_id if isinstance(session_id, Scope) else session_id
        if not is_sampled(sid, self.settings.sample_rate):
            return None
        fields: dict[str, Any] = {"name": name, "value": value}
        _add_optional(fields, completion_id=completion_id, document_ids=list(document_ids) if document_ids else None,
                      details=dict(details) if details else None)  # fmt: skip
        return self._put(OUTCOME, sid, fields)

    def _resolve_target(
        self, target: str | uuid.UUID | Scope, session_id: str | None, completion_id: uuid.UUID | str | None
    ) -> tuple[str | None, uuid.UUID | str | None]:
        """(session id, completion id) of a feedback target; the session id is ``None`` when it is not known here."""
        if isinstance(target, Scope):
            return target.session_id, completion_id
        if isinstance(target, uuid.UUID) or session_id is not None:
            cid = _as_uuid(target)
            return session_id or self._completion_session(cid), cid if cid is not None else target
        known = self._completion_session(_as_uuid(target))
        if known is not None:
            return known, target
        return target, completion_id

    def _remember_completion(self, completion_id: uuid.UUID, session_id: str) -> None:
        with self._completions_lock:
            self._completions[completion_id] = session_id
            if len(self._completions) > COMPLETION_MEMORY:
                self._completions.popitem(last=False)

    def _completion_session(self, completion_id: uuid.UUID | None) -> str | None:
        if completion_id is None:
            return None
        with self._completions_lock:
            return self._completions.get(completion_id)

    # -- the OpenAI client ------------------------------------------------------------------

    def wrap_openai(self, client: C, *, request_token_data: bool | Literal["auto"] = "auto") -> C:
        """Log every completion of an ``openai.OpenAI`` or ``AsyncOpenAI`` client (chat, text, the
        Responses API and the parse/stream helpers); see :mod:`flywheel.sdk.openai`.
        ``request_token_data="auto"`` asks for token ids and logprobs where the server accepts them."""
        from flywheel.sdk.openai import wrap  # lazy: the openai library only for a product that wraps a client

        return wrap(client, self, request_token_data=request_token_data)

    def wrap_anthropic(self, client: C) -> C:
        """Log every message of an ``anthropic.Anthropic`` or ``AsyncAnthropic`` client; see
        :mod:`flywheel.sdk.anthropic`."""
        from flywheel.sdk.anthropic import wrap_anthropic  # lazy: the anthropic library only when wrapping one

        return wrap_anthropic(client, self)

    def litellm_callback(self) -> Any:
        """A LiteLLM callback logging each chat completion into the current session:
        ``litellm.callbacks = [fw.litellm_callback()]``; see :mod:`flywheel.sdk.litellm`."""
        from flywheel.sdk.litellm import FlywheelCallback  # lazy: LiteLLM only for a product that uses it

        return FlywheelCallback(self)

    # -- the hot path -----------------------------------------------------------------------

    def _put(
        self, kind: str, session_id: str | None, fields: Fields, event_id: uuid.UUID | None = None
    ) -> uuid.UUID | None:
        """Enqueue one record; never blocks, never raises. ``None`` if it was dropped.

        ``session_id`` is ``None`` only for unattached feedback (see :meth:`feedback`); ``event_id``
        defaults to a new UUIDv7.
        """
        queue = self._queue
        if len(queue) >= self._queue_size or self._closed:
            self._drop_on_put(kind)
            return None
        event_id = event_id or uuid7()
        queue.append((kind, self.project, session_id, fields, event_id.int, time.time()))
        return event_id

    def _drop_on_put(self, kind: str) -> None:
        self._counters.add("dropped")
        if self._closed:
            self._say(logging.WARNING, "closed", "flywheel: %s event logged after close() was DROPPED", kind)
        else:
            self._say(logging.WARNING, "queue-full", "flywheel: queue full (%d records): %s event DROPPED; "
                      "%d dropped so far", self._queue_size, kind, self._counters.get("dropped"))  # fmt: skip

    # -- delivery ---------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Wait until everything logged so far is delivered; ``False`` if some is still pending at the timeout.

        Pending events are not lost: they are in the queue or the disk spool, and are
        delivered when the transport is back (by this process, or the next one to start).
        While a flush waits, the transport is retried every fraction of a second.
        """
        return self._sender.flush(timeout_s)

    async def aflush(self, timeout_s: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """:meth:`flush` without blocking the event loop."""
        return await asyncio.to_thread(self._sender.flush, timeout_s)

    def close(self, timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Flush (up to ``timeout_s``), then stop the sender; what could not be sent stays in the spool.

        Events logged after close are dropped (counted). Returns what :meth:`flush` returned.
        Called at interpreter exit with a short timeout.
        """
        if self._closed:
            return True
        flushed = self.flush(timeout_s)
        self._closed = True
        self._sender.stop(max(1.0, timeout_s))
        atexit.unregister(self._exit_hook)
        return flushed

    async def aclose(self, timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """:meth:`close` without blocking the event loop."""
        return await asyncio.to_thread(self.close, timeout_s)

    @property
    def stats(self) -> SdkStats:
        """A snapshot of the counters."""
        values = self._counters.values
        spool = self._sender.spool
        return SdkStats(
            enqueued=self._sender.taken + len(self._queue),
            sent=values["sent"],
            spooled=values["spooled"],
            replayed=values["replayed"],
            dropped=values["dropped"],
            invalid=values["invalid"],
            send_failures=values["send_failures"],
            errors=values["errors"],
            token_data_redacted=values["token_data_redacted"],
            token_data_refused=values["token_data_refused"],
            queued=len(self._queue),
            spool_bytes=spool.bytes if spool is not None else 0,
        )

    def __enter__(self) -> Flywheel:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Flywheel(project={self.project!r}, transport={self.transport.name!r})"


def _settings(settings: SdkSettings | None, **overrides: Any) -> SdkSettings:
    """``settings`` (else the environment's), with the non-``None`` overrides applied and validated."""
    given = {key: value for key, value in overrides.items() if value is not None}
    if settings is None:
        return SdkSettings(**given)
    return SdkSettings(**{**settings.model_dump(), **given})


def _check_project(project: str | None) -> str:
    if not project:
        raise ValueError("Flywheel needs a project: pass project= or set FLYWHEEL_PROJECT")
    if len(project) > 128 or not NAME_PATTERN.match(project):
        raise ValueError(f"project {project!r} is not a valid name (letters, digits and ._:@/-, at most 128)")
    return project


def _open_spool(settings: SdkSettings, project: str) -> Spool | None:
    """The spool of this client, or ``None`` (logged) if its folder cannot be used."""
    root = settings.spool_dir / project.replace("/", "_").replace(":", "_")
    try:
        return Spool(root, settings.spool_max_bytes)
    except OSError as err:
        log.error("flywheel: no disk spool (%s): events that cannot be sent at once will be DROPPED", err)
        return None


def _exit_hook(ref: weakref.ref[Flywheel], timeout_s: float) -> Callable[[], None]:
    """An atexit callback that closes the client if it still exists (without keeping it alive)."""

    def hook() -> None:
        fw = ref()
        if fw is not None:
            fw.close(timeout_s)

    return hook


def _as_uuid(value: Any) -> uuid.UUID | None:
    if isinstance(value, uuid.UUID):
        return value
    if isinstance(value, str) and len(value) in (32, 36):
        try:
            return uuid.UUID(value)
        except ValueError:
            return None
    return None
