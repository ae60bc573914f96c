"""What differs between the inner steps of channel-1 kinds: a step strategy per kind.

The loop (:mod:`.loop`) asks its strategy for the next batch, the extra ``compose_loss`` keywords,
what to do after the backward pass, the round's extra metrics and the evaluation; it never knows
whether channel 1 is language modelling or RL.

- :class:`SupervisedSteps` (``loss.channel1 = "lm"``): batches of the :class:`BatchBuilder`.
- :class:`RLSteps` (``"grpo"`` / ``"dppo"``): every ``rl.num_iterations`` inner steps, ``data.batch_size``
  prompts from the :class:`PromptBatcher`, ``rl.num_generations`` completions each sampled from the
  replica's current local parameters (on-policy), scored and turned into a rollout batch
  (:mod:`diloco_serverless.rl.rollouts`); the following iterations reuse it with importance ratios
  against the log-probs of the first iteration's forward pass (TRL's ``old_per_token_logps``;
  DPPO: against the sampler's log-probs).

Exact resume: the strategy's only state is its data position (``position``, counted like the
supervised one: ``data.batch_size`` per inner step) plus the rollout batch in flight. Generation
batches never cross a round (``inner.sync_every`` is a multiple of ``rl.num_iterations``), so a
replica restarted at a round boundary regenerates nothing it had, and the sampling RNG is seeded
from ``(seed, rank, prompt position)``: the rollouts are bit-identical to the run without the restart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from diloco_serverless.config import RunConfig
from diloco_serverless.data.builder import BatchBuilder
from diloco_serverless.data.prompts import PromptBatcher
from diloco_serverless.loss import LossComponents, compose_loss
from diloco_serverless.loss.rl_channel import RLLossSettings
from diloco_serverless.rl.generation import SamplingSettings, TransformersBackend
from diloco_serverless.rl.reward_calls import load_reward_funcs
from diloco_serverless.rl.rollouts import Rollouts, build_rollouts

__all__ = [
    "RLSteps", "SupervisedSteps", "make_steps", "needs_reference_model", "rl_loss_settings", "rows_per_pass",
    "sampling_seed",
]  # fmt: skip


def needs_reference_model(cfg: RunConfig) -> bool:
    """A frozen copy of the initial model is needed: DPO reference log-probs, or the RL KL (``rl.beta > 0``)."""
    return cfg.loss.needs_reference or (cfg.loss.channel1 != "lm" and cfg.rl.beta > 0)


def rows_per_pass(cfg: RunConfig) -> int:
    """Rows of one forward/backward pass: ``data.micro_batch_size`` (default the batch) sequences, times
    ``rl.num_generations`` with an RL channel 1 (each prompt stands for its group of completions)."""
    rows = cfg.data.micro_batch_size or cfg.data.batch_size
    return rows * cfg.rl.num_generations if cfg.loss.channel1 != "lm" else rows


def rl_loss_settings(cfg: RunConfig) -> RLLossSettings:
    """The RL channel's settings from ``[rl]`` (``loss.channel1`` names the kind)."""
    rl = cfg.rl
    return RLLossSettings(
        kind=cfg.loss.channel1, loss_type=rl.loss_type, epsilon_low=rl.epsilon,
        epsilon_high=rl.epsilon if rl.epsilon_high is None else rl.epsilon_high, delta=rl.delta, beta=rl.beta,
        importance_sampling_level=rl.importance_sampling_level, max_completion_length=rl.max_completion_length,
        temperature=rl.temperature, dppo_mask_high=rl.dppo_mask_high, dppo_mask_low=rl.dppo_mask_low,
        adv_tau=rl.adv_tau, kl_tau=rl.kl_tau,
    )  # fmt: skip


def sampling_seed(seed: int, rank: int, position: int) -> int:
    """The sampling seed of the generation batch at prompt ``position`` of ``rank`` (63 bits, stable)."""
    digest = hashlib.sha256(f"rl-sampling:{seed}:{rank}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class SupervisedSteps:
    """Channel 1 = language modelling on the data's batches."""

    def __init__(self, data: BatchBuilder) -> None:
        self.data = data

    def next_batch(self) -> dict[str, Any]:
        return self.data.next_batch()

    def loss_kwargs(self) -> dict[str, Any]:
        return {}

    def after_step(self, comps: LossComponents) -> None:
        """Nothing to keep between supervised steps."""

    def round_metrics(self, inner_s: float) -> dict[str, float]:
        return {}

    def eval_losses(self, model: nn.Module) -> Iterator[float]:
        """``lm_ce`` of each held-out batch."""
        for batch in self.data.eval_batches():
            yield float(compose_loss(model, batch).lm_ce)


class _RolloutPosition:
    """The data interface of the loop (``position``, state, data wait) over a :class:`PromptBatcher`:
    ``position`` counts ``data.batch_size`` per inner step, like the supervised builder."""

    def __init__(self, prompts: PromptBatcher, iterations: int) -> None:
        self.prompts, self.iterations = prompts, iterations
        self.position = 0
        self.format = "prompt"

    @property
    def step_index(self) -> int:
        return self.position // self.prompts.data.batch_size

    @property
    def bad_rows(self) -> int:
        """Prompt rows skipped as unusable so far (``data.max_bad_fraction``, :mod:`diloco_serverless.data.prompts`)."""
        return self.prompts.source.bad_rows.bad

    def prompt_position(self) -> int:
        return (self.step_index // self.iterations) * self.prompts.data.batch_size

    def state_dict(self) -> dict[str, Any]:
        self.prompts.position = self.prompt_position()
        return {**self.prompts.state_dict(), "position": self.position, "rl_iterations": self.iterations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict({**state, "position": 0})
        self.position = int(state["position"])

    def reset_data_wait(self) -> float:
        return self.prompts.reset_data_wait()

    def close(self) -> None:
        self.prompts.close()


class RLSteps:
    """Channel 1 = GRPO or DPPO on rollouts sampled in this replica (module docstring)."""

    def __init__(self, cfg: RunConfig, prompts: PromptBatcher, model: nn.Module, tokenizer: Any, *, rank: int,
                 ref_model: nn.Module | None = None) -> None:  # fmt: skip
        self.cfg, self.model, self.tokenizer, self.rank, self.ref_model = cfg, model, tokenizer, rank, ref_model
        self.data = _RolloutPosition(prompts, cfg.rl.num_iterations)
        self.settings = rl_loss_settings(cfg)
        self.funcs = load_reward_funcs(cfg.rl.reward_funcs)
        self.weights = cfg.rl.reward_weights or [1.0] * len(self.funcs)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        rl = cfg.rl
        sampling = SamplingSettings(rl.temperature, rl.top_p, rl.top_k, rl.max_completion_length)
        self.backend = TransformersBackend(sampling, pad_id=int(pad), eos_id=tokenizer.eos_token_id)
        self._current: Rollouts | None = None
        self._batch: dict[str, Any] = {}
        self._stats: list[dict[str, float]] = []
        self._loss_stats: dict[str, torch.Tensor] = {}
        self._loss_steps = 0

    def _rollouts(self, prompts: list[Any], position: int) -> Rollouts:
        rl = self.cfg.rl
        return build_rollouts(
            self.model, self.backend, prompts, tokenizer=self.tokenizer, num_generations=rl.num_generations,
            reward_funcs=self.funcs, reward_weights=self.weights, scale_rewards=rl.scale_rewards,
            max_completion_length=rl.max_completion_length, seed=sampling_seed(self.cfg.seed, self.rank, position),
            temperature=rl.temperature, ref_model=self.ref_model,
        )  # fmt: skip

    def next_batch(self) -> dict[str, Any]:
        """A fresh rollout batch every ``num_iterations`` steps, else the one in flight."""
        iteration = self.data.step_index % self.data.iterations
        if iteration == 0 or self._current is None:
            position = self.data.prompt_position()
            self.data.prompts.position = position
            prompts = self.data.prompts.next_batch()
            self._current = self._rollouts(prompts, position)
            self._stats.append(self._current.stats([f.name for f in self.funcs]))
            self._batch = dict(self._current.batch)
            rows = int(self._batch["input_ids"].shape[0])
            self._batch["rl_micro_batches"] = -(-rows // rows_per_pass(self.cfg))  # TRL's accumulation normaliser
            if self.settings.kind == "dppo":
                self._batch["old_logprobs"] = self._batch["sampling_logprobs"]
        self.data.position += self.cfg.data.batch_size
        return self._batch

    def loss_kwargs(self) -> dict[str, Any]:
        return {"channel1": self.settings.kind, "rl": self.settings}

    def after_step(self, comps: LossComponents) -> None:
        """Keep the first iteration's policy log-probs (GRPO's ``old_logprobs`` of the later ones) and
        the loss metrics (on the device, read once per round)."""
        if self.settings.kind == "grpo" and "old_logprobs" not in self._batch and self.data.iterations > 1:
            if comps.rl_token_logprobs is not None:
                self._batch["old_logprobs"] = comps.rl_token_logprobs.detach()
        for key, value in comps.rl_stats.items():
            prev = self._loss_stats.get(key)
            self._loss_stats[key] = value.detach() if prev is None else prev + value.detach()
        self._loss_steps += 1

    def round_metrics(self, inner_s: float) -> dict[str, float]:
        """The round's rollout and loss metrics (means over its generation batches / steps)."""
        out: dict[str, float] = {}
        keys = {k for s in self._stats for k in s}
        for key in sorted(keys):
            values = [s[key] for s in self._stats if key in s]
            out[key] = sum(values) / len(values) if key not in ("generation_s", "reward_s") else sum(values)
        if self._loss_steps:
            for key, value in self._loss_stats.items():
                out[key] = float(value) / self._loss_steps
        out["generation_share"] = out.get("generation_s", 0.0) / inner_s if inner_s > 0 else 0.0
        self._stats, self._loss_stats, self._loss_steps = [], {}, 0
        return out

    def eval_losses(self, model: nn.Module) -> Iterator[float]:
        """Minus the mean reward of completions of each held-out prompt batch (sampled with a fixed seed)."""
        for k, prompts in enumerate(self.data.prompts.eval_batches()):
            saved, self.model = self.model, model
            try:
                rollouts = self._rollouts(prompts, -1 - k)
            finally:
                self.model = saved
            yield -float(torch.nan_to_num(torch.nanmean(rollouts.rewards), nan=0.0))


def make_steps(cfg: RunConfig, tokenizer: Any, model: nn.Module, *, rank: int, ref_model: nn.Module | None,
               device: torch.device, storage_options: dict[str, Any] | None) -> SupervisedSteps | RLSteps:  # fmt: skip
    """The step strategy of ``loss.channel1``."""
    if cfg.loss.channel1 == "lm":
        builder = BatchBuilder.from_config(
            cfg, tokenizer, rank=rank, ref_model=ref_model, device=device, storage_options=storage_options
        )
        return SupervisedSteps(builder)
    prompts = PromptBatcher.from_config(cfg, tokenizer, rank=rank, storage_options=storage_options)
    return RLSteps(cfg, prompts, model, tokenizer, rank=rank, ref_model=ref_model)
