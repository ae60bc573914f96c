"""Group-relative advantages with TRL 1.16's ``GRPOTrainer`` semantics.

The generation batch holds ``num_generations`` consecutive completions of each prompt
(``[p0 g0, p0 g1, ..., p1 g0, ...]``). A reward is ``nan`` when the completion is unscorable
(every reward function returned ``None``); it is left out of its group's mean and std, and its
advantage is 0. For ``scale``:

- ``"group"``: ``(r - mean_group) / (nanstd_group + 1e-4)``;
- ``"batch"``: ``(r - mean_group) / (nanstd_batch + 1e-4)`` (the group mean is still the baseline);
- ``"none"``: ``r - mean_group`` (Dr. GRPO's unscaled advantages).

``nanstd`` is the NaN-ignoring standard deviation with Bessel's correction (``nan`` for fewer than
two values, so a group with a single scorable completion gets advantage 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SCALES = ("group", "batch", "none")
STD_EPS = 1e-4


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction; NaN where fewer than 2 values."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = (variance * correction).sqrt()
    if dim is None:
        return std.reshape(()) if not keepdim else std
    return std if keepdim else std.squeeze(dim)


def weighted_rewards(rewards_per_func: torch.Tensor, weights: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """``[N]`` weighted sum of ``[N, F]`` per-function rewards (NaN entries skipped, TRL's ``nansum``);
    a row where every function returned NaN stays NaN (unscorable)."""
    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func must be [N, F], got shape {tuple(rewards_per_func.shape)}")
    w = torch.as_tensor(weights, dtype=torch.float32, device=rewards_per_func.device)
    if w.shape != (rewards_per_func.shape[1],):
        raise ValueError(
            f"got {w.numel()} reward weights for {rewards_per_func.shape[1]} reward functions; "
            "give one weight per function (rl.reward_weights)"
        )
    total = (rewards_per_func.float() * w.unsqueeze(0)).nansum(dim=1)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    return torch.where(unscorable, torch.full_like(total, float("nan")), total)


def group_advantages(
    rewards: torch.Tensor | Sequence[float | None], num_generations: int, scale: str = "group"
) -> torch.Tensor:
    """fp32 ``[N]`` advantages of ``N = prompts * num_generations`` rewards (``None``/NaN: unscorable).

    Raises ``ValueError`` for an unknown ``scale``, ``num_generations < 1``, or a reward count that is
    not a multiple of ``num_generations``.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES} (rl.scale_rewards), got {scale!r}")
    if isinstance(rewards, torch.Tensor):
        r = rewards.float().flatten()
    else:
        r = torch.tensor([float("nan") if x is None else float(x) for x in rewards], dtype=torch.float32)
    g = int(num_generations)
    if g < 1 or r.numel() == 0 or r.numel() % g:
        raise ValueError(
            f"got {r.numel()} rewards for num_generations={num_generations}: need a positive multiple "
            "(each prompt's completions side by side)"
        )
    grouped = r.view(-1, g)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(g)
    advantages = r - mean
    if scale == "group":
        std = nanstd(grouped, dim=1).repeat_interleave(g) if g > 1 else torch.zeros_like(r)
        advantages = advantages / (std + STD_EPS)
    elif scale == "batch":
        std = nanstd(r).expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0)
