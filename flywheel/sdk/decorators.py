"""``@observe``: a function call becomes a session, or a span of the session it runs in.

```python
from flywheel import observe

@observe(session_id_arg="conversation_id")      # called outside a session: one session per call
async def handle(conversation_id: str, text: str) -> str:
    plan = await planner(text)                    # called inside it: a span, child of the session's root
    ...

@observe(role="planner")
async def planner(text: str) -> str: ...
```

Outside any session the call opens one (``session_start``), makes it the current scope
for the call's duration and ends it when the call ends: ``completed`` when it returns,
``failed`` with the error when it raises, ``abandoned`` when it is cancelled (or a
generator is closed before it finished). Inside a session (the current scope of the
calling context, see :func:`~flywheel.sdk.client.current_scope`) it opens a span, a child
of the innermost scope, and ends it ``completed``, ``failed`` or ``cancelled``. Sync and
async functions, sync and async generators and methods are supported.

The wrapped call never fails because of Flywheel: without a client (none given, none set
with :func:`set_default_client`, and none can be made from the ``FLYWHEEL_*`` environment)
the function runs unobserved (logged once); an internal failure is counted in
``stats.errors`` and logged; a transport that cannot send spools as for every other event.
The function's own exceptions propagate unchanged.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import logging
import os
import threading
from collections.abc import AsyncGenerator, Callable, Generator
from typing import Any, ParamSpec, TypeVar, overload

from flywheel.sdk.client import Flywheel, Session, Span, _error_text, current_scope

log = logging.getLogger("flywheel.sdk")

P = ParamSpec("P")
R = TypeVar("R")

ROLE_MAX = 64
"""Longest span role the event contract accepts."""
AGENT_MAX = 128
"""Longest ``session_start.agent`` the event contract accepts."""


# -- the client used outside a session -----------------------------------------------------

_default_lock = threading.Lock()
_default: Flywheel | None = None
_default_pid: int | None = None
_default_failed = False


def set_default_client(fw: Flywheel | None) -> None:
    """The client ``@observe`` opens sessions with when it was given no ``client=``.

    Without one, the first observed call outside a session makes ``Flywheel()`` from the
    ``FLYWHEEL_*`` environment; if that is not configured, observed functions run
    unobserved. ``None`` forgets the default (the next call tries the environment again).
    """
    global _default, _default_pid, _default_failed
    with _default_lock:
        _default, _default_pid, _default_failed = fw, os.getpid() if fw is not None else None, False


def default_client() -> Flywheel | None:
    """The default client (made from the environment on first use), or ``None`` if Flywheel is not configured."""
    global _default, _default_pid, _default_failed
    fw, pid = _default, os.getpid()
    if fw is not None and _default_pid == pid:
        return fw
    if _default_failed and fw is None:
        return None
    with _default_lock:
        if _default is not None and _default_pid == pid:
            return _default
        if _default is not None:  # inherited across fork: its sender thread did not come along
            atexit.unregister(_default._exit_hook)  # its exit flush would wait on a sender that is not there
        try:
            _default, _default_pid = Flywheel(), pid
        except ValueError as err:  # not configured (no project, ...): the host runs on, unobserved
            _default, _default_pid, _default_failed = None, None, True
            log.warning("flywheel: @observe runs functions unobserved: no client (%s); pass client= to observe(), "
                        "call flywheel.sdk.set_default_client(fw) or configure FLYWHEEL_*", err)  # fmt: skip
        return _default


# -- one observed call ---------------------------------------------------------------------


class _Run:
    """The session or span an observed call opened, current while the function body runs."""

    __slots__ = ("scope",)

    def __init__(self, scope: Session | Span):
        self.scope = scope

    def finish(self, exc: BaseException | None) -> None:
        """End the scope as the call ended (after :meth:`Scope.deactivate`); never raises."""
        scope = self.scope
        try:
            if isinstance(scope, Span):
                if exc is None:
                    scope.end("completed")
                elif _cancelled(exc):
                    scope.end("cancelled", scope.result)
                else:
                    scope.end("failed", scope.result if scope.result is not None else _error_text(exc))
            elif exc is None:
                scope.end("completed")
            elif _cancelled(exc):
                scope.end("abandoned")
            else:
                scope.end("failed", _error_text(exc))
        except Exception as err:  # ending must never break the agent's call; counted and logged
            _internal_error(scope._fw, "end", err)


def _cancelled(exc: BaseException) -> bool:
    return isinstance(exc, asyncio.CancelledError | GeneratorExit)


def _internal_error(fw: Flywheel | None, what: str, err: Exception) -> None:
    if fw is not None:
        fw._counters.add("errors")
    log.error("flywheel: @observe could not %s a session or span: %r", what, err, exc_info=err)


class _Observer:
    """What one decoration fixed: how a call of the function is observed."""

    def __init__(
        self,
        func: Callable[..., Any],
        name: str | None,
        role: str | None,
        session_id_arg: str | None,
        task: str | None,
        client: Flywheel | None,
    ):
        qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        self.qualname = qualname
        self.agent = name
        """``session_start.agent`` (``None``: the client's ``agent``, else the qualified name)."""
        self.span_role = role or name or qualname[-ROLE_MAX:]
        self.session_role = role or "agent"
        self.task = task
        self.client = client
        self.session_id_at = _argument_locator(func, session_id_arg) if session_id_arg else None

    def start(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, activate: bool = True) -> _Run | None:
        """Open the call's span or session (and make it current); ``None``: run unobserved. Never raises."""
        fw = self.client
        try:
            scope = current_scope()
            if scope is not None and (fw is None or scope._fw is fw):
                run = _Run(scope.span(self.span_role))
            else:
                fw = fw or default_client()
                if fw is None:
                    return None
                session_id = self.session_id_at(args, kwargs) if self.session_id_at is not None else None
                agent = self.agent or fw.agent or self.qualname[-AGENT_MAX:]
                run = _Run(fw.session(session_id, role=self.session_role, agent=agent, task=self.task))
            if activate:
                run.scope.activate()
            return run
        except Exception as err:  # observing must never break the agent's call; counted and logged
            _internal_error(fw, "open", err)
            return None


def _argument_locator(func: Callable[..., Any], arg: str) -> Callable[[tuple[Any, ...], dict[str, Any]], str | None]:
    """A function of a call's ``(args, kwargs)`` that returns argument ``arg`` as a session id (``None``: absent)."""
    label = getattr(func, "__qualname__", repr(func))
    try:
        parameters = inspect.signature(func).parameters
    except (TypeError, ValueError) as err:
        raise TypeError(f"observe(session_id_arg={arg!r}): cannot read the signature of {label}: {err}") from err
    param = parameters.get(arg)
    if param is None:
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            raise TypeError(f"observe(session_id_arg={arg!r}): {label} has no parameter {arg!r} "
                            f"(it has {', '.join(parameters) or 'none'})")  # fmt: skip
        position, default = None, None
    elif param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        raise TypeError(f"observe(session_id_arg={arg!r}): {label}'s {arg!r} is *args/**kwargs, not one argument")
    else:
        positional = param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD)
        position = list(parameters).index(arg) if positional else None
        default = None if param.default is param.empty else param.default

    def locate(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        if arg in kwargs:
            value = kwargs[arg]
        elif position is not None and position < len(args):
            value = args[position]
        else:
            value = default
        return None if value is None or value == "" else str(value)

    return locate


# -- the decorator -------------------------------------------------------------------------


@overload
def observe(func: Callable[P, R], /) -> Callable[P, R]: ...


@overload
def observe(
    func: None = None,
    /,
    *,
    name: str | None = None,
    role: str | None = None,
    session_id_arg: str | None = None,
    task: str | None = None,
    client: Flywheel | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


def observe(
    func: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    role: str | None = None,
    session_id_arg: str | None = None,
    task: str | None = None,
    client: Flywheel | None = None,
) -> Any:
    """Observe every call of a function: a session outside any session, a span inside one.

    Bare (``@observe``) or with arguments (``@observe(role="planner")``):

    - ``name``: which agent this function is: ``session_start.agent`` of a session it
      opens (default: the client's ``agent=``, else the function's qualified name) and
      the role of a span it opens when ``role`` is not given.
    - ``role``: the role of a span it opens (default ``name``, else the function's qualified
      name, its last 64 characters) and of a session's root agent (default ``agent``).
      The trainer trains configured roles only (``trainable_roles``: ``agent``,
      ``orchestrator``).
    - ``session_id_arg``: the parameter whose value is the id of a session it opens (as
      text; a fresh UUIDv7 when the call gives none). Must name a parameter of the function.
    - ``task``: ``session_start.task`` of a session it opens.
    - ``client``: the :class:`Flywheel` to open sessions with (default:
      :func:`set_default_client`'s, else one from the ``FLYWHEEL_*`` environment). Inside a
      session of another client the call opens a session of its own.

    The wrapper keeps the function's name, docstring, signature and ``__wrapped__``.
    Raises ``TypeError`` at decoration for what could never work (not a callable, bad
    argument types, a ``session_id_arg`` the function does not have).
    """
    for label, value in (("name", name), ("role", role), ("session_id_arg", session_id_arg), ("task", task)):
        if value is not None and (not isinstance(value, str) or not value):
            raise TypeError(f"observe({label}=...) must be a non-empty string, not {value!r}")
    if role is not None and len(role) > ROLE_MAX:
        raise TypeError(f"observe(role={role!r}) is longer than {ROLE_MAX} characters")
    if name is not None and len(name) > ROLE_MAX:
        raise TypeError(f"observe(name={name!r}) is longer than {ROLE_MAX} characters (it may be a span's role)")
    if task is not None and len(task) > AGENT_MAX:
        raise TypeError(f"observe(task={task!r}) is longer than {AGENT_MAX} characters")
    if client is not None and not isinstance(client, Flywheel):
        raise TypeError(f"observe(client=...) must be a Flywheel client, not {type(client).__name__}")

    def decorate(target: Callable[..., Any]) -> Callable[..., Any]:
        return _decorate(target, name, role, session_id_arg, task, client)

    return decorate if func is None else decorate(func)


def _decorate(
    func: Any, name: str | None, role: str | None, session_id_arg: str | None, task: str | None, client: Any
) -> Any:
    if isinstance(func, staticmethod | classmethod):  # @observe above @staticmethod / @classmethod
        return type(func)(_decorate(func.__func__, name, role, session_id_arg, task, client))
    if not callable(func):
        raise TypeError(f"@observe decorates a function or method, not {type(func).__name__} {func!r}")
    observer = _Observer(func, name, role, session_id_arg, task, client)
    if inspect.isasyncgenfunction(func):
        wrapper: Callable[..., Any] = _async_generator_wrapper(func, observer)
    elif inspect.isgeneratorfunction(func):
        wrapper = _generator_wrapper(func, observer)
    elif inspect.iscoroutinefunction(func):
        wrapper = _async_wrapper(func, observer)
    else:
        wrapper = _sync_wrapper(func, observer)
    return functools.wraps(func)(wrapper)


def _sync_wrapper(func: Callable[..., Any], observer: _Observer) -> Callable[..., Any]:
    def observed(*args: Any, **kwargs: Any) -> Any:
        run = observer.start(args, kwargs)
        if run is None:
            return func(*args, **kwargs)
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:
            run.scope.deactivate()
            run.finish(exc)
            raise
        run.scope.deactivate()
        run.finish(None)
        return result

    return observed


def _async_wrapper(func: Callable[..., Any], observer: _Observer) -> Callable[..., Any]:
    async def observed(*args: Any, **kwargs: Any) -> Any:
        run = observer.start(args, kwargs)
        if run is None:
            return await func(*args, **kwargs)
        try:
            result = await func(*args, **kwargs)
        except BaseException as exc:
            run.scope.deactivate()
            run.finish(exc)
            raise
        run.scope.deactivate()
        run.finish(None)
        return result

    return observed


def _generator_wrapper(func: Callable[..., Any], observer: _Observer) -> Callable[..., Any]:
    """A generator whose scope is current only while the wrapped generator runs, not between its yields
    (the caller runs there); values sent and exceptions thrown in are passed on, as ``yield from`` would."""

    def observed(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        run = observer.start(args, kwargs, activate=False)  # at the first next(), when the body starts
        gen = func(*args, **kwargs)
        if run is None:
            return (yield from gen)
        scope = run.scope
        sent: Any = None
        thrown: BaseException | None = None
        try:
            while True:
                scope.activate()
                try:
                    item = gen.send(sent) if thrown is None else gen.throw(thrown)
                finally:
                    scope.deactivate()
                sent, thrown = None, None
                try:
                    sent = yield item
                except GeneratorExit:  # closed by the caller before the end
                    scope.activate()
                    try:
                        gen.close()
                    finally:
                        scope.deactivate()
                    raise
                except BaseException as exc:  # thrown in by the caller: passed on to the wrapped generator
                    thrown = exc
        except StopIteration as stop:
            run.finish(None)
            return stop.value
        except BaseException as exc:
            run.finish(exc)
            raise

    return observed


def _async_generator_wrapper(func: Callable[..., Any], observer: _Observer) -> Callable[..., Any]:
    """:func:`_generator_wrapper` for async generators."""

    async def observed(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
        run = observer.start(args, kwargs, activate=False)
        agen = func(*args, **kwargs)
        scope = run.scope if run is not None else None
        sent: Any = None
        thrown: BaseException | None = None
        try:
            while True:
                if scope is not None:
                    scope.activate()
                try:
                    item = await (agen.asend(sent) if thrown is None else agen.athrow(thrown))
                finally:
                    if scope is not None:
                        scope.deactivate()
                sent, thrown = None, None
                try:
                    sent = yield item
                except GeneratorExit:  # closed by the caller before the end
                    if scope is not None:
                        scope.activate()
                    try:
                        await agen.aclose()
                    finally:
                        if scope is not None:
                            scope.deactivate()
                    raise
                except BaseException as exc:  # thrown in by the caller: passed on to the wrapped generator
                    thrown = exc
        except StopAsyncIteration:
            if run is not None:
                run.finish(None)
        except BaseException as exc:
            if run is not None:
                run.finish(exc)
            raise

    return observed


__all__ = ["default_client", "observe", "set_default_client"]
