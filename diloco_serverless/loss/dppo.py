"""PRIME-RL's DPPO-clip loss (``prime_rl.trainer.rl.loss.default_loss_fn``).

Per token, with ``r = exp(trainer - inference)`` and ``d = exp(trainer) - exp(inference)`` (the
move in probability space)::

    masked  = d > dppo_mask_high  if A > 0  else  d < -dppo_mask_low   # trust region by A's sign
    keep    = loss_mask & ~masked
    loss_t  = -(keep * adv_tau * A * r) + kl_tau * loss_mask * (trainer - inference) ** 2

summed over tokens (PRIME-RL divides the sum by the global count of loss tokens afterwards; pass
it as ``token_count`` to get that mean). A masked token still pays the squared log-ratio KL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DPPOTerms:
    """The loss and PRIME-RL's metrics (detached fp32 scalars, means over ``loss_mask``)."""

    loss: torch.Tensor
    is_masked: torch.Tensor  # fraction of loss tokens outside the trust region
    mismatch_kl: torch.Tensor  # mean ``r - log r - 1`` over loss tokens


def check_dppo_options(dppo_mask_high: float, dppo_mask_low: float, adv_tau: float, kl_tau: float) -> None:
    """``ValueError`` naming the first option that is not a finite number >= 0."""
    for name, value in (
        ("dppo_mask_high", dppo_mask_high), ("dppo_mask_low", dppo_mask_low),
        ("adv_tau", adv_tau), ("kl_tau", kl_tau),
    ):  # fmt: skip
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def dppo_terms(
    trainer_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    dppo_mask_high: float = 0.2,
    dppo_mask_low: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
    token_count: torch.Tensor | float | None = None,
) -> DPPOTerms:
    """:func:`dppo_loss` and its metrics."""
    check_dppo_options(dppo_mask_high, dppo_mask_low, adv_tau, kl_tau)
    if inference_logprobs.shape != trainer_logprobs.shape or loss_mask.shape != trainer_logprobs.shape:
        raise ValueError(
            f"trainer_logprobs {tuple(trainer_logprobs.shape)}, inference_logprobs "
            f"{tuple(inference_logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} must have one shape"
        )
    lp = trainer_logprobs.float()
    inf = inference_logprobs.to(lp.device).float()
    mask = loss_mask.to(lp.device) != 0
    adv = advantages.to(lp.device).float()
    if adv.dim() == lp.dim() - 1:
        adv = adv.unsqueeze(-1)
    adv = adv.expand_as(lp)
    log_ratio = lp - inf
    ratio = torch.exp(log_ratio)
    probs_diff = torch.exp(lp) - torch.exp(inf)
    masked = torch.where(adv > 0, probs_diff > dppo_mask_high, probs_diff < -dppo_mask_low)
    keep = mask & ~masked
    pg = keep * (adv_tau * adv) * ratio
    kl = mask * log_ratio**2
    loss = (-pg + kl_tau * kl).sum()
    if token_count is not None:
        loss = loss / token_count
    n = mask.sum().clamp(min=1)
    mismatch = (ratio - log_ratio - 1).detach()
    return DPPOTerms(
        loss=loss,
        is_masked=(mask & masked).sum().float() / n,
        mismatch_kl=torch.where(mask, mismatch, 0.0).sum() / n,
    )


def dppo_loss(
    trainer_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    dppo_mask_high: float = 0.2,
    dppo_mask_low: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
    token_count: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """The DPPO-clip loss (fp32 scalar), summed over tokens, divided by ``token_count`` when given.

    ``trainer_logprobs``: the current policy's per-token log-probs (``[T]`` or ``[B, T]``);
    ``inference_logprobs``: the sampling policy's; ``advantages``: per token, or per row (``[B]``);
    ``loss_mask``: non-zero on trained tokens. Raises ``ValueError`` for mismatched shapes or an
    option that is negative or non-finite.
    """
    return dppo_terms(
        trainer_logprobs, inference_logprobs, advantages, loss_mask, dppo_mask_high=dppo_mask_high,
        dppo_mask_low=dppo_mask_low, adv_tau=adv_tau, kl_tau=kl_tau, token_count=token_count,
    ).loss  # fmt: skip
