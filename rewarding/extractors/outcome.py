"""Outcome: verifiable results (tests passed, task solved, a numeric metric) mapped to reward.

Each configured outcome name has a rule; the latest Outcome event of that name counts (a
later one corrects an earlier one). Several configured outcomes are combined by the
configured rule. A session without any configured outcome has no outcome value (yet): a
later Outcome event makes a new reward version. For the calculator demo, ``task_solved``
(bool) maps to 1 or 0.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from rewarding.extractors.base import Components, Extractor, mean
from rewarding.session_state import Session


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


class OutcomeExtractorSettings(BaseModel):
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


def combine(values: list[float], how: str) -> float:
    """Combine per-outcome rewards by ``mean``, ``min``, ``max`` or ``sum``."""
    if how == "mean":
        return mean(values)
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    if how == "sum":
        return sum(values)
    raise ValueError(f"unknown outcome combination {how!r}")


def outcome_terms(session: Session, rules: dict[str, OutcomeRule], names: list[str] | None = None) -> dict[str, float]:
    """Outcome name -> mapped reward, for the configured outcomes present (limited to ``names``)."""
    latest = session.latest_outcomes()
    wanted = names if names is not None else list(rules)
    return {name: map_outcome(rules[name], latest[name].value) for name in wanted if name in latest and name in rules}


class OutcomeExtractor(Extractor):
    """Configured outcomes -> one reward."""

    name = "outcome"
    version = "1"
    Settings = OutcomeExtractorSettings

    def __init__(self, settings: OutcomeExtractorSettings):
        self.settings = settings

    def extract(self, session: Session) -> Components:
        terms = outcome_terms(session, self.settings.rules)
        ignored = sorted(set(session.latest_outcomes()) - set(self.settings.rules))
        details = {"ignored": ignored} if ignored else {}
        if not terms:
            return Components(value=None, details=details)
        return Components(value=combine(list(terms.values()), self.settings.combine), terms=terms, details=details)
