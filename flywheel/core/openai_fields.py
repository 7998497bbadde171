"""Completion event fields from OpenAI-shaped requests and responses, for every producer of them.

The SDK's ``wrap_openai`` reads the official client's objects; the router's capture reads the
JSON it proxies (wrapped by :func:`as_object`, so both go through the same code). What is read:
the request's prompt and sampling parameters, and per choice the text, tool calls, finish
reason, token ids (vLLM's ``return_token_ids``) and sampling logprobs, whole or from a stream's
chunks (:class:`StreamAccumulator`). Imports nothing of the openai library.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_NAME_BAD = re.compile(r"[^A-Za-z0-9._:@/-]")
_UNSET_TYPES = frozenset({"NotGiven", "Omit"})

Kind = Literal["chat", "text"]


def given(value: Any) -> bool:
    """Whether a request option was really given: not absent, ``None``, or the openai client's
    ``NOT_GIVEN`` / ``omit`` sentinels (recognised by type name: this module does not import openai)."""
    return value is not None and type(value).__name__ not in _UNSET_TYPES


RESPONSE_FIELDS = frozenset({
    "choices", "index", "finish_reason", "message", "delta", "text", "content", "tool_calls", "id", "function",
    "custom", "name", "arguments", "input", "logprobs", "logprob", "token_logprobs", "model", "usage",
    "prompt_token_ids", "token_ids",
})  # fmt: skip
"""The fields of OpenAI's (and vLLM's) chat and text completions and chunks this module reads: a JSON
object wrapped by :func:`as_object` reads one it lacks as ``None``, as the openai types do."""


class _Fields:
    """Attribute access over a JSON object, as the openai types give: its keys, and any of
    :data:`RESPONSE_FIELDS` it lacks as ``None``; any other name (or one starting with ``_``) raises
    :class:`AttributeError`."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]):
        self._data = data

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # private and special names (copy's, pickle's probes) are never fields
            raise AttributeError(name)
        if name in self._data:
            return as_object(self._data[name])
        if name in RESPONSE_FIELDS:
            return None
        raise AttributeError(f"{type(self).__name__} object has no field {name!r}")


def as_object(value: Any) -> Any:
    """A JSON value readable like the openai client's response objects (objects by attribute, lists as lists)."""
    if isinstance(value, Mapping):
        return _Fields(value)
    if isinstance(value, list):
        return [as_object(v) for v in value]
    return value


# -- request ---------------------------------------------------------------------------------


def request_fields(kind: Kind, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What the request contributes to the completion event: model, prompt, sampling parameters."""
    fields: dict[str, Any] = {"model": str(kwargs.get("model", "")), "sampling": sampling_params(kwargs)}
    if kind == "chat":
        fields["prompt_messages"] = [m for m in (normalize_message(x) for x in kwargs.get("messages") or ()) if m]
    else:
        prompt = kwargs.get("prompt")
        if isinstance(prompt, str):
            fields["prompt_text"] = prompt
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(p, str) for p in prompt):
            fields["prompt_texts"] = list(prompt)
    return fields


def _number(low: float, high: float, *, low_open: bool = False) -> Any:
    def check(v: Any) -> bool:
        return isinstance(v, (int, float)) and (low < v if low_open else low <= v) and v <= high

    return check


SAMPLING_CHECKS: dict[str, Any] = {
    "temperature": _number(0, 10),
    "top_p": _number(0, 1, low_open=True),
    "top_k": lambda v: isinstance(v, int) and v >= -1,
    "min_p": _number(0, 1),
    "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2),
    "repetition_penalty": _number(0, 100, low_open=True),
    "min_tokens": lambda v: isinstance(v, int) and 0 <= v <= 65_536,
    "max_tokens": lambda v: isinstance(v, int) and 1 <= v <= 65_536,
    "seed": lambda v: isinstance(v, int),
}
"""Sampling parameters recorded as numbers, with the contract's ranges (a value outside is left out)."""

CONSTRAINT_OPTIONS = {
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
    "structured_outputs": "structured_outputs",
    "guided_json": "structured_outputs",
    "guided_regex": "structured_outputs",
    "guided_choice": "structured_outputs",
    "guided_grammar": "structured_outputs",
    "use_beam_search": "beam_search",
    "thinking_token_budget": "thinking_token_budget",
    "logits_processors": "logits_processors",
}
"""Request options (top level or ``extra_body``) that restrict which tokens may be sampled, to the name recorded."""


def sampling_params(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling parameters of a request: whatever shapes the distribution its tokens were sampled from.

    Standard OpenAI options are read from the call's keyword arguments, vLLM's own (``top_k``,
    ``min_p``, ``repetition_penalty``, ``min_tokens``, ...) from ``extra_body`` (which the client
    merges into the request, so it wins there too). Numbers outside the contract's ranges are left
    out rather than losing the completion. Options that restrict the sampled tokens in ways the
    trainer cannot reproduce (allowed tokens, bad words, structured outputs, a JSON response format,
    a forced tool choice, beam search, ...) are listed by name in ``constraints``; an invalid
    ``logit_bias`` is listed there too, so the record never looks less constrained than the request was.
    """
    extra = kwargs.get("extra_body") if isinstance(kwargs.get("extra_body"), Mapping) else {}

    def option(key: str) -> Any:
        value = extra.get(key) if extra and given(extra.get(key)) else kwargs.get(key)
        return value if given(value) else None

    params: dict[str, Any] = {}
    for key, check in SAMPLING_CHECKS.items():
        value = option(key)
        if key == "max_tokens" and value is None:
            value = option("max_completion_tokens")
        if value is not None and not isinstance(value, bool) and check(value):
            params[key] = value
    constraints: list[str] = []
    bias = option("logit_bias")
    if isinstance(bias, Mapping) and bias:
        try:
            cleaned = {str(int(k)): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            cleaned = None
        if cleaned is not None and len(cleaned) <= 4096 and all(-100 <= v <= 100 for v in cleaned.values()):
            params["logit_bias"] = cleaned
        else:
            constraints.append("logit_bias")
    for option_name, name in CONSTRAINT_OPTIONS.items():
        value = option(option_name)
        if value is not None and value is not False and value != [] and name not in constraints:
            constraints.append(name)
    response_format = option("response_format")
    kind = response_format.get("type") if isinstance(response_format, Mapping) else response_format
    if response_format is not None and kind != "text":
        constraints.append("response_format")
    tool_choice = option("tool_choice")
    if tool_choice == "required" or isinstance(tool_choice, Mapping):
        constraints.append("tool_choice")
    if constraints:
        params["constraints"] = constraints
    stop = kwargs.get("stop")
    if isinstance(stop, str):
        params["stop"] = [stop]
    elif isinstance(stop, Sequence) and given(stop):
        params["stop"] = [s for s in stop if isinstance(s, str)][:16]
    return params


def normalize_message(message: Any) -> dict[str, Any] | None:
    """One request message as the contract's ``Message`` (dict), or ``None`` if it has no usable role."""
    if hasattr(message, "model_dump"):
        message = message.model_dump()
    if not isinstance(message, Mapping):
        return None
    role = message.get("role")
    if role == "function":
        role = "tool"
    if role not in MESSAGE_ROLES:
        return None
    out: dict[str, Any] = {"role": role, "content": content_text(message.get("content"))}
    name = message.get("name")
    if isinstance(name, str):
        out["name"] = name[:128]
    tool_call_id = message.get("tool_call_id")
    if isinstance(tool_call_id, str):
        out["tool_call_id"] = tool_call_id[:128]
    return out


def content_text(content: Any) -> str | None:
    """Message content as text: a string as is, the text parts of a list of parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text") if part.get("type", "text") == "text" else part.get("refusal")
                if isinstance(text, str):
                    parts.append(text)
        return "\n".join(parts)
    return str(content)


# -- response --------------------------------------------------------------------------------


def as_name(value: str | None) -> str | None:
    """``value`` made a valid contract name (policy versions: served model names may be paths)."""
    if not value:
        return None
    cleaned = _NAME_BAD.sub("_", value).lstrip("._:@/-")
    return cleaned[:128] or None


def aligned_logprobs(token_ids: list[int] | None, logprobs: list[float | None] | None) -> list[float] | None:
    """The logprobs if they can be trusted: one finite value <= 0 per completion token, else ``None``."""
    if token_ids is None or logprobs is None or len(token_ids) != len(logprobs):
        return None
    out = []
    for value in logprobs:
        if value is None or not math.isfinite(value) or value > 1e-4:
            return None
        out.append(min(float(value), 0.0))
    return out


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [int(v) for v in value]
    return None


def _tool_call(call: Any) -> dict[str, Any] | None:
    """A response tool call as the contract's ``ToolCall`` (dict)."""
    function = getattr(call, "function", None) or getattr(call, "custom", None)
    name = getattr(function, "name", None)
    if not call.id or not name:
        return None
    arguments = getattr(function, "arguments", None)
    if arguments is None:
        arguments = getattr(function, "input", "")
    return {"id": call.id, "name": name, "arguments": arguments or ""}


def parse_chat_completion(response: Any) -> list[dict[str, Any]]:
    """Per choice of an ``openai.types.chat.ChatCompletion``: the completion event's response fields."""
    prompt_ids = _ints(getattr(response, "prompt_token_ids", None))
    results = []
    for choice in sorted(response.choices, key=lambda c: c.index):
        message = choice.message
        token_ids = _ints(getattr(choice, "token_ids", None))
        content = choice.logprobs.content if choice.logprobs is not None else None
        logprobs = [t.logprob for t in content] if content is not None else None
        results.append(
            response_fields(
                text=message.content or "",
                tool_calls=[c for c in (_tool_call(t) for t in message.tool_calls or ()) if c],
                finish_reason=choice.finish_reason,
                prompt_token_ids=prompt_ids,
                token_ids=token_ids,
                logprobs=logprobs,
            )
        )
    return results


def parse_text_completion(response: Any) -> list[dict[str, Any]]:
    """Per choice of an ``openai.types.Completion``: the completion event's response fields."""
    results = []
    for choice in sorted(response.choices, key=lambda c: c.index):
        token_ids = _ints(getattr(choice, "token_ids", None))
        logprobs = choice.logprobs.token_logprobs if choice.logprobs is not None else None
        fields = response_fields(
            text=choice.text or "",
            tool_calls=[],
            finish_reason=choice.finish_reason,
            prompt_token_ids=_ints(getattr(choice, "prompt_token_ids", None)),
            token_ids=token_ids,
            logprobs=logprobs,
        )
        fields["index"] = choice.index
        results.append(fields)
    return results


def response_fields(
    *,
    text: str,
    tool_calls: list[dict[str, Any]],
    finish_reason: str | None,
    prompt_token_ids: list[int] | None,
    token_ids: list[int] | None,
    logprobs: list[float | None] | None,
) -> dict[str, Any]:
    """The completion event's response fields of one completion (logprobs kept only when aligned with its
    token ids); shared by the chat and text paths and the Responses API's (:mod:`flywheel.sdk.openai_responses`)."""
    return {
        "completion_text": text,
        "tool_calls": tool_calls,
        "finish_reason": finish_reason,
        "prompt_token_ids": prompt_token_ids,
        "completion_token_ids": token_ids,
        "logprobs": aligned_logprobs(token_ids, logprobs),
    }


@dataclass
class _ChoiceState:
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    has_token_ids: bool = False
    has_logprobs: bool = False
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None


class StreamAccumulator:
    """Collects the chunks of a chat or text stream into the fields of one completion per choice."""

    def __init__(self, kind: Kind):
        self.kind = kind
        self.model: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.usage: Any = None
        self._choices: dict[int, _ChoiceState] = {}

    def add(self, chunk: Any) -> None:
        """Take in one chunk (``ChatCompletionChunk`` or ``Completion``)."""
        self.model = getattr(chunk, "model", None) or self.model
        if getattr(chunk, "usage", None) is not None:
            self.usage = chunk.usage
        prompt_ids = _ints(getattr(chunk, "prompt_token_ids", None))
        if prompt_ids is not None:
            self.prompt_token_ids = prompt_ids
        for choice in chunk.choices or ():
            state = self._choices.setdefault(choice.index, _ChoiceState())
            if self.kind == "chat":
                self._add_chat(state, choice)
            else:
                self._add_text(state, choice)
            token_ids = _ints(getattr(choice, "token_ids", None))
            if token_ids is not None:
                state.has_token_ids = True
                state.token_ids.extend(token_ids)
            if choice.finish_reason:
                state.finish_reason = choice.finish_reason

    @staticmethod
    def _add_chat(state: _ChoiceState, choice: Any) -> None:
        delta = choice.delta
        if delta is not None and delta.content:
            state.text.append(delta.content)
        for call in (delta.tool_calls if delta is not None else None) or ():
            slot = state.tool_calls.setdefault(call.index, {"id": None, "name": None, "arguments": []})
            slot["id"] = call.id or slot["id"]
            if call.function is not None:
                slot["name"] = call.function.name or slot["name"]
                if call.function.arguments:
                    slot["arguments"].append(call.function.arguments)
        content = choice.logprobs.content if choice.logprobs is not None else None
        if content is not None:
            state.has_logprobs = True
            state.logprobs.extend(t.logprob for t in content)

    @staticmethod
    def _add_text(state: _ChoiceState, choice: Any) -> None:
        if choice.text:
            state.text.append(choice.text)
        prompt_ids = _ints(getattr(choice, "prompt_token_ids", None))
        if prompt_ids is not None:
            state.prompt_token_ids = prompt_ids
        token_logprobs = choice.logprobs.token_logprobs if choice.logprobs is not None else None
        if token_logprobs is not None:
            state.has_logprobs = True
            state.logprobs.extend(token_logprobs)

    def results(self) -> list[dict[str, Any]]:
        """The response fields of every choice seen so far, in index order."""
        results = []
        for index, state in sorted(self._choices.items()):
            calls = [
                {"id": c["id"], "name": c["name"], "arguments": "".join(c["arguments"])}
                for _, c in sorted(state.tool_calls.items())
                if c["id"] and c["name"]
            ]
            token_ids = state.token_ids if state.has_token_ids else None
            fields = response_fields(
                text="".join(state.text),
                tool_calls=calls,
                finish_reason=state.finish_reason,
                prompt_token_ids=state.prompt_token_ids or self.prompt_token_ids,
                token_ids=token_ids,
                logprobs=state.logprobs if state.has_logprobs else None,
            )
            fields["index"] = index
            results.append(fields)
        return results
