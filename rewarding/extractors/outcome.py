"""Outcome: verifiable results (tests passed, task solved, a numeric metric) mapped to reward.

Each configured outcome name has a rule; the latest Outcome event of that name counts (a
later one corrects an earlier one). Several configured outcomes are combined by the
configured rule. A session without any configured outcome has no outcome value (yet): a
later Outcome event makes a new reward version. For the calculator demo, ``task_solved``
(bool) maps to 1 or 0.

The rules and their mapping live in the task layer (:mod:`flywheel.task.outcome`): the
trainer's replay suite scores its re-runs of held-out sessions with the same code.
"""

from __future__ import annotations

from flywheel.task.outcome import OutcomeRule, OutcomeSettings, combine, map_outcome, mapped_terms
from rewarding.extractors.base import Components, Extractor
from rewarding.session_state import Session

__all__ = [
    "OutcomeExtractor",
    "OutcomeExtractorSettings",
    "OutcomeRule",
    "combine",
    "map_outcome",
    "outcome_terms",
]

OutcomeExtractorSettings = OutcomeSettings
"""The extractor's settings (``rewarding.scoring.extractors.outcome``): the task layer's :class:`OutcomeSettings`."""


def outcome_terms(session: Session, rules: dict[str, OutcomeRule], names: list[str] | None = None) -> dict[str, float]:
    """Outcome name -> mapped reward, for the configured outcomes present (limited to ``names``)."""
    latest = {name: outcome.value for name, outcome in session.latest_outcomes().items()}
    return mapped_terms(latest, rules, names)


class OutcomeExtractor(Extractor):
    """Configured outcomes -> one reward."""

    name = "outcome"
    version = "1"
    Settings = OutcomeExtractorSettings

    def __init__(self, settings: OutcomeExtractorSettings):
        self.settings = settings

    def extract(self, session: Session) -> Components:
        latest = {name: outcome.value for name, outcome in session.latest_outcomes().items()}
        terms = mapped_terms(latest, self.settings.rules)
        ignored = sorted(set(latest) - set(self.settings.rules))
        details = {"ignored": ignored} if ignored else {}
        if not terms:
            return Components(value=None, details=details)
        return Components(value=combine(list(terms.values()), self.settings.combine), terms=terms, details=details)
