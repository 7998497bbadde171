"""Verifiable outcomes mapped to reward: the one rule that rewarding and the trainer's replay suite share.

A session reports named, verifiable results (``Outcome`` events: ``task_solved``,
``tests_passed``, a numeric metric). Each configured name has an :class:`OutcomeRule`; the
latest value of each configured name is mapped by its rule and the mapped values are combined
(:func:`outcome_reward`). Rewarding's ``outcome`` extractor scores production sessions with it
(its settings section ``rewarding.scoring.extractors.outcome`` is an :class:`OutcomeSettings`),
and the trainer's replay suite scores a re-run of a held-out session with it, on the outcome
values that the task's verifier (:mod:`flywheel.task.verify`) computes, so both score alike.

Pure Python and pydantic: no rewarding, trainer or database import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, Field


class OutcomeRule(BaseModel):
    """How one named Outcome event's value maps to a reward."""

    kind: Literal["bool", "linear", "threshold"] = "bool"
    """``bool``: true/false values; ``linear``: scale * value + offset; ``threshold``: above/below a bound."""
    true_value: float = Field(1.0, ge=-1e6, le=1e6)
    """``bool``: reward of a true (or non-zero) value."""
    false_value: float = Field(0.0, ge=-1e6, le=1e6)
    """``bool``: reward of a false (or zero) value."""
    scale: float = Field(1.0, ge=-1e6, le=1e6)
    """``linear``: multiplier of the value."""
    offset: float = Field(0.0, ge=-1e6, le=1e6)
    """``linear``: added after scaling."""
    threshold: float = Field(0.0, ge=-1e12, le=1e12)
    """``threshold``: values at or above it earn ``above_value``."""
    above_value: float = Field(1.0, ge=-1e6, le=1e6)
    """``threshold``: reward at or above the threshold."""
    below_value: float = Field(0.0, ge=-1e6, le=1e6)
    """``threshold``: reward below the threshold."""
    clip_min: float = Field(-1e6, ge=-1e6, le=1e6)
    """Lowest reward this rule gives."""
    clip_max: float = Field(1e6, ge=-1e6, le=1e6)
    """Highest reward this rule gives."""


def _default_outcome_rules() -> dict[str, OutcomeRule]:
    return {"task_solved": OutcomeRule(), "tests_passed": OutcomeRule()}


class OutcomeSettings(BaseModel):
    """Verifiable outcomes (tests passed, task solved, a metric) mapped to reward."""

    rules: dict[str, OutcomeRule] = Field(default_factory=_default_outcome_rules)
    """Outcome name -> rule; outcomes without a rule are ignored (and listed in the components)."""
    combine: Literal["mean", "min", "max", "sum"] = "mean"
    """How the rewards of several configured outcomes in one session are combined."""


def map_outcome(rule: OutcomeRule, value: float | bool) -> float:
    """The reward ``rule`` gives ``value``, clipped to the rule's range."""
    number = float(value)
    if rule.kind == "bool":
        reward = rule.true_value if number != 0.0 else rule.false_value
    elif rule.kind == "linear":
        reward = rule.scale * number + rule.offset
    else:
        reward = rule.above_value if number >= rule.threshold else rule.below_value
    return min(max(reward, rule.clip_min), rule.clip_max)


def combine(values: Sequence[float], how: str) -> float:
    """Combine per-outcome rewards by ``mean``, ``min``, ``max`` or ``sum``."""
    if how == "mean":
        if not values:
            raise ValueError("mean requires at least one value")
        return math.fsum(values) / len(values)  # statistics.fmean's float, without its generator
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    if how == "sum":
        return sum(values)
    raise ValueError(f"unknown outcome combination {how!r}")


def mapped_terms(
    values: Mapping[str, float | bool], rules: Mapping[str, OutcomeRule], names: Sequence[str] | None = None
) -> dict[str, float]:
    """Outcome name -> mapped reward, for the configured outcomes present in ``values`` (limited to ``names``)."""
    wanted = names if names is not None else list(rules)
    return {name: map_outcome(rules[name], values[name]) for name in wanted if name in values and name in rules}


def outcome_reward(values: Mapping[str, float | bool], settings: OutcomeSettings) -> float | None:
    """The outcome reward of one session's latest outcome values; None when no configured outcome is present."""
    terms = mapped_terms(values, settings.rules)
    return combine(list(terms.values()), settings.combine) if terms else None
