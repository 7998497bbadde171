"""Score one session: run the extractors, combine them, build its samples and its record.

Pure apart from the judge: the same session and settings give the same
:class:`ScoredSession`, whether it comes from the stream or from a recompute.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flywheel.core.contracts.samples import ScoredSample
from flywheel.core.settings import RewardingSettings
from rewarding.composite import combine, config_hash, effective_weights
from rewarding.detectors import session_stats
from rewarding.extractors import Extractor, JudgeUrl, build_extractors
from rewarding.samples import build_samples
from rewarding.session_state import Session


@dataclass(frozen=True)
class ScoredSession:
    """A session's reward record and its samples, ready for the store."""

    project: str
    session_id: str
    reward: float
    components: dict[str, Any]
    """Per extractor, plus ``_meta`` (input hash, event ids, detector stats)."""
    extractor_versions: dict[str, str]
    config_hash: str
    policy_version: str | None
    input_hash: str
    event_ids: list[str]
    samples: list[ScoredSample]
    skipped: Counter[str] = field(default_factory=Counter)
    """Completions that could not become samples, by reason."""

    @property
    def key(self) -> tuple[str, str]:
        """(project, session id)."""
        return (self.project, self.session_id)


class Scorer:
    """The configured extractors and composite, applied to sessions."""

    def __init__(self, settings: RewardingSettings, extractors: dict[str, Extractor]):
        self.settings = settings
        self.extractors = extractors
        self.versions = {name: ex.version for name, ex in sorted(extractors.items())}
        self.config_hash = config_hash(settings.scoring, self.versions)

    @classmethod
    def from_settings(cls, settings: RewardingSettings, judge_url: JudgeUrl) -> Scorer:
        """A scorer with every extractor the settings weight."""
        return cls(settings, build_extractors(settings, judge_url))

    @property
    def calls_out(self) -> bool:
        """Whether some extractor calls a remote service (the GRM judge): then score with :meth:`score`."""
        return any(ex.calls_out for ex in self.extractors.values())

    def _weights(self, session: Session) -> dict[str, float]:
        return {n: w for n, w in effective_weights(self.settings.scoring, session.task).items() if n in self.extractors}

    async def score(self, session: Session) -> ScoredSession:
        """Score ``session``."""
        weights = self._weights(session)
        names = sorted(weights)
        by_name = {n: self.extractors[n].extract(session) for n in names if not self.extractors[n].calls_out}
        remote = [n for n in names if n not in by_name]
        if remote:
            by_name.update(zip(remote, await asyncio.gather(*(self.extractors[n].aextract(session) for n in remote))))
        return self._finish(session, weights, by_name)

    def score_local(self, session: Session) -> ScoredSession:
        """:meth:`score` without an event loop, for a scorer none of whose extractors call out."""
        if self.calls_out:
            raise RuntimeError("this scorer calls a remote judge: use score()")
        weights = self._weights(session)
        return self._finish(session, weights, {n: self.extractors[n].extract(session) for n in sorted(weights)})

    def _finish(self, session: Session, weights: dict[str, float], by_name: dict[str, Any]) -> ScoredSession:
        names = sorted(weights)
        composite = combine(by_name, weights)
        samples, skipped = build_samples(session, composite, self.settings.scoring.trainable_roles)
        event_ids = session.event_ids
        input_hash = session.input_hash()
        stats = session_stats(session, by_name.get("grm"), self.settings.detectors.clarifying_pattern)
        meta = {"input_hash": input_hash, "n_events": len(event_ids), "event_ids": event_ids, "stats": stats}
        return ScoredSession(
            project=session.project,
            session_id=session.session_id,
            reward=composite.reward,
            components={**composite.components, "_meta": meta},
            extractor_versions={n: self.versions[n] for n in names},
            config_hash=self.config_hash,
            policy_version=session.policy_version(),
            input_hash=input_hash,
            event_ids=event_ids,
            samples=samples,
            skipped=skipped,
        )

    def score_sync(self, session: Session) -> ScoredSession:
        """:meth:`score` outside an event loop."""
        return asyncio.run(self.score(session))

    async def aclose(self) -> None:
        """Close the extractors' clients."""
        for extractor in self.extractors.values():
            await extractor.aclose()
