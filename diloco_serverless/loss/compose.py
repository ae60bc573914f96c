"""``compose_loss``: the three-channel composer loss every replica minimises in its inner steps.

    total = lm_ce + alpha_sdpo * sdpo_jsd + beta_replay * trace_replay_dpo

1. ``lm_ce`` (always on): response-masked next-token cross-entropy of ``input_ids``; or, with
   ``channel1="grpo"|"dppo"`` and a batch that carries rollouts (an ``advantages`` key), the RL
   loss ``rl`` of :mod:`.rl_channel` (TRL's GRPO family or PRIME-RL's DPPO-clip) from the same
   forward pass: ``total = rl + alpha_sdpo * sdpo_jsd + beta_replay * trace_replay_dpo``, and
   ``lm_ce`` is then the (detached) NLL of the sampled completions, reported only.
2. ``sdpo_jsd`` (hint self-distillation): the same model, under ``torch.no_grad()``, reads
   ``ctx_teacher_input_ids`` (prompt + hint + the same response); its response logits teach the
   student's response logits through the generalized JSD (:mod:`.jsd`), TAID (:mod:`.taid`) or
   entropy-aware OPD (:mod:`.entropy_opd`). Mean over response tokens.
3. ``trace_replay_dpo`` (trace-replay preference): DPO or SimPO (:mod:`.dpo`) on
   ``dpo_chosen_*`` / ``dpo_rejected_*`` pairs. Mean over pairs.

A channel whose weight is 0, or whose inputs are absent (missing, ``None`` or empty tensors),
contributes an exact fp32 zero and runs no forward pass; with both weights 0 ``total`` is ``lm_ce``
itself, bit for bit what ``transformers`` computes for ``labels`` masked to the response.
The model's mode (train/eval) is left as it is for the teacher pass. Loss math runs in fp32 with
autocast disabled; the forward passes run under whatever autocast the caller set.

Speed: when the chosen side of every pair *is* the student sequence (same ids and masks: records
without their own preference pair, as the stdlib data), its log-probs come from the student's
logits and only the rejected side runs a forward pass. The loss math reads no tensor value into
Python (no boolean-mask indexing, no ``.item()``): the checks that read values (empty response
masks, teacher/student token counts, non-finite reference log-probs) run together in one read when
``validate=True`` (the default) and not at all with ``validate=False``, and the chosen-is-student test
is one more read when the replay channel is live.

Micro-batches: ``token_count`` / ``pair_count`` replace the number of scored response tokens / pairs
the means are taken over; pass the whole batch's (:func:`scored_tokens`, the row count) for each of
its micro-batches and the micro-batches' losses add up to the whole batch's loss, their gradients
to its gradient.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from diloco_serverless.loss._batch import (
    SequenceInputs,
    check_has_response,
    check_ref_finite,
    check_ref_logprobs,
    check_same_rows,
    is_absent,
    sequence_inputs,
)
from diloco_serverless.loss.dpo import (
    check_positive,
    check_variant,
    dpo_loss,
    simpo_loss,
)
from diloco_serverless.loss.entropy_opd import check_h_max, entropy_opd_loss
from diloco_serverless.loss.jsd import check_jsd_beta, generalized_jsd
from diloco_serverless.loss.logprobs import (
    aligned_logits,
    causal_lm_logits,
    fp32_math,
    masked_mean,
    response_ce,
    token_logprobs,
)
from diloco_serverless.loss.rl_channel import CHANNEL1_KINDS, RLLossSettings, carries_rollouts, rl_channel
from diloco_serverless.loss.taid import check_taid_t, taid_loss

SDPO_WRAPPERS = ("none", "taid", "entropy_opd")
_TEACHER_KEYS = ("ctx_teacher_input_ids", "ctx_teacher_attention_mask", "ctx_teacher_response_mask")
_PAIR_KEYS = ("dpo_chosen_input_ids", "dpo_rejected_input_ids")


@dataclass(frozen=True)
class LossComponents:
    """The total loss (differentiable) and its three channels, each an fp32 scalar tensor.

    ``sdpo_jsd`` and ``trace_replay_dpo`` are unweighted; a disabled channel is an exact 0. With an
    RL channel 1, ``rl`` is its loss, ``rl_stats`` its detached metrics and ``rl_token_logprobs`` the
    policy's ``[B, T]`` per-token log-probs (see :class:`~diloco_serverless.loss.rl_channel.RLChannel`).
    """

    total: torch.Tensor
    lm_ce: torch.Tensor
    sdpo_jsd: torch.Tensor
    trace_replay_dpo: torch.Tensor
    rl: torch.Tensor | None = None
    rl_stats: dict[str, torch.Tensor] = field(default_factory=dict)
    rl_token_logprobs: torch.Tensor | None = None

    def to_floats(self) -> dict[str, float]:
        """Detached Python floats for metrics and heartbeats (``rl`` and its metrics when present)."""
        names = ("total", "lm_ce", "sdpo_jsd", "trace_replay_dpo")
        out = {name: float(getattr(self, name).detach()) for name in names}
        if self.rl is not None:
            out["rl"] = float(self.rl.detach())
            out.update({k: float(v) for k, v in self.rl_stats.items()})
        return out


@dataclass(frozen=True)
class _Settings:
    alpha_sdpo: float
    beta_replay: float
    dpo_variant: str
    dpo_beta: float
    simpo_beta: float
    simpo_gamma: float
    jsd_beta: float
    sdpo_wrapper: str
    taid_t: float | None
    entropy_opd_h_max: float | None


def compose_loss(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    alpha_sdpo: float = 0.0,
    beta_replay: float = 0.0,
    dpo_variant: str = "dpo",
    dpo_beta: float = 0.1,
    simpo_beta: float = 2.0,
    simpo_gamma: float = 1.0,
    jsd_beta: float = 0.5,
    sdpo_wrapper: str = "none",
    taid_t: float | None = None,
    entropy_opd_h_max: float | None = None,
    validate: bool = True,
    token_count: torch.Tensor | float | None = None,
    pair_count: float | None = None,
    channel1: str = "lm",
    rl: RLLossSettings | None = None,
) -> LossComponents:
    """Compute ``total = lm_ce + alpha_sdpo * sdpo_jsd + beta_replay * trace_replay_dpo``.

    ``model`` is any causal LM returning ``.logits`` (``transformers`` or compatible); ``batch`` holds
    the keys listed in the package docstring. Raises ``ValueError`` naming the argument or batch key
    (and shapes) for: an unknown ``dpo_variant`` / ``sdpo_wrapper``, a weight < 0 or non-finite,
    ``jsd_beta`` / ``taid_t`` outside ``[0, 1]``, ``taid_t`` missing with ``sdpo_wrapper='taid'``,
    masks whose shape differs from their ids, row counts that disagree, reference log-probs that are
    not ``[B]``, and, with ``validate=True``, a teacher row scoring a different number of response
    tokens than the student row, a response mask with no tokens, or non-finite reference log-probs
    (with ``validate=False`` such a batch gives a wrong or non-finite loss instead).

    ``token_count`` (tensor or number) and ``pair_count``: what ``lm_ce``/``sdpo_jsd`` and
    ``trace_replay_dpo`` are averaged over instead of this batch's scored response tokens and rows
    (see the module docstring: micro-batches).

    ``channel1``: ``"lm"``, ``"grpo"`` or ``"dppo"``; an RL kind uses ``rl`` (default
    :class:`RLLossSettings` of that kind) when the batch carries rollouts, and ``lm_ce`` otherwise.
    The RL loss's own normaliser is the batch key ``num_items_in_batch`` (``token_count`` does not
    apply to it).
    """
    if channel1 not in CHANNEL1_KINDS:
        raise ValueError(f"channel1 must be one of {CHANNEL1_KINDS} (loss.channel1), got {channel1!r}")
    if channel1 != "lm" and rl is None:
        rl = RLLossSettings(kind=channel1)
    if rl is not None and channel1 != "lm" and rl.kind != channel1:
        raise ValueError(f"channel1={channel1!r} but the RL settings are for {rl.kind!r}")
    settings = _validate_settings(
        alpha_sdpo=alpha_sdpo, beta_replay=beta_replay, dpo_variant=dpo_variant, dpo_beta=dpo_beta,
        simpo_beta=simpo_beta, simpo_gamma=simpo_gamma, jsd_beta=jsd_beta, sdpo_wrapper=sdpo_wrapper,
        taid_t=taid_t, entropy_opd_h_max=entropy_opd_h_max,
    )  # fmt: skip
    student = sequence_inputs(batch, "", "by the language-modelling channel")
    teacher = pair = None
    if settings.alpha_sdpo != 0.0 and not is_absent(batch, _TEACHER_KEYS[0]):
        teacher = sequence_inputs(batch, "ctx_teacher_", "by the hint self-distillation channel (alpha_sdpo > 0)")
        check_same_rows("input_ids", student.input_ids, teacher.ids_key, teacher.input_ids)
    if settings.beta_replay != 0.0 and not all(is_absent(batch, key) for key in _PAIR_KEYS):
        pair = _pair_inputs(batch, settings)
    if validate:
        _check_values(student, teacher, pair)
    logits = causal_lm_logits(model, student.input_ids, student.attention_mask)
    rl_out = None
    if channel1 != "lm" and carries_rollouts(batch):
        assert rl is not None
        rl_out = rl_channel(logits, student, batch, rl)
        lm_ce, total = rl_out.nll, rl_out.loss
    else:
        lm_ce = response_ce(logits, student.input_ids, student.response_mask, token_count)
        total = lm_ce
    sdpo, replay = _zero(lm_ce), _zero(lm_ce)
    if teacher is not None:
        tokens = student.scored.sum() if token_count is None else token_count
        sdpo = _sdpo_channel(model, student, teacher, logits, settings, tokens)
        total = total + settings.alpha_sdpo * sdpo
    if pair is not None:
        replay = _replay_channel(model, student, logits, pair, settings, pair_count)
        total = total + settings.beta_replay * replay
    if rl_out is None:
        return LossComponents(total=total, lm_ce=lm_ce, sdpo_jsd=sdpo, trace_replay_dpo=replay)
    return LossComponents(
        total=total, lm_ce=lm_ce, sdpo_jsd=sdpo, trace_replay_dpo=replay, rl=rl_out.loss.detach(),
        rl_stats=rl_out.stats, rl_token_logprobs=rl_out.token_logprobs,
    )  # fmt: skip


def scored_tokens(batch: Mapping[str, Any]) -> torch.Tensor:
    """Number of response tokens ``lm_ce`` scores in ``batch`` (a long scalar tensor on the batch's
    device; no value is read): the ``token_count`` to pass for each micro-batch of ``batch``."""
    mask: torch.Tensor = batch["response_mask"]
    return (mask[:, 1:] != 0).sum()


@dataclass(frozen=True)
class _Pair:
    chosen: SequenceInputs
    rejected: SequenceInputs
    refs: tuple[tuple[str, torch.Tensor], ...]  # (key, [B] reference log-probs) for DPO, empty for SimPO


def _pair_inputs(batch: Mapping[str, Any], s: _Settings) -> _Pair:
    why = "by the trace-replay channel (beta_replay > 0)"
    chosen = sequence_inputs(batch, "dpo_chosen_", why)
    rejected = sequence_inputs(batch, "dpo_rejected_", why)
    check_same_rows(chosen.ids_key, chosen.input_ids, rejected.ids_key, rejected.input_ids)
    refs: tuple[tuple[str, torch.Tensor], ...] = ()
    if s.dpo_variant == "dpo":
        rows = chosen.input_ids.shape[0]
        refs = tuple(
            (key, check_ref_logprobs(batch, key, rows, chosen.ids_key, finite=False))
            for key in ("dpo_chosen_ref_logprobs", "dpo_rejected_ref_logprobs")
        )
    return _Pair(chosen, rejected, refs)


def _check_values(student: SequenceInputs, teacher: SequenceInputs | None, pair: _Pair | None) -> None:
    """The checks that read tensor values, in one read; if one fails, it raises its own message."""
    device = student.input_ids.device
    bad = [student.tokens_per_row.sum() == 0]
    if teacher is not None:
        bad.append((student.tokens_per_row != teacher.tokens_per_row.to(device)).any())
    if pair is not None:
        bad += [(seq.tokens_per_row == 0).any().to(device) for seq in (pair.chosen, pair.rejected)]
        bad += [(~torch.isfinite(ref)).any().to(device) for _, ref in pair.refs]
    if not bool(torch.stack(bad).any()):
        return
    check_has_response(student, per_row=False)
    if teacher is not None:
        _check_row_counts(student, teacher)
    if pair is not None:
        check_has_response(pair.chosen, per_row=True)
        check_has_response(pair.rejected, per_row=True)
        for key, ref in pair.refs:
            check_ref_finite(key, ref)


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=like.device)


def _check_weight(name: str, value: float) -> float:
    out = float(value)
    if not math.isfinite(out) or out < 0.0:
        raise ValueError(f"{name} must be a finite weight >= 0 (0 turns the channel off), got {value!r}")
    return out


def _validate_settings(**kw: Any) -> _Settings:
    """Check every keyword up front, whether or not its channel is live this call."""
    if kw["sdpo_wrapper"] not in SDPO_WRAPPERS:
        raise ValueError(f"sdpo_wrapper must be one of {SDPO_WRAPPERS}, got {kw['sdpo_wrapper']!r}")
    taid_t = kw["taid_t"]
    if kw["sdpo_wrapper"] == "taid" or taid_t is not None:
        taid_t = check_taid_t(taid_t)  # required by the TAID wrapper, range-checked whenever given
    gamma = float(kw["simpo_gamma"])
    if not math.isfinite(gamma):
        raise ValueError(f"simpo_gamma must be finite, got {kw['simpo_gamma']!r}")
    return _Settings(
        alpha_sdpo=_check_weight("alpha_sdpo", kw["alpha_sdpo"]),
        beta_replay=_check_weight("beta_replay", kw["beta_replay"]),
        dpo_variant=check_variant(kw["dpo_variant"]),
        dpo_beta=check_positive("dpo_beta", kw["dpo_beta"]),
        simpo_beta=check_positive("simpo_beta", kw["simpo_beta"]),
        simpo_gamma=gamma,
        jsd_beta=check_jsd_beta(kw["jsd_beta"]),
        sdpo_wrapper=kw["sdpo_wrapper"],
        taid_t=taid_t,
        entropy_opd_h_max=check_h_max(kw["entropy_opd_h_max"]),
    )


def _check_row_counts(student: SequenceInputs, teacher: SequenceInputs) -> None:
    """``ValueError`` naming the first row whose two response masks score different token counts."""
    s_counts, t_counts = student.tokens_per_row, teacher.tokens_per_row.to(student.input_ids.device)
    bad = (s_counts != t_counts).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        raise ValueError(
            f"row {row}: 'response_mask' scores {int(s_counts[row])} response tokens but "
            f"'ctx_teacher_response_mask' scores {int(t_counts[row])} (shapes "
            f"{tuple(student.response_mask.shape)} and {tuple(teacher.response_mask.shape)}); "
            "the teacher context must end with the same response as the student"
        )


def _sdpo_channel(
    model: nn.Module,
    student: SequenceInputs,
    teacher: SequenceInputs,
    logits: torch.Tensor,
    s: _Settings,
    tokens: torch.Tensor | float,
) -> torch.Tensor:
    """Mean per-token divergence between the hinted teacher pass and the student's logits.

    Computed at every student position (``[B * (T-1), V]``) against the teacher logits of the
    teacher's k-th scored token for the student's k-th, then averaged over the scored positions:
    no boolean indexing, so no value is read."""
    scored = student.scored
    with fp32_math(logits.device):
        student_all = logits[:, :-1].float()
    if s.sdpo_wrapper == "taid" and s.taid_t == 0.0:
        teacher_all = student_all.detach()  # TAID at t = 0 never reads the teacher: skip its forward.
    else:
        with torch.no_grad():
            teacher_logits = causal_lm_logits(model, teacher.input_ids, teacher.attention_mask)
            teacher_all = aligned_logits(teacher_logits, teacher.scored.to(teacher_logits.device), scored)
    with fp32_math(logits.device):
        vocab = student_all.shape[-1]
        flat_s = student_all.reshape(-1, vocab)
        flat_t = teacher_all.to(flat_s.device).float().reshape(-1, vocab)
        if s.sdpo_wrapper == "taid":
            per_token = taid_loss(flat_s, flat_t, s.taid_t)  # type: ignore[arg-type]
        elif s.sdpo_wrapper == "entropy_opd":
            per_token = entropy_opd_loss(flat_s, flat_t, s.entropy_opd_h_max)
        else:
            per_token = generalized_jsd(flat_s, flat_t, s.jsd_beta)
        return masked_mean(per_token.view(scored.shape), scored, tokens)


def _same_sequences(a: SequenceInputs, b: SequenceInputs) -> bool:
    """True when ``a`` and ``b`` are the same rows (ids, attention and response masks): one read."""
    if a.input_ids.shape != b.input_ids.shape or a.input_ids.device != b.input_ids.device:
        return False
    same = (
        (a.input_ids == b.input_ids).all()
        & (a.attention_mask == b.attention_mask).all()
        & ((a.response_mask != 0) == (b.response_mask != 0)).all()
    )
    return bool(same)


def _pair_token_logprobs(
    model: nn.Module, student: SequenceInputs, student_logits: torch.Tensor, pair: _Pair
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of both sides: the chosen side from the student's logits when it is the
    student sequence, else one forward pass of both sides when their lengths agree, else two."""
    chosen, rejected = pair.chosen, pair.rejected
    if _same_sequences(chosen, student):
        lp_r = token_logprobs(causal_lm_logits(model, rejected.input_ids, rejected.attention_mask), rejected)
        return token_logprobs(student_logits, chosen), lp_r
    if chosen.input_ids.shape == rejected.input_ids.shape:
        ids = torch.cat([chosen.input_ids, rejected.input_ids.to(chosen.input_ids.device)])
        mask = torch.cat([chosen.attention_mask, rejected.attention_mask.to(chosen.attention_mask.device)])
        logits = causal_lm_logits(model, ids, mask)
        rows = chosen.input_ids.shape[0]
        return token_logprobs(logits[:rows], chosen), token_logprobs(logits[rows:], rejected)
    lp_c = token_logprobs(causal_lm_logits(model, chosen.input_ids, chosen.attention_mask), chosen)
    lp_r = token_logprobs(causal_lm_logits(model, rejected.input_ids, rejected.attention_mask), rejected)
    return lp_c, lp_r


def _replay_channel(
    model: nn.Module,
    student: SequenceInputs,
    student_logits: torch.Tensor,
    pair: _Pair,
    s: _Settings,
    pair_count: float | None,
) -> torch.Tensor:
    """Mean DPO / SimPO loss over the ``dpo_chosen_*`` / ``dpo_rejected_*`` pairs."""
    chosen, rejected = pair.chosen, pair.rejected
    lp_c, lp_r = _pair_token_logprobs(model, student, student_logits, pair)
    with fp32_math(lp_c.device):
        sum_c, sum_r = lp_c.sum(dim=1), lp_r.sum(dim=1).to(lp_c.device)
        if s.dpo_variant == "dpo":
            (_, ref_c), (_, ref_r) = pair.refs
            per_pair = dpo_loss(sum_c, sum_r, ref_c.to(lp_c.device), ref_r.to(lp_c.device), s.dpo_beta)
        else:
            avg_c = sum_c / chosen.tokens_per_row.to(lp_c.device)
            avg_r = sum_r / rejected.tokens_per_row.to(lp_c.device)
            per_pair = simpo_loss(avg_c, avg_r, s.simpo_beta, s.simpo_gamma)
        return per_pair.mean() if pair_count is None else per_pair.sum() / pair_count
