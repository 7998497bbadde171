"""A token budget on an agent's context: count it, ask for a prune or a summary near it, allow only that over it.

```python
with fw.session(task="research") as s:
    with s.budget(max_tokens=4096, warn_at=0.8, action="prune", tokenizer=tokenizer.encode) as budget:
        budget.add(messages)  # the context as the model will see it
        if budget.nudge:  # near or over: ask the agent to prune
            messages.append({"role": "user", "content": budget.nudge})
        ...
        budget.check(tool_name)  # over the budget: BudgetExceeded unless it is the prune tool
        s.prune(["doc-3"], tokens_after=budget.count(messages))  # the budget's count drops to tokens_after
```

States: ``ok`` below the warn line (``warn_at`` × ``max_tokens``), ``near`` at or past it (the
harness should ask the agent to prune or summarise: :attr:`Budget.nudge`), ``over`` past
``max_tokens`` (only the budget's action is allowed: :meth:`Budget.allows`,
:meth:`Budget.check`). Every enforcement is logged through the session as a ``budget`` event
(:class:`~flywheel.core.contracts.BudgetEnforcement`) that the retrieval and summary reward
extractors read: entering ``near``, entering ``over``, a refused tool, and a prune or summary
recorded through the budget's scope while near or over (``reduced``).

The budget does no I/O of its own (its events are enqueued like every logging call), so it
works the same in sync and async code (``with`` or ``async with``). It enforces whether or not
the session is sampled; an unsampled session logs nothing. One budget belongs to one agent
loop: it is not thread-safe.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from flywheel.sdk.client import Scope

BUDGET = "budget"
"""The event type the budget logs."""

Tokenizer = Callable[[str], int | Sequence[int]]
"""Text -> its tokens (a sequence whose length is counted, e.g. a Hugging Face tokenizer's or
tiktoken's ``encode``) or directly their number."""
State = Literal["ok", "near", "over"]
Action = Literal["prune", "summary"]
_RANK: dict[str, int] = {"ok": 0, "near": 1, "over": 2}
MAX_BUDGET = 2**31 - 1
"""Largest budget and count the ``budget`` event carries."""


def approx_tokens(text: str) -> int:
    """An APPROXIMATE token count: ``ceil(len(text) / 4)`` (about four characters a token in English
    for GPT-style BPE vocabularies). Pass a real tokenizer where the budget must hold exactly."""
    return -(-len(text) // 4)


class BudgetExceeded(RuntimeError):
    """A tool was refused because the context is over its token budget.

    ``tool`` was refused; ``tokens`` and ``budget_tokens`` say how far over it is; ``action``
    (``prune`` or ``summary``) is what the budget asks for, and ``allowed_tools`` the tools it
    still allows.
    """

    def __init__(self, tool: str, tokens: int, budget_tokens: int, action: str, allowed_tools: Sequence[str]):
        self.tool = tool
        self.tokens = tokens
        self.budget_tokens = budget_tokens
        self.action = action
        self.allowed_tools = tuple(allowed_tools)
        allowed = " or ".join(repr(t) for t in self.allowed_tools)
        super().__init__(
            f"token budget exceeded: the context holds {tokens} tokens, over its budget of {budget_tokens}; "
            f"tool {tool!r} refused: only {allowed} is allowed (the budget's action is {action!r}) "
            f"until the context is back under {budget_tokens} tokens"
        )


def message_text(message: Any) -> str:
    """The text of one chat message that a tokenizer counts: its content (a string or text parts),
    its name, and its tool calls' names and arguments. A dict or an object with these attributes
    (an OpenAI or Anthropic SDK model); the chat template's own tokens are not included."""
    if isinstance(message, str):
        return message
    get = message.get if isinstance(message, Mapping) else lambda key, default=None: getattr(message, key, default)
    pieces: list[str] = []
    name = get("name")
    if isinstance(name, str):
        pieces.append(name)
    _content_text(get("content"), pieces)
    for call in get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else getattr(call, "function", None)
        target = function if function is not None else call
        for key in ("name", "arguments"):
            value = target.get(key) if isinstance(target, Mapping) else getattr(target, key, None)
            if isinstance(value, str):
                pieces.append(value)
    return "\n".join(pieces)


def _content_text(content: Any, pieces: list[str]) -> None:
    if content is None:
        return
    if isinstance(content, str):
        pieces.append(content)
        return
    if isinstance(content, Iterable):
        for part in content:
            if isinstance(part, str):
                pieces.append(part)
                continue
            text = part.get("text") if isinstance(part, Mapping) else getattr(part, "text", None)
            if isinstance(text, str):
                pieces.append(text)
        return
    raise TypeError(f"message content must be text or a list of parts, got {type(content).__name__}")


class Budget:
    """A token budget on the context of one scope (a session or a span); see the module docstring.

    Made by :meth:`flywheel.sdk.Scope.budget`; active inside ``with`` / ``async with``, where a
    :meth:`~flywheel.sdk.Scope.prune` or :meth:`~flywheel.sdk.Scope.summary` recorded through
    the same scope with ``tokens_after`` sets the count to it (and fills in ``tokens_before``
    from the count when it is not given).
    """

    def __init__(
        self,
        scope: Scope,
        max_tokens: int,
        *,
        warn_at: float = 0.8,
        action: Action = "prune",
        tokenizer: Tokenizer | None = None,
        allowed_tools: Iterable[str] | None = None,
        tokens: int = 0,
    ):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_BUDGET:
            raise ValueError(f"budget max_tokens must be an integer from 1 to {MAX_BUDGET} (got {max_tokens!r})")
        if isinstance(warn_at, bool) or not isinstance(warn_at, (int, float)) or not 0.0 < warn_at <= 1.0:
            raise ValueError(f"budget warn_at must be a share of max_tokens in (0, 1] (got {warn_at!r})")
        if action not in ("prune", "summary"):
            raise ValueError(f"budget action must be 'prune' or 'summary' (got {action!r})")
        if tokenizer is not None and not callable(tokenizer):
            raise ValueError(f"budget tokenizer must be callable (text -> token ids or a count), got {tokenizer!r}")
        tools = tuple(allowed_tools) if allowed_tools is not None else (action,)
        if not tools or not all(isinstance(t, str) and t for t in tools):
            raise ValueError(f"budget allowed_tools must be non-empty tool names (got {tools!r})")
        self._scope = scope
        self.max_tokens = max_tokens
        """The budget: most tokens the context may hold."""
        self.warn_at = float(warn_at)
        """Share of ``max_tokens`` at which the budget is ``near``."""
        self.action: Action = action
        """What the budget asks for near it and allows alone over it: ``prune`` or ``summary``."""
        self.tokenizer = tokenizer
        """Counts :meth:`add`'s text; ``None``: only :meth:`set` counts."""
        self.allowed_tools = tools
        """Tool names allowed over the budget (default: the action's name, ``prune`` or ``summary``)."""
        self.tokens = 0
        """The context's size now, in tokens."""
        self.state: State = "ok"
        """``ok``, ``near`` or ``over``."""
        self.active = False
        """Inside its ``with`` block (prunes and summaries of its scope update it)."""
        self.set(tokens)

    # -- counting ------------------------------------------------------------------------------

    def count(self, content: str | Any | Iterable[Any]) -> int:
        """Tokens of ``content`` (text, one chat message, or a list of messages), without changing the count."""
        if self.tokenizer is None:
            raise ValueError(
                "this budget has no tokenizer: pass tokenizer= to budget() (a tokenizer's encode, or "
                "flywheel.sdk.budget.approx_tokens for an approximation), or count yourself and call set(tokens)"
            )
        if isinstance(content, str) or isinstance(content, Mapping) or hasattr(content, "content"):
            return self._tokens_of(message_text(content))
        if isinstance(content, Iterable):
            return sum(self._tokens_of(message_text(message)) for message in content)
        raise TypeError(f"budget can count text, a chat message or a list of them, got {type(content).__name__}")

    def _tokens_of(self, text: str) -> int:
        assert self.tokenizer is not None
        counted = self.tokenizer(text)
        if isinstance(counted, bool):
            raise TypeError("the budget's tokenizer returned a bool: it must return token ids or a count")
        if isinstance(counted, int):
            n = counted
        elif hasattr(counted, "__len__"):
            n = len(counted)
        else:
            raise TypeError(f"the budget's tokenizer must return token ids or a count, got {type(counted).__name__}")
        if n < 0:
            raise ValueError(f"the budget's tokenizer returned a negative count ({n})")
        return n

    def add(self, content: str | Any | Iterable[Any]) -> int:
        """Add the tokens of ``content`` (text, one chat message, or a list of messages) to the count;
        returns the count. Logs ``near`` / ``over`` when the count crosses the warn line / the budget."""
        return self.set(self.tokens + self.count(content))

    def set(self, tokens: int) -> int:
        """Set the count (e.g. from the server's ``usage.prompt_tokens``); returns it. Logs ``near`` /
        ``over`` when the count crosses the warn line / the budget upwards."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_BUDGET:
            raise ValueError(f"budget token count must be an integer from 0 to {MAX_BUDGET} (got {tokens!r})")
        before = self.state
        self.tokens = tokens
        self.state = self._state_of(tokens)
        if _RANK[self.state] > _RANK[before]:
            self._log(self.state)
        return tokens

    def _state_of(self, tokens: int) -> State:
        if tokens > self.max_tokens:
            return "over"
        if tokens >= self.warn_at * self.max_tokens:
            return "near"
        return "ok"

    @property
    def remaining(self) -> int:
        """Tokens left before the budget (negative when over)."""
        return self.max_tokens - self.tokens

    # -- enforcing -----------------------------------------------------------------------------

    @property
    def nudge(self) -> str | None:
        """A short instruction for the agent's prompt when near or over the budget; ``None`` when ok."""
        if self.state == "ok":
            return None
        tools = " or ".join(f"`{t}`" for t in self.allowed_tools)
        what = (
            f"prune the documents or chunks you no longer need with {tools}"
            if self.action == "prune"
            else f"summarise what you need to keep so far with {tools}"
        )
        if self.state == "near":
            share = math.floor(100 * self.tokens / self.max_tokens)
            return f"Your context holds {self.tokens} of {self.max_tokens} tokens ({share}%): {what} before going on."
        return (
            f"Your context is over its budget ({self.tokens} of {self.max_tokens} tokens): {what} now; "
            f"no other tool is allowed until it is back under {self.max_tokens}."
        )

    def allows(self, tool: str) -> bool:
        """Whether ``tool`` may run now: any tool unless over the budget, then only the allowed ones."""
        return self.state != "over" or tool in self.allowed_tools

    def check(self, tool: str, *, tool_call_id: str | None = None) -> None:
        """Raise :class:`BudgetExceeded` (and log the refusal) if ``tool`` may not run now; ``tool_call_id``
        names the refused call in the log, so the reward can reach the completion that made it."""
        if self.allows(tool):
            return
        extra: dict[str, Any] = {"refused_tool": tool}
        if tool_call_id is not None:
            extra["tool_call_id"] = tool_call_id
        self._log("refused", **extra)
        raise BudgetExceeded(tool, self.tokens, self.max_tokens, self.action, self.allowed_tools)

    # -- what the scope tells it -----------------------------------------------------------------

    def _reduced(self, by: Action, tokens_after: int | None, event_id: uuid.UUID | None) -> None:
        """A prune or summary was recorded through the scope: the count drops to ``tokens_after``.

        Without a valid ``tokens_after`` the count stays: the logging call that tells it never
        raises (an invalid ``tokens_after`` makes its ``context`` event invalid, counted by the sender).
        """
        if isinstance(tokens_after, bool) or not isinstance(tokens_after, int) or not 0 <= tokens_after <= MAX_BUDGET:
            return
        before_tokens, before_state = self.tokens, self.state
        self.set(tokens_after)
        if before_state != "ok" and event_id is not None:
            self._log("reduced", reduced_by=by, context_event_id=event_id, tokens_before=before_tokens,
                      state_before=before_state)  # fmt: skip

    def _log(self, kind: str, **extra: Any) -> None:
        scope = self._scope
        if not scope.sampled:
            return
        fields = {
            "span": {"span_id": scope.span_id, "role": scope.role},
            "kind": kind,
            "budget_tokens": self.max_tokens,
            "warn_at": self.warn_at,
            "action": self.action,
            "tokens": self.tokens,
            "state": self.state,
            **extra,
        }
        scope._fw._put(BUDGET, scope.session_id, fields)  # not scope._log: last_event_id stays the last content

    # -- context management --------------------------------------------------------------------

    def __enter__(self) -> Budget:
        self._scope._budgets.append(self)
        self.active = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.active = False
        budgets = self._scope._budgets
        if self in budgets:
            budgets.remove(self)

    async def __aenter__(self) -> Budget:
        return self.__enter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"Budget({self.tokens}/{self.max_tokens} tokens, {self.state}, action={self.action!r})"
