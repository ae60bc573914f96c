"""Log-space primitives shared by the distillation losses (all math in fp32).

Every function takes ``[N, V]`` logits (N scored tokens, V vocabulary) and works on log-probs,
never on probabilities divided or logged again, so finite logits always give finite results.
Log-probs are clamped at the most negative finite fp32 value: a ``-inf`` logit (a masked vocab
entry) then contributes ``0 * finite = 0`` instead of ``0 * -inf = NaN``, and gradients stay finite.
"""

from __future__ import annotations

import torch

_MIN_LOG = torch.finfo(torch.float32).min


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """fp32 ``log_softmax`` over the last dim, clamped to stay finite where a logit is ``-inf``."""
    return torch.log_softmax(logits.float(), dim=-1).clamp(min=_MIN_LOG)


def kl_logspace(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-row ``KL(p || q) = sum_v p(v) (log p(v) - log q(v))`` from log-probs, shape ``[N]``."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def entropy_logspace(log_p: torch.Tensor) -> torch.Tensor:
    """Per-row Shannon entropy ``-sum_v p(v) log p(v)`` in nats, shape ``[N]``."""
    return -(log_p.exp() * log_p).sum(dim=-1)


def check_pair(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    """``ValueError`` unless both are ``[N, V]`` logits of the same shape."""
    if student_logits.dim() != 2 or student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} must both be [N, V] with the same shape"
        )
