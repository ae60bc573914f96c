"""The GRPO policy loss with TRL 1.16's definitions (``GRPOTrainer._compute_loss``).

Per token, with ``ratio = exp(logprobs - old_logprobs)`` (``importance_sampling_level="token"``)
or ``exp(mean over the completion of that difference)`` per sequence (``"sequence"``, GSPO)::

    clipped  = clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    ratio    = min(ratio, delta)                      # only when delta is set (INTELLECT-2)
    loss_t   = -min(ratio * A, clipped * A) + beta * kl_t
    kl_t     = exp(ref - logprobs) - (ref - logprobs) - 1     # the k3 estimator, when beta != 0

and the per-token losses are reduced over ``mask`` by ``loss_type``:

- ``grpo``: mean over each completion's tokens, then mean over completions;
- ``bnpo``: mean over the batch's completion tokens;
- ``dr_grpo``: sum over the batch / (completions * ``max_completion_length``);
- ``dapo`` (TRL's default): sum over the batch / ``num_items_in_batch``, the completion tokens of
  the whole generation batch (default: this batch's), so micro-batches of one generation batch
  add up to its loss.

``old_logprobs=None`` means on-policy (``logprobs.detach()``: ratio 1, gradient of the plain
policy gradient). All math in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IS_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class GRPOTerms:
    """The loss and what TRL logs beside it (detached fp32 scalars, means over ``mask``)."""

    loss: torch.Tensor
    kl: torch.Tensor  # mean k3 KL to the reference (0 when beta == 0)
    clip_low: torch.Tensor  # fraction of tokens with ratio < 1 - epsilon_low and A < 0
    clip_high: torch.Tensor  # fraction of tokens with ratio > 1 + epsilon_high and A > 0

    @property
    def clip_fraction(self) -> torch.Tensor:
        return self.clip_low + self.clip_high


def check_grpo_options(
    loss_type: str, epsilon_low: float, epsilon_high: float, delta: float | None, beta: float,
    importance_sampling_level: str, max_completion_length: int | None,
) -> None:  # fmt: skip
    """``ValueError`` naming the option for an unknown ``loss_type``/level or an out-of-range number."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got {importance_sampling_level!r}")
    for name, value in (("epsilon_low", epsilon_low), ("epsilon_high", epsilon_high), ("beta", beta)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if delta is not None and (not math.isfinite(delta) or delta <= 1.0):
        raise ValueError(f"delta (the two-sided clip's upper bound on the ratio) must be > 1, got {delta!r}")
    if max_completion_length is not None and max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length!r}")


def grpo_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
) -> GRPOTerms:
    """:func:`grpo_loss` and its metrics; see the module docstring for the formulas."""
    check_grpo_options(
        loss_type, epsilon_low, epsilon_high, delta, beta, importance_sampling_level, max_completion_length
    )
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs must be [B, T] with mask of the same shape, got {tuple(logprobs.shape)} and {tuple(mask.shape)}"
        )
    if old_logprobs is not None and old_logprobs.shape != logprobs.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)} must match logprobs {tuple(logprobs.shape)}")
    if beta != 0.0 and (ref_logprobs is None or ref_logprobs.shape != logprobs.shape):
        got = None if ref_logprobs is None else tuple(ref_logprobs.shape)
        raise ValueError(f"beta={beta} needs ref_logprobs of shape {tuple(logprobs.shape)}, got {got}")
    lp = logprobs.float()
    m = mask.to(lp.device).float()
    adv = advantages.to(lp.device).float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    old = lp.detach() if old_logprobs is None else old_logprobs.to(lp.device).float()
    log_ratio = lp - old
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    ratio = coef_1 if delta is None else torch.clamp(coef_1, max=delta)
    per_token = -torch.min(ratio * adv, coef_2 * adv)
    kl = torch.zeros((), device=lp.device)
    if beta != 0.0:
        assert ref_logprobs is not None
        diff = ref_logprobs.to(lp.device).float() - lp
        per_token_kl = torch.exp(diff) - diff - 1
        per_token = per_token + beta * per_token_kl
        kl = _masked_mean(per_token_kl.detach(), m)
    loss = _reduce(per_token, m, loss_type, max_completion_length, num_items_in_batch)
    low = ((coef_1 < 1 - epsilon_low) & (adv < 0)).float().detach()
    high = ((coef_1 > 1 + epsilon_high) & (adv > 0)).float().detach()
    return GRPOTerms(loss=loss, kl=kl, clip_low=_masked_mean(low, m), clip_high=_masked_mean(high, m))


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """The GRPO loss (fp32 scalar) of ``[B, T]`` completion-token ``logprobs`` under the current policy.

    ``old_logprobs``: the sampling policy's (``None``: on-policy); ``advantages``: ``[B]`` or ``[B, T]``;
    ``mask``: ``[B, T]``, non-zero on completion tokens; ``ref_logprobs``: the KL reference's, needed
    when ``beta != 0``; ``max_completion_length`` (``dr_grpo``; default ``T``); ``num_items_in_batch``
    (``dapo``; default ``mask.sum()``). Raises ``ValueError`` naming a bad option or shape.
    """
    return grpo_terms(
        logprobs, old_logprobs, advantages, mask, loss_type=loss_type, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, delta=delta, beta=beta, ref_logprobs=ref_logprobs,
        importance_sampling_level=importance_sampling_level, max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
    ).loss  # fmt: skip


def _masked_mean(values: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    values = values.expand_as(m) if values.shape != m.shape else values
    return (values * m).sum() / m.sum().clamp(min=1.0)


def _reduce(
    per_token: torch.Tensor,
    m: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None,
    num_items_in_batch: torch.Tensor | float | None,
) -> torch.Tensor:
    masked = per_token * m
    if loss_type == "grpo":
        return (masked.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        length = m.shape[1] if max_completion_length is None else max_completion_length
        return masked.sum() / (masked.shape[0] * length)
    count = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=m.device)
    return masked.sum() / count.float().clamp(min=1.0)
