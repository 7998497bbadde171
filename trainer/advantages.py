"""Advantages: group-relative where a group key has several episodes, a baseline elsewhere.

The unit of comparison is the *episode* (one session): a session may contribute several
completions (turns), and counting each of them as an independent sample would give
long episodes more weight in their group's baseline. Each completion keeps its own
reward; its baseline comes from the other episodes of its group (RLOO) or from the
group mean and standard deviation (GRPO).

Completions without such a group are compared against a baseline:

- ``running_mean``: a running mean of rewards per task kind, carried across cycles in the
  checkpoint metrics (:class:`BaselineState`). A kind seen for the first time uses the
  leave-one-out mean of the other episodes of that kind in this batch.
- ``value``: a learned value, ridge regression from prompt features (the parent policy's
  last hidden state at the end of the prompt) to reward, evaluated leave-one-out so a
  sample's own reward never enters its baseline.

``norm="batch"`` (``trainer.advantages.norm``) then divides every advantage by the batch standard deviation.
Pure Python plus torch for the ridge solve; no database, no model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from flywheel.core.settings.trainer import AdvantageSettings

# torch is imported inside the functions that use it: trainer.cycle imports this module in
# processes that never train (``flywheel-trainer check``).

if TYPE_CHECKING:
    import torch

EPS = 1e-6
DEFAULT_KIND = "default"


@dataclass(frozen=True)
class AdvInput:
    """What the estimator needs of one completion."""

    episode: str
    """Episode identity, e.g. ``project/session_id``."""
    group_key: str | None
    kind: str | None
    """Task kind for the running-mean baseline (the sample's ``task``)."""
    reward: float


@dataclass
class BaselineState:
    """Running mean of rewards per task kind, carried from cycle to cycle."""

    means: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, stored in the checkpoint metrics."""
        return {"means": dict(self.means), "counts": dict(self.counts)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> BaselineState:
        """Inverse of :meth:`to_dict`; ``None`` or ``{}`` gives an empty state."""
        data = data or {}
        return cls(
            means={str(k): float(v) for k, v in data.get("means", {}).items()},
            counts={str(k): int(v) for k, v in data.get("counts", {}).items()},
        )


@dataclass
class AdvantageResult:
    """Advantages in input order, which estimator gave each, and the updated baseline state."""

    advantages: list[float]
    source: list[Literal["group", "baseline"]]
    state: BaselineState
    stats: dict[str, float]


def compute_advantages(
    samples: Sequence[AdvInput],
    config: AdvantageSettings,
    state: BaselineState | None = None,
    features: torch.Tensor | None = None,
) -> AdvantageResult:
    """Advantages of ``samples`` (see the module docstring).

    ``features`` (one row per sample) is required when ``config.baseline == "value"``
    and some sample falls back to the baseline.
    """
    state = state or BaselineState()
    if config.group not in ("rloo", "grpo"):
        raise ValueError(f"unknown trainer.advantages.group {config.group!r}")
    if config.baseline not in ("running_mean", "value"):
        raise ValueError(f"unknown trainer.advantages.baseline {config.baseline!r}")
    if config.norm not in ("none", "batch"):
        raise ValueError(f"unknown trainer.advantages.norm {config.norm!r}")
    advantages = [0.0] * len(samples)
    source: list[Literal["group", "baseline"]] = ["baseline"] * len(samples)
    episode_reward = episode_rewards(samples)
    grouped, singles = split_by_group(samples)
    for members in grouped.values():
        for i, adv in group_relative(samples, members, episode_reward, config.group).items():
            advantages[i] = adv
            source[i] = "group"
    if singles:
        if config.baseline == "value":
            if features is None:
                raise ValueError("trainer.advantages.baseline='value' needs prompt features")
            baselines = value_baseline(features[singles], [samples[i].reward for i in singles], config.value_l2)
        else:
            baselines = running_mean_baseline(samples, singles, episode_reward, state)
        for i, base in zip(singles, baselines):
            advantages[i] = samples[i].reward - base
    if config.norm == "batch":
        advantages = scale_by_std(advantages)
    new_state = update_running_mean(state, samples, episode_reward, config.momentum)
    return AdvantageResult(advantages, source, new_state, advantage_stats(advantages, source, grouped))


def episode_rewards(samples: Sequence[AdvInput]) -> dict[str, float]:
    """Mean reward of each episode's completions."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for s in samples:
        sums[s.episode] += s.reward
        counts[s.episode] += 1
    return {e: sums[e] / counts[e] for e in sums}


def split_by_group(samples: Sequence[AdvInput]) -> tuple[dict[str, list[int]], list[int]]:
    """Indices of samples in groups with >= 2 episodes, and the indices of all others."""
    members: dict[str, list[int]] = defaultdict(list)
    episodes: dict[str, set[str]] = defaultdict(set)
    for i, s in enumerate(samples):
        if s.group_key is not None:
            members[s.group_key].append(i)
            episodes[s.group_key].add(s.episode)
    grouped = {g: idx for g, idx in members.items() if len(episodes[g]) >= 2}
    in_group = {i for idx in grouped.values() for i in idx}
    return grouped, [i for i in range(len(samples)) if i not in in_group]


def group_relative(
    samples: Sequence[AdvInput],
    members: list[int],
    episode_reward: dict[str, float],
    estimator: Literal["rloo", "grpo"],
) -> dict[int, float]:
    """Advantage of each member: its reward against the other episodes (RLOO) or the group (GRPO)."""
    episodes = sorted({samples[i].episode for i in members})
    rewards = [episode_reward[e] for e in episodes]
    n, total = len(rewards), sum(rewards)
    out: dict[int, float] = {}
    if estimator == "rloo":
        for i in members:
            others = (total - episode_reward[samples[i].episode]) / (n - 1)
            out[i] = samples[i].reward - others
        return out
    mean = total / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    for i in members:
        out[i] = (samples[i].reward - mean) / (std + EPS)
    return out


def running_mean_baseline(
    samples: Sequence[AdvInput], singles: list[int], episode_reward: dict[str, float], state: BaselineState
) -> list[float]:
    """The running mean of each sample's kind; a new kind uses the leave-one-out batch mean of its episodes."""
    by_kind: dict[str, dict[str, float]] = defaultdict(dict)
    for i in singles:
        by_kind[kind_of(samples[i])][samples[i].episode] = episode_reward[samples[i].episode]
    out = []
    for i in singles:
        kind = kind_of(samples[i])
        if kind in state.means:
            out.append(state.means[kind])
            continue
        others = [r for e, r in by_kind[kind].items() if e != samples[i].episode]
        out.append(sum(others) / len(others) if others else 0.0)
    return out


def value_baseline(features: torch.Tensor, rewards: Sequence[float], l2: float) -> list[float]:
    """Leave-one-out predictions of a ridge regression (with bias) from ``features`` to ``rewards``.

    Closed form: with the hat matrix H = X (XᵀX + λI)⁻¹ Xᵀ, the prediction for row i
    fitted without row i is y_i - (y_i - ŷ_i) / (1 - H_ii). The bias is not penalised.
    """
    import torch

    n = features.shape[0]
    if n < 2:
        return [0.0] * n
    x = features.detach().to(torch.float64)
    x = (x - x.mean(0)) / (x.std(0, unbiased=False) + EPS)
    x = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], dim=1)
    y = torch.tensor(list(rewards), dtype=torch.float64)
    penalty = torch.eye(x.shape[1], dtype=torch.float64) * l2
    penalty[-1, -1] = 0.0
    hat = x @ torch.linalg.solve(x.T @ x + penalty, x.T)
    fitted = hat @ y
    leverage = torch.diagonal(hat).clamp(max=1.0 - 1e-9)
    loo = y - (y - fitted) / (1.0 - leverage)
    return [float(v) for v in loo]


def scale_by_std(values: list[float]) -> list[float]:
    """``values`` divided by their (population) standard deviation; unchanged when it is ~0."""
    if len(values) < 2:
        return list(values)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    if std < EPS:
        return list(values)
    return [v / std for v in values]


def update_running_mean(
    state: BaselineState, samples: Sequence[AdvInput], episode_reward: dict[str, float], momentum: float
) -> BaselineState:
    """A new state with this batch's mean episode reward per kind folded in (exponential moving average)."""
    per_kind: dict[str, dict[str, float]] = defaultdict(dict)
    for s in samples:
        per_kind[kind_of(s)][s.episode] = episode_reward[s.episode]
    means, counts = dict(state.means), dict(state.counts)
    for kind, rewards in per_kind.items():
        batch_mean = sum(rewards.values()) / len(rewards)
        means[kind] = momentum * means[kind] + (1 - momentum) * batch_mean if kind in means else batch_mean
        counts[kind] = counts.get(kind, 0) + len(rewards)
    return BaselineState(means, counts)


def advantage_stats(
    advantages: list[float], source: list[Literal["group", "baseline"]], grouped: dict[str, list[int]]
) -> dict[str, float]:
    """Mean, std, min, max of the advantages, the share from groups and the number of groups."""
    n = len(advantages)
    if n == 0:
        return {"adv_mean": 0.0, "adv_std": 0.0, "adv_min": 0.0, "adv_max": 0.0, "group_fraction": 0.0, "groups": 0.0}
    mean = sum(advantages) / n
    return {
        "adv_mean": mean,
        "adv_std": math.sqrt(sum((a - mean) ** 2 for a in advantages) / n),
        "adv_min": min(advantages),
        "adv_max": max(advantages),
        "group_fraction": sum(s == "group" for s in source) / n,
        "groups": float(len(grouped)),
    }


def kind_of(sample: AdvInput) -> str:
    """The running-mean key of a sample."""
    return sample.kind or DEFAULT_KIND
