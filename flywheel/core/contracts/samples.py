"""Training samples: what rewarding writes for the trainer, and the record it publishes with them.

A *training sample* is one model completion scored under one reward version of its session:
the tokens the policy saw and produced, the log-probabilities it sampled them with, which of
them are trained, and the reward. It crosses two process boundaries:

- rewarding writes it to the ``training_samples`` table (one row per completion and reward
  version, :class:`flywheel.core.db.models.TrainingSample`; the columns carry the same names as
  the fields here), and the trainer reads it back as a :class:`StoredSample`;
- rewarding publishes it inside a :class:`ScoredReward` on the ``rewards.scored`` topic (key:
  session id), one record per reward version.

A later reward version of a session (late feedback, a recompute) carries new samples of the
same completions; readers keep the newest version per completion, never both.

Schema history (``ScoredReward.schema_version``; the table's shape changes only through a migration):
  1 — initial version.
  2 — each sample carries ``sampling``: the completion's sampling parameters (the distribution its
      behaviour logprobs refer to). A version-1 record still reads: its samples get the default
      (nothing recorded). Column ``training_samples.sampling`` since migration 0006 (rows written
      before hold ``{}``).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flywheel.core.contracts.events import SamplingParams

SCORED_SCHEMA_VERSION = 2
"""The ``rewards.scored`` schema version this code writes."""
SUPPORTED_SCORED_SCHEMA_VERSIONS = frozenset({1, 2})
"""``rewards.scored`` schema versions this code reads."""


class ScoredSample(BaseModel):
    """One completion's training sample under the reward version that carries it.

    Rewarding builds many of these per second from already validated events: it constructs them
    without validation (``model_construct``); every other producer validates.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    completion_id: uuid.UUID
    """The completion this sample trains (the SDK's UUIDv7)."""
    policy_version: str
    """The policy that produced the completion; the trainer keeps only on-policy versions."""
    group_key: str | None
    """Group for group-relative advantages: the session's ``group_key``, else a hash of its first prompt."""
    task: str | None
    """Task kind of the session (a baseline per task when the sample has no group)."""
    agent_role: str
    """Span role of the completion (``agent``, ``orchestrator``, ...); the trainer trains only its trainable roles."""
    prompt_token_ids: list[int]
    """Prompt tokens as the policy saw them (conditioning only, never trained)."""
    completion_token_ids: list[int]
    """Tokens the policy generated."""
    loss_mask: list[int]
    """One entry per completion token: 1 when it is trained, 0 otherwise (a frozen role's tokens are all 0)."""
    behaviour_logprobs: list[float]
    """Sampling log-probability of each completion token under the policy that generated it (importance ratios)."""
    reward: float
    """The sample's reward: the session reward plus the completion's own terms."""
    components: dict[str, Any]
    """The reward explained: ``session_reward``, ``session`` (weighted terms), ``completion`` (its own), ``span_id``."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """The completion's sampling parameters: ``behaviour_logprobs`` are log-probabilities under the distribution
    they define (vLLM's processed logprobs). All unset (the default, and rows written before it was recorded)
    means the server's defaults; the trainer then assumes ``trainer.step.sampling_temperature``."""

    @field_validator("sampling", mode="before")
    @classmethod
    def _none_is_unrecorded(cls, value: Any) -> Any:
        return {} if value is None else value


class StoredSample(ScoredSample):
    """A ``training_samples`` row: a scored sample with the identity of its row and of its reward version."""

    id: int
    """``training_samples.id``."""
    project: str
    """The agent product."""
    session_id: str
    """The session of the completion."""
    reward_id: int
    """``rewards.id`` of the reward version that carries the sample."""
    reward_version: int = Field(ge=1)
    """The session's reward version; of one completion's rows, the newest version counts."""
    created_at: datetime
    """When rewarding wrote the row (the database clock); the trainer's data windows are on it."""

    @property
    def episode(self) -> str:
        """Episode identity for the advantage estimator: ``<project>/<session_id>``."""
        return f"{self.project}/{self.session_id}"

    @classmethod
    def from_row(cls, row: Any) -> StoredSample:
        """A ``training_samples`` row (an ORM object or any object with its columns as attributes), validated."""
        return cls.model_validate(row, from_attributes=True)


class ScoredReward(BaseModel):
    """A ``rewards.scored`` record: one reward version of one session, with every training sample it carries.

    Published after the database commit, at least once: a consumer dedupes by (``project``,
    ``session_id``, ``reward_version``) and keeps the newest version per session, as the trainer
    does with ``training_samples``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1, 2] = SCORED_SCHEMA_VERSION
    """Version of this schema; readers refuse versions they do not know."""
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
