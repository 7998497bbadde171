"""Scores: named scores (numeric, boolean or categorical, as Langfuse and LangSmith keep them) mapped to reward.

A named score is a ``feedback`` of kind ``score`` with a ``name`` and a ``value``
(``fw.score(...)``). Each configured name has a :class:`ScoreRule`: the outcome rules
(``bool``, ``linear``, ``threshold``, see :mod:`flywheel.task.outcome`) for numbers and
booleans, and ``categorical``, a table from category to reward. A name counts once per target
(the whole session or one completion), by its latest score; a name scored on several targets
counts the mean of their rewards. Several configured names are combined by ``combine``.

Scores of a name without a rule are kept (in ``raw_events``, like every event) and listed as
``ignored`` in the components; a value its rule cannot map (a category missing from the table, a
category under a numeric rule, a number under a categorical one) is listed as ``unmapped``.
Nothing configured (the default) or nothing mapped: no value, so the composite is unchanged.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, Field, model_validator

from flywheel.task.outcome import OutcomeRule, combine, map_outcome
from rewarding.extractors.base import Components, Extractor, mean
from rewarding.session_state import Session


class ScoreRule(OutcomeRule):
    """How one score name's values map to a reward: an outcome rule, or a table of categories."""

    kind: Literal["bool", "linear", "threshold", "categorical"] = "bool"  # type: ignore[assignment]
    """``bool``: true/false (or non-zero/zero) values; ``linear``: scale * value + offset; ``threshold``:
    above/below a bound; ``categorical``: the reward ``categories`` gives the value."""
    categories: dict[str, float] = Field(default_factory=dict, max_length=1024)
    """``categorical``: category -> reward; a category not listed is unmapped (no reward)."""

    @model_validator(mode="after")
    def _categories_for_categorical(self) -> Self:
        if self.kind == "categorical" and not self.categories:
            raise ValueError("categories: required when kind is 'categorical' (category -> reward)")
        if self.kind != "categorical" and self.categories:
            raise ValueError(f"categories: only for kind 'categorical' (kind is '{self.kind}')")
        bad = [k for k, v in self.categories.items() if not -1e6 <= v <= 1e6]
        if bad:
            raise ValueError(f"categories: rewards must be within ±1e6 ({bad[0]!r} is not)")
        return self


class ScoresSettings(BaseModel):
    """Named scores mapped to reward; a score whose name has no rule is ignored (and listed)."""

    rules: dict[str, ScoreRule] = Field(default_factory=dict)
    """Score name -> rule. Empty by default: no score becomes reward until its name is configured."""
    combine: Literal["mean", "min", "max", "sum"] = "mean"
    """How the rewards of several configured score names in one session are combined."""


def map_score(rule: ScoreRule, value: bool | float | str) -> float | None:
    """The reward ``rule`` gives ``value`` (clipped to the rule's range); None when it cannot map it."""
    if rule.kind == "categorical":
        if not isinstance(value, str) or value not in rule.categories:
            return None
        return min(max(rule.categories[value], rule.clip_min), rule.clip_max)
    if isinstance(value, str):
        return None
    return map_outcome(rule, value)


class ScoresExtractor(Extractor):
    """Configured named scores -> one reward."""

    name = "scores"
    version = "1"
    Settings = ScoresSettings

    def __init__(self, settings: ScoresSettings):
        self.settings = settings

    def extract(self, session: Session) -> Components:
        latest: dict[str, dict[str, bool | float | str]] = {}  # name -> target -> latest value
        for feedback in session.feedback:
            if feedback.name is None or feedback.value is None:
                continue
            target = str(feedback.completion_id) if feedback.completion_id else "session"
            latest.setdefault(feedback.name, {})[target] = feedback.value
        rules = self.settings.rules
        terms: dict[str, float] = {}
        unmapped: list[dict[str, Any]] = []
        for name in sorted(set(latest) & set(rules)):
            rewards = []
            for target, value in sorted(latest[name].items()):
                reward = map_score(rules[name], value)
                if reward is None:
                    unmapped.append({"name": name, "target": target, "value": value})
                else:
                    rewards.append(reward)
            if rewards:
                terms[name] = mean(rewards)
        details: dict[str, Any] = {}
        ignored = sorted(set(latest) - set(rules))
        if ignored:
            details["ignored"] = ignored
        if unmapped:
            details["unmapped"] = unmapped
        if not terms:
            return Components(value=None, details=details)
        return Components(value=combine(list(terms.values()), self.settings.combine), terms=terms, details=details)
