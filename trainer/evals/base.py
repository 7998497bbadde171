"""The eval-suite interface: a named, versioned evaluation of a policy served by the gate's engine.

A suite is a class registered in the ``flywheel.eval_suites`` entry-point group
(``[project.entry-points."flywheel.eval_suites"]``; ``trainer.gate.run`` lists the names the
gate runs), loaded by :func:`flywheel.core.plugins.load` and instantiated without arguments.
It brings its own settings model as the class attribute ``Settings`` (every field with a
default); its section ``trainer.gate.suites.<name>`` arrives as a plain mapping and is
validated against that model by :func:`flywheel.core.plugins.plugin_settings` (the key
``margin`` of the section is the gate's, not the suite's).

The gate evaluates a candidate and its parent on the same problems: it calls
:meth:`EvalSuite.prepare` once, which fixes what is evaluated (the problems, a slice of
sessions) and the cache key, then :meth:`EvalSuite.evaluate` once per policy, each loaded in
the gate's inference engine (:class:`trainer.engine.ServedPolicy`: ``chat`` and a concurrent
``map``). A key names everything that decides the result (suite version, settings, what was
prepared, sampling, the engine's kind): each policy's result is cached in its registry row
under it and reused only for the same evaluation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from flywheel.core.settings import Settings
from trainer.engine import Sampling

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from trainer.engine import ServedPolicy


@dataclass(frozen=True)
class EvalContext:
    """What a suite may read besides its own settings."""

    settings: Settings
    """The whole settings (a suite may read other sections, e.g. rewarding's outcome rules)."""
    sampling: Sampling
    """Sampling as the fleet serves: ``temperature`` is ``trainer.step.sampling_temperature``."""
    engine_kind: str = "vllm"
    """The engine's kind, part of every key."""
    session: Session | None = None
    """The registry's database session (None where the caller has no database)."""


@dataclass(frozen=True)
class Prepared:
    """One evaluation fixed by :meth:`EvalSuite.prepare`: the same for a candidate and its parent."""

    key: str
    """Cache key of this evaluation."""
    items: Any = None
    """Whatever the suite evaluates (problems, sessions), passed back to :meth:`EvalSuite.evaluate`."""
    settings: Any = None
    """The suite's validated settings it was prepared with."""
    info: dict[str, Any] = field(default_factory=dict)
    """What the suite wants recorded about the preparation (added to each result)."""


class EvalSuite(ABC):
    """An eval-suite plug-in."""

    name: ClassVar[str]
    """The name it is registered and configured under."""
    version: ClassVar[str]
    """Version of its problems and scoring; bump it when the same policy would score differently."""
    Settings: ClassVar[type[BaseModel]]
    """Its settings model (every field with a default)."""

    @abstractmethod
    def prepare(self, settings: Any, context: EvalContext) -> Prepared:
        """Fix what is evaluated and its cache key (``settings`` is an instance of :attr:`Settings`)."""

    @abstractmethod
    def evaluate(self, policy: ServedPolicy, prepared: Prepared, context: EvalContext) -> dict[str, Any]:
        """Evaluate one served policy; a JSON-ready result with at least ``success_rate`` and ``n``.

        ``n == 0`` means nothing could be measured (the gate then passes this suite with a note).
        """
