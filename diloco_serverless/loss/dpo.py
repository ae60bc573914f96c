"""Preference losses for the trace-replay channel: DPO and SimPO.

* DPO (Rafailov et al., "Direct Preference Optimization", arXiv 2305.18290, Eq. 7)::

      loss = -log sigmoid(beta * ((lp_c - ref_c) - (lp_r - ref_r)))

  with ``lp_*`` the policy's and ``ref_*`` the frozen reference model's sequence log-probs.
* SimPO (Meng et al., "Simple Preference Optimization with a Reference-Free Reward",
  arXiv 2405.14734, Eq. 6)::

      loss = -log sigmoid(beta * (avg_lp_c - avg_lp_r) - gamma)

  with length-normalised (per response token) log-probs and no reference model.

Both return one loss per pair (fp32 ``[B]``); ``logsigmoid`` keeps them finite for any finite margin.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DPO_VARIANTS = ("dpo", "simpo")


def check_positive(name: str, value: float) -> float:
    """``value`` as a float; ``ValueError`` naming ``name`` unless it is finite and > 0."""
    out = float(value)
    if not math.isfinite(out) or out <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return out


def check_variant(dpo_variant: str) -> str:
    """``ValueError`` listing the choices unless ``dpo_variant`` is one of :data:`DPO_VARIANTS`."""
    if dpo_variant not in DPO_VARIANTS:
        raise ValueError(f"dpo_variant must be one of {DPO_VARIANTS}, got {dpo_variant!r}")
    return dpo_variant


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or any(len(s) != 1 for s in shapes.values()):
        raise ValueError(f"preference log-probs must all be [B] with the same B, got shapes {shapes}")


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """Per-pair DPO loss, fp32 ``[B]``. Raises ``ValueError`` on shape mismatch or ``beta <= 0``."""
    _check_same_shape(
        policy_chosen=policy_chosen, policy_rejected=policy_rejected, ref_chosen=ref_chosen, ref_rejected=ref_rejected
    )
    beta = check_positive("dpo_beta", beta)
    chosen = policy_chosen.float() - ref_chosen.float()
    rejected = policy_rejected.float() - ref_rejected.float()
    return -F.logsigmoid(beta * (chosen - rejected))


def simpo_loss(avg_chosen: torch.Tensor, avg_rejected: torch.Tensor, beta: float, gamma: float) -> torch.Tensor:
    """Per-pair SimPO loss from length-normalised log-probs, fp32 ``[B]``.

    Raises ``ValueError`` on shape mismatch, ``beta <= 0`` or a non-finite ``gamma``.
    """
    _check_same_shape(avg_chosen=avg_chosen, avg_rejected=avg_rejected)
    beta = check_positive("simpo_beta", beta)
    gamma = float(gamma)
    if not math.isfinite(gamma):
        raise ValueError(f"simpo_gamma must be finite, got {gamma!r}")
    return -F.logsigmoid(beta * (avg_chosen.float() - avg_rejected.float()) - gamma)
