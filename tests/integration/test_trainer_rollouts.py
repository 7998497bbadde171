"""Real scored samples for the trainer's tests and benchmark: episodes of the calculator task.

:func:`sample_rows` runs whole episodes of the base model (token in, token out: the next
turn's context is the exact ids generated so far plus the tool's reply), records the
sampling log-prob of every generated token, scores each episode with the task's verifiable
outcome and renders it the way rewarding writes ``training_samples``: the opening prompt,
then one completion holding every turn, with the tool's tokens masked out (loss mask 0).
:func:`insert_rows` writes them, each with its ``rewards`` row, into a database.

The test below checks what the trainer relies on: an unchanged policy sees importance
ratios of 1 on these logprobs.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flywheel.task import arith

pytestmark = pytest.mark.integration

PROJECT = "trainer-tests"


@dataclass
class Rollout:
    """One episode under construction: the ids so far and the completion part of them."""

    episode: arith.Episode
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


def sample_rows(
    model_dir: Path,
    n_problems: int,
    group_size: int,
    seed: int = 0,
    policy_version: str | None = None,
    max_new_tokens: int = 16,
) -> list[dict[str, Any]]:
    """``n_problems`` TRAIN problems x ``group_size`` episodes each, as ``training_samples`` dicts."""
    import torch

    from flywheel.model.build import read_sidecar
    from flywheel.model.eval import load_policy

    model, tokenizer = load_policy(model_dir)
    version = policy_version or read_sidecar(model_dir).policy_version
    problems = arith.sample_problems("train", n_problems, seed)
    rollouts = []
    for p in problems:
        for _ in range(group_size):
            episode = arith.start_episode(p)
            ids = tokenizer.apply_chat_template(episode.messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            rollouts.append(Rollout(episode, list(ids)))
    eot = tokenizer.eos_token_id
    tool_id = tokenizer.convert_tokens_to_ids("<|tool|>")
    assistant_id = tokenizer.convert_tokens_to_ids("<|assistant|>")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        while active := [r for r in rollouts if not r.episode.done]:
            for r, new, logps in zip(
                active, *generate(model, [r.context for r in active], eot, tokenizer.pad_token_id, max_new_tokens)
            ):
                r.completion_ids += new
                r.loss_mask += [1] * len(new)
                r.logprobs += logps
                if new[-1] != eot:  # the harness closes a turn cut at max_new_tokens
                    r.completion_ids.append(eot)
                    r.loss_mask.append(0)
                    r.logprobs.append(0.0)
                text = tokenizer.decode(new, skip_special_tokens=True)
                arith.advance_episode(r.episode, text)
                if r.episode.messages[-1]["role"] == "tool" and not r.episode.done:
                    tail = [
                        tool_id,
                        *tokenizer.encode(r.episode.messages[-1]["content"], add_special_tokens=False),
                        eot,
                        assistant_id,
                    ]
                    r.completion_ids += tail
                    r.loss_mask += [0] * len(tail)
                    r.logprobs += [0.0] * len(tail)
    rows = []
    for i, r in enumerate(rollouts):
        reward = 1.0 if arith.is_success(r.episode.problem, r.episode.final_text) else 0.0
        rows.append(
            {
                "session_id": f"s{seed}-{i}",
                "group_key": r.episode.problem.id,
                "task": f"arith:{r.episode.problem.kind}",
                "agent_role": "agent",
                "policy_version": version,
                "prompt_token_ids": r.prompt_ids,
                "completion_token_ids": r.completion_ids,
                "loss_mask": r.loss_mask,
                "behaviour_logprobs": r.logprobs,
                "reward": reward,
                "components": {"outcome": {"value": reward, "weight": 1.0}},
            }
        )
    return rows


def generate(
    model: Any, contexts: list[list[int]], eot: int, pad: int, max_new_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one turn for each context (temperature 1, full distribution); ids and their logprobs."""
    import torch

    width = max(len(c) for c in contexts)
    input_ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, c in enumerate(contexts):
        input_ids[i, width - len(c) :] = torch.tensor(c)
        attention[i, width - len(c) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=eot,
            pad_token_id=pad,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[:, width:]
    logps = torch.stack(out.scores, dim=1).log_softmax(-1).gather(-1, new[..., None]).squeeze(-1)
    ids_out, lp_out = [], []
    for row, lp in zip(new.tolist(), logps.tolist()):
        end = row.index(eot) + 1 if eot in row else len(row)
        ids_out.append(row[:end])
        lp_out.append(lp[:end])
    return ids_out, lp_out


def insert_rows(url: str, rows: list[dict[str, Any]], project: str = PROJECT) -> list[int]:
    """Insert ``rows`` as ``training_samples`` (fresh completion ids), each with a ``rewards`` row."""
    from flywheel.core.db.engine import session_factory
    from flywheel.core.db.models import Reward, TrainingSample

    ids = []
    with session_factory(url)() as session:
        for row in rows:
            session_id = f"{row['session_id']}-{uuid.uuid4().hex[:8]}"
            reward = Reward(
                project=project,
                session_id=session_id,
                version=1,
                reward=row["reward"],
                components=row["components"],
                extractor_versions={"outcome": "1"},
                config_hash="test",
                policy_version=row["policy_version"],
            )
            session.add(reward)
            session.flush()
            sample = TrainingSample(
                project=project,
                session_id=session_id,
                completion_id=uuid.uuid4(),
                reward_id=reward.id,
                reward_version=1,
                **{k: v for k, v in row.items() if k != "session_id"},
            )
            session.add(sample)
            session.flush()
            ids.append(sample.id)
        session.commit()
    return ids


def shuffled(rows: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    out = list(rows)
    random.Random(seed).shuffle(out)
    return out


def test_rollout_logprobs_give_unit_ratios_under_the_same_policy(base_model_dir):
    import torch

    from flywheel.core.settings.trainer import StepSettings
    from flywheel.model.eval import load_policy
    from trainer.step import StepSample, forward_batches, make_logprob_module, micro_batches

    rows = sample_rows(base_model_dir, n_problems=4, group_size=2, seed=7)
    assert all(len(r["completion_token_ids"]) == len(r["loss_mask"]) == len(r["behaviour_logprobs"]) for r in rows)
    assert any(0 in r["loss_mask"] for r in rows), "expected at least one tool call with masked tool tokens"
    model, tokenizer = load_policy(base_model_dir)
    samples = [
        StepSample(
            i,
            r["prompt_token_ids"],
            r["completion_token_ids"],
            r["loss_mask"],
            r["behaviour_logprobs"],
            0.0,
            r["reward"],
        )
        for i, r in enumerate(rows)
    ]
    batches = micro_batches(samples, StepSettings(), tokenizer.pad_token_id)
    logps = torch.cat([lp for lp, _ in forward_batches(make_logprob_module(model, 1.0), batches)])
    behaviour = torch.cat([mb.behaviour_logprobs for mb in batches])
    ratio = torch.exp(logps - behaviour)
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-3), float((ratio - 1).abs().max())
