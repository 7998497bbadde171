"""The eval-suite interface: a named, versioned held-out evaluation of a loaded policy.

A suite is a class registered in the ``flywheel.eval_suites`` entry-point group
(``[project.entry-points."flywheel.eval_suites"]``, the name being ``trainer.gate.suite``),
loaded by :func:`flywheel.core.plugins.load` and instantiated without arguments. It brings
its own settings model as the class attribute ``Settings`` (every field with a default);
its section ``trainer.gate.suites.<name>`` arrives as a plain mapping and is validated
against that model by :func:`flywheel.core.plugins.plugin_settings`.

The gate runs the same suite, with the same settings, on a candidate and its parent, and
caches each policy's result in its registry row under :meth:`EvalSuite.key`: a key names
everything that decides the result (suite version, settings, sampling temperature), so a
cached result is reused only for the same evaluation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class EvalSuite(ABC):
    """An eval-suite plug-in."""

    name: ClassVar[str]
    """The name it is registered and configured under."""
    version: ClassVar[str]
    """Version of its problems and scoring; bump it when the same policy would score differently."""
    Settings: ClassVar[type[BaseModel]]
    """Its settings model (every field with a default)."""

    @abstractmethod
    def key(self, settings: Any, temperature: float) -> str:
        """Cache key of one evaluation setup (``settings`` is an instance of :attr:`Settings`).

        ``temperature`` is the temperature serving samples with (``trainer.step.sampling_temperature``).
        """

    @abstractmethod
    def evaluate(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: Any, temperature: float
    ) -> dict[str, Any]:
        """Evaluate a loaded policy; a JSON-ready result with at least ``success_rate`` (0..1) and ``n``."""
