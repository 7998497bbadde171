"""Does the trainer see what serving sampled? Its log-probs of served completions against the recorded ones.

At step 0 (the trainer's weights are the ones that served) the importance ratio of every
completion token must be 1: the log-prob the trainer computes for a token, under the
distribution the completion was sampled from, must equal the behaviour log-prob vLLM
recorded (``--logprobs-mode processed_logprobs``). :func:`check_logprobs` computes the
first exactly as a training step does (packing, :func:`trainer.step.make_logprob_module`,
the sample's temperature / top-k / top-p / min-p) and reports the largest
``|log ratio|``. Used by the integration test against real vLLM and by benchmarks
(``step0_max_abs_log_ratio``; with the weights of a served version,
``version_truth_max_abs_diff``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flywheel.core.contracts.events import SamplingParams
from trainer.select import sampling_exclusion
from trainer.step import (
    StepSample,
    TokenSampling,
    build_micro_batch,
    forward_batches,
    make_logprob_module,
    split_micro_batches,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class TruthSample:
    """One served completion: its tokens, how it was sampled and the log-probs serving recorded."""

    prompt_ids: list[int]
    """Prompt token ids as the server tokenised them (``prompt_token_ids``)."""
    completion_ids: list[int]
    """The sampled token ids (``token_ids``)."""
    recorded_logprobs: list[float]
    """The server's log-prob of each sampled token (one per completion token)."""
    sampling: SamplingParams | Mapping[str, Any] | TokenSampling | None = None
    """The request's sampling parameters (the contract's ``SamplingParams``, its dict, a
    :class:`~trainer.step.TokenSampling`, or None: nothing set, the default temperature applies)."""


@dataclass
class TruthReport:
    """The trainer's log-probs of each completion and how far they are from the recorded ones."""

    logprobs: list[list[float] | None]
    """Per sample (input order): the trainer's log-prob of every completion token; None if excluded."""
    max_abs_log_ratio: float
    """``max |trainer - recorded|`` over every token of every checked sample (0.0 when none was checked)."""
    sample_max_abs_log_ratio: list[float | None]
    """Per sample: its largest ``|log ratio|``; None if excluded."""
    worst: tuple[int, int] | None
    """``(sample index, token index)`` of the largest ``|log ratio|``; None when no token was checked."""
    tokens: int
    """Completion tokens checked."""
    excluded: dict[str, int] = field(default_factory=dict)
    """Samples the trainer would not train, by reason (:func:`trainer.select.sampling_exclusion`)."""

    def to_dict(self) -> dict[str, Any]:
        """The summary (no per-token lists), JSON-ready."""
        return {
            "max_abs_log_ratio": self.max_abs_log_ratio,
            "worst": list(self.worst) if self.worst else None,
            "tokens": self.tokens,
            "samples": sum(1 for x in self.logprobs if x is not None),
            "excluded": dict(self.excluded),
        }


def check_logprobs(
    model: PreTrainedModel,
    samples: Sequence[TruthSample],
    *,
    default_temperature: float = 1.0,
    pad_id: int = 0,
    micro_batch_tokens: int = 8192,
    pack_row_tokens: int = 256,
) -> TruthReport:
    """The trainer's per-token log-probs of ``samples`` under ``model``, and the max |log ratio| to the recorded ones.

    ``model``: a loaded policy (a ``*ForCausalLM`` or a peft model), already on its device and
    in the dtype the trainer uses; it is put in eval mode and run without gradient, exactly as
    the trainer's reference pass runs it (same packing into rows of ``pack_row_tokens``, same
    micro-batches of ``micro_batch_tokens``, same log-prob module). Each sample's log-probs are
    under the distribution it was sampled from: its temperature (``default_temperature``,
    i.e. ``trainer.step.sampling_temperature``, where none was recorded), then min-p, top-k and
    top-p as vLLM applies them. Samples the trainer would exclude (greedy, penalties, logit bias,
    other constraints) are not computed and are counted in ``excluded``.

    Raises ``ValueError`` naming the sample when its arrays disagree (an empty prompt or
    completion, or not one recorded log-prob per completion token).
    """
    step_samples: list[StepSample] = []
    index: list[int] = []
    excluded: Counter[str] = Counter()
    for i, s in enumerate(samples):
        if not s.prompt_ids or not s.completion_ids:
            raise ValueError(f"sample {i}: empty prompt or completion")
        if len(s.recorded_logprobs) != len(s.completion_ids):
            n, m = len(s.completion_ids), len(s.recorded_logprobs)
            raise ValueError(f"sample {i}: {n} completion tokens but {m} recorded logprobs")
        sampling = s.sampling
        if not isinstance(sampling, TokenSampling):
            reason = sampling_exclusion(sampling)
            if reason is not None:
                excluded[reason] += 1
                continue
            sampling = TokenSampling.from_params(sampling)
        n = len(s.completion_ids)
        step_samples.append(
            StepSample(
                i, list(s.prompt_ids), list(s.completion_ids), [1] * n, list(s.recorded_logprobs), 0.0, 0.0, sampling
            )
        )
        index.append(i)

    logprobs: list[list[float] | None] = [None] * len(samples)
    if step_samples:
        import torch

        device = next(model.parameters()).device
        groups = split_micro_batches([s.length for s in step_samples], micro_batch_tokens, pack_row_tokens)
        batches = [
            build_micro_batch([step_samples[k] for k in g], pack_row_tokens, pad_id, default_temperature).to(device)
            for g in groups
        ]
        was_training = model.training
        model.eval()
        try:
            results = forward_batches(make_logprob_module(model, default_temperature), batches)
        finally:
            model.train(was_training)
        for mb, (logp, _) in zip(batches, results):
            logp = logp.detach().to("cpu", torch.float64)
            owner = mb.token_sample.cpu()
            for k, sample_id in enumerate(mb.sample_ids):
                logprobs[sample_id] = logp[owner == k].tolist()

    sample_max: list[float | None] = [None] * len(samples)
    worst: tuple[int, int] | None = None
    overall = 0.0
    tokens = 0
    for i in index:
        values = logprobs[i]
        assert values is not None
        diffs = [abs(a - b) for a, b in zip(values, samples[i].recorded_logprobs)]
        diffs = [d if math.isfinite(d) else math.inf for d in diffs]
        tokens += len(diffs)
        j = max(range(len(diffs)), key=diffs.__getitem__)
        sample_max[i] = diffs[j]
        if worst is None or diffs[j] > overall:
            overall, worst = diffs[j], (i, j)
    return TruthReport(
        logprobs=logprobs,
        max_abs_log_ratio=overall,
        sample_max_abs_log_ratio=sample_max,
        worst=worst,
        tokens=tokens,
        excluded=dict(excluded),
    )
