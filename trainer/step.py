"""The training step: packed sequences, trained-token log-probs, the loss, AdamW.

``train_on_batch`` is the whole update of one cycle, written to be read top to bottom.
The plumbing around it (packing, micro-batches, the log-prob module, reductions across
ranks) sits above it in small functions.

Packing: each sample is ``prompt + completion`` token ids. Samples are packed first-fit
decreasing into rows of at most ``pack_row_tokens`` tokens, with position ids restarting
at 0 for every sample and no attention mask; transformers then builds a block-causal
mask from the position ids, so a token attends only to earlier tokens of its own sample.
Nothing is spent on padding except each row's tail. Only the hidden states that predict a
trained token go through the LM head, so no ``(tokens, vocab)`` logits exist for prompt,
tool-output or sub-agent tokens.

Data parallel: sample ``i`` belongs to rank ``i % world`` for the whole cycle; every rank
runs the same number of optimizer steps and micro-batches (an empty micro-batch is a
one-token forward with zero loss), the loss of a step is divided by the trained-token
count of the whole step on all ranks, and DDP / FSDP average the gradients, so the update
equals the single-process one.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from tqdm.auto import tqdm

from flywheel.core.settings.trainer import LossSettings, StepSettings
from trainer.loss import kl_k3, token_loss

# torch is imported inside the functions that use it: trainer.cycle imports this module in
# processes that never train (``flywheel-trainer check``).

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


class CycleTimeout(RuntimeError):
    """The cycle ran past its time limit (recoverable: the next cycle starts afresh)."""


@dataclass(frozen=True)
class TokenSampling:
    """The distribution a completion's tokens were sampled from, as the trainer reproduces it.

    vLLM's processed distribution (``--logprobs-mode processed_logprobs``): logits divided by
    ``temperature``, then min-p, top-k and top-p masks in that order, then a softmax over the
    kept tokens. The neutral values (``top_k`` 0, ``top_p`` 1, ``min_p`` 0) mean no truncation.
    """

    temperature: float | None = None
    """Softmax temperature (> 0); None: not recorded, ``trainer.step.sampling_temperature`` is assumed."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens (ties with the k-th kept); 0: no limit."""
    top_p: float = 1.0
    """Keep the most likely tokens whose cumulative probability reaches ``top_p``; 1: no limit."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one; 0: none dropped."""

    def __post_init__(self) -> None:
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy samples are not trainable), got {self.temperature}")
        if not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1 or self.top_k < 0:
            raise ValueError(f"sampling out of range: top_k={self.top_k}, top_p={self.top_p}, min_p={self.min_p}")

    @classmethod
    def from_params(cls, sampling: Any) -> TokenSampling:
        """From a completion's ``SamplingParams`` (or its dict, or None: nothing recorded).

        Only the parameters the trainer reproduces are read; whether the others rule the
        sample out is :func:`trainer.select.sampling_exclusion`'s decision.
        """
        if sampling is None:
            return cls()
        get = sampling.get if isinstance(sampling, dict) else (lambda key: getattr(sampling, key, None))
        top_k, top_p, min_p = get("top_k"), get("top_p"), get("min_p")
        return cls(
            temperature=get("temperature"),
            top_k=top_k if top_k is not None and top_k > 0 else 0,
            top_p=top_p if top_p is not None else 1.0,
            min_p=min_p if min_p is not None else 0.0,
        )


@dataclass(frozen=True)
class StepSample:
    """One sequence to train on."""

    sample_id: int
    prompt_ids: list[int]
    completion_ids: list[int]
    target_mask: list[int]
    """1 for a completion token that is trained (model-generated, trainable role)."""
    behaviour_logprobs: list[float]
    """Log-probability of each completion token under the distribution ``sampling`` describes."""
    advantage: float
    reward: float
    sampling: TokenSampling = TokenSampling()
    """The distribution the completion was sampled from; the trained log-probs are under the same one."""

    def __post_init__(self) -> None:
        if isinstance(self.sampling, dict):  # from a JSON batch file (dataclasses.asdict)
            object.__setattr__(self, "sampling", TokenSampling(**self.sampling))

    @property
    def length(self) -> int:
        """Tokens in the packed sequence."""
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def n_trained(self) -> int:
        """Trained tokens."""
        return sum(1 for m in self.target_mask if m)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in a data-parallel group (world 1: no group)."""

    rank: int = 0
    world: int = 1
    strategy: Literal["none", "ddp", "fsdp"] = "none"


@dataclass
class MicroBatch:
    """Packed tensors of some samples, and the flat trained-token view of them."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    pred_index: torch.Tensor
    """Flat index (into rows * width) of the hidden state that predicts each trained token."""
    target_ids: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    token_sample: torch.Tensor
    """Index (into ``sample_ids``) of the sample of each trained token."""
    last_prompt_index: torch.Tensor
    """Flat index of each sample's last prompt token (prompt features for the value baseline)."""
    sample_ids: list[int]
    n_tokens: int
    """Real (non-padding) tokens."""
    temperature: torch.Tensor | None = None
    """Per trained token: the temperature it was sampled at (float32; None: the module's own)."""
    top_k: torch.Tensor | None = None
    """Per trained token: top-k (0: none); None when no token of the batch has one."""
    top_p: torch.Tensor | None = None
    """Per trained token: top-p (float32, 1: none); None when no token of the batch has one."""
    min_p: torch.Tensor | None = None
    """Per trained token: min-p (float32, 0: none); None when no token of the batch has one."""

    def sampling_kwargs(self) -> dict[str, torch.Tensor | None]:
        """The per-token sampling tensors, as keyword arguments of the log-prob module."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with its tensors on ``device``."""
        if self.input_ids.device == device:
            return self
        tensors = {k: v.to(device, non_blocking=True) for k, v in self.__dict__.items() if hasattr(v, "to")}
        return MicroBatch(**{**self.__dict__, **tensors})


@dataclass
class TrainResult:
    """What one cycle's update did."""

    steps: list[dict[str, float]]
    loss_before: float
    loss_after: float
    tokens: int
    trained_tokens: int
    seconds: float
    tokens_per_s: float

    def summary(self) -> dict[str, float]:
        """Cycle-level metrics (the per-step list aside)."""
        last = self.steps[-1] if self.steps else {}
        return {
            "loss_before": self.loss_before,
            "loss_after": self.loss_after,
            "optimizer_steps": float(len(self.steps)),
            "tokens": float(self.tokens),
            "trained_tokens": float(self.trained_tokens),
            "train_seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            **{f"last_{k}": v for k, v in last.items() if k != "step"},
        }


# --------------------------------------------------------------------------- packing


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` packed first-fit decreasing into rows of at most ``capacity`` tokens.

    A sequence longer than ``capacity`` gets a row of its own.
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max(capacity - lengths[i], 0))
    return rows


def split_micro_batches(lengths: Sequence[int], budget: int, row_tokens: int | None = None) -> list[list[int]]:
    """Groups of indices whose micro-batch stays within ``budget`` tokens (at least one index each).

    Without ``row_tokens`` a group's size is its real tokens, taken in order. With it, a group's
    size is the packed tensor it becomes (``rows x width`` of :func:`pack_rows`, padding
    included), and the indices are taken longest first so long samples share micro-batches with
    long ones: every micro-batch is then at most ``max(budget, its longest sample)`` tokens, so
    memory is bounded by the budget (or, for a sample longer than the budget, by that sample
    alone, which is never split) whatever the batch.
    """
    if row_tokens is None:
        groups: list[list[int]] = []
        current: list[int] = []
        total = 0
        for i, n in enumerate(lengths):
            if current and total + n > budget:
                groups.append(current)
                current, total = [], 0
            current.append(i)
            total += n
        if current:
            groups.append(current)
        return groups
    groups = []
    current = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if current and packed_size([lengths[j] for j in (*current, i)], row_tokens) > budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def packed_size(lengths: Sequence[int], row_tokens: int) -> int:
    """Elements of the tensor that :func:`build_micro_batch` makes of sequences of ``lengths`` (padding included)."""
    rows = pack_rows(lengths, row_tokens)
    return len(rows) * max(sum(lengths[i] for i in row) for row in rows)


def build_micro_batch(
    samples: Sequence[StepSample], row_tokens: int, pad_id: int, default_temperature: float = 1.0
) -> MicroBatch:
    """Pack ``samples`` into rows and index their trained tokens (in sample order).

    Each trained token carries its sample's sampling: the temperature (``default_temperature``
    where none was recorded) always, top-k / top-p / min-p only when some sample truncates
    with them (so an untruncated batch costs no sort).
    """
    import torch

    rows = pack_rows([s.length for s in samples], row_tokens)
    width = max(sum(samples[i].length for i in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    start = [0] * len(samples)
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            s = samples[i]
            input_ids[r, offset : offset + s.length] = torch.tensor(s.prompt_ids + s.completion_ids)
            position_ids[r, offset : offset + s.length] = torch.arange(s.length)
            start[i] = r * width + offset
            offset += s.length
        position_ids[r, offset:] = torch.arange(width - offset)
    pred, target, behaviour, adv, owner = [], [], [], [], []
    for i, s in enumerate(samples):
        for j, trained in enumerate(s.target_mask):
            if trained:
                pred.append(start[i] + len(s.prompt_ids) + j - 1)
                target.append(s.completion_ids[j])
                behaviour.append(s.behaviour_logprobs[j])
                adv.append(s.advantage)
                owner.append(i)
    token_sample = torch.tensor(owner, dtype=torch.long)
    sampling = [s.sampling for s in samples]

    def per_token(values: list[float | int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)[token_sample]

    temps = [x.temperature if x.temperature is not None else default_temperature for x in sampling]
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        pred_index=torch.tensor(pred, dtype=torch.long),
        target_ids=torch.tensor(target, dtype=torch.long),
        behaviour_logprobs=torch.tensor(behaviour, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        token_sample=token_sample,
        last_prompt_index=torch.tensor([start[i] + len(s.prompt_ids) - 1 for i, s in enumerate(samples)]),
        sample_ids=[s.sample_id for s in samples],
        n_tokens=sum(s.length for s in samples),
        temperature=per_token(temps, torch.float32),
        top_k=per_token([x.top_k for x in sampling], torch.long) if any(x.top_k > 0 for x in sampling) else None,
        top_p=per_token([x.top_p for x in sampling], torch.float32) if any(x.top_p < 1 for x in sampling) else None,
        min_p=per_token([x.min_p for x in sampling], torch.float32) if any(x.min_p > 0 for x in sampling) else None,
    )


def micro_batches(
    samples: Sequence[StepSample], step: StepSettings, pad_id: int, device: torch.device | None = None
) -> list[MicroBatch]:
    """``samples`` split by the token budget, each split packed (and moved to ``device``)."""
    groups = split_micro_batches([s.length for s in samples], step.micro_batch_tokens, step.pack_row_tokens)
    batches = [
        build_micro_batch([samples[i] for i in g], step.pack_row_tokens, pad_id, step.sampling_temperature)
        for g in groups
    ]
    return [mb.to(device) for mb in batches] if device is not None else batches


def empty_micro_batch(pad_id: int) -> MicroBatch:
    """A one-token forward with no trained token: keeps ranks in lock step when one has no data."""
    import torch

    return MicroBatch(
        input_ids=torch.full((1, 1), pad_id, dtype=torch.long),
        position_ids=torch.zeros((1, 1), dtype=torch.long),
        pred_index=torch.zeros(0, dtype=torch.long),
        target_ids=torch.zeros(0, dtype=torch.long),
        behaviour_logprobs=torch.zeros(0),
        advantages=torch.zeros(0),
        token_sample=torch.zeros(0, dtype=torch.long),
        last_prompt_index=torch.zeros(0, dtype=torch.long),
        sample_ids=[],
        n_tokens=0,
    )


# --------------------------------------------------------------------------- model plumbing


def causal_lm(model: Any) -> Any:
    """The ``*ForCausalLM`` inside a peft model (LoRA layers already injected), or ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def truncation_mask(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which tokens vLLM keeps for sampling: a ``(tokens, vocab)`` boolean mask, without gradient.

    ``logits`` are float32 and already divided by the temperature. Mirrors vLLM 0.32's sampler
    (``Sampler.sample``: the min-p logits processor, then ``apply_top_k_top_p_pytorch``):

    1. min-p: ``p = softmax(logits)``; drop tokens with ``p < min_p * max(p)``;
    2. top-k: drop tokens whose logit is below the k-th largest (ties with it are kept);
    3. top-p: sort the survivors ascending, softmax, cumulative sum; drop those whose cumulative
       sum is ``<= 1 - top_p`` (the most likely token always stays).

    Per row: ``top_k`` 0 (or >= vocab), ``top_p`` 1 and ``min_p`` 0 leave the row alone; a
    tensor that is None applies to no row. Only the rows that truncate are sorted.
    """
    import torch

    with torch.no_grad():
        masked = logits.detach().float().clone()
        vocab = masked.shape[-1]
        if min_p is not None:
            rows = (min_p > 0).nonzero().squeeze(1)
            if rows.numel():
                sub = masked.index_select(0, rows)
                probs = sub.softmax(dim=-1)
                threshold = probs.amax(dim=-1, keepdim=True) * min_p.index_select(0, rows).float()[:, None]
                masked[rows] = sub.masked_fill(probs < threshold, -math.inf)
        if top_k is not None:
            rows = ((top_k > 0) & (top_k < vocab)).nonzero().squeeze(1)
            if rows.numel():
                sub = masked.index_select(0, rows)
                k = top_k.index_select(0, rows).long()
                kth = sub.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
                masked[rows] = sub.masked_fill(sub < kth, -math.inf)
        if top_p is not None:
            rows = (top_p < 1).nonzero().squeeze(1)
            if rows.numel():
                sub = masked.index_select(0, rows)
                ordered, order = sub.sort(dim=-1, descending=False)
                cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
                drop = cumulative <= 1 - top_p.index_select(0, rows).float()[:, None]
                drop[:, -1] = False
                masked[rows] = sub.scatter(-1, order, ordered.masked_fill(drop, -math.inf))
        return masked != -math.inf


def processed_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: torch.Tensor | float | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-prob of each ``target_ids`` token under vLLM's processed (sampled-from) distribution.

    ``logits``: ``(tokens, vocab)`` raw logits of the policy; ``temperature`` a per-token tensor
    or one number; the truncation tensors as in :func:`truncation_mask`. In float32: the logits
    divided by the temperature, the kept set chosen without gradient, then a log-softmax over
    the kept tokens, so the gradient flows through the renormalised distribution. The target is
    always in the kept set (the server sampled it; a last-bit difference at the boundary of the
    set must not make it impossible). With no truncation this is a plain log-softmax: no sort.
    """
    import torch

    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        logits = logits / temperature.to(logits.dtype)[:, None]
    elif temperature is not None and temperature != 1.0:
        logits = logits / temperature
    if top_k is not None or top_p is not None or min_p is not None:
        keep = truncation_mask(logits, top_k, top_p, min_p)
        keep[torch.arange(keep.shape[0], device=keep.device), target_ids] = True
        logits = logits.masked_fill(~keep, -math.inf)
    return logits.gather(-1, target_ids[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def make_logprob_module(model: PreTrainedModel, temperature: float = 1.0) -> torch.nn.Module:
    """A module whose forward returns the log-prob of each trained token (and prompt features).

    The log-prob is under the distribution each token was sampled from
    (:func:`processed_logprobs`): the micro-batch's per-token ``temperature``, ``top_k``,
    ``top_p`` and ``min_p`` (:meth:`MicroBatch.sampling_kwargs`). ``temperature`` here applies
    only to a call that passes no per-token temperature.
    """
    import torch

    class TokenLogprobs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.policy = model

        def forward(
            self,
            input_ids: torch.Tensor,
            position_ids: torch.Tensor,
            pred_index: torch.Tensor,
            target_ids: torch.Tensor,
            feature_index: torch.Tensor | None = None,
            temperature: torch.Tensor | None = None,
            top_k: torch.Tensor | None = None,
            top_p: torch.Tensor | None = None,
            min_p: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            lm = causal_lm(self.policy)
            backbone = getattr(lm, lm.base_model_prefix)
            hidden = backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
            flat = hidden.reshape(-1, hidden.shape[-1])
            logits = lm.get_output_embeddings()(flat.index_select(0, pred_index)).float()
            temps = temperature if temperature is not None else default_temperature
            logp = processed_logprobs(logits, target_ids, temps, top_k, top_p, min_p)
            features = flat.index_select(0, feature_index) if feature_index is not None else None
            return logp, features

    default_temperature = temperature
    return TokenLogprobs()


def wrap_for_dist(module: torch.nn.Module, dist: DistInfo) -> torch.nn.Module:
    """DDP or FSDP2 around ``module`` (``trainer.parallel.wrap_for_dist``: FSDP shards each decoder layer,
    the modules outside them as one group, then the root; a policy sharded at load stays as it is)."""
    from trainer.parallel import wrap_for_dist as wrap

    return wrap(module, dist.strategy, dist.world)


def all_reduce(values: list[float], op: Literal["sum", "min", "max"], dist: DistInfo) -> list[float]:
    """``values`` reduced over all ranks (unchanged in a single process)."""
    if dist.world == 1:
        return values
    import torch
    import torch.distributed as tdist

    tensor = torch.tensor(values, dtype=torch.float64)
    reduce_op = {"sum": tdist.ReduceOp.SUM, "min": tdist.ReduceOp.MIN, "max": tdist.ReduceOp.MAX}[op]
    tdist.all_reduce(tensor, op=reduce_op)
    return tensor.tolist()


def equalize(batches: list[MicroBatch], dist: DistInfo, pad_id: int, device: torch.device) -> list[MicroBatch]:
    """Pad with empty micro-batches so every rank runs as many forwards as the busiest one."""
    most = int(all_reduce([float(len(batches))], "max", dist)[0])
    return batches + [empty_micro_batch(pad_id).to(device) for _ in range(most - len(batches))]


def shard_plan(n_samples: int, step: StepSettings, dist: DistInfo) -> list[list[list[int]]]:
    """For each epoch, for each optimizer step, the indices of this rank's samples.

    Sample ``i`` belongs to rank ``i % world``; each epoch shuffles (seeded) and cuts the
    whole batch into ``ceil(n / mini_batch_samples)`` steps, the same count on every rank.
    """
    steps = max(math.ceil(n_samples / step.mini_batch_samples), 1)
    plan = []
    for epoch in range(step.epochs):
        order = list(range(n_samples))
        random.Random(f"flywheel-trainer:{step.seed}:{epoch}").shuffle(order)
        chunks = [order[k * n_samples // steps : (k + 1) * n_samples // steps] for k in range(steps)]
        plan.append([[i for i in chunk if i % dist.world == dist.rank] for chunk in chunks])
    return plan


def forward_batches(
    module: torch.nn.Module, batches: list[MicroBatch], with_features: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Trained-token log-probs (and prompt features) of each micro-batch, without gradients."""
    import torch

    out = []
    with torch.no_grad():
        for mb in batches:
            logp, features = module(
                mb.input_ids,
                mb.position_ids,
                mb.pred_index,
                mb.target_ids,
                mb.last_prompt_index if with_features else None,
                **mb.sampling_kwargs(),
            )
            out.append((logp, features))
    return out


def batch_loss(
    batches: list[MicroBatch], logps: list[torch.Tensor], start_logps: list[torch.Tensor], loss: LossSettings
) -> tuple[float, float]:
    """Sum of the cycle's objective and number of trained tokens over ``batches``.

    CISPO's importance weights are held at their values under the starting policy
    (``start_logps``), which makes this the objective whose gradient the first step follows,
    so "the loss went down" means the update moved the policy the way the loss asked.
    PPO's clipped surrogate is evaluated as it is. ``start_logps`` is also the KL reference.
    """
    import torch

    total, tokens = 0.0, 0.0
    for mb, logp, start in zip(batches, logps, start_logps):
        if loss.kind == "cispo":
            weight = torch.exp((start - mb.behaviour_logprobs).clamp(-20, 20)).clamp(
                loss.is_ratio_min, loss.is_ratio_max
            )
            value = -weight * mb.advantages * logp
            if loss.kl_coef > 0:
                value = value + loss.kl_coef * kl_k3(logp, start)
        else:
            value = token_loss(logp, mb.behaviour_logprobs, mb.advantages, loss, start).loss
        total += float(value.sum())
        tokens += float(mb.target_ids.numel())
    return total, tokens


def prompt_features(
    model: PreTrainedModel, samples: Sequence[StepSample], step: StepSettings, pad_id: int
) -> torch.Tensor:
    """The policy's last hidden state at the end of each sample's prompt (for the value baseline)."""
    import torch

    module = make_logprob_module(model, step.sampling_temperature)
    was_training = model.training
    model.eval()
    try:
        batches = micro_batches(samples, step, pad_id, next(model.parameters()).device)
        features = [f for _, f in forward_batches(module, batches, with_features=True)]
    finally:
        model.train(was_training)
    return torch.cat([f for f in features if f is not None], dim=0).float()


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter and buffer (names sorted), gathering sharded tensors."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def optimizer_step(
    wrapped: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    chosen: Sequence[StepSample],
    step: StepSettings,
    loss: LossSettings,
    pad_id: int,
    dist: DistInfo,
    device: torch.device,
    ref_by_sample: dict[int, torch.Tensor] | None = None,
    deadline: float | None = None,
) -> dict[str, float]:
    """One optimizer step on ``chosen`` (this rank's share): micro-batches, backward, clip, AdamW; its metrics.

    ``ref_by_sample`` holds the KL reference log-probs (needed only when ``kl_coef > 0``).
    """
    import torch

    step_started = time.perf_counter()
    batches = equalize(micro_batches(chosen, step, pad_id, device) if chosen else [], dist, pad_id, device)
    local_trained = sum(mb.target_ids.numel() for mb in batches)
    global_trained = all_reduce([float(local_trained)], "sum", dist)[0]
    scale = dist.world / max(global_trained, 1.0)
    sums = {"loss": 0.0, "ratio": 0.0, "clipped": 0.0, "kl": 0.0}
    ratio_min, ratio_max = math.inf, -math.inf
    optimizer.zero_grad(set_to_none=True)
    for k, mb in enumerate(batches):
        if deadline is not None and dist.world == 1 and time.monotonic() > deadline:
            raise CycleTimeout("time limit reached during the training loop")
        sync = k == len(batches) - 1
        with _no_sync(wrapped, dist, skip=not sync):
            logp, _ = wrapped(mb.input_ids, mb.position_ids, mb.pred_index, mb.target_ids, **mb.sampling_kwargs())
            ref = _gather_ref(ref_by_sample, mb)
            terms = token_loss(logp, mb.behaviour_logprobs, mb.advantages, loss, ref)
            (terms.loss.sum() * scale).backward()
        sums["loss"] += float(terms.loss.detach().sum())
        sums["ratio"] += float(terms.ratio.sum())
        sums["clipped"] += float(terms.clipped.sum())
        if terms.kl is not None:
            sums["kl"] += float(terms.kl.sum())
        if terms.ratio.numel():
            ratio_min = min(ratio_min, float(terms.ratio.min()))
            ratio_max = max(ratio_max, float(terms.ratio.max()))
    grad_norm = torch.nn.utils.clip_grad_norm_(params, step.grad_clip)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()

    # Metrics of this step, over all ranks.
    rewards = [s.reward for s in chosen]
    advs = [s.advantage for s in chosen]
    tokens = sum(mb.n_tokens for mb in batches)
    summed = all_reduce(
        [
            sums["loss"],
            sums["ratio"],
            sums["clipped"],
            sums["kl"],
            float(len(chosen)),
            sum(rewards),
            sum(advs),
            sum(a * a for a in advs),
            float(tokens),
        ],
        "sum",
        dist,
    )
    low = all_reduce([ratio_min, min(advs, default=math.inf)], "min", dist)
    high = all_reduce([ratio_max, max(advs, default=-math.inf)], "max", dist)
    loss_sum, ratio_sum, clipped_sum, kl_sum, n, reward_sum, adv_sum, adv_sq, tokens_all = summed
    adv_mean = adv_sum / max(n, 1.0)
    seconds = time.perf_counter() - step_started
    metrics = {
        "loss": loss_sum / max(global_trained, 1.0),
        "reward_mean": reward_sum / max(n, 1.0),
        "adv_mean": adv_mean,
        "adv_std": math.sqrt(max(adv_sq / max(n, 1.0) - adv_mean**2, 0.0)),
        "adv_min": low[1] if math.isfinite(low[1]) else 0.0,
        "adv_max": high[1] if math.isfinite(high[1]) else 0.0,
        "ratio_mean": ratio_sum / max(global_trained, 1.0),
        "ratio_min": low[0] if math.isfinite(low[0]) else 1.0,
        "ratio_max": high[0] if math.isfinite(high[0]) else 1.0,
        "clip_frac": clipped_sum / max(global_trained, 1.0),
        "kl": kl_sum / max(global_trained, 1.0),
        "grad_norm": float(grad_norm),
        "samples": n,
        "tokens": tokens_all,
        "trained_tokens": global_trained,
        "tokens_per_s": tokens_all / max(seconds, 1e-9),
        "lr": step.learning_rate,
        "seconds": seconds,
    }
    return metrics


# --------------------------------------------------------------------------- the step


def train_on_batch(
    model: PreTrainedModel,
    samples: Sequence[StepSample],
    step: StepSettings,
    loss: LossSettings,
    pad_id: int,
    dist: DistInfo | None = None,
    deadline: float | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> TrainResult:
    """Train ``model`` in place on ``samples``; returns per-step metrics and the loss before and after.

    ``deadline`` (a ``time.monotonic()`` value, single process only) raises
    :class:`CycleTimeout` between micro-batches once passed.
    """
    import torch

    dist = dist or DistInfo()
    started = time.perf_counter()
    torch.manual_seed(step.seed)
    device = next(model.parameters()).device

    # The plan of optimizer steps (this rank's share of each), the log-prob module, AdamW.
    plan = shard_plan(len(samples), step, dist)
    module = make_logprob_module(model, step.sampling_temperature)
    wrapped = wrap_for_dist(module, dist)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=step.learning_rate, weight_decay=step.weight_decay)

    # Reference pass with the starting weights (the parent): the KL reference and the loss before.
    mine = [samples[i] for i in range(len(samples)) if i % dist.world == dist.rank]
    eval_batches = equalize(micro_batches(mine, step, pad_id, device) if mine else [], dist, pad_id, device)
    model.eval()
    start_logps = [logp for logp, _ in forward_batches(wrapped, eval_batches)]
    ref_by_sample = _per_sample(eval_batches, start_logps) if loss.kl_coef > 0 else None
    before_sum, before_tokens = all_reduce(list(batch_loss(eval_batches, start_logps, start_logps, loss)), "sum", dist)

    # Optimizer steps.
    model.train()
    step_metrics: list[dict[str, float]] = []
    total_tokens = total_trained = 0
    n_steps = sum(len(epoch) for epoch in plan)
    progress = _progress(n_steps, step.show_progress and dist.rank == 0)
    step_index = 0
    for epoch in plan:
        for chunk in epoch:
            metrics = optimizer_step(
                wrapped,
                optimizer,
                params,
                [samples[i] for i in chunk],
                step,
                loss,
                pad_id,
                dist,
                device,
                ref_by_sample,
                deadline,
            )
            metrics = {"step": float(step_index), **metrics}
            global_trained, tokens_all = metrics["trained_tokens"], metrics["tokens"]
            step_metrics.append(metrics)
            total_tokens += int(tokens_all)
            total_trained += int(global_trained)
            step_index += 1
            progress.update(metrics)
            if on_step is not None and dist.rank == 0:
                on_step(metrics)
    progress.close()

    # The same loss on the whole batch with the final weights.
    model.eval()
    end_logps = [logp for logp, _ in forward_batches(wrapped, eval_batches)]
    after_sum, after_tokens = all_reduce(list(batch_loss(eval_batches, end_logps, start_logps, loss)), "sum", dist)
    seconds = time.perf_counter() - started
    train_seconds = sum(m["seconds"] for m in step_metrics)
    return TrainResult(
        steps=step_metrics,
        loss_before=before_sum / max(before_tokens, 1.0),
        loss_after=after_sum / max(after_tokens, 1.0),
        tokens=total_tokens,
        trained_tokens=total_trained,
        seconds=seconds,
        tokens_per_s=total_tokens / max(train_seconds, 1e-9),
    )


def _per_sample(batches: list[MicroBatch], logps: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Trained-token log-probs keyed by sample id."""
    out = {}
    for mb, logp in zip(batches, logps):
        for k, sample_id in enumerate(mb.sample_ids):
            out[sample_id] = logp[mb.token_sample == k]
    return out


def _gather_ref(ref_by_sample: dict[int, torch.Tensor] | None, mb: MicroBatch) -> torch.Tensor | None:
    """The reference log-probs of ``mb``'s trained tokens, in its token order (None without a reference)."""
    import torch

    if ref_by_sample is None:
        return None
    if not mb.sample_ids:
        return torch.zeros(0, device=mb.input_ids.device)
    return torch.cat([ref_by_sample[sid] for sid in mb.sample_ids])


def _no_sync(wrapped: torch.nn.Module, dist: DistInfo, skip: bool) -> Any:
    """DDP's ``no_sync`` for all but the last micro-batch of a step; a null context otherwise."""
    if skip and dist.strategy == "ddp" and dist.world > 1:
        return wrapped.no_sync()
    return nullcontext()


class _Progress:
    """A tqdm bar over optimizer steps showing loss, reward and tokens/s (or nothing)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            self.bar = tqdm(total=total, desc="train", unit="step", leave=False)

    def update(self, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{metrics['loss']:.4f}",
                reward=f"{metrics['reward_mean']:.3f}",
                tok_s=f"{metrics['tokens_per_s']:.0f}",
            )
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress(total: int, enabled: bool) -> _Progress:
    return _Progress(total, enabled)
