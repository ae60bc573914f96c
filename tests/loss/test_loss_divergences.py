"""Per-token distillation losses against hand-computed references and their endpoints."""

from __future__ import annotations

import math

import pytest
import torch

from diloco_serverless.loss import (
    entropy_opd_loss,
    generalized_jsd,
    taid_loss,
    teacher_entropy,
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _kl(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def _logits(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


# Two tokens over a vocabulary of 3, written as probabilities so the references are plain arithmetic.
TEACHER = [[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]]
STUDENT = [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_generalized_jsd_matches_hand_reference(beta: float) -> None:
    out = generalized_jsd(_logits(STUDENT), _logits(TEACHER), beta)
    expected = []
    for p, q in zip(TEACHER, STUDENT):
        if beta == 0.0:
            expected.append(_kl(p, q))  # forward KL(teacher || student)
        elif beta == 1.0:
            expected.append(_kl(q, p))  # reverse KL(student || teacher)
        else:
            m = [beta * pi + (1 - beta) * qi for pi, qi in zip(p, q)]
            expected.append(beta * _kl(p, m) + (1 - beta) * _kl(q, m))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=1e-5)


def test_generalized_jsd_endpoints_are_forward_and_reverse_kl() -> None:
    student, teacher = torch.randn(5, 7), torch.randn(5, 7)
    log_q, log_p = student.log_softmax(-1), teacher.log_softmax(-1)
    forward = (log_p.exp() * (log_p - log_q)).sum(-1)
    reverse = (log_q.exp() * (log_q - log_p)).sum(-1)
    torch.testing.assert_close(generalized_jsd(student, teacher, 0.0), forward)
    torch.testing.assert_close(generalized_jsd(student, teacher, 1.0), reverse)
    assert not torch.allclose(forward, reverse)


def test_generalized_jsd_zero_for_identical_and_bounded() -> None:
    logits = torch.randn(4, 6)
    for beta in (0.0, 0.5, 1.0):
        torch.testing.assert_close(generalized_jsd(logits, logits.clone(), beta), torch.zeros(4), atol=1e-6, rtol=0)
    # JSD(0.5) is at most log 2 for any pair of distributions.
    far = generalized_jsd(torch.tensor([[30.0, -30.0]]), torch.tensor([[-30.0, 30.0]]), 0.5)
    assert 0.69 < float(far) <= math.log(2) + 1e-6


@pytest.mark.parametrize("beta", [-0.1, 1.5, float("nan")])
def test_generalized_jsd_rejects_bad_beta(beta: float) -> None:
    with pytest.raises(ValueError, match="jsd_beta"):
        generalized_jsd(torch.zeros(1, 3), torch.zeros(1, 3), beta)


def test_shape_mismatch_names_shapes() -> None:
    for fn in (lambda s, t: generalized_jsd(s, t, 0.5), lambda s, t: taid_loss(s, t, 0.5), entropy_opd_loss):
        with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
            fn(torch.zeros(2, 3), torch.zeros(2, 4))


def test_taid_matches_hand_reference() -> None:
    s_logits = [[1.0, -0.5, 0.25], [0.0, 2.0, -1.0]]
    t_logits = [[-1.0, 0.5, 2.0], [1.5, 0.0, 0.5]]
    t = 0.4
    expected = []
    for s, te in zip(s_logits, t_logits):
        target = _softmax([(1 - t) * a + t * b for a, b in zip(s, te)])
        log_q = [math.log(v) for v in _softmax(s)]
        expected.append(-sum(p * lq for p, lq in zip(target, log_q)))
    out = taid_loss(torch.tensor(s_logits), torch.tensor(t_logits), t)
    torch.testing.assert_close(out, torch.tensor(expected), atol=1e-6, rtol=1e-5)


def test_taid_at_t0_has_zero_gradient_and_ignores_teacher() -> None:
    student = torch.randn(4, 9, requires_grad=True)
    a = taid_loss(student, torch.randn(4, 9), 0.0)
    b = taid_loss(student, torch.randn(4, 9) * 10, 0.0)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    (grad,) = torch.autograd.grad(a.mean(), student)
    torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-7, rtol=0)


def test_taid_at_t1_is_forward_kl_to_teacher() -> None:
    student = torch.randn(4, 9, requires_grad=True)
    teacher = torch.randn(4, 9)
    out = taid_loss(student, teacher, 1.0)
    log_p, log_q = teacher.log_softmax(-1), student.log_softmax(-1)
    forward_kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    teacher_h = -(log_p.exp() * log_p).sum(-1)
    # Upstream's loss is the cross-entropy to the teacher: forward KL plus the teacher's entropy ...
    torch.testing.assert_close(out, forward_kl + teacher_h)
    # ... so its gradient is exactly the forward KL's gradient.
    (g_taid,) = torch.autograd.grad(out.sum(), student)
    (g_kl,) = torch.autograd.grad(forward_kl.sum(), student)
    torch.testing.assert_close(g_taid, g_kl, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("t", [-0.01, 1.01, float("inf"), None])
def test_taid_rejects_bad_t(t: float | None) -> None:
    with pytest.raises(ValueError, match="taid_t"):
        taid_loss(torch.zeros(1, 3), torch.zeros(1, 3), t)  # type: ignore[arg-type]


def test_entropy_opd_matches_hand_reference() -> None:
    out = entropy_opd_loss(_logits(STUDENT), _logits(TEACHER))
    expected = []
    for p, q in zip(TEACHER, STUDENT):
        w = min(max(-sum(v * math.log(v) for v in p) / math.log(3), 0.0), 1.0)
        expected.append(w * _kl(p, q) + (1 - w) * _kl(q, p))
    torch.testing.assert_close(out, torch.tensor(expected), atol=1e-6, rtol=1e-5)


def test_entropy_opd_h_max_clamps_weight_to_forward_kl() -> None:
    student, teacher = torch.randn(3, 5), torch.randn(3, 5)
    log_p, log_q = teacher.log_softmax(-1), student.log_softmax(-1)
    forward = (log_p.exp() * (log_p - log_q)).sum(-1)
    # A tiny h_max makes every w = clamp(H / h_max, 0, 1) = 1: pure forward KL.
    torch.testing.assert_close(entropy_opd_loss(student, teacher, 1e-9), forward)
    with pytest.raises(ValueError, match="entropy_opd_h_max"):
        entropy_opd_loss(student, teacher, 0.0)


def test_entropy_opd_zero_when_teacher_equals_student() -> None:
    logits = torch.randn(6, 11)
    torch.testing.assert_close(entropy_opd_loss(logits, logits.clone()), torch.zeros(6), atol=1e-6, rtol=0)


def test_teacher_entropy_endpoints() -> None:
    vocab = 16
    one_hot = torch.full((1, vocab), -1e4)
    one_hot[0, 3] = 1e4
    masked = torch.full((1, vocab), float("-inf"))
    masked[0, 5] = 0.0
    uniform = torch.zeros(1, vocab)
    assert float(teacher_entropy(one_hot)) == pytest.approx(0.0, abs=1e-6)
    assert float(teacher_entropy(masked)) == pytest.approx(0.0, abs=1e-6)
    assert float(teacher_entropy(uniform)) == pytest.approx(math.log(vocab), rel=1e-6)


@pytest.mark.parametrize(
    "loss_fn",
    [
        lambda s, t: generalized_jsd(s, t, 0.0),
        lambda s, t: generalized_jsd(s, t, 0.5),
        lambda s, t: generalized_jsd(s, t, 1.0),
        lambda s, t: taid_loss(s, t, 0.7),
        lambda s, t: entropy_opd_loss(s, t),
    ],
    ids=["jsd0", "jsd.5", "jsd1", "taid", "entropy_opd"],
)
def test_extreme_and_masked_logits_stay_finite(loss_fn) -> None:  # type: ignore[no-untyped-def]
    student = torch.randn(4, 8) * 1e3
    teacher = torch.randn(4, 8) * 1e3
    student[:, 0] = teacher[:, 0] = float("-inf")  # a masked vocabulary entry (e.g. padded vocab)
    student.requires_grad_(True)
    out = loss_fn(student, teacher)
    (grad,) = torch.autograd.grad(out.sum(), student)
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
