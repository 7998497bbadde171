"""Log every completion of the official ``openai`` client (sync and async, streaming or not).

``fw.wrap_openai(client)`` (or :func:`wrap`) patches the client's
``chat.completions.create`` and ``completions.create`` in place and returns the same
client. A call made inside a session (the current one of this context, or an explicit
``session=`` argument, which the wrapper removes before calling OpenAI) is logged as one
``completion`` event per choice, with:

- the request (prompt messages or text, sampling parameters) and the response (text,
  tool calls, finish reason);
- the policy version: the router's ``x-flywheel-policy-version`` response header, else
  the served model name; the replica (its public id) from ``x-flywheel-replica`` when present;
- token ids and sampling logprobs. Unless ``request_token_data=False``, the wrapper asks
  vLLM for them where the agent did not choose otherwise: ``extra_body``
  ``{"return_token_ids": true}``, ``logprobs=True, top_logprobs=0`` (chat) or
  ``logprobs=0`` (text); vLLM then adds ``token_ids`` / ``prompt_token_ids`` to the
  choices / response. Turn it off for servers other than vLLM (OpenAI's API refuses
  unknown fields);
- the latency as the client saw it (to the end of the stream, for a stream).

Inside a session (logged or not sampled) the wrapper also sends the request header
``x-flywheel-session-id`` (through ``extra_headers``, unless the agent set it), so the
router keeps the session on one policy version.

Streams are observed chunk by chunk and logged when they end (or are closed early,
then with what was received). For a stream the wrapper also asks for
``stream_options={"include_usage": true}``; if the agent had not asked for it, the extra
usage-only chunk is swallowed, so the agent receives exactly the chunks it would have.
What the agent receives is otherwise unchanged, except for the logprobs / token-id fields
it may now see, and a private attribute carrying the completion ids (see
:func:`completion_ids`). Logging never raises into the agent: a failure is counted in
``fw.stats.errors`` and logged; errors of the call itself propagate unchanged.
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import openai
from openai import AsyncStream, Stream

from flywheel.core.contracts import headers
from flywheel.sdk.client import Flywheel, Scope, current_scope

log = logging.getLogger("flywheel.sdk")

POLICY_VERSION_HEADER = headers.POLICY_VERSION
SESSION_HEADER = headers.SESSION_ID
SERVED_BY_HEADER = headers.REPLICA
IDS_ATTRIBUTE = "_flywheel_completion_ids"
"""Private attribute set on a logged response: the completion ids, one per choice."""
MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_NAME_BAD = re.compile(r"[^A-Za-z0-9._:@/-]")

Kind = Literal["chat", "text"]
C = TypeVar("C")


# -- request ---------------------------------------------------------------------------------


def _given(value: Any) -> bool:
    """Whether a keyword argument was really given (not absent, ``None``, ``NOT_GIVEN`` or ``omit``)."""
    return value is not None and not isinstance(value, (openai.NotGiven, openai.Omit))


def prepare_request(kind: Kind, kwargs: Mapping[str, Any], *, request_token_data: bool) -> tuple[dict[str, Any], bool]:
    """The call's keyword arguments with the token-data options added; and whether usage was requested for us.

    Only options the agent left unset are added: ``return_token_ids`` in ``extra_body``,
    ``logprobs`` (and ``top_logprobs=0`` for chat), and for streams ``include_usage``.
    """
    out = dict(kwargs)
    if request_token_data:
        extra = dict(out["extra_body"]) if isinstance(out.get("extra_body"), Mapping) else {}
        extra.setdefault("return_token_ids", True)
        out["extra_body"] = extra
        if not _given(out.get("logprobs")):
            if kind == "chat":
                out["logprobs"] = True
                if not _given(out.get("top_logprobs")):
                    out["top_logprobs"] = 0
            else:
                out["logprobs"] = 0
    injected_usage = False
    if out.get("stream") is True:
        options = dict(out["stream_options"]) if isinstance(out.get("stream_options"), Mapping) else {}
        if "include_usage" not in options:
            options["include_usage"] = True
            out["stream_options"] = options
            injected_usage = True
    return out, injected_usage


def with_session_header(kwargs: Mapping[str, Any], session_id: str | None) -> dict[str, Any]:
    """The call's keyword arguments with ``x-flywheel-session-id`` in ``extra_headers`` (for the router's
    sticky routing), unless the agent set that header itself (in any letter case) or there is no session."""
    out = dict(kwargs)
    if not session_id:
        return out
    given = out.get("extra_headers")
    headers = dict(given) if isinstance(given, Mapping) else {}
    if any(isinstance(k, str) and k.lower() == SESSION_HEADER for k in headers):
        return out
    headers[SESSION_HEADER] = session_id
    out["extra_headers"] = headers
    return out


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

    def given(key: str) -> Any:
        value = extra.get(key) if extra and _given(extra.get(key)) else kwargs.get(key)
        return value if _given(value) else None

    params: dict[str, Any] = {}
    for key, check in SAMPLING_CHECKS.items():
        value = given(key)
        if key == "max_tokens" and value is None:
            value = given("max_completion_tokens")
        if value is not None and not isinstance(value, bool) and check(value):
            params[key] = value
    constraints: list[str] = []
    bias = given("logit_bias")
    if isinstance(bias, Mapping) and bias:
        try:
            cleaned = {str(int(k)): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            cleaned = None
        if cleaned is not None and len(cleaned) <= 4096 and all(-100 <= v <= 100 for v in cleaned.values()):
            params["logit_bias"] = cleaned
        else:
            constraints.append("logit_bias")
    for option, name in CONSTRAINT_OPTIONS.items():
        value = given(option)
        if value is not None and value is not False and value != [] and name not in constraints:
            constraints.append(name)
    response_format = given("response_format")
    kind = response_format.get("type") if isinstance(response_format, Mapping) else response_format
    if response_format is not None and kind != "text":
        constraints.append("response_format")
    tool_choice = given("tool_choice")
    if tool_choice == "required" or isinstance(tool_choice, Mapping):
        constraints.append("tool_choice")
    if constraints:
        params["constraints"] = constraints
    stop = kwargs.get("stop")
    if isinstance(stop, str):
        params["stop"] = [stop]
    elif isinstance(stop, Sequence) and _given(stop):
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
            _response_fields(
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
        fields = _response_fields(
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


def _response_fields(
    *,
    text: str,
    tool_calls: list[dict[str, Any]],
    finish_reason: str | None,
    prompt_token_ids: list[int] | None,
    token_ids: list[int] | None,
    logprobs: list[float | None] | None,
) -> dict[str, Any]:
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
            fields = _response_fields(
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


# -- logging ---------------------------------------------------------------------------------


@dataclass
class _Call:
    """One wrapped call in flight: what is needed to log it when its response is complete."""

    fw: Flywheel
    scope: Scope
    kind: Kind
    request: dict[str, Any]
    n: int
    started: float
    policy_version: str | None = None
    served_by: str | None = None
    logged: bool = False

    def log(self, results: list[dict[str, Any]], model: str | None) -> list[uuid.UUID]:
        """Log one completion per choice; never raises (a failure is counted and logged)."""
        if self.logged:
            return []
        self.logged = True
        try:
            return self._log(results, model)
        except Exception as err:  # logging must never break the agent's call; counted and logged
            self.fw._counters.add("errors")
            log.error("flywheel: could not log a %s completion: %r", self.kind, err, exc_info=err)
            return []

    def _log(self, results: list[dict[str, Any]], model: str | None) -> list[uuid.UUID]:
        latency_ms = (time.perf_counter() - self.started) * 1000
        served_model = model or self.request["model"]
        policy = as_name(self.policy_version) or as_name(served_model) or "unknown"
        prompt_texts = self.request.get("prompt_texts")
        ids = []
        for fields in results:
            index = fields.pop("index", 0)
            prompt_text = self.request.get("prompt_text")
            if prompt_texts:
                prompt_text = prompt_texts[min(index // max(self.n, 1), len(prompt_texts) - 1)]
            completion_id = self.scope.completion(
                model=served_model,
                policy_version=policy,
                prompt_messages=self.request.get("prompt_messages"),
                prompt_text=prompt_text,
                sampling=self.request["sampling"],
                latency_ms=latency_ms,
                served_by=self.served_by,
                **fields,
            )
            if completion_id is not None:
                ids.append(completion_id)
        return ids


def completion_ids(response: Any) -> list[uuid.UUID]:
    """The completion ids (one per choice) the wrapper logged for a response or stream, for feedback."""
    return list(getattr(response, IDS_ATTRIBUTE, None) or [])


def _attach_ids(response: Any, ids: list[uuid.UUID]) -> None:
    try:
        object.__setattr__(response, IDS_ATTRIBUTE, ids)
    except (AttributeError, TypeError):
        log.debug("flywheel: cannot attach completion ids to %s", type(response).__name__)


def _headers(raw: Any) -> tuple[str | None, str | None]:
    headers = getattr(raw, "headers", None) or {}
    return headers.get(POLICY_VERSION_HEADER), headers.get(SERVED_BY_HEADER)


class _Observer:
    """Watches a stream's chunks and logs the completion when the stream ends."""

    def __init__(self, call: _Call, injected_usage: bool):
        self.call = call
        self.injected_usage = injected_usage
        self.accumulator = StreamAccumulator(call.kind)
        self.ids: list[uuid.UUID] = []

    def observe(self, chunk: Any) -> bool:
        """Record a chunk; ``False`` for the usage-only chunk the agent did not ask for (hidden from it)."""
        try:
            self.accumulator.add(chunk)
        except Exception as err:  # a chunk we cannot read must not break the agent's stream; counted and logged
            self.call.fw._counters.add("errors")
            log.error("flywheel: could not read a stream chunk: %r", err, exc_info=err)
        return not (self.injected_usage and not chunk.choices and getattr(chunk, "usage", None) is not None)

    def finish(self, stream: Any) -> None:
        if self.call.logged:
            return
        self.ids = self.call.log(self.accumulator.results(), self.accumulator.model)
        _attach_ids(stream, self.ids)


class LoggedStream(Stream):  # type: ignore[type-arg]
    """An ``openai.Stream`` that logs its completion when it ends; otherwise the same stream."""

    _fw_observer: _Observer

    @classmethod
    def adopt(cls, stream: Stream[Any], observer: _Observer) -> LoggedStream:
        logged = cls.__new__(cls)
        logged.__dict__.update(stream.__dict__)
        logged._fw_observer = observer
        return logged

    def __next__(self) -> Any:
        while True:
            try:
                chunk = self._iterator.__next__()
            except StopIteration:
                self._fw_observer.finish(self)
                raise
            if self._fw_observer.observe(chunk):
                return chunk

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                yield self.__next__()
            except StopIteration:
                return

    def close(self) -> None:
        self._fw_observer.finish(self)
        super().close()


class LoggedAsyncStream(AsyncStream):  # type: ignore[type-arg]
    """An ``openai.AsyncStream`` that logs its completion when it ends; otherwise the same stream."""

    _fw_observer: _Observer

    @classmethod
    def adopt(cls, stream: AsyncStream[Any], observer: _Observer) -> LoggedAsyncStream:
        logged = cls.__new__(cls)
        logged.__dict__.update(stream.__dict__)
        logged._fw_observer = observer
        return logged

    async def __anext__(self) -> Any:
        while True:
            try:
                chunk = await self._iterator.__anext__()
            except StopAsyncIteration:
                self._fw_observer.finish(self)
                raise
            if self._fw_observer.observe(chunk):
                return chunk

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            try:
                yield await self.__anext__()
            except StopAsyncIteration:
                return

    async def close(self) -> None:
        self._fw_observer.finish(self)
        await super().close()


# -- patching --------------------------------------------------------------------------------


def _target_scope(explicit: Any) -> Scope | None:
    """The scope a call belongs to: an explicit ``session=`` argument, else the current one (sampled or not)."""
    return explicit if isinstance(explicit, Scope) else current_scope()


def _begin(
    fw: Flywheel, kind: Kind, kwargs: dict[str, Any], token_data: bool
) -> tuple[_Call, dict[str, Any], bool] | None:
    """Prepare the logged version of a call, or ``None`` to make it unlogged (no session, or a failure).

    Either way, inside a session (logged or not) ``kwargs`` gains the session header.
    """
    target = _target_scope(kwargs.pop("session", None))
    if target is not None:
        kwargs.update(with_session_header(kwargs, target.session_id))
    scope = target if target is not None and target.sampled else None
    if scope is None:
        return None
    try:
        call_kwargs, injected = prepare_request(kind, kwargs, request_token_data=token_data)
        n = kwargs.get("n") if isinstance(kwargs.get("n"), int) else 1
        call = _Call(fw, scope, kind, request_fields(kind, kwargs), n, time.perf_counter())
    except Exception as err:  # an odd request must not break the agent's call; counted and logged, sent unlogged
        fw._counters.add("errors")
        log.error("flywheel: could not prepare a %s request for logging: %r", kind, err, exc_info=err)
        return None
    return call, call_kwargs, injected


def _finish(call: _Call, raw: Any, injected: bool, parse: Any) -> Any:
    """Log a non-streamed response, or wrap a stream so it is logged when it ends."""
    call.policy_version, call.served_by = _headers(raw)
    if isinstance(parse, Stream):
        return LoggedStream.adopt(parse, _Observer(call, injected))
    if isinstance(parse, AsyncStream):
        return LoggedAsyncStream.adopt(parse, _Observer(call, injected))
    try:
        results = parse_chat_completion(parse) if call.kind == "chat" else parse_text_completion(parse)
    except Exception as err:  # an unexpected response shape must not break the agent; counted and logged
        call.fw._counters.add("errors")
        log.error("flywheel: could not read a %s response: %r", call.kind, err, exc_info=err)
        return parse
    _attach_ids(parse, call.log(results, getattr(parse, "model", None)))
    return parse


def _sync_create(fw: Flywheel, kind: Kind, resource: Any, token_data: bool) -> Any:
    original = resource.create
    raw_create = resource.with_raw_response.create

    def create(*args: Any, **kwargs: Any) -> Any:
        begun = _begin(fw, kind, kwargs, token_data)
        if begun is None:
            return original(*args, **kwargs)
        call, call_kwargs, injected = begun
        call.started = time.perf_counter()
        raw = raw_create(*args, **call_kwargs)
        return _finish(call, raw, injected, raw.parse())

    create.__wrapped__ = original  # type: ignore[attr-defined]
    create.__doc__ = original.__doc__
    return create


def _async_create(fw: Flywheel, kind: Kind, resource: Any, token_data: bool) -> Any:
    original = resource.create
    raw_create = resource.with_raw_response.create

    async def create(*args: Any, **kwargs: Any) -> Any:
        begun = _begin(fw, kind, kwargs, token_data)
        if begun is None:
            return await original(*args, **kwargs)
        call, call_kwargs, injected = begun
        call.started = time.perf_counter()
        raw = await raw_create(*args, **call_kwargs)
        return _finish(call, raw, injected, raw.parse())

    create.__wrapped__ = original  # type: ignore[attr-defined]
    create.__doc__ = original.__doc__
    return create


def wrap(client: C, fw: Flywheel, *, request_token_data: bool = True) -> C:
    """Patch ``client`` (``openai.OpenAI`` or ``openai.AsyncOpenAI``) to log its completions into ``fw``; returns it.

    Wrapping the same client twice is a no-op. Copies made later with
    ``client.with_options(...)`` are not wrapped; wrap them too.
    """
    if getattr(client, "_flywheel_wrapped", None) is fw:
        return client
    is_async = isinstance(client, openai.AsyncOpenAI)
    if not is_async and not isinstance(client, openai.OpenAI):
        raise TypeError(f"expected an openai.OpenAI or openai.AsyncOpenAI client, got {type(client).__name__}")
    make = _async_create if is_async else _sync_create
    chat_resource = client.chat.completions
    text_resource = client.completions
    chat_resource.create = make(fw, "chat", chat_resource, request_token_data)
    text_resource.create = make(fw, "text", text_resource, request_token_data)
    client._flywheel_wrapped = fw  # type: ignore[attr-defined]
    return client
