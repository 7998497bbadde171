"""Records rewarding publishes on the ``rewards.scored`` topic (key: session id).

One record per reward version, carrying its samples: :class:`ScoredReward` and
:class:`ScoredSample`, the core's contracts (:mod:`flywheel.core.contracts.samples`, schema
history there). Published after the database commit, at least once: a consumer dedupes by
(``project``, ``session_id``, ``reward_version``) and keeps the newest version per session, as
the trainer does with ``training_samples``.
"""

from __future__ import annotations

from datetime import datetime

from flywheel.core.contracts.samples import SCORED_SCHEMA_VERSION, ScoredReward, ScoredSample
from rewarding.scorer import ScoredSession

__all__ = ["SCORED_SCHEMA_VERSION", "ScoredReward", "ScoredSample", "scored_record"]


def scored_record(
    scored: ScoredSession, reward_id: int, version: int, reason: str | None, at: datetime
) -> ScoredReward:
    """The topic record of one written (or already identically stored) reward version."""
    return ScoredReward(
        project=scored.project,
        session_id=scored.session_id,
        reward_id=reward_id,
        reward_version=version,
        reason=reason,
        config_hash=scored.config_hash,
        policy_version=scored.policy_version,
        reward=scored.reward,
        samples=scored.samples,
        scored_at=at,
    )
