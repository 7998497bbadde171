"""Checkpoint records: the registry's ``checkpoints.eval`` column and the checkpoint folder's sidecar.

``checkpoints.eval`` (JSONB) is a :class:`CheckpointEval`::

    {"heldout": {"<eval key>": {"success_rate": 0.41, "n": 200, ...}, ...},
     "gate": {"passed": true, "reason": "passed: ...", "candidate": {...}, "parent": {...},
              "margin": 0.02, "delta": 0.01, "key": "<eval key>",
              "suites": [{"suite": "arith", "key": "<eval key>", "candidate": {...}, "parent": {...},
                          "delta": 0.01, "margin": 0.02, "passed": true}, ...]}}

``heldout`` caches one :class:`HeldoutResult` per evaluation setup (each eval suite of the
trainer's gate, the base model's build), so each policy is evaluated once per setup; ``gate`` is
the trainer's eval-gate decision (:class:`GateRecord`), absent on a root checkpoint: one
:class:`SuiteVerdict` per suite it ran, and at the top level the first suite's numbers (the
checkpoint's headline held-out success, :meth:`CheckpointEval.headline`). The trainer writes it; serving, the
dashboard and the demo read it. Parse a stored value with :meth:`CheckpointEval.parse` and store
one with :meth:`CheckpointEval.to_dict`: results and records keep every key they were given, known
or not (an eval suite may report more than ``success_rate`` and ``n``), so what is read and written
back is what was there.

A checkpoint folder written by the trainer holds ``flywheel_checkpoint.json``, a
:class:`CheckpointSidecar` (written last, by :func:`trainer.ckpt.publish`): where the checkpoint
came from and how it did.

Schema history (``CheckpointSidecar.schema_version``; the ``eval`` column's shape changes only
additively):
  1 — initial version.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer

SIDECAR_NAME = "flywheel_checkpoint.json"
"""The sidecar's file name in a checkpoint folder."""
SIDECAR_SCHEMA_VERSION = 1
"""The sidecar schema version this code writes."""

Format = Literal["full", "lora"]
"""A checkpoint's format: ``full`` (a Hugging Face model folder) or ``lora`` (a peft adapter over ``base_model``)."""


class _Stored(BaseModel):
    """A stored JSON object: keeps unknown keys, and dumps back exactly the keys it was given."""

    model_config = ConfigDict(extra="allow", frozen=True)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready object to store: the keys given (unknown ones included), nothing added."""
        return self.model_dump(mode="json", exclude_unset=True)


class HeldoutResult(_Stored):
    """One held-out evaluation of one policy under one setup: an eval suite's result.

    Beyond the two fields below, a result keeps whatever its suite reports. The built-in
    ``arith`` suite (:class:`flywheel.model.eval.EvalResult`) adds ``successes``, ``split``,
    ``seed``, ``temperature``, ``max_new_tokens``, ``by_kind``, ``finish_reasons``,
    ``tool_call_rate``, ``tool_error_rate`` and ``seconds``; the base model's build-time result
    adds ``source: "build"``.
    """

    success_rate: float
    """Share of the held-out problems solved, 0..1."""
    n: int | None = None
    """Problems evaluated (every suite reports it; absent only in rows written by hand)."""


class SuiteVerdict(_Stored):
    """One eval suite's verdict within a gate decision: both measurements under one setup.

    A suite passes when ``candidate.success_rate >= parent.success_rate - margin``, or when it
    measured nothing (``candidate.n == 0``, e.g. a replay suite without held-out sessions yet;
    its ``note`` says so).
    """

    suite: str
    """The eval suite's name (``arith``, ``replay``, a user suite's)."""
    key: str
    """The evaluation setup both were measured under (its key in :attr:`CheckpointEval.heldout`)."""
    candidate: HeldoutResult
    """The candidate's result."""
    parent: HeldoutResult
    """The parent's result under the same setup."""
    delta: float
    """``candidate.success_rate - parent.success_rate``."""
    margin: float
    """How much worse than its parent the candidate may be on this suite and still pass."""
    passed: bool
    """Whether this suite let the candidate pass."""
    note: str | None = None
    """Why a suite passed without a comparison (nothing measured)."""


class GateRecord(_Stored):
    """The eval gate's decision on a candidate checkpoint, with both measurements of every suite.

    The trainer passes a candidate when no suite regresses beyond its margin (each
    :class:`SuiteVerdict` passed). The top-level ``candidate``, ``parent``, ``margin``,
    ``delta`` and ``key`` are the first suite's (the checkpoint's headline held-out success;
    a record written before several suites holds only those).
    """

    passed: bool
    """Whether the candidate may serve (``candidate``) or not (``rejected``)."""
    reason: str
    """The verdict in words: the failing suites first, each with both success rates, the delta, the margin and ``n``."""
    candidate: HeldoutResult
    """The candidate's held-out result (first suite)."""
    parent: HeldoutResult | None = None
    """The parent's held-out result under the same setup (the trainer always records it)."""
    margin: float | None = None
    """How much worse than its parent a candidate may be and still pass (the trainer always records it)."""
    delta: float | None = None
    """``candidate.success_rate - parent.success_rate`` (the trainer always records it)."""
    key: str
    """The evaluation setup both were measured under (its key in :attr:`CheckpointEval.heldout`)."""
    suites: list[SuiteVerdict] | None = None
    """Every suite's verdict, in the order the gate ran them (None in records written before several suites)."""

    def failing(self) -> list[SuiteVerdict]:
        """The suites that regressed beyond their margin."""
        return [v for v in self.suites or [] if not v.passed]


class CheckpointEval(_Stored):
    """A checkpoint's ``eval`` column: cached held-out results and, for a trained checkpoint, its gate."""

    heldout: dict[str, HeldoutResult] = Field(default_factory=dict)
    """Held-out results by evaluation key (``arith-v1/heldout/n200/s1234/t1.0/m24``), in stored order."""
    gate: GateRecord | None = None
    """The eval gate's decision; None for a checkpoint that did not go through the gate (a root)."""

    @classmethod
    def parse(cls, value: Mapping[str, Any] | None) -> CheckpointEval:
        """A stored ``eval`` value (None or ``{}`` for a checkpoint with none)."""
        return cls.model_validate(value or {})

    def cached(self, key: str) -> HeldoutResult | None:
        """The held-out result under evaluation ``key``, if one is cached."""
        return self.heldout.get(key)

    def with_heldout(self, key: str, result: HeldoutResult) -> CheckpointEval:
        """A copy with ``result`` cached under ``key`` (replacing an earlier one in place, else added last)."""
        return self.model_copy(update={"heldout": {**self.heldout, key: result}})

    @property
    def gated_success(self) -> float | None:
        """The held-out success its eval gate measured; None for a checkpoint that did not go through the gate."""
        return self.gate.candidate.success_rate if self.gate is not None else None

    def headline(self) -> HeldoutResult | None:
        """The held-out result a checkpoint is shown with: its gate's (first suite) when it went
        through the gate, else the first one cached (a root's build-time result)."""
        if self.gate is not None:
            return self.gate.candidate
        return next(iter(self.heldout.values()), None)

    def latest_heldout(self) -> HeldoutResult | None:
        """The held-out result stored last (the only one, for a checkpoint evaluated under one setup)."""
        return next(reversed(self.heldout.values()), None)


class CheckpointSidecar(BaseModel):
    """``flywheel_checkpoint.json``: where a checkpoint came from and how it did."""

    schema_version: int = SIDECAR_SCHEMA_VERSION
    """Version of this schema."""
    checkpoint_id: str
    """The registry id (``c<cycle>-<digest>``), also the folder's name."""
    policy_version: str
    """Unique; what vLLM serves it under (``update_weight_version`` / the LoRA name)."""
    parent_id: str | None
    """The checkpoint it was trained from."""
    parent_policy_version: str | None
    """The parent's policy version."""
    format: Format
    """``full`` or ``lora``."""
    base_model: str
    """Full model folder this checkpoint applies to (a LoRA adapter's base; for ``full``, its root)."""
    cycle_id: int | None
    """The training cycle that wrote it."""
    data_window_start: datetime | None
    """Start (exclusive) of the data window on ``training_samples.created_at``; None: from the beginning."""
    data_window_end: datetime | None
    """End (inclusive) of the data window."""
    n_samples: int
    """Samples trained on."""
    sample_ids: list[int]
    """The exact ``training_samples`` ids trained on."""
    sample_ids_hash: str
    """SHA-256 of the sorted sample ids."""
    config_hash: str
    """SHA-256 of :attr:`config`."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The trainer settings that shaped the update."""
    metrics: dict[str, Any] = Field(default_factory=dict)
    """Cycle summary: loss before/after, selection counts, advantage stats, tokens/s."""
    steps: list[dict[str, float]] = Field(default_factory=list)
    """Per optimizer step: loss, mean reward, advantage and ratio stats, clip fraction, KL, tokens/s."""
    baseline_state: dict[str, Any] = Field(default_factory=dict)
    """The running-mean advantage baseline after this cycle (the next cycle starts from it)."""
    gate: GateRecord | None = None
    """The eval gate's decision and both evaluations."""

    @field_serializer("gate")
    def _gate_as_given(self, gate: GateRecord | None) -> dict[str, Any] | None:
        """The record's own keys only (a record written before several suites gains no ``suites: null``)."""
        return gate.to_dict() if gate is not None else None

    status: Literal["candidate", "rejected"]
    """The gate's verdict as a registry status."""
    versions: dict[str, str] = Field(default_factory=dict)
    """Library versions that trained it (torch, transformers, peft)."""
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    """When it was written."""
