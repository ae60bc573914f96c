"""Batches for ``compose_loss``: one replica's deterministic, restartable stream of training data.

``BatchBuilder.from_config(cfg, tokenizer, rank=r, ref_model=ref)`` yields dicts with the batch
keys :mod:`diloco_serverless.loss.compose` reads (all ``torch.long`` ``[B, T]`` except the ``[B]``
fp32 reference log-probs)::

    input_ids, attention_mask, response_mask                                   channel 1 (always)
    ctx_teacher_input_ids, ctx_teacher_attention_mask, ctx_teacher_response_mask   channel 2 (alpha_sdpo > 0)
    dpo_{chosen,rejected}_{input_ids,attention_mask,response_mask}             channel 3 (beta_replay > 0)
    dpo_chosen_ref_logprobs, dpo_rejected_ref_logprobs                         channel 3 with dpo_variant="dpo"

The keys of a channel whose weight is 0 are left out (``compose_loss`` then skips it and no work is
spent building it). Reference log-probs come from a frozen copy of the *initial* model
(:func:`make_reference_model`, DPO: Rafailov et al., arXiv 2305.18290); SimPO (Meng et al., arXiv
2405.14734) needs none. Student rows are ``seq_len`` long, teacher rows ``seq_len + hint_len``.

Batch ``k`` of rank ``r`` holds examples ``k*B .. k*B+B-1`` of the rank's source, each a pure
function of ``(seed, r, index)``: :meth:`BatchBuilder.state_dict` is ``{"position": k*B, ...}`` and
restoring it resumes the exact stream. :meth:`BatchBuilder.eval_batches` walks the held-out split
(the same batches on every call and rank) and carries only the channel-1 keys: eval loss is lm_ce.

Failure: :class:`DataError` for bad records, empty shards, a rank outside the run, or a DPO config
without a reference model; the message names the rank, file, line or key and the fix.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from diloco_serverless.config import DataConfig, LossConfig, RunConfig
from diloco_serverless.data.examples import DataError, Example, collate
from diloco_serverless.data.jsonl import JsonlSource
from diloco_serverless.data.stdlib import StdlibSource
from diloco_serverless.loss import sequence_logprobs

__all__ = [
    "DataError",
    "Example",
    "ExampleSource",
    "BatchBuilder",
    "make_source",
    "make_reference_model",
    "reference_logprobs",
    "STUDENT_KEYS",
    "TEACHER_KEYS",
    "DPO_KEYS",
    "REF_KEYS",
]

STUDENT_KEYS = ("input_ids", "attention_mask", "response_mask")
TEACHER_KEYS = tuple(f"ctx_teacher_{k}" for k in STUDENT_KEYS)
DPO_KEYS = tuple(f"dpo_{side}_{k}" for side in ("chosen", "rejected") for k in STUDENT_KEYS)
REF_KEYS = ("dpo_chosen_ref_logprobs", "dpo_rejected_ref_logprobs")


class ExampleSource(Protocol):
    """Where examples come from (``StdlibSource``, ``JsonlSource``)."""

    name: str

    def train_example(self, index: int) -> Example: ...

    def eval_example(self, index: int) -> Example: ...


def make_source(
    data: DataConfig,
    tokenizer: Any,
    *,
    rank: int,
    world_size: int,
    seed: int,
    storage_options: dict[str, Any] | None = None,
) -> ExampleSource:
    """``data.source == "stdlib"`` -> StdlibSource, anything else -> JsonlSource (path or URL)."""
    if data.source == "stdlib":
        return StdlibSource(tokenizer, data, rank=rank, world_size=world_size, seed=seed)
    return JsonlSource(
        tokenizer, data, rank=rank, world_size=world_size, seed=seed, storage_options=storage_options
    )


def make_reference_model(model: nn.Module) -> nn.Module:
    """A frozen deep copy (eval mode, no grad) of ``model``: call it on the initial model, before any
    training step or checkpoint load, so every replica (also a restarted one) has the same reference."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


@torch.no_grad()
def reference_logprobs(ref_model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``dpo_{chosen,rejected}_ref_logprobs`` ([B], fp32) of ``batch``'s DPO rows under ``ref_model``."""
    seq_lp = sequence_logprobs
    out = {}
    for side in ("chosen", "rejected"):
        p = f"dpo_{side}_"
        out[f"{p}ref_logprobs"] = seq_lp(
            ref_model, batch[f"{p}input_ids"], batch[f"{p}attention_mask"], batch[f"{p}response_mask"]
        ).float()
    return out


def _start_id(tokenizer: Any) -> int:
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    raise DataError("tokenizer has no BOS, EOS or pad token; set tokenizer.pad_token before building batches")


class BatchBuilder:
    """Deterministic batches of one rank; iterate it or call :meth:`next_batch`."""

    def __init__(
        self,
        source: ExampleSource,
        tokenizer: Any,
        data: DataConfig,
        loss: LossConfig,
        *,
        rank: int,
        seed: int,
        ref_model: nn.Module | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if loss.needs_reference and ref_model is None:
            raise DataError(
                f"rank {rank}: loss.dpo_variant='dpo' with loss.beta_replay={loss.beta_replay} needs reference "
                "log-probs; pass ref_model=make_reference_model(initial_model), or set dpo_variant='simpo'"
            )
        self.source, self.data, self.loss = source, data, loss
        self.rank, self.seed, self.ref_model = rank, seed, ref_model
        self.device = torch.device(device)
        self.position = 0
        pad = getattr(tokenizer, "pad_token_id", None)
        self._start = _start_id(tokenizer)
        self._pad = int(pad) if pad is not None else self._start

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        tokenizer: Any,
        *,
        rank: int,
        ref_model: nn.Module | None = None,
        device: torch.device | str = "cpu",
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> BatchBuilder:
        """The builder for ``rank`` of a run (world size = ``cfg.replicas`` unless given)."""
        world = cfg.replicas if world_size is None else world_size
        source = make_source(
            cfg.data, tokenizer, rank=rank, world_size=world, seed=cfg.seed, storage_options=storage_options
        )
        return cls(source, tokenizer, cfg.data, cfg.loss, rank=rank, seed=cfg.seed, ref_model=ref_model, device=device)

    # ------------------------------------------------------------------ batches
    def _collate(self, examples: list[Example], *, teacher: bool, dpo: bool) -> dict[str, torch.Tensor]:
        batch = collate(
            examples, seq_len=self.data.seq_len, hint_len=self.data.hint_len, pad_id=self._pad,
            start_id=self._start, teacher=teacher, dpo=dpo,
        )
        return {k: v.to(self.device) for k, v in batch.items()}

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next training batch; advances the position by ``batch_size`` examples."""
        b = self.data.batch_size
        examples = [self.source.train_example(self.position + i) for i in range(b)]
        batch = self._collate(examples, teacher=self.loss.alpha_sdpo > 0, dpo=self.loss.beta_replay > 0)
        if self.loss.needs_reference:
            assert self.ref_model is not None
            batch.update(reference_logprobs(self.ref_model, batch))
        self.position += b
        return batch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.next_batch()

    def eval_batches(self, num_batches: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """``num_batches`` (default ``data.eval_batches``) held-out batches with the channel-1 keys;
        the same batches on every call and every rank."""
        n = self.data.eval_batches if num_batches is None else num_batches
        b = self.data.batch_size
        for k in range(n):
            examples = [self.source.eval_example(k * b + i) for i in range(b)]
            yield self._collate(examples, teacher=False, dpo=False)

    # ------------------------------------------------------------------ position
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe data position: ``{"position", "rank", "seed", "source", "batch_size"}``."""
        return {
            "position": self.position,
            "rank": self.rank,
            "seed": self.seed,
            "source": self.data.source,
            "batch_size": self.data.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["position"]``. DataError if it was saved for another seed or source
        (the stream would differ); a different rank is allowed (e.g. a rank taking over a shard)."""
        current = {"seed": self.seed, "source": self.data.source}
        for key, value in current.items():
            if key in state and state[key] != value:
                raise DataError(
                    f"rank {self.rank}: data position was saved with {key}={state[key]!r}, this run has "
                    f"{key}={value!r}; it cannot resume that stream"
                )
        position = state.get("position")
        if not isinstance(position, int) or position < 0:
            raise DataError(f"rank {self.rank}: data position must be a non-negative int, got {position!r}")
        self.position = position
