"""A round's accumulators and the micro-batch helpers of the inner step (split out of :mod:`.loop`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco_serverless.loss import LossComponents

COMPONENTS = ("total", "lm_ce", "sdpo_jsd", "trace_replay_dpo")


@dataclass
class Segment:
    """Accumulators for the inner steps of one exchange round, kept on the device: the loss
    components and token counts are read once, when the round's metrics are written."""

    start: float = field(default_factory=time.monotonic)
    steps: int = 0
    sums: torch.Tensor | None = None  # [4] fp32: COMPONENTS summed over the round's steps
    token_sum: torch.Tensor | None = None  # attention-mask tokens of the round's batches

    def add(self, comps: LossComponents, tokens: torch.Tensor) -> None:
        values = torch.stack([getattr(comps, name).detach().float() for name in COMPONENTS])
        self.sums = values if self.sums is None else self.sums + values
        self.token_sum = tokens if self.token_sum is None else self.token_sum + tokens
        self.steps += 1

    def read(self) -> tuple[dict[str, float], int]:
        """``(component means, tokens)`` of the round: one read of the device accumulators."""
        if self.sums is None or self.token_sum is None:
            return {}, 0
        *sums, tokens = torch.cat([self.sums.double(), self.token_sum.double().reshape(1)]).tolist()
        return {name: v / self.steps for name, v in zip(COMPONENTS, sums)}, int(tokens)


def micro_batches(batch: Mapping[str, Any], size: int) -> list[dict[str, Any]]:
    """``batch`` cut into consecutive row slices of ``size`` rows (views, no copies); keys whose
    tensor is not ``[B, ...]`` (an absent, empty channel) are passed to every slice unchanged."""
    rows = int(batch["input_ids"].shape[0])
    if size >= rows:
        return [dict(batch)]

    def cut(value: Any, start: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
            return value[start : start + size]
        return value

    return [{k: cut(v, start) for k, v in batch.items()} for start in range(0, rows, size)]


def add_components(a: LossComponents, b: LossComponents) -> LossComponents:
    """Component-wise sum (the micro-batches' shares of one batch's loss); the RL channel's metrics
    add up too (each micro-batch's share) and its per-token log-probs are concatenated by row."""
    total, lm_ce, sdpo, replay = (getattr(a, name) + getattr(b, name) for name in COMPONENTS)
    if a.rl is None or b.rl is None:
        return LossComponents(total, lm_ce, sdpo, replay)
    lp = None
    if a.rl_token_logprobs is not None and b.rl_token_logprobs is not None:
        lp = torch.cat([a.rl_token_logprobs, b.rl_token_logprobs])
    stats = {k: a.rl_stats[k] + b.rl_stats[k] for k in a.rl_stats if k in b.rl_stats}
    return LossComponents(total, lm_ce, sdpo, replay, rl=a.rl + b.rl, rl_stats=stats, rl_token_logprobs=lp)
