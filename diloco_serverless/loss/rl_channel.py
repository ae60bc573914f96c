"""Channel 1 as reinforcement learning: the GRPO or DPPO loss of a batch of rollouts.

A rollout batch is an ordinary ``compose_loss`` batch (``input_ids`` = left-padded prompt followed
by the completion, ``attention_mask``, ``response_mask`` = the completion tokens up to and including
EOS) plus:

- ``advantages``: fp32 ``[B]`` (or ``[B, T]``), from :func:`~diloco_serverless.loss.group_advantages`;
- ``old_logprobs`` (optional): fp32 ``[B, T]``, the log-prob of token ``t`` under the policy that
  sampled it, aligned with ``input_ids`` (0 outside the completion). Absent means on-policy
  (TRL's ``old_per_token_logps = per_token_logps.detach()``); DPPO needs it;
- ``ref_logprobs`` (when ``beta > 0``): fp32 ``[B, T]``, the KL reference's, aligned the same way;
- ``num_items_in_batch`` (optional): the completion tokens of the whole generation batch, the
  ``dapo`` / DPPO normaliser when the batch is one micro-batch of it;
- ``rl_micro_batches`` (optional int): the number of micro-batches the generation batch is cut into;
  the ``grpo`` / ``bnpo`` / ``dr_grpo`` loss of each is divided by it (TRL's gradient-accumulation
  normaliser), so the micro-batches' losses add up to the batch's.

The policy's log-probs are those of ``logits / temperature`` (TRL divides by the sampling
temperature too), computed in fp32 from the student forward pass ``compose_loss`` already ran.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diloco_serverless.loss._batch import SequenceInputs, is_absent, require_tensor
from diloco_serverless.loss.dppo import check_dppo_options, dppo_terms
from diloco_serverless.loss.grpo import check_grpo_options, grpo_terms
from diloco_serverless.loss.logprobs import fp32_math

CHANNEL1_KINDS = ("lm", "grpo", "dppo")
ROLLOUT_KEY = "advantages"  # a batch carries rollouts when it has this key


@dataclass(frozen=True)
class RLLossSettings:
    """The options of the RL channel; names follow TRL's ``GRPOConfig`` and PRIME-RL's loss config."""

    kind: str = "grpo"  # "grpo" or "dppo"
    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None
    temperature: float = 1.0
    dppo_mask_high: float = 0.2
    dppo_mask_low: float = 0.2
    adv_tau: float = 1.0
    kl_tau: float = 1e-3

    def __post_init__(self) -> None:
        if self.kind not in ("grpo", "dppo"):
            raise ValueError(f"the RL channel's kind must be 'grpo' or 'dppo', got {self.kind!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        check_grpo_options(
            self.loss_type, self.epsilon_low, self.epsilon_high, self.delta, self.beta,
            self.importance_sampling_level, self.max_completion_length,
        )  # fmt: skip
        check_dppo_options(self.dppo_mask_high, self.dppo_mask_low, self.adv_tau, self.kl_tau)


def carries_rollouts(batch: Mapping[str, Any]) -> bool:
    """True when ``batch`` holds rollouts (an ``advantages`` tensor)."""
    return not is_absent(batch, ROLLOUT_KEY)


@dataclass(frozen=True)
class RLChannel:
    """The channel's loss (differentiable), the completion NLL (detached, reported as ``lm_ce``),
    detached scalar metrics (``rl_entropy``, ``rl_kl``, ``rl_clip_fraction``) and the policy's
    detached ``[B, T]`` per-token log-probs aligned with ``input_ids`` (the ``old_logprobs`` of a
    later iteration over the same rollouts)."""

    loss: torch.Tensor
    nll: torch.Tensor
    stats: dict[str, torch.Tensor]
    token_logprobs: torch.Tensor


def _aligned(batch: Mapping[str, Any], key: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
    value = require_tensor(batch, key, "by the RL channel")
    if value.shape[0] != shape[0] or value.shape[1] != shape[1] + 1:
        raise ValueError(
            f"batch key {key!r} has shape {tuple(value.shape)} but 'input_ids' has shape "
            f"{(shape[0], shape[1] + 1)}; per-token log-probs are aligned with input_ids"
        )
    return value[:, 1:].to(device).float()


def rl_channel(
    logits: torch.Tensor, seq: SequenceInputs, batch: Mapping[str, Any], s: RLLossSettings
) -> RLChannel:
    """The RL loss of the rollout ``batch`` from the student's ``[B, T, V]`` ``logits``."""
    scored = seq.scored
    with fp32_math(logits.device):
        shifted = logits[:, :-1].float() / s.temperature
        log_z = torch.logsumexp(shifted, dim=-1)
        targets = seq.input_ids[:, 1:].to(shifted.device)
        lp = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
        lp = torch.where(scored, lp, 0.0)
        mask = scored.float()
        advantages = require_tensor(batch, ROLLOUT_KEY, "by the RL channel").to(lp.device).float()
        if advantages.shape[0] != lp.shape[0]:
            raise ValueError(
                f"batch key 'advantages' has shape {tuple(advantages.shape)} for {lp.shape[0]} rows of input_ids"
            )
        old = None if is_absent(batch, "old_logprobs") else _aligned(batch, "old_logprobs", lp.shape, lp.device)
        items = batch.get("num_items_in_batch")
        stats: dict[str, torch.Tensor] = {}
        if s.kind == "dppo":
            if old is None:
                raise ValueError("the DPPO channel needs 'old_logprobs' (the sampling policy's) in the batch")
            count = mask.sum().clamp(min=1.0) if items is None else items
            dppo = dppo_terms(
                lp, old, advantages, mask, dppo_mask_high=s.dppo_mask_high, dppo_mask_low=s.dppo_mask_low,
                adv_tau=s.adv_tau, kl_tau=s.kl_tau, token_count=count,
            )  # fmt: skip
            loss = dppo.loss
            stats["rl_clip_fraction"] = dppo.is_masked
            stats["rl_kl"] = dppo.mismatch_kl
        else:
            ref = None if s.beta == 0.0 else _aligned(batch, "ref_logprobs", lp.shape, lp.device)
            grpo = grpo_terms(
                lp, old, advantages, mask, loss_type=s.loss_type, epsilon_low=s.epsilon_low,
                epsilon_high=s.epsilon_high, delta=s.delta, beta=s.beta, ref_logprobs=ref,
                importance_sampling_level=s.importance_sampling_level,
                max_completion_length=s.max_completion_length, num_items_in_batch=items,
            )  # fmt: skip
            loss = grpo.loss
            if s.loss_type != "dapo":
                loss = loss / int(batch.get("rl_micro_batches") or 1)
            stats["rl_clip_fraction"] = grpo.clip_fraction
            stats["rl_kl"] = grpo.kl
        tokens = mask.sum().clamp(min=1.0)
        with torch.no_grad():
            probs = torch.softmax(shifted, dim=-1)
            entropy = log_z - (probs * shifted).sum(-1)
            stats["rl_entropy"] = (entropy * mask).sum() / tokens
        policy_lp = lp.detach()
        nll = -policy_lp.sum() / tokens
        aligned = torch.nn.functional.pad(policy_lp, (1, 0))
        return RLChannel(loss=loss, nll=nll, stats=stats, token_logprobs=aligned)
