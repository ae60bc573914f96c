"""Batch validation for :func:`diloco_serverless.loss.compose_loss`.

Every check raises ``ValueError`` naming the offending key(s) and their shapes, so that a bad
batch from ``data.py`` is diagnosed at the loss instead of as a silent NaN three rounds later.

Conventions: token ids are ``[B, T]`` integer tensors; attention and response masks have the
ids' shape and any dtype (non-zero means "on"). ``response_mask[b, t] == 1`` marks token ``t`` as
a response token; it is predicted by the logits at position ``t - 1`` (next-token shift), so a
response token at position 0 can never be scored and is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SequenceInputs:
    """One validated ``(ids, attention mask, response mask)`` triple and the keys it came from."""

    ids_key: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor

    @property
    def scored(self) -> torch.Tensor:
        """Bool ``[B, T-1]``: position ``t`` of the logits predicts response token ``t + 1``."""
        return self.response_mask[:, 1:] != 0

    @property
    def tokens_per_row(self) -> torch.Tensor:
        """Long ``[B]``: number of scored response tokens in each row."""
        return self.scored.sum(dim=1)


def is_absent(batch: Mapping[str, Any], key: str) -> bool:
    """True when ``key`` is missing, ``None`` or an empty tensor (a channel then switches off)."""
    value = batch.get(key)
    return value is None or (isinstance(value, torch.Tensor) and value.numel() == 0)


def require_tensor(batch: Mapping[str, Any], key: str, why: str) -> torch.Tensor:
    """``batch[key]`` as a tensor; ``ValueError`` naming ``key`` and ``why`` it is needed otherwise."""
    value = batch.get(key)
    if value is None:
        raise ValueError(f"batch key {key!r} is missing but required {why}; present keys: {sorted(batch)}")
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"batch key {key!r} must be a torch.Tensor, got {type(value).__name__}")
    return value


def sequence_inputs(batch: Mapping[str, Any], prefix: str, why: str) -> SequenceInputs:
    """Read and validate ``<prefix>input_ids`` with its ``attention_mask`` and ``response_mask``.

    Raises ``ValueError`` when a key is missing, the ids are not a 2-D integer tensor, or a mask's
    shape differs from the ids' shape (the message names both keys and both shapes).
    """
    ids_key = f"{prefix}input_ids"
    ids = require_tensor(batch, ids_key, why)
    check_ids(ids_key, ids)
    masks = []
    for name in ("attention_mask", "response_mask"):
        key = f"{prefix}{name}"
        mask = require_tensor(batch, key, why)
        if mask.shape != ids.shape:
            raise ValueError(
                f"batch key {key!r} has shape {tuple(mask.shape)} but {ids_key!r} has shape "
                f"{tuple(ids.shape)}; masks must match their ids token for token"
            )
        masks.append(mask.to(ids.device))
    return SequenceInputs(ids_key, ids, masks[0], masks[1])


def check_ids(key: str, ids: torch.Tensor) -> None:
    """``ValueError`` unless ``ids`` is a non-empty ``[B, T]`` integer tensor with ``T >= 2``."""
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(
            f"batch key {key!r} must be a [B, T] integer tensor of token ids, "
            f"got shape {tuple(ids.shape)} and dtype {ids.dtype}"
        )
    if ids.shape[0] == 0 or ids.shape[1] < 2:
        raise ValueError(
            f"batch key {key!r} has shape {tuple(ids.shape)}: need at least one row and two tokens "
            "(a response token is scored by the logits of the token before it)"
        )


def check_has_response(seq: SequenceInputs, *, per_row: bool) -> None:
    """``ValueError`` when the response mask scores no token (in the batch, or in a row if ``per_row``)."""
    key = seq.ids_key.replace("input_ids", "response_mask")
    counts = seq.tokens_per_row
    if int(counts.sum()) == 0:
        raise ValueError(
            f"batch key {key!r} (shape {tuple(seq.response_mask.shape)}) selects no response token "
            "after position 0; every batch needs at least one scored response token"
        )
    if per_row and bool((counts == 0).any()):
        row = int((counts == 0).nonzero()[0, 0])
        raise ValueError(
            f"batch key {key!r} (shape {tuple(seq.response_mask.shape)}) selects no response token in "
            f"row {row}; truncate the prompt rather than the response, or drop the pair"
        )


def check_same_rows(key_a: str, a: torch.Tensor, key_b: str, b: torch.Tensor) -> None:
    """``ValueError`` when two tensors disagree on the batch dimension."""
    if a.shape[0] != b.shape[0]:
        raise ValueError(
            f"batch keys {key_a!r} (shape {tuple(a.shape)}) and {key_b!r} (shape {tuple(b.shape)}) "
            "must have the same number of rows"
        )


def check_ref_logprobs(
    batch: Mapping[str, Any], key: str, rows: int, ids_key: str, *, finite: bool = True
) -> torch.Tensor:
    """Validate a ``[B]`` reference log-prob tensor; ``ValueError`` naming the key and shapes.
    ``finite=False`` leaves out the one check that reads values (:func:`check_ref_finite`)."""
    ref = require_tensor(batch, key, "by dpo_variant='dpo' (reference log-probs of the frozen model)")
    if ref.shape != (rows,):
        raise ValueError(
            f"batch key {key!r} has shape {tuple(ref.shape)} but must be [B] = ({rows},) to match "
            f"{ids_key!r}; compute it with diloco_serverless.loss.sequence_logprobs"
        )
    if not ref.dtype.is_floating_point:
        raise ValueError(f"batch key {key!r} must be a floating tensor, got dtype {ref.dtype}")
    if finite:
        check_ref_finite(key, ref)
    return ref


def check_ref_finite(key: str, ref: torch.Tensor) -> None:
    """``ValueError`` naming ``key`` when the reference log-probs hold NaN or Inf (reads the values)."""
    if not bool(torch.isfinite(ref).all()):
        raise ValueError(f"batch key {key!r} (shape {tuple(ref.shape)}) contains non-finite values")
