"""Held-out success of a policy on the calculator task, with transformers on the CPU.

The trainer's eval gate reuses :func:`heldout_success`: it takes a model folder, or a
model and tokenizer already in memory, and runs whole episodes (tool calls included)
in batches, sampling the way the fleet serves (temperature 1.0, no top-k / top-p).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.task import arith

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_EVAL_N = 200
DEFAULT_EVAL_SEED = 1234
DEFAULT_MAX_NEW_TOKENS = 24


def heldout_key(n: int, seed: int, temperature: float, max_new_tokens: int) -> str:
    """Cache key of one held-out evaluation setup, e.g. ``arith-v1/heldout/n200/s1234/t1.0/m24``.

    A checkpoint's row keeps each held-out result under its key (``checkpoints.eval``), so a
    policy is evaluated once per setup (the trainer's gate, the base model's build).
    """
    return f"{arith.TASK_VERSION}/heldout/n{n}/s{seed}/t{temperature}/m{max_new_tokens}"


"""Longest legitimate turn (``<calc>99*99</calc>``) is 11 tokens."""


@dataclass
class EvalResult:
    """Outcome of an evaluation run over ``n`` problems of one split."""

    success_rate: float
    n: int
    successes: int
    split: str
    seed: int
    temperature: float
    max_new_tokens: int
    by_kind: dict[str, float] = field(default_factory=dict)
    """Success rate per problem kind (add, sub, mul)."""
    finish_reasons: dict[str, int] = field(default_factory=dict)
    """How many episodes ended with an answer, without one, or at max turns."""
    tool_call_rate: float = 0.0
    """Share of episodes that called the tool at least once."""
    tool_error_rate: float = 0.0
    """Malformed tool calls per tool call."""
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    """A task's own figures (PARL: ``critical_steps``, ``parallel_rate``, ``subagents_per_episode``)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return asdict(self)


def load_policy(model_dir: Path | str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model folder (float32, eval mode) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model, tokenizer


def make_generate_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    temperature: float = 1.0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> arith.GenerateBatch:
    """A batched chat backend for :func:`arith.run_episodes` over a transformers model.

    ``temperature == 0`` decodes greedily; otherwise it samples from the full
    distribution (top_k=0, top_p=1.0), as vLLM serves by default.
    """
    import torch

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id

    def generate_batch(chats: list[list[arith.Message]]) -> list[str]:
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        sampling: dict[str, Any] = (
            {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            if temperature > 0
            else {"do_sample": False}
        )
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, **sampling)
        new = out[:, enc["input_ids"].shape[1] :]
        return tokenizer.batch_decode(new, skip_special_tokens=True)

    return generate_batch


def evaluate_problems(
    problems: list[arith.Problem],
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    temperature: float = 1.0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = 200,
) -> list[arith.Episode]:
    """Run one episode per problem, ``batch_size`` episodes in lock step."""
    generate_batch = make_generate_batch(model, tokenizer, temperature, max_new_tokens)
    episodes: list[arith.Episode] = []
    for start in range(0, len(problems), batch_size):
        episodes += arith.run_episodes(problems[start : start + batch_size], generate_batch)
    return episodes


def summarize(
    episodes: list[arith.Episode], split: str, seed: int, temperature: float, max_new_tokens: int
) -> EvalResult:
    """Aggregate episodes into an :class:`EvalResult`."""
    n = len(episodes)
    successes = sum(e.success for e in episodes)
    kinds = Counter(e.problem.kind for e in episodes)
    kind_wins = Counter(e.problem.kind for e in episodes if e.success)
    calls = sum(e.tool_calls for e in episodes)
    return EvalResult(
        success_rate=successes / n if n else 0.0,
        n=n,
        successes=successes,
        split=split,
        seed=seed,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        by_kind={k: kind_wins[k] / kinds[k] for k in sorted(kinds)},
        finish_reasons=dict(Counter(e.finish_reason for e in episodes)),
        tool_call_rate=sum(e.tool_calls > 0 for e in episodes) / n if n else 0.0,
        tool_error_rate=sum(e.tool_errors for e in episodes) / calls if calls else 0.0,
    )


def heldout_success(
    model: Path | str | PreTrainedModel,
    n: int = DEFAULT_EVAL_N,
    seed: int = DEFAULT_EVAL_SEED,
    temperature: float = 1.0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    split: arith.Split = "heldout",
    batch_size: int = 200,
) -> EvalResult:
    """Success rate over ``n`` problems of ``split`` (held out by default).

    ``model`` is a model folder, or a loaded model together with ``tokenizer``.
    The problems and the sampling are both fixed by ``seed``; the caller's torch RNG
    state is left untouched.
    """
    import torch

    started = time.perf_counter()
    if isinstance(model, (str, Path)):
        model, tokenizer = load_policy(model)
    elif tokenizer is None:
        raise ValueError("heldout_success: pass a tokenizer together with a loaded model")
    problems = arith.sample_problems(split, n, seed)
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            episodes = evaluate_problems(problems, model, tokenizer, temperature, max_new_tokens, batch_size)
    finally:
        model.train(was_training)
    result = summarize(episodes, split, seed, temperature, max_new_tokens)
    result.seconds = round(time.perf_counter() - started, 3)
    return result
