"""TAID: Temporally Adaptive Interpolated Distillation (Shing et al., ICLR 2025, arXiv 2501.16937).

A port of the loss and the adaptive schedule of the reference implementation (SakanaAI/TAID,
``src/distil_losses/taid.py``), rewritten for this package. The student learns from an
intermediate distribution that moves from itself (``t = 0``) to the teacher (``t = 1``)::

    p_t  = softmax((1 - t) * stopgrad(student_logits) + t * teacher_logits)
    loss = -mean_token sum_v p_t(v) * log_softmax(student_logits)(v)

As upstream, the loss is the cross-entropy to ``p_t`` (upstream calls it "forward KL"; it differs
from ``KL(p_t || student)`` by the entropy of ``p_t``, which carries no gradient). At ``t = 0`` the
gradient is exactly zero and the teacher is not read; at ``t = 1`` it is the cross-entropy to the
teacher, i.e. ``KL(teacher || student) + H(teacher)``, with the gradient of the forward KL.
Vocabulary entries where the student logit is infinite (masked) contribute 0, as upstream.
"""

from __future__ import annotations

import math

import torch

from diloco_serverless.loss._math import check_pair, log_probs


def check_taid_t(t: float | None) -> float:
    """``t`` as a float; ``ValueError`` when it is missing, non-finite or outside ``[0, 1]``."""
    if t is None:
        raise ValueError("sdpo_wrapper='taid' needs taid_t in [0, 1] (e.g. TAIDScheduler(...).t); got None")
    value = float(t)
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"taid_t must lie in [0, 1], got {t!r}")
    return value


def taid_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, t: float) -> torch.Tensor:
    """Per-token TAID loss, fp32 ``[N]``. Raises ``ValueError`` on a shape mismatch or bad ``t``."""
    check_pair(student_logits, teacher_logits)
    t = check_taid_t(t)
    student = student_logits.float()
    if t == 0.0:
        mixed = student.detach()
    elif t == 1.0:
        mixed = teacher_logits.float().detach()
    else:
        mixed = (1.0 - t) * student.detach() + t * teacher_logits.float().detach()
    target = torch.softmax(mixed, dim=-1)
    terms = target * log_probs(student)
    terms = torch.where(torch.isinf(student), torch.zeros_like(terms), terms)
    return -terms.sum(dim=-1)


class TAIDScheduler:
    """The adaptive schedule of the interpolation parameter ``t`` (TAID, arXiv 2501.16937, Sec. 3.2).

    Call :meth:`update_t` once per optimizer step with that step's TAID loss (the ``sdpo_jsd``
    component) and pass :attr:`t` as ``taid_t`` to the next ``compose_loss``. Adaptive mode keeps a
    momentum ``m`` of the loss's relative improvement and moves ``t`` by
    ``alpha * sigmoid(m) * (1 - t)``, never below the linear schedule and never above ``t_end``;
    the first call only records the loss. ``disable_adaptive=True`` is the plain linear schedule
    ``t_start + progress * (t_end - t_start)`` with ``progress = global_step / num_train_steps``
    (clamped to ``[0, 1]``). ``t`` depends on the replica's own loss: replicas that must share ``t``
    should use the linear mode or feed a loss they agree on. Invalid arguments raise ``ValueError``.
    """

    def __init__(
        self,
        num_train_steps: int,
        t_start: float = 0.4,
        t_end: float = 1.0,
        alpha: float = 5e-4,
        beta: float = 0.99,
        disable_adaptive: bool = False,
    ) -> None:
        if int(num_train_steps) != num_train_steps or num_train_steps < 1:
            raise ValueError(f"TAIDScheduler needs num_train_steps >= 1 (an integer), got {num_train_steps!r}")
        if not 0.0 <= t_start < 1.0 or not 0.0 < t_end <= 1.0 or t_start > t_end:
            raise ValueError(
                "TAIDScheduler needs 0 <= t_start <= t_end <= 1 and t_start < 1, "
                f"got t_start={t_start!r}, t_end={t_end!r}"
            )
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"TAIDScheduler alpha (step size of t) must lie in [0, 1], got {alpha!r}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"TAIDScheduler beta (momentum decay) must lie in [0, 1), got {beta!r}")
        self.num_train_steps = int(num_train_steps)
        self.t_start, self.t_end = float(t_start), float(t_end)
        self.alpha, self.beta = float(alpha), float(beta)
        self.disable_adaptive = bool(disable_adaptive)
        self.t = self.t_start
        self.momentum = 0.0
        self.prev_loss: float | None = None

    def target(self, global_step: int) -> float:
        """The linear schedule's value at ``global_step``."""
        progress = min(max(global_step / self.num_train_steps, 0.0), 1.0)
        return self.t_start + progress * (self.t_end - self.t_start)

    def update_t(self, loss: float | torch.Tensor, global_step: int) -> float:
        """Advance ``t`` after the step ``global_step`` whose TAID loss was ``loss``; returns the new ``t``.

        Raises ``ValueError`` when ``loss`` is not finite (it would poison the momentum).
        """
        value = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
        if not math.isfinite(value):
            raise ValueError(f"TAIDScheduler.update_t got a non-finite loss {value!r} at global_step {global_step}")
        if self.disable_adaptive:
            self.t = self.target(global_step)
        elif self.prev_loss is not None:
            relative_change = (self.prev_loss - value) / (self.prev_loss + 1e-15)
            self.momentum = self.beta * self.momentum + (1.0 - self.beta) * relative_change
            delta_t = self.alpha * _sigmoid(self.momentum) * (1.0 - self.t)
            self.t = min(self.t_end, max(self.target(global_step), self.t + delta_t))
        self.prev_loss = value
        return self.t

    def state_dict(self) -> dict[str, float | None]:
        """JSON-serialisable state (``t``, momentum, previous loss) for checkpoints."""
        return {"t": self.t, "momentum": self.momentum, "prev_loss": self.prev_loss}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        """Restore what :meth:`state_dict` returned; ``KeyError`` naming a missing entry."""
        self.t = float(state["t"])  # type: ignore[arg-type]
        self.momentum = float(state["momentum"])  # type: ignore[arg-type]
        prev = state["prev_loss"]
        self.prev_loss = None if prev is None else float(prev)


def _sigmoid(x: float) -> float:
    """Numerically stable logistic function for Python floats."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)
