"""Shared pieces of the data pipeline: the Example record, deterministic helpers and collation.

An :class:`Example` holds token ids only (the sources tokenize), so collation is pure list work:
right padding to fixed lengths (``seq_len`` for student and DPO rows, ``seq_len + hint_len`` for
the self-distillation teacher) keeps every batch the same shape.

Failure: :class:`DataError` (a ``ValueError``) names the source, rank, file/line or example index
and what to do.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from diloco_serverless.errors import UserInputError

__all__ = ["DataError", "Example", "example_rng", "split_fraction", "collate", "fit_pair", "shuffle_lines"]


class DataError(UserInputError):
    """Bad or insufficient data; the message names the source, rank, line or file and the fix."""


@dataclass(frozen=True)
class Example:
    """One training example as token ids.

    ``prompt`` + ``response`` is the student sequence (channel 1). ``teacher_prompt`` + ``response``
    is what the self-distillation teacher reads (channel 2: the prompt with the hint). ``prompt`` +
    ``chosen`` / ``prompt`` + ``rejected`` is the preference pair (channel 3); ``chosen`` defaults to
    ``response``. ``source`` says where it came from (file path or JSONL line) for error messages.
    ``loss_mask`` (one 0/1 per ``response`` token, None = all 1) marks the response tokens the loss
    scores, for a chat whose response spans several assistant turns with user turns between them;
    the teacher row carries the same mask, so both score the same tokens.
    """

    prompt: list[int]
    response: list[int]
    teacher_prompt: list[int]
    rejected: list[int]
    chosen: list[int] = field(default_factory=list)
    source: str = ""
    loss_mask: list[int] | None = None

    @property
    def chosen_or_response(self) -> list[int]:
        return self.chosen or self.response


def example_rng(seed: int, *parts: object) -> random.Random:
    """A ``random.Random`` seeded from ``(seed, *parts)`` via SHA-512 of the string: identical on every
    machine and process (independent of PYTHONHASHSEED)."""
    return random.Random(":".join(str(p) for p in (seed, *parts)))


class EpochOrder:
    """Record indices ``0..n-1`` in a seeded shuffled order per epoch (``example_rng(seed, tag, rank,
    epoch)``), the current epoch's order cached: the same order on every machine and after a resume."""

    def __init__(self, n: int, seed: int, tag: str, rank: int) -> None:
        self.n, self.seed, self.tag, self.rank = n, seed, tag, rank
        self._epoch, self.order = -1, list[int]()

    def candidates(self, index: int) -> Iterator[int]:
        """The record at position ``index`` (epoch ``index // n``), then the ones after it in that epoch's
        order, wrapping: a record that cannot be used gives way to the next one."""
        epoch, offset = divmod(index, self.n)
        if self._epoch != epoch:
            order = list(range(self.n))
            example_rng(self.seed, self.tag, self.rank, epoch).shuffle(order)
            self._epoch, self.order = epoch, order
        order = self.order
        for step in range(self.n):
            yield order[(offset + step) % self.n]


def split_fraction(name: str) -> float:
    """A stable number in [0, 1) from ``name`` (SHA-256), used for the train/eval split."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2.0**64


def fit_pair(prompt: Sequence[int], response: Sequence[int], length: int) -> tuple[list[int], list[int]]:
    """Truncate to ``len(prompt) + len(response) <= length``: the response keeps at least half of
    ``length`` (cut on the right), the prompt is cut on the left. Keeps >= 1 prompt token if any."""
    p, r = list(prompt), list(response)
    if len(p) + len(r) <= length:
        return p, r
    r = r[: length - min(len(p), length // 2)]
    p = p[len(p) - (length - len(r)) :] if length > len(r) else []
    return p, r


def _row(
    prompt: list[int], response: list[int], length: int, pad_id: int, mask: list[int] | None = None
) -> tuple[list[int], list[int], list[int]]:
    n = len(prompt) + len(response)
    ids = prompt + response + [pad_id] * (length - n)
    attn = [1] * n + [0] * (length - n)
    scored = [1] * len(response) if mask is None else mask[: len(response)]
    resp = [0] * len(prompt) + scored + [0] * (length - n)
    return ids, attn, resp


def _stack(rows: list[tuple[list[int], list[int], list[int]]], prefix: str) -> dict[str, torch.Tensor]:
    ids, attn, resp = zip(*rows)
    return {
        f"{prefix}input_ids": torch.tensor(ids, dtype=torch.long),
        f"{prefix}attention_mask": torch.tensor(attn, dtype=torch.long),
        f"{prefix}response_mask": torch.tensor(resp, dtype=torch.long),
    }


def collate(
    examples: Sequence[Example],
    *,
    seq_len: int,
    hint_len: int,
    pad_id: int,
    start_id: int,
    teacher: bool = True,
    dpo: bool = True,
) -> dict[str, torch.Tensor]:
    """Right-padded batch tensors with the batch keys ``compose_loss`` reads (:mod:`diloco_serverless.loss.compose`).

    Student rows are ``[B, seq_len]``; teacher rows ``[B, seq_len + hint_len]`` and hold exactly the
    student's (possibly truncated) response, so both masks select the same number of tokens. An empty
    prompt becomes ``[start_id]`` so that the first response token is scored in both views. An
    example's ``loss_mask`` limits both response masks to the tokens it marks.
    """
    student, teach, chosen, rejected = [], [], [], []
    for ex in examples:
        if not ex.response:
            raise DataError(f"example from {ex.source or '?'} has an empty response")
        p, r = fit_pair(ex.prompt or [start_id], ex.response, seq_len)
        student.append(_row(p, r, seq_len, pad_id, ex.loss_mask))
        if teacher:
            t_len = seq_len + hint_len
            tp = (ex.teacher_prompt or [start_id])[-(t_len - len(r)) :]
            teach.append(_row(tp, r, t_len, pad_id, ex.loss_mask))
        if dpo:
            chosen.append(_row(*fit_pair(ex.prompt or [start_id], ex.chosen_or_response, seq_len), seq_len, pad_id))
            rejected.append(_row(*fit_pair(ex.prompt or [start_id], ex.rejected, seq_len), seq_len, pad_id))
    batch = _stack(student, "")
    if teacher:
        batch.update(_stack(teach, "ctx_teacher_"))
    if dpo:
        batch.update(_stack(chosen, "dpo_chosen_"))
        batch.update(_stack(rejected, "dpo_rejected_"))
    return batch


def shuffle_lines(lines: Sequence[list[int]], rng: random.Random) -> list[int] | None:
    """The lines' tokens concatenated in a shuffled order that differs from the original, or None
    when no order differs (fewer than 2 distinct lines)."""
    original = [t for line in lines for t in line]
    n = len(lines)
    candidates = [rng.sample(range(n), n) for _ in range(3)] + [[(i + 1) % n for i in range(n)]]
    for order in candidates:
        shuffled = [t for i in order for t in lines[i]]
        if shuffled != original:
            return shuffled
    return None
