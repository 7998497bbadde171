"""Completion event fields from OpenAI Responses API requests and responses (``client.responses``).

Read by the OpenAI wrapper (:mod:`flywheel.sdk.openai`) for ``responses.create`` (whole or
streamed), ``responses.parse`` and ``responses.stream``. What is read:

- the prompt: ``instructions`` as a system message, then ``input`` (a string is one user
  message; of a list of items, messages with their text parts, ``function_call_output`` items as
  tool messages, ``function_call`` items as assistant messages without content);
- the sampling parameters (``max_output_tokens`` as ``max_tokens``; ``text.format`` or
  ``text_format`` other than text, and a forced ``tool_choice``, as constraints);
- the output text (``output_text`` and refusal parts of the message items), function and custom
  tool calls, and a finish reason made from the status: ``completed`` is ``stop``
  (``tool_calls`` when the output has tool calls), ``incomplete`` is ``length`` for
  ``max_output_tokens`` and the reason itself otherwise, any other status is itself;
- token ids where vLLM returns them (``enable_response_messages``: one ``raw_message_tokens``
  entry in ``input_messages`` and one in ``output_messages``) and logprobs from the
  ``output_text`` parts (``include=["message.output_text.logprobs"]``), kept only when they align
  one to one with the completion's token ids (vLLM's streamed responses leave out the logprob of
  a final stop token, so such a completion is logged with token ids and without logprobs).

Imports nothing of the openai library.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from flywheel.core.openai_fields import given, normalize_message, response_fields, sampling_params

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The ``include`` value that asks for the sampled tokens' logprobs."""
VLLM_FIELDS = ("enable_response_messages",)
"""The ``extra_body`` fields only vLLM understands: with it vLLM returns the prompt's and the output's token ids."""


def _dump(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value


def _get(value: Any, name: str) -> Any:
    """A field of a JSON object or of an openai response object (extra fields of either)."""
    if isinstance(value, Mapping):
        return value.get(name)
    return getattr(value, name, None)


# -- request ---------------------------------------------------------------------------------


def prepare_request(
    kwargs: Mapping[str, Any], *, request_token_data: bool, vllm_fields: bool = True, logprobs: bool = True
) -> dict[str, Any]:
    """The call's keyword arguments with the token-data options the agent left unset added:
    ``enable_response_messages`` in ``extra_body`` (vLLM's), ``include`` logprobs and ``top_logprobs=0``."""
    out = dict(kwargs)
    if request_token_data and vllm_fields:
        extra = dict(out["extra_body"]) if isinstance(out.get("extra_body"), Mapping) else {}
        for name in VLLM_FIELDS:
            extra.setdefault(name, True)
        out["extra_body"] = extra
    if request_token_data and logprobs:
        include = out.get("include")
        listed = list(include) if given(include) and isinstance(include, Sequence) else []
        if LOGPROBS_INCLUDE not in listed:
            out["include"] = [*listed, LOGPROBS_INCLUDE]
        if not given(out.get("top_logprobs")):
            out["top_logprobs"] = 0
    return out


def _parts_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = []
    for part in content if isinstance(content, Sequence) else ():
        part = _dump(part)
        if not isinstance(part, Mapping):
            continue
        text = part.get("refusal") if part.get("type") == "refusal" else part.get("text")
        if isinstance(text, str):
            parts.append(text)
    return "\n".join(parts)


def prompt_messages(kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as the contract's messages (dicts)."""
    messages: list[dict[str, Any]] = []
    instructions = kwargs.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    items = kwargs.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    for item in items if isinstance(items, Sequence) and given(items) else ():
        item = _dump(item)
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            message = normalize_message({**item, "content": _parts_text(item.get("content"))})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output) if isinstance(output, list) else None
            message = {"role": "tool", "content": text if text is not None else json.dumps(output, default=str)}
            if isinstance(item.get("call_id"), str):
                message["tool_call_id"] = item["call_id"][:128]
        elif kind in ("function_call", "custom_tool_call"):
            message = {"role": "assistant", "content": None}
        else:
            message = None
        if message:
            messages.append(message)
    return messages


def request_fields(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What a Responses request contributes to the completion event: model, prompt, sampling parameters."""
    mapped = {k: kwargs.get(k) for k in ("temperature", "top_p", "extra_body", "tool_choice", "logit_bias")}
    mapped["max_tokens"] = kwargs.get("max_output_tokens")
    text = kwargs.get("text")
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if given(fmt):
        mapped["response_format"] = fmt
    if given(kwargs.get("text_format")):
        mapped["response_format"] = {"type": "json_schema"}
    return {
        "model": str(kwargs.get("model", "")),
        "sampling": sampling_params(mapped),
        "prompt_messages": prompt_messages(kwargs),
    }


# -- response --------------------------------------------------------------------------------


def _raw_tokens(messages: Any) -> list[int] | None:
    """The token ids of vLLM's ``input_messages`` / ``output_messages`` when it is one raw entry."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or len(messages) != 1:
        return None
    (entry,) = messages
    tokens = _get(entry, "tokens")
    if _get(entry, "type") != "raw_message_tokens" or not isinstance(tokens, Sequence):
        return None
    return [int(t) for t in tokens]


def _tool_call(item: Any) -> dict[str, Any] | None:
    kind = _get(item, "type")
    if kind not in ("function_call", "custom_tool_call"):
        return None
    call_id, name = _get(item, "call_id"), _get(item, "name")
    if not call_id or not name:
        return None
    arguments = _get(item, "arguments") if kind == "function_call" else _get(item, "input")
    return {"id": call_id, "name": name, "arguments": arguments or ""}


def finish_reason(status: Any, incomplete_details: Any, has_tool_calls: bool) -> str | None:
    if status == "completed":
        return "tool_calls" if has_tool_calls else "stop"
    if status == "incomplete":
        reason = _get(incomplete_details, "reason")
        return "length" if reason == "max_output_tokens" else (str(reason)[:32] if reason else "incomplete")
    return str(status)[:32] if status else None


def parse_response(response: Any) -> list[dict[str, Any]]:
    """A ``Response`` (or ``ParsedResponse``) as the completion event's response fields (one completion)."""
    texts: list[str] = []
    logprobs: list[float | None] = []
    all_logprobs = True
    calls = []
    for item in _get(response, "output") or ():
        call = _tool_call(item)
        if call is not None:
            calls.append(call)
            continue
        if _get(item, "type") != "message":
            continue
        for part in _get(item, "content") or ():
            if _get(part, "type") == "refusal":
                texts.append(_get(part, "refusal") or "")
                all_logprobs = False
            elif _get(part, "type") == "output_text":
                texts.append(_get(part, "text") or "")
                part_logprobs = _get(part, "logprobs")
                if part_logprobs is None:
                    all_logprobs = False
                else:
                    logprobs.extend(_get(lp, "logprob") for lp in part_logprobs)
    fields = response_fields(
        text="".join(texts),
        tool_calls=calls,
        finish_reason=finish_reason(_get(response, "status"), _get(response, "incomplete_details"), bool(calls)),
        prompt_token_ids=_raw_tokens(_get(response, "input_messages")),
        token_ids=_raw_tokens(_get(response, "output_messages")),
        logprobs=logprobs if all_logprobs and not calls else None,
    )
    fields["index"] = 0
    return [fields]


TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesAccumulator:
    """Collects a Responses stream's events into the fields of its completion.

    The terminal event (``response.completed``, ``.incomplete`` or ``.failed``) carries the whole
    response, which is read as a whole one; a stream closed before it gives the text deltas and
    the tool calls received so far, without finish reason or token data.
    """

    def __init__(self) -> None:
        self.model: str | None = None
        self.final: Any = None
        self._text: list[str] = []
        self._calls: list[dict[str, Any]] = []

    def add(self, event: Any) -> None:
        kind = _get(event, "type")
        response = _get(event, "response")
        if response is not None:
            self.model = _get(response, "model") or self.model
        if kind in TERMINAL_EVENTS:
            self.final = response
        elif kind == "response.output_text.delta":
            self._text.append(_get(event, "delta") or "")
        elif kind == "response.output_item.done":
            call = _tool_call(_get(event, "item"))
            if call is not None:
                self._calls.append(call)

    def results(self) -> list[dict[str, Any]]:
        if self.final is not None:
            return parse_response(self.final)
        fields = response_fields(
            text="".join(self._text),
            tool_calls=list(self._calls),
            finish_reason=None,
            prompt_token_ids=None,
            token_ids=None,
            logprobs=None,
        )
        fields["index"] = 0
        return [fields]
