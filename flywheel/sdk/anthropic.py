"""Log every message of the official ``anthropic`` client (sync and async, streaming or not).

``wrap_anthropic(client, fw)`` patches the client's ``messages.create`` and ``messages.stream``
in place and returns the same client. A call made inside a session (the current one of this
context, or an explicit ``session=`` argument, which the wrapper removes before calling
Anthropic) is logged as one ``completion`` event, with:

- the prompt: ``system`` as a system message, then ``messages`` (text blocks as content;
  ``tool_result`` blocks as tool messages naming their ``tool_use_id``);
- the response: the text blocks' text, ``tool_use`` blocks as tool calls (their ``input`` as
  JSON text), and the ``stop_reason`` as finish reason: ``end_turn`` and ``stop_sequence`` are
  ``stop``, ``max_tokens`` is ``length``, ``tool_use`` is ``tool_calls``, any other is itself;
- the sampling settings: ``max_tokens``, ``temperature``, ``top_p`` and ``top_k`` (as keyword
  arguments or in ``extra_body``), ``stop_sequences``, and a forcing ``tool_choice`` (``any``,
  ``tool``) or an ``output_config`` format as constraints;
- the policy version: the served model name (Anthropic gives no token ids or logprobs, so
  these completions are logged for their text, never trained on); the latency as the client saw it.

Streams are logged when they end or are closed (``messages.stream(...)``: when its block ends),
with what was received. What the caller receives is unchanged. The ``anthropic`` package is
imported only by :func:`wrap_anthropic`. Logging never raises into the agent: a failure is counted
in ``fw.stats.errors`` and logged; errors of the call itself propagate unchanged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from flywheel.core.openai_fields import given, sampling_params
from flywheel.sdk._patch import AsyncStreamMixin, ManagerMixin, StreamMixin, adopt, replacing
from flywheel.sdk.client import Flywheel, Scope

if TYPE_CHECKING:
    from flywheel.sdk.openai import _Call

log = logging.getLogger("flywheel.sdk")
C = TypeVar("C")

STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}
"""Anthropic's ``stop_reason`` as the finish reason the other wrappers record."""

__all__ = ["completion_ids", "parse_message", "request_fields", "wrap_anthropic"]


def _shared() -> Any:
    """The OpenAI wrapper's module, whose call logging this wrapper shares (imported when first needed:
    it imports the openai package, which importing the SDK must not)."""
    from flywheel.sdk import openai as shared

    return shared


def completion_ids(response: Any) -> list[Any]:
    """The completion ids the wrapper logged for a message, stream or ``messages.stream(...)`` stream."""
    return _shared().completion_ids(response)


def _attach_ids(response: Any, ids: list[Any]) -> None:
    _shared()._attach_ids(response, ids)


def _dump(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value


def _get(value: Any, name: str) -> Any:
    return value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)


def _blocks_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for block in content if isinstance(content, Sequence) else ():
        block = _dump(block)
        if isinstance(block, Mapping) and block.get("type") == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
    return "\n".join(texts)


# -- request ---------------------------------------------------------------------------------


def prompt_messages(kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as the contract's messages (dicts)."""
    out: list[dict[str, Any]] = []
    system = kwargs.get("system")
    if given(system):
        out.append({"role": "system", "content": _blocks_text(system)})
    for message in kwargs.get("messages") or ():
        message = _dump(message)
        if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
            continue
        content = message.get("content")
        blocks = [_dump(b) for b in content] if isinstance(content, Sequence) and not isinstance(content, str) else []
        results = [b for b in blocks if isinstance(b, Mapping) and b.get("type") == "tool_result"]
        if isinstance(content, str) or len(results) < len(blocks) or not blocks:
            out.append({"role": message["role"], "content": _blocks_text(content)})
        for result in results:
            tool: dict[str, Any] = {"role": "tool", "content": _blocks_text(result.get("content")) or ""}
            if isinstance(result.get("tool_use_id"), str):
                tool["tool_call_id"] = result["tool_use_id"][:128]
            out.append(tool)
    return out


def request_fields(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What a Messages request contributes to the completion event: model, prompt, sampling settings."""
    mapped = {k: kwargs.get(k) for k in ("max_tokens", "temperature", "top_p", "top_k", "extra_body")}
    mapped["stop"] = kwargs.get("stop_sequences") if given(kwargs.get("stop_sequences")) else None
    choice = kwargs.get("tool_choice")
    if isinstance(choice, Mapping) and choice.get("type") in ("any", "tool"):
        mapped["tool_choice"] = "required"
    config = kwargs.get("output_config")
    if isinstance(config, Mapping) and given(config.get("format")):
        mapped["response_format"] = config["format"]
    if given(kwargs.get("output_format")):
        mapped["response_format"] = {"type": "json_schema"}
    return {
        "model": str(kwargs.get("model", "")),
        "sampling": sampling_params(mapped),
        "prompt_messages": prompt_messages(kwargs),
    }


# -- response --------------------------------------------------------------------------------


def _fields(text: str, calls: list[dict[str, Any]], stop_reason: Any) -> dict[str, Any]:
    reason = STOP_REASONS.get(stop_reason, str(stop_reason)[:32]) if stop_reason else None
    return {
        "completion_text": text,
        "tool_calls": calls,
        "finish_reason": reason,
        "prompt_token_ids": None,
        "completion_token_ids": None,
        "logprobs": None,
        "index": 0,
    }


def _tool_call(block: Any, arguments: str | None = None) -> dict[str, Any] | None:
    if _get(block, "type") != "tool_use" or not _get(block, "id") or not _get(block, "name"):
        return None
    if arguments is None:
        arguments = json.dumps(_get(block, "input") or {}, default=str)
    return {"id": _get(block, "id"), "name": _get(block, "name"), "arguments": arguments}


def parse_message(message: Any) -> list[dict[str, Any]]:
    """A ``Message`` as the completion event's response fields (one completion)."""
    texts, calls = [], []
    for block in _get(message, "content") or ():
        if _get(block, "type") == "text":
            texts.append(_get(block, "text") or "")
        else:
            call = _tool_call(block)
            if call is not None:
                calls.append(call)
    return [_fields("".join(texts), calls, _get(message, "stop_reason"))]


class MessageAccumulator:
    """Collects a Messages stream's events (``message_start``, ``content_block_*``, ``message_delta``)."""

    def __init__(self) -> None:
        self.model: str | None = None
        self.stop_reason: Any = None
        self._blocks: dict[int, dict[str, Any]] = {}

    def add(self, event: Any) -> None:
        kind = _get(event, "type")
        if kind == "message_start":
            self.model = _get(_get(event, "message"), "model") or self.model
        elif kind == "content_block_start":
            block = _get(event, "content_block")
            self._blocks[_get(event, "index")] = {"block": block, "parts": []}
        elif kind == "content_block_delta":
            slot = self._blocks.setdefault(_get(event, "index"), {"block": None, "parts": []})
            delta = _get(event, "delta")
            part = _get(delta, "text") if _get(delta, "type") == "text_delta" else _get(delta, "partial_json")
            if _get(delta, "type") in ("text_delta", "input_json_delta") and isinstance(part, str):
                slot["parts"].append(part)
        elif kind == "message_delta":
            self.stop_reason = _get(_get(event, "delta"), "stop_reason") or self.stop_reason

    def results(self) -> list[dict[str, Any]]:
        texts, calls = [], []
        for _, slot in sorted(self._blocks.items()):
            block = slot["block"]
            if _get(block, "type") == "text":
                texts.append((_get(block, "text") or "") + "".join(slot["parts"]))
            elif block is not None:
                call = _tool_call(block, "".join(slot["parts"]) or None)
                if call is not None:
                    calls.append(call)
        return [_fields("".join(texts), calls, self.stop_reason)]


# -- patching --------------------------------------------------------------------------------


class _Observer:
    def __init__(self, call: _Call):
        self.call = call
        self.accumulator = MessageAccumulator()

    def observe(self, event: Any) -> None:
        try:
            self.accumulator.add(event)
        except Exception as err:  # an event we cannot read must not break the agent's stream; counted and logged
            self.call.fw._counters.add("errors")
            log.error("flywheel: could not read an anthropic stream event: %r", err, exc_info=err)

    def finish(self, stream: Any) -> None:
        if not self.call.logged:
            _attach_ids(stream, self.call.log(self.accumulator.results(), self.accumulator.model))


_STREAM_CLASSES: dict[type, type] = {}


def _logged_stream(stream: Any, observer: _Observer) -> Any:
    """The same ``anthropic.Stream`` / ``AsyncStream`` (a subclass of its class), logging when it ends or closes."""
    mixin = AsyncStreamMixin if hasattr(type(stream), "__anext__") else StreamMixin
    return adopt(stream, mixin, _STREAM_CLASSES, _fw_observer=observer)


def _begin(fw: Flywheel, kwargs: dict[str, Any]) -> _Call | None:
    """The logged version of a call, or ``None`` to make it unlogged (no sampled session, or a failure)."""
    target = _shared()._target_scope(kwargs.pop("session", None))
    if target is None or not target.sampled:
        return None
    try:
        return _shared()._Call(fw, target, "chat", request_fields(kwargs), 1, time.perf_counter())
    except Exception as err:  # an odd request must not break the agent's call; counted and logged, sent unlogged
        fw._counters.add("errors")
        log.error("flywheel: could not prepare an anthropic request for logging: %r", err, exc_info=err)
        return None


def _finish(call: _Call, result: Any) -> Any:
    import anthropic

    if isinstance(result, (anthropic.Stream, anthropic.AsyncStream)):
        return _logged_stream(result, _Observer(call))
    try:
        results = parse_message(result)
    except Exception as err:  # an unexpected response shape must not break the agent; counted and logged
        call.fw._counters.add("errors")
        log.error("flywheel: could not read an anthropic message: %r", err, exc_info=err)
        return result
    _attach_ids(result, call.log(results, _get(result, "model")))
    return result


def _create(fw: Flywheel, resource: Any, is_async: bool) -> Any:
    """``resource.create`` (sync or async) logging its messages."""
    original = resource.create

    def create(*args: Any, **kwargs: Any) -> Any:
        call = _begin(fw, kwargs)
        if call is None:
            return original(*args, **kwargs)
        return _finish(call, original(*args, **kwargs))

    async def acreate(*args: Any, **kwargs: Any) -> Any:
        call = _begin(fw, kwargs)
        if call is None:
            return await original(*args, **kwargs)
        return _finish(call, await original(*args, **kwargs))

    return replacing(original, acreate if is_async else create)


class _LoggedManager(ManagerMixin):
    """Mixed into ``messages.stream(...)``'s context manager: the stream it opens is logged when it
    ends, or with what was received when the block ends."""

    _fw_call: _Call
    _fw_logged: Any
    _fw_stream: Any

    def _fw_open(self) -> None:
        self._fw_call.started = time.perf_counter()  # the request is made as the block opens

    def _fw_adopt(self, stream: Any) -> Any:
        raw = getattr(stream, "_raw_stream", None)
        if raw is not None:
            self._fw_logged = stream._raw_stream = _logged_stream(raw, _Observer(self._fw_call))
        self._fw_stream = stream
        return stream

    def _fw_done(self) -> None:
        if self._fw_logged is not None:
            self._fw_logged._fw_observer.finish(self._fw_logged)
            _attach_ids(self._fw_stream, completion_ids(self._fw_logged))

    def __enter__(self) -> Any:
        self._fw_open()
        return self._fw_adopt(super().__enter__())  # type: ignore[misc]

    async def __aenter__(self) -> Any:
        self._fw_open()
        return self._fw_adopt(await super().__aenter__())  # type: ignore[misc]


_MANAGER_CLASSES: dict[type, type] = {}


def _stream(fw: Flywheel, resource: Any) -> Any:
    original = resource.stream

    def stream(*args: Any, session: Scope | None = None, **kwargs: Any) -> Any:
        call = _begin(fw, {**kwargs, "session": session})
        manager = original(*args, **kwargs)
        if call is None:
            return manager
        return adopt(manager, _LoggedManager, _MANAGER_CLASSES, _fw_call=call, _fw_logged=None, _fw_stream=None)

    return replacing(original, stream)


def wrap_anthropic(client: C, fw: Flywheel) -> C:
    """Patch ``client`` (``anthropic.Anthropic`` or ``anthropic.AsyncAnthropic``) to log its messages into ``fw``.

    Returns the same client; wrapping it twice is a no-op.
    """
    import anthropic  # lazy: the SDK does not require the anthropic package

    if getattr(client, "_flywheel_wrapped", None) is fw:
        return client
    is_async = isinstance(client, anthropic.AsyncAnthropic)
    if not is_async and not isinstance(client, anthropic.Anthropic):
        raise TypeError(
            f"expected an anthropic.Anthropic or anthropic.AsyncAnthropic client, got {type(client).__name__}"
        )
    resource = client.messages
    resource.create = _create(fw, resource, is_async)
    if callable(getattr(resource, "stream", None)):
        resource.stream = _stream(fw, resource)
    client._flywheel_wrapped = fw  # type: ignore[attr-defined]
    return client
