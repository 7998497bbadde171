"""Log every LiteLLM chat completion (``litellm.completion`` / ``acompletion``, streamed or not).

``litellm.callbacks = [fw.litellm_callback()]`` (or ``[FlywheelCallback(fw)]``) registers a
:class:`FlywheelCallback`, a LiteLLM ``CustomLogger``. A call made inside a session (the current
scope of the calling context) is logged as one ``completion`` event per choice, with:

- the request's messages and the sampling parameters LiteLLM sent (its ``optional_params``,
  ``extra_body`` included);
- the response's text, tool calls and finish reason (for a stream, the whole response LiteLLM
  assembles when the stream ends);
- the token ids and logprobs where the response carries them (vLLM's, when the agent asked for
  ``logprobs`` and ``extra_body={"return_token_ids": True}``; this callback never changes a request);
- the policy version: the Flywheel router's ``x-flywheel-policy-version`` response header, else
  the served model; the replica from ``x-flywheel-replica``; the router's completion ids;
- the latency between the start and end times LiteLLM reports.

LiteLLM calls the success hooks of sync calls on a thread of its own and those of async calls
after the call, so the scope is taken when the call starts (``log_pre_api_call``, which runs in
the caller's context) and kept under LiteLLM's ``litellm_call_id`` until its success or failure
hook (a call whose start it did not see, as when the callback is registered only in
``litellm.success_callback``, is not logged). A failed call logs nothing. Other call types
(embeddings, text completions, images, the Responses API) are ignored. Logging never raises
into the agent: a failure is counted in ``fw.stats.errors`` and logged.

Imported only by a product that uses it: ``import flywheel.sdk`` does not import LiteLLM.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

from flywheel.core.contracts import headers
from flywheel.core.openai_fields import as_name, as_object, parse_chat_completion, request_fields
from flywheel.sdk.client import Flywheel, Scope, current_scope

log = logging.getLogger("flywheel.sdk")

CHAT_CALL_TYPES = frozenset({"completion", "acompletion"})
"""LiteLLM's ``call_type`` of the calls logged."""
PENDING_LIMIT = 10_000
"""Calls started and not yet ended whose scope is kept (the oldest is forgotten past this)."""
PROVIDER_HEADER_PREFIX = "llm_provider-"
"""How LiteLLM names a provider's response headers in a response's ``additional_headers``."""

_pending: OrderedDict[str, Scope | None] = OrderedDict()
"""The scope of each call started and not yet ended, by ``litellm_call_id``: shared by every callback
instance, so a call is logged once even where LiteLLM keeps an earlier instance registered."""
_pending_lock = threading.Lock()

__all__ = ["FlywheelCallback", "call_fields", "session_headers"]


def session_headers(scope: Scope | None = None) -> dict[str, str]:
    """The request header that keeps a session on one policy version behind the Flywheel router
    (``x-flywheel-session-id``): pass as ``extra_headers=``. Empty outside a session. ``scope``
    defaults to the current one."""
    scope = scope if scope is not None else current_scope()
    return {headers.SESSION_ID: scope.session_id} if scope is not None else {}


def _response_header(response: Any, name: str) -> str | None:
    hidden = getattr(response, "_hidden_params", None)
    found = hidden.get("additional_headers") if isinstance(hidden, Mapping) else None
    if not isinstance(found, Mapping):
        return None
    value = found.get(PROVIDER_HEADER_PREFIX + name, found.get(name))
    return str(value) if value is not None else None


def _router_ids(response: Any) -> list[uuid.UUID]:
    header = _response_header(response, headers.COMPLETION_IDS)
    if not header:
        return []
    try:
        ids = [uuid.UUID(part.strip()) for part in header.split(",")]
    except ValueError:
        return []
    return ids if all(i.version == 7 for i in ids) else []


def _latency_ms(start_time: Any, end_time: Any) -> float:
    if isinstance(start_time, datetime) and isinstance(end_time, datetime):
        return max((end_time - start_time).total_seconds() * 1000, 0.0)
    if isinstance(start_time, (int, float)) and isinstance(end_time, (int, float)):
        return max((end_time - start_time) * 1000, 0.0)
    return 0.0


def call_fields(kwargs: Mapping[str, Any], response: Any, start_time: Any, end_time: Any) -> list[dict[str, Any]]:
    """The :meth:`Scope.completion` keyword arguments for each choice of one LiteLLM chat call:
    ``kwargs`` as LiteLLM gives its callbacks, ``response`` a ``litellm.ModelResponse``."""
    sent = kwargs.get("optional_params") if isinstance(kwargs.get("optional_params"), Mapping) else {}
    request = request_fields("chat", {**sent, "messages": kwargs.get("messages")})
    served_model = getattr(response, "model", None) or str(kwargs.get("model") or "") or "unknown"
    policy = as_name(_response_header(response, headers.POLICY_VERSION)) or as_name(served_model) or "unknown"
    served_by = _response_header(response, headers.REPLICA)
    router_ids = _router_ids(response)
    latency_ms = _latency_ms(start_time, end_time)
    out = []
    # Read as JSON: LiteLLM's choices keep fields such as vLLM's token_ids as extras, logprobs as a model or dict.
    plain = response.model_dump() if hasattr(response, "model_dump") else response
    for index, fields in enumerate(parse_chat_completion(as_object(plain) if isinstance(plain, Mapping) else plain)):
        out.append(
            {
                "completion_id": router_ids[index] if index < len(router_ids) else None,
                "model": served_model,
                "policy_version": policy,
                "prompt_messages": request["prompt_messages"],
                "sampling": request["sampling"],
                "latency_ms": latency_ms,
                "served_by": served_by,
                **fields,
            }
        )
    return out


class FlywheelCallback(CustomLogger):  # type: ignore[misc]
    """A LiteLLM callback that logs each chat completion into the Flywheel session it was made in.

    ``litellm.callbacks = [FlywheelCallback(fw)]``; see the module's documentation.
    """

    def __init__(self, fw: Flywheel):
        super().__init__()
        self.fw = fw

    # -- LiteLLM's hooks --------------------------------------------------------------------

    def log_pre_api_call(self, model: Any, messages: Any, kwargs: Any) -> None:
        """Called in the caller's context before each request: remember the current scope."""
        call_id = kwargs.get("litellm_call_id") if isinstance(kwargs, Mapping) else None
        if not call_id:
            return
        scope = current_scope()
        with _pending_lock:
            if call_id in _pending and scope is None:
                return  # a retry made outside the caller's context keeps the scope of its first try
            _pending[call_id] = scope
            _pending.move_to_end(call_id)
            while len(_pending) > PENDING_LIMIT:
                _pending.popitem(last=False)

    def log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._log(kwargs, response_obj, start_time, end_time)

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._log(kwargs, response_obj, start_time, end_time)

    def log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._forget(kwargs)

    async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._forget(kwargs)

    # -- logging ----------------------------------------------------------------------------

    @staticmethod
    def _take_scope(kwargs: Any) -> Scope | None:
        """The scope remembered for this call when it started, forgotten from now on."""
        call_id = kwargs.get("litellm_call_id") if isinstance(kwargs, Mapping) else None
        with _pending_lock:
            return _pending.pop(call_id, None) if call_id else None

    def _forget(self, kwargs: Any) -> None:
        self._take_scope(kwargs)

    def _log(self, kwargs: Any, response: Any, start_time: Any, end_time: Any) -> list[uuid.UUID]:
        """Log one completion per choice of a finished chat call; never raises."""
        try:
            if not isinstance(kwargs, Mapping) or kwargs.get("call_type") not in CHAT_CALL_TYPES:
                return []
            scope = self._take_scope(kwargs)
            if scope is None or not scope.sampled or not getattr(response, "choices", None):
                return []
            ids = []
            for fields in call_fields(kwargs, response, start_time, end_time):
                completion_id = scope.completion(**fields)
                if completion_id is not None:
                    ids.append(completion_id)
            return ids
        except Exception as err:  # logging must never break the agent's call; counted and logged
            self.fw._counters.add("errors")
            log.error("flywheel: could not log a LiteLLM completion: %r", err, exc_info=err)
            return []
