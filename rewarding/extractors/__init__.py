"""Reward extractors, one module each, and the factory that builds them from settings.

To add one: write ``rewarding/extractors/<name>.py`` with an :class:`Extractor` subclass
(``name``, ``version``, ``extract``), give it a settings class in ``flywheel/core/settings/``
under ``ScoringSettings``, add it to :data:`FACTORIES`, and give it a weight.
"""

from __future__ import annotations

from collections.abc import Callable

from flywheel.core.settings import RewardingSettings
from rewarding.extractors.base import Components, Extractor, ExtractorError
from rewarding.extractors.grm import GrmExtractor
from rewarding.extractors.outcome import OutcomeExtractor
from rewarding.extractors.parl import ParlExtractor
from rewarding.extractors.retrieval import RetrievalExtractor
from rewarding.extractors.shaping import ShapingExtractor
from rewarding.extractors.summary import SummaryExtractor
from rewarding.extractors.user_signal import UserSignalExtractor
from rewarding.grm import JudgeClient, JudgeConfig

__all__ = ["Components", "Extractor", "ExtractorError", "FACTORIES", "VERSIONS", "build_extractors"]

JudgeUrl = Callable[[], str]
"""Returns the judge's base URL when the settings name none (the local stack's vLLM)."""


def _grm(settings: RewardingSettings, judge_url: JudgeUrl) -> Extractor:
    grm = settings.scoring.grm
    if not grm.enabled:
        raise ExtractorError("the grm extractor has a weight but scoring.grm.enabled is false")
    config = JudgeConfig(
        base_url=grm.base_url or judge_url(),
        model=grm.model,
        api_key=grm.api_key.get_secret_value() if grm.api_key else None,
        timeout_s=grm.timeout_s,
        retries=grm.retries,
        retry_backoff_s=grm.retry_backoff_s,
        concurrency=grm.concurrency,
        cache_size=grm.cache_size,
    )
    return GrmExtractor(grm, JudgeClient(config))


FACTORIES: dict[str, Callable[[RewardingSettings, JudgeUrl], Extractor]] = {
    "outcome": lambda s, _: OutcomeExtractor(s.scoring.outcome),
    "user_signal": lambda s, _: UserSignalExtractor(s.scoring.user_signal),
    "grm": _grm,
    "shaping": lambda s, _: ShapingExtractor(s.scoring.shaping),
    "parl": lambda s, _: ParlExtractor(s.scoring.parl, s.scoring.outcome),
    "retrieval": lambda s, _: RetrievalExtractor(s.scoring.retrieval),
    "summary": lambda s, _: SummaryExtractor(s.scoring.summary, s.scoring.outcome),
}
"""Extractor name -> factory."""

VERSIONS: dict[str, str] = {
    cls.name: cls.version
    for cls in (
        OutcomeExtractor,
        UserSignalExtractor,
        GrmExtractor,
        ShapingExtractor,
        ParlExtractor,
        RetrievalExtractor,
        SummaryExtractor,
    )
}
"""Extractor name -> version of the code in this checkout."""


def needed(settings: RewardingSettings) -> set[str]:
    """Extractors with a non-zero weight in the defaults or in any task's weights."""
    scoring = settings.scoring
    names = {n for n, w in scoring.weights.items() if w != 0.0}
    for weights in scoring.task_weights.values():
        names |= {n for n, w in weights.items() if w != 0.0}
    if not scoring.grm.enabled:
        names.discard("grm")
    return names


def build_extractors(settings: RewardingSettings, judge_url: JudgeUrl) -> dict[str, Extractor]:
    """Every extractor that some weight needs; an unknown name is refused (ExtractorError)."""
    names = needed(settings)
    unknown = sorted(names - set(FACTORIES))
    if unknown:
        raise ExtractorError(f"unknown extractor(s) in scoring weights: {unknown} (known: {sorted(FACTORIES)})")
    return {name: FACTORIES[name](settings, judge_url) for name in sorted(names)}
