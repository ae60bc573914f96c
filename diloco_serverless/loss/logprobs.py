"""Logits, response-masked cross-entropy and sequence log-probs of a causal LM.

All loss math runs in fp32 even when the model runs in bf16 or under autocast: logits are
upcast before any softmax. The next-token shift follows ``transformers``: the logits at position
``t`` score token ``t + 1``, so ``response_mask[:, 0]`` is never scored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from diloco_serverless.loss._batch import SequenceInputs, check_ids

_IGNORE = -100


@contextlib.contextmanager
def fp32_math(device: torch.device) -> Iterator[None]:
    """Disable autocast for ``device`` inside the block so loss math stays in fp32."""
    if torch.is_autocast_enabled(device.type):
        with torch.autocast(device_type=device.type, enabled=False):
            yield
    else:
        yield


def causal_lm_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One forward pass; returns the ``[B, T, V]`` logits (``.logits`` of an HF output, or a tensor).

    Raises ``ValueError`` when the model returns something without logits of shape ``[B, T, V]``.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask)
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"model returned {got} for input_ids of shape {tuple(input_ids.shape)}; "
            "compose_loss needs a causal LM whose output has .logits of shape [B, T, V]"
        )
    return logits


def response_ce(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    token_count: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Mean token cross-entropy over the response tokens (fp32 scalar).

    Computed exactly as ``transformers``' ``ForCausalLMLoss`` computes ``model(..., labels=labels).loss``
    with ``labels = input_ids`` where ``response_mask`` is set and ``-100`` elsewhere, so the two
    agree bit for bit. With ``token_count`` the sum is divided by it instead of by this batch's
    number of response tokens (a micro-batch's share of a larger batch's mean).
    """
    labels = input_ids.masked_fill(response_mask == 0, _IGNORE)
    shift_labels = nn.functional.pad(labels, (0, 1), value=_IGNORE)[..., 1:].contiguous()
    with fp32_math(logits.device):
        flat = logits.float().view(-1, logits.shape[-1])
        if token_count is None:
            return nn.functional.cross_entropy(flat, shift_labels.view(-1), ignore_index=_IGNORE, reduction="mean")
        total = nn.functional.cross_entropy(flat, shift_labels.view(-1), ignore_index=_IGNORE, reduction="sum")
        return total / token_count


def scored_logits(logits: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, V]`` logits of the positions that score a response token, row-major order.

    Boolean-mask indexing: the output size depends on the mask, so this reads it (a device sync);
    the loss channels use :func:`aligned_logits` / :func:`masked_mean` instead."""
    return logits[:, :-1][scored].float()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor | float | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set, divided by ``count`` (default: the number set); fp32.

    ``torch.where`` rather than a product, so a NaN at a masked-out position stays out."""
    total = torch.where(mask, values.float(), 0.0).sum()
    return total / (mask.sum() if count is None else count)


def aligned_logits(teacher_logits: torch.Tensor, teacher_scored: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """``[B, S, V]`` teacher logits laid out like a ``[B, S]`` student mask ``scored``.

    Position ``t`` of row ``b`` holds the teacher logits (``teacher_logits[:, :-1]``) of the teacher's
    k-th scored position of row ``b`` when ``t`` is the student's k-th scored position; other
    positions hold some finite logits of the same row (mask them out). ``teacher_scored`` is the
    teacher's ``[B, T_t - 1]`` mask; rows must score the same number of tokens. Reads no values.
    """
    rows, width = teacher_scored.shape
    rank_t = teacher_scored.long().cumsum(1) - 1
    slot = torch.where(teacher_scored, rank_t, width)  # unscored teacher positions go to a spare column
    table = torch.zeros(rows, width + 1, dtype=torch.long, device=teacher_scored.device)
    positions = torch.arange(width, device=teacher_scored.device).expand(rows, width)
    table.scatter_(1, slot, torch.where(teacher_scored, positions, 0))
    rank_s = (scored.long().cumsum(1) - 1).clamp(0, width).to(table.device)
    source = table.gather(1, rank_s)  # [B, S]: teacher position for each student position
    shifted = teacher_logits[:, :-1]
    return shifted.gather(1, source.unsqueeze(-1).expand(-1, -1, shifted.shape[-1]))


def token_logprobs(logits: torch.Tensor, seq: SequenceInputs) -> torch.Tensor:
    """fp32 ``[B, T-1]`` log-prob of each scored response token, 0 at unscored positions (computed
    at every position and masked: no value is read)."""
    scored = seq.scored
    with fp32_math(logits.device):
        shifted = logits[:, :-1].float()
        targets = seq.input_ids[:, 1:].to(shifted.device)
        lp = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
        return torch.where(scored.to(lp.device), lp, 0.0)


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Sum of the response tokens' log-probs under ``model``, fp32 ``[B]``.

    Used by ``data.py`` (under ``torch.no_grad()``, with a frozen copy of the initial model) for the
    DPO reference log-probs ``dpo_*_ref_logprobs``, and by the trace-replay channel (with grad).
    A row without scored response tokens sums to 0. Raises ``ValueError`` naming the argument and
    the shapes when the ids are not ``[B, T]`` integers or a mask's shape differs.
    """
    check_ids("input_ids", input_ids)
    for key, mask in (("attention_mask", attention_mask), ("response_mask", response_mask)):
        if mask.shape != input_ids.shape:
            raise ValueError(
                f"{key} has shape {tuple(mask.shape)} but input_ids has shape {tuple(input_ids.shape)}"
            )
    seq = SequenceInputs("input_ids", input_ids, attention_mask, response_mask.to(input_ids.device))
    logits = causal_lm_logits(model, input_ids, attention_mask)
    return token_logprobs(logits, seq).sum(dim=1)
