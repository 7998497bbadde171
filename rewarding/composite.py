"""The composite reward: a configured weighted sum of extractor values, and the config hash.

``reward = sum(weight[e] * value[e] for extractors e with a value)``: an extractor without a
value (nothing to say, or a recorded failure) is left out, never counted as zero. Terms an
extractor gives one completion (``per_completion``) are added, weighted the same way, to
that completion's sample only. The configuration hash covers everything that decides the
numbers (weights, every registered extractor's settings, extractor versions) and nothing
operational (endpoints, timeouts: an extractor's ``unhashed`` fields), so equal hashes and
equal inputs mean equal rewards.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from flywheel.core.settings import ScoringSettings
from rewarding.extractors import Components, configured


def effective_weights(scoring: ScoringSettings, task: str | None) -> dict[str, float]:
    """The weights for a session of ``task``: the defaults, overridden entry by entry per task."""
    weights = dict(scoring.weights)
    if task is not None and task in scoring.task_weights:
        weights.update(scoring.task_weights[task])
    return {name: w for name, w in weights.items() if w != 0.0}


def config_hash(scoring: ScoringSettings, versions: dict[str, str]) -> str:
    """SHA-256 (hex, 64 characters) of the scoring configuration and the extractor versions.

    The scoring settings are hashed as one object: its own fields, and under each registered
    extractor's name that extractor's validated settings without its ``unhashed`` fields (the
    same JSON as when these settings were fields of the scoring settings, so hashes carry over).
    """
    dump = scoring.model_dump(mode="json", exclude={"extractors"})
    for name, extractor in configured(scoring).items():
        dump[name] = extractor.settings.model_dump(mode="json", exclude=set(extractor.cls.unhashed))
    text = json.dumps({"scoring": dump, "versions": dict(sorted(versions.items()))}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class CompositeReward:
    """A session's reward, its explanation and the per-completion additions."""

    reward: float
    components: dict[str, Any]
    """Extractor name -> its components JSON plus ``weight`` and ``weighted``."""
    per_completion: dict[str, float]
    """Completion id -> weighted sum of the terms given to that completion only."""
    per_completion_terms: dict[str, dict[str, float]]
    """Completion id -> ``extractor.term`` -> weighted value."""


def combine(results: dict[str, Components], weights: dict[str, float]) -> CompositeReward:
    """The weighted sum of ``results`` (extractor name -> components)."""
    reward = 0.0
    components: dict[str, Any] = {}
    per_completion: dict[str, float] = {}
    per_terms: dict[str, dict[str, float]] = {}
    for name in sorted(results):
        result, weight = results[name], weights[name]
        weighted = weight * result.value if result.value is not None else None
        if weighted is not None:
            reward += weighted
        components[name] = {**result.to_json(), "weight": weight, "weighted": weighted}
        for completion_id, terms in result.per_completion.items():
            for term, value in terms.items():
                per_terms.setdefault(completion_id, {})[f"{name}.{term}"] = weight * value
                per_completion[completion_id] = per_completion.get(completion_id, 0.0) + weight * value
    return CompositeReward(reward, components, per_completion, per_terms)
