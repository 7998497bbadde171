"""Records rewarding publishes on the ``rewards.scored`` topic (key: session id).

One record per reward version, carrying its samples. Published after the database commit,
at least once: a consumer dedupes by (``project``, ``session_id``, ``reward_version``) and
keeps the newest version per session, as the trainer does with ``training_samples``.

Schema history:
  1 — initial version.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rewarding.samples import SampleRow
from rewarding.scorer import ScoredSession

SCORED_SCHEMA_VERSION = 1


class ScoredSample(BaseModel):
    """One completion's training sample under the reward version that carries it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    completion_id: uuid.UUID
    """The completion this sample trains."""
    policy_version: str
    """The policy that produced the completion."""
    group_key: str | None
    """Group for group-relative advantages."""
    task: str | None
    """Task kind."""
    agent_role: str
    """Span role of the completion."""
    prompt_token_ids: list[int]
    """Prompt tokens (never trained)."""
    completion_token_ids: list[int]
    """Generated tokens."""
    loss_mask: list[int]
    """1 for a trained completion token."""
    behaviour_logprobs: list[float]
    """Sampling log-probabilities, one per completion token."""
    reward: float
    """The sample's reward (session reward plus its own terms)."""
    components: dict[str, Any]
    """The sample's reward explanation."""


class ScoredReward(BaseModel):
    """One reward version of one session, with every training sample it carries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCORED_SCHEMA_VERSION
    """Version of this schema."""
    project: str
    """The agent product."""
    session_id: str
    """The session (also the record key)."""
    reward_id: int
    """``rewards.id`` of this version."""
    reward_version: int = Field(ge=1)
    """The session's reward version; a newer one supersedes this one and its samples."""
    reason: str | None
    """Why this version exists (``finalized``, ``late_feedback``, ``timeout``, ``recompute``)."""
    config_hash: str
    """Hash of the scoring configuration."""
    policy_version: str | None
    """The session's (majority) policy version."""
    reward: float
    """The session reward."""
    samples: list[ScoredSample]
    """One per completion that could be trained."""
    scored_at: datetime
    """When rewarding published it."""


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
        samples=[_sample(s) for s in scored.samples],
        scored_at=at,
    )


def _sample(sample: SampleRow) -> ScoredSample:
    return ScoredSample(
        completion_id=sample.completion_id,
        policy_version=sample.policy_version,
        group_key=sample.group_key,
        task=sample.task,
        agent_role=sample.agent_role,
        prompt_token_ids=sample.prompt_token_ids,
        completion_token_ids=sample.completion_token_ids,
        loss_mask=sample.loss_mask,
        behaviour_logprobs=sample.behaviour_logprobs,
        reward=sample.reward,
        components=sample.components,
    )
