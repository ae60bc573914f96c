"""One generation batch: prompts -> G completions each -> rewards -> group advantages -> a rollout batch.

The batch is what :func:`~diloco_serverless.loss.compose_loss` reads with an RL channel 1
(:mod:`diloco_serverless.loss.rl_channel`): ``input_ids`` = left-padded prompt + completion,
``attention_mask``, ``response_mask`` (the completion up to and including EOS), ``advantages``,
``sampling_logprobs`` (the sampler's, aligned with ``input_ids``), ``num_items_in_batch`` (the
completion tokens of the whole generation batch: the ``dapo`` / DPPO normaliser), and with
``ref_model`` the KL reference's ``ref_logprobs``.

Completions are decoded without special tokens; for a prompt given as messages the completion is
``[{"role": "assistant", "content": text}]`` (TRL's conversational format).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from diloco_serverless.data.prompts import PromptRecord
from diloco_serverless.loss.advantages import group_advantages, nanstd, weighted_rewards
from diloco_serverless.rl.generation import Generation, GenerationBackend
from diloco_serverless.rl.reward_calls import NamedReward, score


@dataclass
class Rollouts:
    """The rollout batch and what the round's metrics report about it."""

    batch: dict[str, torch.Tensor]
    rewards_per_func: torch.Tensor  # fp32 [N, F], NaN = None
    rewards: torch.Tensor  # fp32 [N] weighted sum, NaN = unscorable
    completion_lengths: torch.Tensor  # long [N]
    generation_s: float
    reward_s: float
    completions: list[Any] = field(default_factory=list)

    def stats(self, names: Sequence[str]) -> dict[str, float]:
        """Reward mean/std (overall and per function), completion length, zero-std group fraction."""
        out: dict[str, float] = {}

        def put(key: str, value: torch.Tensor) -> None:
            v = float(value)
            if math.isfinite(v):
                out[key] = v

        put("reward_mean", torch.nanmean(self.rewards))
        put("reward_std", nanstd(self.rewards))
        for j, name in enumerate(names):
            short = name.rsplit(":", 1)[-1]
            put(f"reward/{short}/mean", torch.nanmean(self.rewards_per_func[:, j]))
            put(f"reward/{short}/std", nanstd(self.rewards_per_func[:, j]))
        out["completion_length"] = float(self.completion_lengths.float().mean())
        out["generation_s"] = self.generation_s
        out["reward_s"] = self.reward_s
        return out


def _completion(prompt: Any, text: str) -> Any:
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


@torch.no_grad()
def _token_logprobs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 ``[N, T]`` log-prob of token ``t`` under ``model`` at ``temperature`` (0 at position 0)."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / temperature
    lp = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(lp, (1, 0))


def build_rollouts(
    model: nn.Module,
    backend: GenerationBackend,
    prompts: Sequence[PromptRecord],
    *,
    tokenizer: Any,
    num_generations: int,
    reward_funcs: Sequence[NamedReward],
    reward_weights: Sequence[float],
    scale_rewards: str,
    max_completion_length: int,
    seed: int,
    temperature: float = 1.0,
    ref_model: nn.Module | None = None,
) -> Rollouts:
    """Sample, score and batch one generation batch (see the module docstring)."""
    t0 = time.perf_counter()
    gen: Generation = backend.generate(model, [p.prompt_ids for p in prompts], num_generations, seed=seed)
    if gen.completion_ids.device.type == "cuda":
        torch.cuda.synchronize(gen.completion_ids.device)
    t1 = time.perf_counter()
    g = num_generations
    lengths = gen.completion_mask.sum(1)
    ids_lists = [row[: int(n)] for row, n in zip(gen.completion_ids.tolist(), lengths.tolist())]
    texts = tokenizer.batch_decode(ids_lists, skip_special_tokens=True)
    rep = [p for p in prompts for _ in range(g)]
    completions = [_completion(p.prompt, t) for p, t in zip(rep, texts)]
    keys = sorted({k for p in prompts for k in p.columns})
    columns = {k: [p.columns.get(k) for p in rep] for k in keys}
    table = score(
        reward_funcs, [p.prompt for p in rep], completions, ids_lists, columns,
        max_completion_length=max_completion_length,
    )  # fmt: skip
    per_func = torch.tensor(table, dtype=torch.float32).reshape(len(rep), len(reward_funcs))
    rewards = weighted_rewards(per_func, list(reward_weights))
    advantages = group_advantages(rewards, g, scale=scale_rewards)
    device = gen.prompt_ids.device
    input_ids = torch.cat([gen.prompt_ids, gen.completion_ids], dim=1)
    attention = torch.cat([gen.prompt_mask, gen.completion_mask], dim=1)
    response = torch.cat([torch.zeros_like(gen.prompt_mask), gen.completion_mask], dim=1)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "response_mask": response,
        "advantages": advantages.to(device),
        "sampling_logprobs": torch.cat([torch.zeros_like(gen.prompt_mask).float(), gen.sampling_logprobs], dim=1),
        "num_items_in_batch": gen.completion_mask.sum().float(),
    }
    if ref_model is not None:
        batch["ref_logprobs"] = _token_logprobs(ref_model, input_ids, attention, temperature)
    t2 = time.perf_counter()
    return Rollouts(batch, per_func, rewards, lengths.cpu(), t1 - t0, t2 - t1, completions)
