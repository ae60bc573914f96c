"""The composer loss: response-masked CE + hint self-distillation + trace-replay preference.

Public API: :func:`compose_loss`, the RL channel-1 losses :func:`grpo_loss` (TRL 1.16's GRPO
family), :func:`group_advantages` and :func:`dppo_loss` (PRIME-RL's DPPO-clip),
:class:`LossComponents`, :class:`TAIDScheduler` and
:func:`sequence_logprobs` (fp32 ``[B]`` sum of response-token log-probs, used by ``data.py`` for
the DPO reference log-probs). The per-token/per-pair building blocks live in :mod:`.jsd`,
:mod:`.taid`, :mod:`.entropy_opd` and :mod:`.dpo`.

Batch keys (``[B, T]`` tensors unless noted): ``input_ids``, ``attention_mask``, ``response_mask``;
``ctx_teacher_input_ids``, ``ctx_teacher_attention_mask``, ``ctx_teacher_response_mask``;
``dpo_chosen_input_ids``, ``dpo_chosen_attention_mask``, ``dpo_chosen_response_mask``,
``dpo_rejected_input_ids``, ``dpo_rejected_attention_mask``, ``dpo_rejected_response_mask``,
``dpo_chosen_ref_logprobs`` ``[B]``, ``dpo_rejected_ref_logprobs`` ``[B]``.
"""

from __future__ import annotations

from diloco_serverless.loss.advantages import group_advantages
from diloco_serverless.loss.compose import SDPO_WRAPPERS, LossComponents, compose_loss, scored_tokens
from diloco_serverless.loss.dpo import DPO_VARIANTS, dpo_loss, simpo_loss
from diloco_serverless.loss.dppo import dppo_loss
from diloco_serverless.loss.entropy_opd import entropy_opd_loss, teacher_entropy
from diloco_serverless.loss.grpo import grpo_loss
from diloco_serverless.loss.jsd import generalized_jsd
from diloco_serverless.loss.logprobs import response_ce, sequence_logprobs
from diloco_serverless.loss.taid import TAIDScheduler, taid_loss

__all__ = [
    "DPO_VARIANTS",
    "SDPO_WRAPPERS",
    "LossComponents",
    "TAIDScheduler",
    "compose_loss",
    "dpo_loss",
    "dppo_loss",
    "entropy_opd_loss",
    "generalized_jsd",
    "group_advantages",
    "grpo_loss",
    "response_ce",
    "scored_tokens",
    "sequence_logprobs",
    "simpo_loss",
    "taid_loss",
    "teacher_entropy",
]
