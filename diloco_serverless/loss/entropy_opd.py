"""Entropy-Aware On-Policy Distillation (Jin et al., arXiv 2603.07079).

Reverse KL ``KL(student || teacher)`` is mode-seeking: precise where the teacher is confident but
it collapses diversity where the teacher is uncertain. Entropy-aware OPD mixes in forward KL
``KL(teacher || student)`` in proportion to the teacher's token entropy::

    w = clamp(H(teacher) / h_max, 0, 1)
    loss = w * KL(teacher || student) + (1 - w) * KL(student || teacher)

``h_max`` defaults to ``log(V)``, the entropy of the uniform distribution, so ``w`` is the teacher's
normalised entropy. The weight is computed from the teacher alone and carries no gradient.
"""

from __future__ import annotations

import math

import torch

from diloco_serverless.loss._math import (
    check_pair,
    entropy_logspace,
    kl_logspace,
    log_probs,
)


def check_h_max(h_max: float | None) -> float | None:
    """``h_max`` as a float (or ``None``); ``ValueError`` unless it is finite and positive."""
    if h_max is None:
        return None
    value = float(h_max)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"entropy_opd_h_max must be a positive number of nats or None (= log V), got {h_max!r}")
    return value


def teacher_entropy(teacher_logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy (nats) of ``softmax(teacher_logits)``, fp32 ``[N]``; 0 for one-hot, log V uniform."""
    return entropy_logspace(log_probs(teacher_logits))


def entropy_opd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, h_max: float | None = None
) -> torch.Tensor:
    """Per-token entropy-weighted forward/reverse KL, fp32 ``[N]``; zero when teacher equals student.

    Raises ``ValueError`` on a shape mismatch or a non-positive ``h_max``.
    """
    check_pair(student_logits, teacher_logits)
    h_max = check_h_max(h_max)
    if h_max is None:
        # log(V) is the uniform distribution's entropy; with V == 1 every entropy and KL is 0 anyway.
        h_max = math.log(student_logits.shape[-1]) if student_logits.shape[-1] > 1 else 1.0
    log_q = log_probs(student_logits)
    log_p = log_probs(teacher_logits)
    with torch.no_grad():
        weight = (entropy_logspace(log_p) / h_max).clamp(0.0, 1.0)
    return weight * kl_logspace(log_p, log_q) + (1.0 - weight) * kl_logspace(log_q, log_p)
