"""Generalized Jensen-Shannon divergence, with TRL's GKD convention for ``beta``.

GKD (Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes", arXiv 2306.13649, Eq. 1) defines, for teacher ``P`` and student ``Q``::

    M = beta * P + (1 - beta) * Q
    JSD(beta)(P || Q) = beta * KL(P || M) + (1 - beta) * KL(Q || M)

TRL's ``GKDTrainer.generalized_jsd_loss`` computes exactly this for ``0 < beta < 1`` and replaces
the endpoints (where the formula degenerates to 0) by the limits the trainer documents:
``beta == 0`` is the forward KL ``KL(P || Q)`` and ``beta == 1`` the reverse KL ``KL(Q || P)``.
We follow TRL: same mixture, same weights, same endpoints. The mixture is formed in log space
(``logsumexp``), never by adding probabilities and taking a log.
"""

from __future__ import annotations

import math

import torch

from diloco_serverless.loss._math import check_pair, kl_logspace, log_probs


def check_jsd_beta(beta: float) -> float:
    """``beta`` as a float; ``ValueError`` unless it is a finite number in ``[0, 1]``."""
    value = float(beta)
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"jsd_beta must lie in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta!r}")
    return value


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token generalized JSD between teacher and student, fp32 ``[N]`` (nats).

    ``student_logits`` and ``teacher_logits`` are ``[N, V]``; the teacher is normally computed under
    ``torch.no_grad()``. Raises ``ValueError`` on a shape mismatch or ``beta`` outside ``[0, 1]``.
    """
    check_pair(student_logits, teacher_logits)
    beta = check_jsd_beta(beta)
    log_q = log_probs(student_logits)
    log_p = log_probs(teacher_logits)
    if beta == 0.0:
        return kl_logspace(log_p, log_q)
    if beta == 1.0:
        return kl_logspace(log_q, log_p)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log1p(-beta)]), dim=0)
    return beta * kl_logspace(log_p, log_m) + (1.0 - beta) * kl_logspace(log_q, log_m)
