"""Log every completion of the official ``openai`` client (sync and async, streaming or not).

``fw.wrap_openai(client)`` (or :func:`wrap`) patches the client's
``chat.completions.create`` and ``completions.create`` in place and returns the same
client; also ``chat.completions.parse`` / ``.stream`` (and ``beta.chat.completions``' where
present) and ``responses.create`` / ``.parse`` / ``.stream`` (read by
:mod:`flywheel.sdk.openai_responses`). A call made inside a session (the current one of this context, or an explicit
``session=`` argument, which the wrapper removes before calling OpenAI) is logged as one
``completion`` event per choice, with:

- the request (prompt messages or text, sampling parameters) and the response (text,
  tool calls, finish reason);
- the policy version: the router's ``x-flywheel-policy-version`` response header, else
  the served model name; the replica (its public id) from ``x-flywheel-replica`` when present;
- token ids and sampling logprobs. Unless ``request_token_data=False``, the wrapper asks
  for them where the agent did not choose otherwise: ``logprobs=True, top_logprobs=0``
  (chat) or ``logprobs=0`` (text), and vLLM's own ``extra_body``
  ``{"return_token_ids": true}``, with which vLLM adds ``token_ids`` / ``prompt_token_ids``
  to the choices / response. With ``request_token_data="auto"`` (the default of :func:`wrap`)
  the vLLM-only field is not sent to the vendor APIs in :data:`VENDOR_HOSTS`, which refuse
  unknown fields, and a call another server refuses (HTTP 400 or 422 naming a field the
  wrapper added) is made again without that field, which this client then no longer
  sends (see :class:`TokenDataPolicy`); ``True`` always asks, ``False`` never;
- the latency as the client saw it (to the end of the stream, for a stream).

Inside a session (logged or not sampled) the wrapper also sends the request header
``x-flywheel-session-id`` (through ``extra_headers``, unless the agent set it), so the
router keeps the session on one policy version, and the scope's span as
``x-flywheel-span-id`` / ``x-flywheel-agent-role``, so a router that captures the
completion records it in the same agent span.

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

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import openai
from openai import AsyncStream, Stream

from flywheel.core.contracts import headers
from flywheel.core.openai_fields import (
    Kind,
    StreamAccumulator,
    aligned_logprobs,
    as_name,
    normalize_message,
    parse_chat_completion,
    parse_text_completion,
    request_fields,
    sampling_params,
)
from flywheel.sdk import openai_responses
from flywheel.sdk._patch import AsyncStreamMixin, ManagerMixin, StreamMixin, adopt, replacing
from flywheel.sdk.client import Flywheel, Scope, current_scope

log = logging.getLogger("flywheel.sdk")

POLICY_VERSION_HEADER = headers.POLICY_VERSION
SESSION_HEADER = headers.SESSION_ID
SPAN_HEADER = headers.SPAN_ID
ROLE_HEADER = headers.AGENT_ROLE
SERVED_BY_HEADER = headers.REPLICA
COMPLETION_IDS_HEADER = headers.COMPLETION_IDS
IDS_ATTRIBUTE = "_flywheel_completion_ids"
"""Private attribute set on a logged response: the completion ids, one per choice."""
C = TypeVar("C")
CallKind = Kind | Literal["responses"]
POLICY_ATTRIBUTE = "_flywheel_token_data"
"""Private attribute set on a wrapped client: its :class:`TokenDataPolicy`."""

VENDOR_HOSTS = ("api.openai.com", "*.openai.azure.com")
"""Hosts of vendor APIs that refuse vLLM's own request fields (``*.`` matches any subdomain): with
``request_token_data="auto"`` the wrapper does not send them there."""
VLLM_ONLY_FIELDS = ("return_token_ids", *openai_responses.VLLM_FIELDS)
"""The ``extra_body`` fields the wrapper adds that only vLLM understands (chat and text, Responses)."""
LOGPROB_FIELDS = ("logprobs", "top_logprobs", "include")
"""The request fields that ask for sampling logprobs (``include``: the Responses API's), taken back together."""
REFUSAL_STATUSES = (400, 422)

RequestTokenData = bool | Literal["auto"]


# -- request ---------------------------------------------------------------------------------


def _given(value: Any) -> bool:
    """Whether a keyword argument was really given (not absent, ``None``, ``NOT_GIVEN`` or ``omit``)."""
    return value is not None and not isinstance(value, (openai.NotGiven, openai.Omit))


__all__ = [  # what the SDK's tests and users import from here; the field parsing lives in the core
    "StreamAccumulator", "aligned_logprobs", "as_name", "completion_ids", "normalize_message",
    "parse_chat_completion", "parse_text_completion", "prepare_request", "request_fields",
    "sampling_params", "token_data_policy", "vendor_host", "wrap",
]  # fmt: skip


def prepare_request(
    kind: Kind,
    kwargs: Mapping[str, Any],
    *,
    request_token_data: bool,
    vllm_fields: bool = True,
    logprobs: bool = True,
) -> tuple[dict[str, Any], bool]:
    """The call's keyword arguments with the token-data options added; and whether usage was requested for us.

    Only options the agent left unset are added: ``return_token_ids`` in ``extra_body`` (unless
    ``vllm_fields`` is false), ``logprobs`` (and ``top_logprobs=0`` for chat; unless ``logprobs``
    is false), and for streams ``include_usage``.
    """
    out = dict(kwargs)
    if request_token_data and vllm_fields:
        extra = dict(out["extra_body"]) if isinstance(out.get("extra_body"), Mapping) else {}
        extra.setdefault("return_token_ids", True)
        out["extra_body"] = extra
    if request_token_data and logprobs:
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


def with_session_header(
    kwargs: Mapping[str, Any], session_id: str | None, span: tuple[str, str] | None = None
) -> dict[str, Any]:
    """The call's keyword arguments with ``x-flywheel-session-id`` in ``extra_headers`` (for the router's
    sticky routing), unless the agent set that header itself (in any letter case) or there is no session.

    ``span``: the current scope's span id and role, sent as ``x-flywheel-span-id`` and
    ``x-flywheel-agent-role`` (each unless the agent set it), so a router that captures the
    completion records it in the same agent span as the SDK does.
    """
    out = dict(kwargs)
    if not session_id:
        return out
    given = out.get("extra_headers")
    headers = dict(given) if isinstance(given, Mapping) else {}
    present = {k.lower() for k in headers if isinstance(k, str)}
    wanted = {SESSION_HEADER: session_id}
    if span is not None:
        wanted |= {SPAN_HEADER: span[0], ROLE_HEADER: span[1]}
    added = {name: value for name, value in wanted.items() if name not in present}
    if not added:
        return out
    out["extra_headers"] = headers | added
    return out


def vendor_host(base_url: Any) -> bool:
    """Whether ``base_url`` (a URL or the client's ``base_url``) is on a host in :data:`VENDOR_HOSTS`."""
    host = (getattr(base_url, "host", None) or _host_of(str(base_url))).lower().rstrip(".")
    for pattern in VENDOR_HOSTS:
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]):
                return True
        elif host == pattern:
            return True
    return False


def _host_of(url: str) -> str:
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0].rsplit("@", 1)[-1].split(":", 1)[0]


def injected_fields(given: Mapping[str, Any], prepared: Mapping[str, Any]) -> frozenset[str]:
    """The token-data request fields :func:`prepare_request` added to ``given`` (not the agent's own)."""
    added = set()
    extra_given = given.get("extra_body") if isinstance(given.get("extra_body"), Mapping) else {}
    extra_prepared = prepared.get("extra_body") if isinstance(prepared.get("extra_body"), Mapping) else {}
    added.update(f for f in VLLM_ONLY_FIELDS if f in extra_prepared and f not in extra_given)
    added.update(f for f in LOGPROB_FIELDS if _given(prepared.get(f)) and prepared.get(f) != given.get(f))
    return frozenset(added)


def refused_fields(error: BaseException, injected: frozenset[str]) -> frozenset[str]:
    """The fields among ``injected`` that ``error`` (an HTTP 400 or 422 from the server) names, if it is one."""
    if not isinstance(error, openai.APIStatusError) or error.status_code not in REFUSAL_STATUSES or not injected:
        return frozenset()
    try:
        text = f"{error.message} {json.dumps(error.body, default=str)}"
    except (TypeError, ValueError):
        text = str(error.message)

    def named(name: str) -> bool:
        return re.search(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])", text) is not None

    logprobs_named = named("logprobs")  # the Responses API's include value ends in ".logprobs"
    return frozenset(f for f in injected if named(f) or (f in LOGPROB_FIELDS and logprobs_named))


def without_fields(prepared: Mapping[str, Any], given: Mapping[str, Any], fields: frozenset[str]) -> dict[str, Any]:
    """``prepared`` without the token-data ``fields`` it added (``logprobs`` and ``top_logprobs`` go together)."""
    out = dict(prepared)
    if fields & set(VLLM_ONLY_FIELDS):
        extra = {k: v for k, v in out.get("extra_body", {}).items() if k not in fields}
        if extra or isinstance(given.get("extra_body"), Mapping):
            out["extra_body"] = extra
        else:
            out.pop("extra_body", None)
    if fields & set(LOGPROB_FIELDS):
        for name in LOGPROB_FIELDS:
            if name in given:
                out[name] = given[name]
            else:
                out.pop(name, None)
    return out


class TokenDataPolicy:
    """Which token-data fields one wrapped client asks for, and what its server has refused.

    ``mode`` is the wrapper's ``request_token_data``: ``True`` always asks (vLLM's own fields and
    logprobs), ``False`` never, ``"auto"`` asks for vLLM's fields unless the client's base URL is
    on a vendor host (:data:`VENDOR_HOSTS`) and, when the server refuses a field the wrapper added
    (HTTP 400 or 422 naming it), makes the call once more without it and stops sending it: vLLM's
    fields for the whole client, logprobs for that model. Each refusal is counted in the client's
    ``token_data_refused`` counter; the first of each kind is logged as a warning.
    """

    def __init__(self, mode: RequestTokenData, base_url: Any):
        if mode not in (True, False, "auto"):
            raise ValueError(f"request_token_data must be True, False or 'auto', got {mode!r}")
        self.mode = mode
        self.vllm_fields = mode is True or (mode == "auto" and not vendor_host(base_url))
        self.no_logprobs_models: set[str] = set()
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def options(self, model: Any) -> dict[str, bool]:
        """The :func:`prepare_request` options for a call to ``model``."""
        with self._lock:
            return {
                "request_token_data": self.mode is not False,
                "vllm_fields": self.vllm_fields,
                "logprobs": str(model) not in self.no_logprobs_models,
            }

    def retry_kwargs(
        self, fw: Flywheel, error: BaseException, given: Mapping[str, Any], prepared: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """The keyword arguments to try once more after ``error``, or ``None`` to let it propagate."""
        if self.mode != "auto":
            return None
        refused = refused_fields(error, injected_fields(given, prepared))
        if not refused:
            return None
        model = str(given.get("model", ""))
        first = []
        with self._lock:
            if refused & set(VLLM_ONLY_FIELDS):
                self.vllm_fields = False
            if refused & set(LOGPROB_FIELDS):
                self.no_logprobs_models.add(model)
            for name in sorted(refused):
                key = name if name in VLLM_ONLY_FIELDS else f"{name}:{model}"
                if key not in self._warned:
                    self._warned.add(key)
                    first.append(name)
        fw._counters.add("token_data_refused")
        if first:
            log.warning(
                "flywheel: the server refused %s (HTTP %s); the call is made again without it, and this client "
                "no longer asks for it%s, so its completions are logged without that token data",
                ", ".join(first), getattr(error, "status_code", "?"),
                "" if set(first) <= set(VLLM_ONLY_FIELDS) else f" from model {model!r}",
            )  # fmt: skip
        return without_fields(prepared, given, refused)


# -- response --------------------------------------------------------------------------------

# -- logging ---------------------------------------------------------------------------------


@dataclass
class _Call:
    """One wrapped call in flight: what is needed to log it when its response is complete."""

    fw: Flywheel
    scope: Scope
    kind: CallKind
    request: dict[str, Any]
    n: int
    started: float
    policy_version: str | None = None
    served_by: str | None = None
    router_ids: list[uuid.UUID] = field(default_factory=list)
    """The completion ids the router gave its capture of this call (``x-flywheel-completion-ids``)."""
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
        for position, fields in enumerate(results):
            index = fields.pop("index", position)  # whole chat answers are parsed in choice order, without it
            prompt_text = self.request.get("prompt_text")
            if prompt_texts:
                prompt_text = prompt_texts[min(index // max(self.n, 1), len(prompt_texts) - 1)]
            given_id = self.router_ids[index] if index < len(self.router_ids) else None
            completion_id = self.scope.completion(
                completion_id=given_id,
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


def _router_ids(raw: Any) -> list[uuid.UUID]:
    """The router's completion ids for this call (one per choice), when it captured it; UUIDv7s only."""
    header = (getattr(raw, "headers", None) or {}).get(COMPLETION_IDS_HEADER)
    if not header:
        return []
    try:
        ids = [uuid.UUID(part.strip()) for part in str(header).split(",")]
    except ValueError:
        return []
    return ids if all(i.version == 7 for i in ids) else []


class _Observer:
    """Watches a stream's chunks and logs the completion when the stream ends."""

    def __init__(self, call: _Call, injected_usage: bool):
        self.call = call
        self.injected_usage = injected_usage
        self.accumulator: Any = (
            openai_responses.ResponsesAccumulator() if call.kind == "responses" else StreamAccumulator(call.kind)
        )
        self.ids: list[uuid.UUID] = []

    def observe(self, chunk: Any) -> bool:
        """Record a chunk; ``False`` for the usage-only chunk the agent did not ask for (hidden from it)."""
        try:
            self.accumulator.add(chunk)
        except Exception as err:  # a chunk we cannot read must not break the agent's stream; counted and logged
            self.call.fw._counters.add("errors")
            log.error("flywheel: could not read a stream chunk: %r", err, exc_info=err)
        if self.call.kind == "responses":
            return True
        return not (self.injected_usage and not chunk.choices and getattr(chunk, "usage", None) is not None)

    def finish(self, stream: Any) -> None:
        if self.call.logged:
            return
        self.ids = self.call.log(self.accumulator.results(), self.accumulator.model)
        _attach_ids(stream, self.ids)


class LoggedStream(StreamMixin, Stream):  # type: ignore[type-arg]
    """An ``openai.Stream`` that logs its completion when it ends; otherwise the same stream."""

    _fw_observer: _Observer


class LoggedAsyncStream(AsyncStreamMixin, AsyncStream):  # type: ignore[type-arg]
    """An ``openai.AsyncStream`` that logs its completion when it ends; otherwise the same stream."""

    _fw_observer: _Observer


# -- patching --------------------------------------------------------------------------------


_BOUND: ContextVar[tuple[Scope | None, list[Any]] | None] = ContextVar("flywheel_openai_bound", default=None)
"""Set while a ``.stream()`` helper's context manager opens its request: the ``session=`` given to
``.stream()`` and a list that collects the logged streams the request made."""


def _target_scope(explicit: Any) -> Scope | None:
    """The scope a call belongs to: an explicit ``session=`` argument (given to the call, or to the
    ``.stream()`` helper that makes it), else the current one (sampled or not)."""
    if isinstance(explicit, Scope):
        return explicit
    bound = _BOUND.get()
    if bound is not None and bound[0] is not None:
        return bound[0]
    return current_scope()


def _begin(
    fw: Flywheel, kind: CallKind, kwargs: dict[str, Any], policy: TokenDataPolicy
) -> tuple[_Call, dict[str, Any], bool] | None:
    """Prepare the logged version of a call, or ``None`` to make it unlogged (no session, or a failure).

    Either way, inside a session (logged or not) ``kwargs`` gains the session header.
    """
    target = _target_scope(kwargs.pop("session", None))
    if target is not None:
        kwargs.update(with_session_header(kwargs, target.session_id, (target.span_id, target.role)))
    scope = target if target is not None and target.sampled else None
    if scope is None:
        return None
    try:
        options = policy.options(kwargs.get("model"))
        if kind == "responses":
            call_kwargs, injected = openai_responses.prepare_request(kwargs, **options), False
            fields = openai_responses.request_fields(kwargs)
        else:
            call_kwargs, injected = prepare_request(kind, kwargs, **options)
            fields = request_fields(kind, kwargs)
        n = kwargs.get("n") if isinstance(kwargs.get("n"), int) else 1
        call = _Call(fw, scope, kind, fields, n, time.perf_counter())
    except Exception as err:  # an odd request must not break the agent's call; counted and logged, sent unlogged
        fw._counters.add("errors")
        log.error("flywheel: could not prepare a %s request for logging: %r", kind, err, exc_info=err)
        return None
    return call, call_kwargs, injected


def _finish(call: _Call, raw: Any, injected: bool, parse: Any) -> Any:
    """Log a non-streamed response, or wrap a stream so it is logged when it ends."""
    call.policy_version, call.served_by = _headers(raw)
    call.router_ids = _router_ids(raw)
    if isinstance(parse, (Stream, AsyncStream)):
        cls = LoggedStream if isinstance(parse, Stream) else LoggedAsyncStream
        logged = cls.adopt(parse, _Observer(call, injected))  # type: ignore[arg-type]
        bound = _BOUND.get()
        if bound is not None:
            bound[1].append(logged)
        return logged
    try:
        parsers = {"chat": parse_chat_completion, "text": parse_text_completion}
        results = parsers.get(call.kind, openai_responses.parse_response)(parse)
    except Exception as err:  # an unexpected response shape must not break the agent; counted and logged
        call.fw._counters.add("errors")
        log.error("flywheel: could not read a %s response: %r", call.kind, err, exc_info=err)
        return parse
    _attach_ids(parse, call.log(results, getattr(parse, "model", None)))
    return parse


class _Tries:
    """The keyword arguments of each try of a logged call (its start time set as each begins): the
    prepared ones, then again without the fields a refusal names (HTTP 400 or 422; each field at
    most once, see :meth:`TokenDataPolicy.retry_kwargs`). The one retry loop of the sync and async ``create``."""

    def __init__(self, fw: Flywheel, policy: TokenDataPolicy, call: _Call, given: Mapping[str, Any],
                 prepared: dict[str, Any]):  # fmt: skip
        self.fw, self.policy, self.call, self.given, self.kwargs = fw, policy, call, given, prepared

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            self.call.started = time.perf_counter()
            yield self.kwargs

    def refused(self, err: openai.APIStatusError) -> None:
        """Take the next try's keyword arguments from the server's refusal ``err``; raise ``err`` when
        there is nothing to take back."""
        retry = self.policy.retry_kwargs(self.fw, err, self.given, self.kwargs)
        if retry is None:
            raise err
        self.kwargs = retry


def _create(
    fw: Flywheel, kind: CallKind, resource: Any, policy: TokenDataPolicy, *, is_async: bool, name: str = "create"
) -> Any:
    """``resource.<name>`` (``create`` or ``parse``, sync or async) logging its completions."""
    original = getattr(resource, name)
    raw_create = getattr(resource.with_raw_response, name)

    def create(*args: Any, **kwargs: Any) -> Any:
        begun = _begin(fw, kind, kwargs, policy)
        if begun is None:
            return original(*args, **kwargs)
        call, call_kwargs, injected = begun
        tries = _Tries(fw, policy, call, kwargs, call_kwargs)
        for attempt in tries:
            try:
                raw = raw_create(*args, **attempt)
                break
            except openai.APIStatusError as err:
                tries.refused(err)
        return _finish(call, raw, injected, raw.parse())

    async def acreate(*args: Any, **kwargs: Any) -> Any:
        begun = _begin(fw, kind, kwargs, policy)
        if begun is None:
            return await original(*args, **kwargs)
        call, call_kwargs, injected = begun
        tries = _Tries(fw, policy, call, kwargs, call_kwargs)
        for attempt in tries:
            try:
                raw = await raw_create(*args, **attempt)
                break
            except openai.APIStatusError as err:
                tries.refused(err)
        return _finish(call, raw, injected, raw.parse())

    return replacing(original, acreate if is_async else create)


class _LoggedManager(ManagerMixin):
    """Mixed into a ``.stream()`` helper's context manager: its request is made with the helper's
    ``session=`` and, when the block ends, the completion is logged (with what was received, if the
    stream was left early) and its ids are attached to the helper's stream."""

    _fw_scope: Scope | None
    _fw_sink: list[Any]
    _fw_stream: Any

    def _fw_bind(self) -> Any:
        return _BOUND.set((self._fw_scope, self._fw_sink))

    def _fw_done(self) -> None:
        for logged in self._fw_sink:
            logged._fw_observer.finish(logged)
            if self._fw_stream is not None:
                _attach_ids(self._fw_stream, completion_ids(logged))

    def __enter__(self) -> Any:
        token = self._fw_bind()
        try:
            self._fw_stream = super().__enter__()  # type: ignore[misc]
        finally:
            _BOUND.reset(token)
        return self._fw_stream

    async def __aenter__(self) -> Any:
        token = self._fw_bind()
        try:
            self._fw_stream = await super().__aenter__()  # type: ignore[misc]
        finally:
            _BOUND.reset(token)
        return self._fw_stream


_MANAGER_CLASSES: dict[type, type] = {}


def _adopt_manager(manager: Any, scope: Scope | None) -> Any:
    """The same context manager (same class, plus :class:`_LoggedManager`), bound to ``scope``."""
    return adopt(manager, _LoggedManager, _MANAGER_CLASSES, _fw_scope=scope, _fw_sink=[], _fw_stream=None)


def _stream_helper(fw: Flywheel, resource: Any) -> Any:
    """``resource.stream`` (a chat or Responses ``.stream()`` helper, which makes its request through
    the patched ``create``) accepting ``session=`` and logging when its block ends."""
    original = resource.stream

    def stream(*args: Any, session: Any = None, **kwargs: Any) -> Any:
        manager = original(*args, **kwargs)
        try:
            return _adopt_manager(manager, session if isinstance(session, Scope) else None)
        except Exception as err:  # an unexpected helper must not break the agent's call; counted and logged
            fw._counters.add("errors")
            log.error("flywheel: could not observe a .stream() helper: %r", err, exc_info=err)
            return manager

    return replacing(original, stream)


def token_data_policy(client: Any) -> TokenDataPolicy | None:
    """The :class:`TokenDataPolicy` of a wrapped client (what it asks for, what was refused), else ``None``."""
    return getattr(client, POLICY_ATTRIBUTE, None)


def wrap(client: C, fw: Flywheel, *, request_token_data: RequestTokenData = "auto") -> C:
    """Patch ``client`` (``openai.OpenAI`` or ``openai.AsyncOpenAI``) to log its completions into ``fw``; returns it.

    ``request_token_data``: ``"auto"`` (ask for token ids and logprobs where the server accepts
    them), ``True`` (always ask, vLLM's own fields included) or ``False`` (never); see
    :class:`TokenDataPolicy`. Wrapping the same client twice is a no-op. Copies made later with
    ``client.with_options(...)`` are not wrapped; wrap them too.
    """
    if getattr(client, "_flywheel_wrapped", None) is fw:
        return client
    is_async = isinstance(client, openai.AsyncOpenAI)
    if not is_async and not isinstance(client, openai.OpenAI):
        raise TypeError(f"expected an openai.OpenAI or openai.AsyncOpenAI client, got {type(client).__name__}")
    policy = TokenDataPolicy(request_token_data, client.base_url)
    text_resource = client.completions
    text_resource.create = _create(fw, "text", text_resource, policy, is_async=is_async)
    beta_chat = getattr(getattr(client, "beta", None), "chat", None)  # the helpers' home in openai < 1.92
    resources: list[tuple[CallKind, Any]] = [("chat", client.chat.completions)]
    beta_completions = getattr(beta_chat, "completions", None)
    if beta_completions is not None and beta_completions is not client.chat.completions:
        resources.append(("chat", beta_completions))
    if getattr(client, "responses", None) is not None:  # the Responses API, from openai 1.66
        resources.append(("responses", client.responses))
    for kind, resource in resources:
        raw = getattr(resource, "with_raw_response", None)
        for name in ("create", "parse"):
            if callable(getattr(resource, name, None)) and callable(getattr(raw, name, None)):
                setattr(resource, name, _create(fw, kind, resource, policy, is_async=is_async, name=name))
        if callable(getattr(resource, "stream", None)):
            resource.stream = _stream_helper(fw, resource)
    setattr(client, POLICY_ATTRIBUTE, policy)
    client._flywheel_wrapped = fw  # type: ignore[attr-defined]
    return client
