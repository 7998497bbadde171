"""Data selection: which scored samples a cycle trains on.

The rules, applied in this order (pure functions, tested with in-memory rows):

1. **Window**: rows created after the last checkpoint's data window ended
   (``checkpoints.data_window_end``, newest over all trainer checkpoints) and up to the
   cycle's start minus ``window_settle_s`` (``trainer.data``). Skipped, failed and lock-busy cycles write no
   checkpoint, so their data stays in the next window.
2. **Newest reward version**: of several rows of one completion, the one with the highest
   ``reward_version`` (late feedback replaces the earlier reward, never adds a sample).
3. **On-policy**: the completion's ``policy_version`` is one the fleet serves now
   (active deployments; with none, the base model's) or an ancestor of one within
   ``max_policy_lag`` checkpoints along the lineage.
4. **Trainable roles**: rows of other roles (frozen sub-agents) are dropped.
4b. **Held out**: rows of held-out sessions (:func:`is_held_out`, ``trainer.gate.holdout_per_mille``)
   are dropped: the gate's replay suite evaluates on them, so no checkpoint trains on them.
5. **Reproducible sampling**: the trainer computes each token's log-prob under the distribution
   the completion was sampled from (temperature, min-p, top-k, top-p: see docs/trainer.md), so
   rows it cannot reproduce are dropped and counted by reason (:func:`sampling_exclusion`):
   greedy (temperature below 1e-5: the behaviour policy was deterministic), a penalty, a logit
   bias, ``min_tokens``, another constraint, or an unreadable ``sampling`` record.
6. **Cap**: at most ``max_samples``, the newest kept.
7. **Minimum**: fewer than ``min_samples`` left skips the cycle, with every count above.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from sqlalchemy import select

from flywheel.core.contracts.events import SamplingParams
from flywheel.core.contracts.samples import StoredSample
from flywheel.core.db.models import TrainingSample as T

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


@dataclass(frozen=True)
class DataWindow:
    """``(start, end]`` on ``training_samples.created_at``; ``start=None`` means from the beginning."""

    start: datetime | None
    end: datetime

    def contains(self, at: datetime) -> bool:
        """True when ``at`` falls inside the window."""
        return (self.start is None or at > self.start) and at <= self.end


HOLDOUT_BUCKETS = 1000
"""Sessions are split by hash into this many buckets; ``trainer.gate.holdout_per_mille`` of them are held out."""

BUCKET_SQL = f"mod(('x' || substr({{hex}}, 1, 14))::bit(56)::bigint, {HOLDOUT_BUCKETS})"
""":func:`holdout_bucket` in PostgreSQL, over the hex SHA-256 digest ``{hex}`` of ``project/session_id``."""


def holdout_bucket(project: str, session_id: str) -> int:
    """The session's hash bucket, 0..999: the first 56 bits of ``sha256("<project>/<session_id>")`` mod 1000."""
    digest = hashlib.sha256(f"{project}/{session_id}".encode()).digest()
    return int.from_bytes(digest[:7], "big") % HOLDOUT_BUCKETS


def is_held_out(project: str, session_id: str, per_mille: int) -> bool:
    """Whether a session is held out of training (for the gate's replay suite)."""
    return per_mille > 0 and holdout_bucket(project, session_id) < per_mille


@dataclass(frozen=True)
class SampleMeta:
    """The columns selection needs (no token arrays)."""

    id: int
    completion_id: uuid.UUID | str
    reward_version: int
    policy_version: str
    agent_role: str
    created_at: datetime
    sampling: Mapping[str, Any] | SamplingParams | None = None
    """The row's ``sampling`` record (None or empty: nothing recorded, the assumed temperature applies)."""
    project: str = ""
    """The session's project (with ``session_id``, what the held-out split hashes)."""
    session_id: str = ""
    """The session the row belongs to."""


GREEDY_BELOW = 1e-5
"""vLLM samples greedily below this temperature (``_SAMPLING_EPS``)."""
EXCLUSION_REASONS = (
    "greedy",
    "penalty",
    "logit_bias",
    "min_tokens",
    "constrained",
    "unknown_sampling",
    "invalid_sampling",
)
"""Why a row's sampling cannot be reproduced by the trainer (``selection`` counts ``sampling_<reason>``)."""


@dataclass(frozen=True)
class SelectionRules:
    """What a cycle accepts."""

    allowed_versions: frozenset[str]
    trainable_roles: frozenset[str]
    min_samples: int
    max_samples: int
    holdout_per_mille: int = 0
    """Sessions held out of training (:func:`is_held_out`)."""


@dataclass
class Selection:
    """The chosen sample ids (newest first), the counts behind them and, if skipped, why."""

    ids: list[int]
    counts: dict[str, int] = field(default_factory=dict)
    skip_reason: str | None = None


class SampleError(ValueError):
    """A sample row is inconsistent (lengths of its arrays disagree); not recoverable by retrying."""


def allowed_versions(
    serving_ids: Iterable[str], lineage: Mapping[str, tuple[str | None, str]], max_policy_lag: int
) -> frozenset[str]:
    """Policy versions of the serving checkpoints and of up to ``max_policy_lag`` ancestors of each.

    ``lineage`` maps checkpoint id to ``(parent_id, policy_version)``.
    """
    versions: set[str] = set()
    for ckpt_id in serving_ids:
        current: str | None = ckpt_id
        for _ in range(max_policy_lag + 1):
            if current is None or current not in lineage:
                break
            parent, version = lineage[current]
            versions.add(version)
            current = parent
    return frozenset(versions)


def choose(rows: Sequence[SampleMeta], rules: SelectionRules) -> Selection:
    """Apply rules 2-7 of the module docstring to the rows of one window."""
    counts = {"in_window": len(rows)}
    newest = newest_reward_versions(rows)
    counts["superseded"] = len(rows) - len(newest)
    on_policy = [r for r in newest if r.policy_version in rules.allowed_versions]
    counts["off_policy"] = len(newest) - len(on_policy)
    roles = [r for r in on_policy if r.agent_role in rules.trainable_roles]
    counts["frozen_role"] = len(on_policy) - len(roles)
    if rules.holdout_per_mille > 0:
        trained = [r for r in roles if not is_held_out(r.project, r.session_id, rules.holdout_per_mille)]
        counts["held_out"] = len(roles) - len(trained)
        roles = trained
    trainable = []
    excluded: dict[str, int] = {}
    for r in roles:
        reason = sampling_exclusion(r.sampling)
        if reason is None:
            trainable.append(r)
        else:
            excluded[reason] = excluded.get(reason, 0) + 1
    counts["untrainable_sampling"] = len(roles) - len(trainable)
    counts.update((f"sampling_{reason}", n) for reason, n in sorted(excluded.items()))
    trainable.sort(key=lambda r: (r.created_at, r.id), reverse=True)
    kept = trainable[: rules.max_samples]
    counts["over_max"] = len(trainable) - len(kept)
    counts["selected"] = len(kept)
    selection = Selection(ids=[r.id for r in kept], counts=counts)
    if len(kept) < rules.min_samples:
        detail = ", ".join(f"{k}={v}" for k, v in counts.items())
        selection.skip_reason = f"too few samples: {len(kept)} < min_samples {rules.min_samples} ({detail})"
        selection.ids = []
    return selection


def sampling_exclusion(sampling: Mapping[str, Any] | SamplingParams | None) -> str | None:
    """Why the trainer cannot reproduce the distribution a row was sampled from, or None when it can.

    It reproduces temperature (> 0), ``top_k``, ``top_p`` and ``min_p``. Not: greedy decoding
    (temperature below 1e-5; the behaviour probability of every token was 1, and vLLM records
    the plain softmax for it), presence / frequency / repetition penalties (they depend on the
    tokens generated so far), a logit bias, ``min_tokens`` (stop tokens masked early) and the
    request options in ``constraints`` (allowed tokens, structured outputs, ...), nor a parameter
    this code does not know (a newer SDK's, kept by the event reader). One of
    :data:`EXCLUSION_REASONS`.
    """
    if sampling is None:
        return None
    if not isinstance(sampling, SamplingParams):
        if not isinstance(sampling, Mapping):
            return "invalid_sampling"
        if not sampling:
            return None
        try:
            sampling = SamplingParams.model_validate(sampling, extra="allow")
        except ValidationError:
            return "invalid_sampling"
    if sampling.model_extra:  # a newer SDK's parameter: it may have shaped the distribution
        return "unknown_sampling"
    if sampling.temperature is not None and sampling.temperature < GREEDY_BELOW:
        return "greedy"
    if (
        (sampling.presence_penalty or 0.0) != 0.0
        or (sampling.frequency_penalty or 0.0) != 0.0
        or (sampling.repetition_penalty if sampling.repetition_penalty is not None else 1.0) != 1.0
    ):
        return "penalty"
    if sampling.logit_bias:
        return "logit_bias"
    if sampling.min_tokens:
        return "min_tokens"
    if sampling.constraints:
        return "constrained"
    return None


def newest_reward_versions(rows: Sequence[SampleMeta]) -> list[SampleMeta]:
    """One row per completion: the one with the highest reward version."""
    best: dict[str, SampleMeta] = {}
    for row in rows:
        key = str(row.completion_id)
        if key not in best or row.reward_version > best[key].reward_version:
            best[key] = row
    return list(best.values())


def validate(sample: StoredSample) -> None:
    """Raise :class:`SampleError` when the arrays of ``sample`` do not line up."""
    n = len(sample.completion_token_ids)
    if n == 0:
        raise SampleError(f"sample {sample.id}: empty completion")
    if len(sample.loss_mask) != n or len(sample.behaviour_logprobs) != n:
        raise SampleError(
            f"sample {sample.id}: {n} completion tokens but {len(sample.loss_mask)} mask entries "
            f"and {len(sample.behaviour_logprobs)} behaviour logprobs"
        )
    if not sample.prompt_token_ids:
        raise SampleError(f"sample {sample.id}: empty prompt")


# --------------------------------------------------------------------------- database


def fetch_window(session: Session, window: DataWindow) -> list[SampleMeta]:
    """Metadata of every ``training_samples`` row inside ``window``."""
    query = select(
        T.id,
        T.completion_id,
        T.reward_version,
        T.policy_version,
        T.agent_role,
        T.created_at,
        T.sampling,
        T.project,
        T.session_id,
    ).where(T.created_at <= window.end)
    if window.start is not None:
        query = query.where(T.created_at > window.start)
    return [SampleMeta(*row) for row in session.execute(query)]


def fetch_samples(session: Session, ids: Sequence[int]) -> list[StoredSample]:
    """Full rows for ``ids``, in the order of ``ids``, as the core's :class:`StoredSample`; each is validated."""
    rows = {r.id: r for r in session.scalars(select(T).where(T.id.in_(list(ids))))}
    missing = [i for i in ids if i not in rows]
    if missing:
        raise SampleError(f"samples vanished while selecting: {missing[:10]}")
    samples = [StoredSample.from_row(rows[i]) for i in ids]
    for sample in samples:
        validate(sample)
    return samples
