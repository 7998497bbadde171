"""How the client wrappers patch a client in place, shared by :mod:`flywheel.sdk.openai` and
:mod:`flywheel.sdk.anthropic` (imports neither client library): methods replaced, objects given a
logging subclass of their class, streams that report each item and their end, ``.stream()`` helpers'
context managers that finish when their block ends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Self, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def replacing(original: Callable[..., Any], replacement: F) -> F:
    """``replacement``, standing in for the client method ``original``: its ``__wrapped__`` and ``__doc__``."""
    replacement.__wrapped__ = original  # type: ignore[attr-defined]
    replacement.__doc__ = original.__doc__
    return replacement


def adopt(obj: Any, mixin: type, classes: dict[type, type], **attrs: Any) -> Any:
    """The same object as an instance of ``Logged<its class>`` (``mixin`` before its class; made once per
    class and kept in ``classes``): its attributes copied, then ``attrs`` set."""
    base = type(obj)
    cls = classes.get(base)
    if cls is None:
        cls = classes[base] = type(f"Logged{base.__name__}", (mixin, base), {})
    adopted = cls.__new__(cls)
    adopted.__dict__.update(obj.__dict__)
    for name, value in attrs.items():
        setattr(adopted, name, value)
    return adopted


class _Observed:
    _fw_observer: Any

    @classmethod
    def adopt(cls, stream: Any, observer: Any) -> Self:
        """``stream`` as an instance of this class (its attributes copied), reporting to ``observer``."""
        adopted = cls.__new__(cls)
        adopted.__dict__.update(stream.__dict__)
        adopted._fw_observer = observer
        return adopted


class StreamMixin(_Observed):
    """Mixed in before a client library's ``Stream`` (whose ``__next__`` gives the next item): each item
    goes to ``_fw_observer.observe`` (``False``: hidden from the caller), and ``_fw_observer.finish(stream)``
    runs when the stream ends or is closed."""

    def __next__(self) -> Any:
        while True:
            try:
                item = super().__next__()  # type: ignore[misc]
            except StopIteration:
                self._fw_observer.finish(self)
                raise
            if self._fw_observer.observe(item) is not False:
                return item

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                yield self.__next__()
            except StopIteration:
                return

    def close(self) -> None:
        self._fw_observer.finish(self)
        super().close()  # type: ignore[misc]


class AsyncStreamMixin(_Observed):
    """:class:`StreamMixin` for a client library's ``AsyncStream``."""

    async def __anext__(self) -> Any:
        while True:
            try:
                item = await super().__anext__()  # type: ignore[misc]
            except StopAsyncIteration:
                self._fw_observer.finish(self)
                raise
            if self._fw_observer.observe(item) is not False:
                return item

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            try:
                yield await self.__anext__()
            except StopAsyncIteration:
                return

    async def close(self) -> None:
        self._fw_observer.finish(self)
        await super().close()  # type: ignore[misc]


class ManagerMixin:
    """Mixed in before a ``.stream()`` helper's context manager: ``_fw_done()`` runs when its block ends,
    after the manager's own exit (the wrapper's subclass says what entering does and what is done)."""

    def _fw_done(self) -> None:
        raise NotImplementedError

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)  # type: ignore[misc]
        finally:
            self._fw_done()

    async def __aexit__(self, *exc: Any) -> Any:
        try:
            return await super().__aexit__(*exc)  # type: ignore[misc]
        finally:
            self._fw_done()
