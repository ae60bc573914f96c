"""The generation backend: ``G`` completions of each prompt, sampled from the replica's local model.

:class:`GenerationBackend` is the interface (a colocated vLLM plugs in here on GPUs later);
:class:`TransformersBackend` implements it with ``model.generate`` (KV cache, left-padded prompts,
``temperature`` / ``top_p`` / ``top_k``, ``max_completion_length``, stop at EOS).

Sampling: the last logits processor (after the temperature, top-k and top-p warpers) draws the next
token from the warped distribution with the backend's own ``torch.Generator`` and leaves only that
token finite, so ``generate``'s greedy pick takes it: the global RNG is never touched, and the same
processor records the sampled token's log-prob under that distribution, one ``[N, V]`` step at a
time (never the ``[N, C, V]`` scores).

Randomness: the generator is seeded with ``seed`` per call; the caller derives it from ``(run seed,
rank, rollout position)``, so the completions of a generation batch are a pure function of the
parameters and that position: exact resume needs no saved RNG state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_completion_length: int = 256


@dataclass(frozen=True)
class Generation:
    """``N`` completions (prompt ``i // G`` for row ``i``): all tensors on the model's device."""

    prompt_ids: torch.Tensor  # long [N, P], left-padded
    prompt_mask: torch.Tensor  # long [N, P]
    completion_ids: torch.Tensor  # long [N, C], padded after EOS / the length limit
    completion_mask: torch.Tensor  # long [N, C]: 1 up to and including the first EOS
    sampling_logprobs: torch.Tensor  # fp32 [N, C], 0 off the mask


class GenerationBackend(Protocol):
    """Samples completions from the current parameters of ``model``."""

    def generate(
        self, model: nn.Module, prompts: Sequence[Sequence[int]], num_generations: int, *, seed: int
    ) -> Generation: ...


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``, ``[N, max len]``, padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(list(row), dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def completion_mask(completion_ids: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """``[N, C]`` long: 1 up to and including the first ``eos_id`` of each row (all 1 without one)."""
    if eos_id is None:
        return torch.ones_like(completion_ids)
    is_eos = completion_ids == eos_id
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion_ids.shape[1])
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    return (positions.unsqueeze(0) <= first.unsqueeze(1)).long()


class _SampleAndRecord:
    """The last logits processor: samples each row's next token from ``softmax(scores)`` with
    ``generator``, records its log-prob, and returns scores that are finite only there (``generate``
    then picks it greedily; a finished row's pick is replaced by pad, its log-prob masked later)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.float()
        log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
        choice = torch.multinomial(torch.exp(logits - log_z), 1, generator=self.generator)
        self.steps.append((logits.gather(1, choice) - log_z).squeeze(1))
        return torch.full_like(scores, float("-inf")).scatter_(1, choice, 0.0)

    def logprobs(self, rows: int) -> torch.Tensor:
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros(rows, 0)


class TransformersBackend:
    """``model.generate`` with sampling, a KV cache and the settings of ``[rl]``."""

    def __init__(self, settings: SamplingSettings, *, pad_id: int, eos_id: int | None) -> None:
        self.settings, self.pad_id, self.eos_id = settings, pad_id, eos_id

    def _processors(self) -> list[Any]:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        s, out = self.settings, list[Any]()
        if s.temperature != 1.0:
            out.append(TemperatureLogitsWarper(s.temperature))
        if s.top_k > 0:
            out.append(TopKLogitsWarper(top_k=s.top_k))
        if s.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=s.top_p))
        return out

    @torch.no_grad()
    def generate(
        self, model: nn.Module, prompts: Sequence[Sequence[int]], num_generations: int, *, seed: int
    ) -> Generation:
        from transformers import GenerationConfig, LogitsProcessorList

        device = next(model.parameters()).device
        rows = [list(p) for p in prompts for _ in range(num_generations)]
        ids, mask = left_pad(rows, self.pad_id, device)
        generator = torch.Generator(device=device).manual_seed(seed)
        record = _SampleAndRecord(generator)
        config = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False, max_new_tokens=self.settings.max_completion_length, pad_token_id=self.pad_id,
            eos_token_id=self.eos_id, return_dict_in_generate=False, use_cache=True,
        )  # fmt: skip  # the warpers and the sampling are ours (module docstring)
        was_training = model.training
        model.eval()
        try:
            out = model.generate(  # type: ignore[operator]  # transformers' GenerationMixin
                input_ids=ids, attention_mask=mask, generation_config=config,
                logits_processor=LogitsProcessorList([*self._processors(), record]),
            )  # fmt: skip
        finally:
            model.train(was_training)
        completion = out[:, ids.shape[1] :]
        if completion.shape[1] == 0:
            completion = torch.full((len(rows), 1), self.eos_id if self.eos_id is not None else self.pad_id,
                                    dtype=torch.long, device=device)  # fmt: skip
        logprobs = record.logprobs(len(rows)).to(device)[:, : completion.shape[1]]
        if logprobs.shape[1] < completion.shape[1]:  # no step ran: the placeholder EOS column
            logprobs = torch.nn.functional.pad(logprobs, (0, completion.shape[1] - logprobs.shape[1]))
        cmask = completion_mask(completion, self.eos_id)
        completion = torch.where(cmask.bool(), completion, self.pad_id)
        return Generation(ids, mask, completion, cmask, torch.where(cmask.bool(), logprobs, 0.0))
