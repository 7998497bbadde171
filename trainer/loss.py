"""The policy-gradient loss over trained tokens: CISPO (default) or PPO-clip, plus optional KL.

Every tensor here is flat: one entry per *trained* token (a model-generated completion
token of a trainable role), already selected by the step. The importance ratio is
``r = exp(logp - behaviour_logp)``: the current policy against the logprobs that serving
recorded when it sampled the token.

- ``cispo`` (MiniMax-M1): ``-sg(clip(r, min, max)) * A * logp``. The truncated ratio is a
  stop-gradient weight, so every token keeps a gradient (PPO would zero it once clipped);
  only the size of its step is bounded.
- ``ppo``: ``-min(r * A, clip(r, 1 - low, 1 + high) * A)``.
- KL (optional, to the parent policy): the k3 estimator
  ``exp(ref - logp) - (ref - logp) - 1``, always >= 0, weighted by ``kl_coef``.

The caller sums the per-token loss and divides by the number of trained tokens of the
whole optimizer step (across micro-batches and ranks), so gradient accumulation and
data parallelism give the same update as one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flywheel.core.settings.trainer import LossSettings

# torch is imported inside the functions that use it: trainer.cycle imports this module in
# processes that never train (``flywheel-trainer check``).

if TYPE_CHECKING:
    import torch

LOG_RATIO_CLAMP = 20.0
"""|logp - behaviour_logp| is clamped before exp so a wild token cannot overflow."""


@dataclass
class TokenLoss:
    """Per-token loss (with gradient) and detached per-token diagnostics."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    """True where the clip or truncation changed the token's contribution."""
    kl: torch.Tensor | None


def token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    config: LossSettings,
    ref_logp: torch.Tensor | None = None,
) -> TokenLoss:
    """The loss of each trained token (see the module docstring)."""
    import torch

    log_ratio = (logp - behaviour_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    if config.kind == "cispo":
        weight = ratio.detach().clamp(min=config.is_ratio_min, max=config.is_ratio_max)
        loss = -weight * advantages * logp
        clipped = (ratio.detach() > config.is_ratio_max) | (ratio.detach() < config.is_ratio_min)
    elif config.kind == "ppo":
        low, high = 1.0 - config.ppo_clip_low, 1.0 + config.ppo_clip_high
        unclipped = ratio * advantages
        clipped_term = ratio.clamp(low, high) * advantages
        loss = -torch.minimum(unclipped, clipped_term)
        clipped = (clipped_term < unclipped).detach()
    else:
        raise ValueError(f"unknown loss {config.kind!r}")
    kl = None
    if config.kl_coef > 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference logprobs")
        delta = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = torch.exp(delta) - delta - 1.0
        loss = loss + config.kl_coef * kl
        kl = kl.detach()
    return TokenLoss(loss=loss, ratio=ratio.detach(), clipped=clipped, kl=kl)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of KL(policy || reference) per token, for metrics."""
    import torch

    delta = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(delta) - delta - 1.0
