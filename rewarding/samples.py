"""Completions -> training sample rows for the trainer.

One row per completion that carries what the trainer needs (prompt and completion token
ids, one behaviour logprob per completion token). The loss mask covers the completion
tokens only: they are the model's own output, so all are 1 for a trainable span role and
0 otherwise. Tool results and user text never appear in a completion (they are part of
later prompts), so they are never trained. A completion without token ids or logprobs is
skipped and counted by reason. The completion's sampling parameters travel with it: its
logprobs are log-probabilities under the distribution they define.

A row is a :class:`flywheel.core.contracts.samples.ScoredSample`, the shape the trainer reads;
it is built with ``model_construct`` (no validation): every field comes from an already
validated completion event, and this runs for every completion of every scored session.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

from flywheel.core.contracts.events import Completion
from flywheel.core.contracts.samples import ScoredSample
from rewarding.composite import CompositeReward
from rewarding.session_state import Session


def group_key(session: Session) -> str | None:
    """SessionStart's group key, else a hash of the session's first prompt (same prompt, same group)."""
    if session.start is not None and session.start.group_key:
        return session.start.group_key
    if not session.completions:
        return None
    first = session.completions[0]
    if first.prompt_token_ids:
        basis = json.dumps(first.prompt_token_ids)
    else:
        basis = json.dumps([m.model_dump(mode="json") for m in first.prompt_messages] or first.prompt_text)
    return "prompt:" + hashlib.sha256(basis.encode()).hexdigest()[:32]


def skip_reason(completion: Completion) -> str | None:
    """Why a completion cannot be a sample, or None."""
    if completion.prompt_token_ids is None:
        return "no_prompt_token_ids"
    if not completion.completion_token_ids:
        return "no_completion_token_ids"
    if completion.logprobs is None:
        return "no_logprobs"
    return None


def build_samples(
    session: Session, composite: CompositeReward, trainable_roles: list[str]
) -> tuple[list[ScoredSample], Counter[str]]:
    """The samples of ``session`` under ``composite``, and the skipped completions by reason."""
    rows: list[ScoredSample] = []
    skipped: Counter[str] = Counter()
    key = group_key(session)
    session_terms = {name: c["weighted"] for name, c in composite.components.items()}
    for completion in session.completions:
        reason = skip_reason(completion)
        if reason is not None:
            skipped[reason] += 1
            continue
        cid = str(completion.completion_id)
        extra = composite.per_completion.get(cid, 0.0)
        trained = 1 if completion.span.role in trainable_roles else 0
        tokens = list(completion.completion_token_ids or [])
        rows.append(
            ScoredSample.model_construct(
                completion_id=completion.completion_id,
                policy_version=completion.policy_version,
                group_key=key,
                task=session.task,
                agent_role=completion.span.role,
                prompt_token_ids=list(completion.prompt_token_ids or []),
                completion_token_ids=tokens,
                loss_mask=[trained] * len(tokens),
                behaviour_logprobs=list(completion.logprobs or []),
                reward=composite.reward + extra,
                components={
                    "session_reward": composite.reward,
                    "session": session_terms,
                    "completion": composite.per_completion_terms.get(cid, {}),
                    "span_id": completion.span.span_id,
                },
                sampling=completion.sampling,
            )
        )
    return rows, skipped
