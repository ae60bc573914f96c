"""DPO and SimPO per-pair losses against hand-computed references."""

from __future__ import annotations

import math

import pytest
import torch

from diloco_serverless.loss import dpo_loss, simpo_loss


def _neg_logsigmoid(x: float) -> float:
    return math.log1p(math.exp(-x))


def test_dpo_matches_hand_reference() -> None:
    lp_c, lp_r = torch.tensor([-3.0, -10.0]), torch.tensor([-5.0, -2.0])
    ref_c, ref_r = torch.tensor([-4.0, -9.0]), torch.tensor([-4.0, -3.0])
    out = dpo_loss(lp_c, lp_r, ref_c, ref_r, beta=0.1)
    # Row 0: margin ((-3 + 4) - (-5 + 4)) = 2; row 1: ((-10 + 9) - (-2 + 3)) = -2.
    expected = torch.tensor([_neg_logsigmoid(0.2), _neg_logsigmoid(-0.2)])
    torch.testing.assert_close(out, expected)
    assert out.dtype == torch.float32


def test_dpo_at_reference_is_log2() -> None:
    lp = torch.tensor([-7.0, -1.0, -3.5])
    out = dpo_loss(lp, lp - 2.0, lp, lp - 2.0, beta=0.5)
    torch.testing.assert_close(out, torch.full((3,), math.log(2.0)))


def test_simpo_matches_hand_reference() -> None:
    avg_c, avg_r = torch.tensor([-0.5, -2.0]), torch.tensor([-1.5, -1.0])
    out = simpo_loss(avg_c, avg_r, beta=2.0, gamma=1.0)
    expected = torch.tensor([_neg_logsigmoid(2.0 * 1.0 - 1.0), _neg_logsigmoid(2.0 * -1.0 - 1.0)])
    torch.testing.assert_close(out, expected)


def test_simpo_lower_for_better_separation() -> None:
    rejected = torch.tensor([-2.0])
    losses = [float(simpo_loss(torch.tensor([c]), rejected, 2.0, 1.0)) for c in (-3.0, -2.0, -1.0, -0.5)]
    assert losses == sorted(losses, reverse=True) and len(set(losses)) == len(losses)


def test_simpo_and_dpo_are_differentiable_and_push_the_right_way() -> None:
    chosen = torch.tensor([-1.0, -2.0], requires_grad=True)
    rejected = torch.tensor([-1.5, -1.0], requires_grad=True)
    simpo_loss(chosen, rejected, 2.0, 0.5).sum().backward()
    assert chosen.grad is not None and rejected.grad is not None
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # raise chosen, lower rejected
    lp_c = torch.tensor([-4.0], requires_grad=True)
    dpo_loss(lp_c, torch.tensor([-4.0]), torch.tensor([-4.0]), torch.tensor([-4.0]), 0.1).sum().backward()
    assert lp_c.grad is not None and float(lp_c.grad) < 0


def test_large_margins_stay_finite() -> None:
    big = torch.tensor([1e6, -1e6])
    assert torch.isfinite(dpo_loss(big, -big, torch.zeros(2), torch.zeros(2), 1.0)).all()
    assert torch.isfinite(simpo_loss(big, -big, 2.0, 1.0)).all()


def test_shape_mismatch_raises_with_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(2,\).*\(3,\)"):
        simpo_loss(torch.zeros(2), torch.zeros(3), 2.0, 1.0)
    with pytest.raises(ValueError, match="ref_rejected"):
        dpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2, 1), 0.1)


@pytest.mark.parametrize("beta", [0.0, -1.0, float("nan")])
def test_non_positive_beta_raises(beta: float) -> None:
    with pytest.raises(ValueError, match="dpo_beta"):
        dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta)
    with pytest.raises(ValueError, match="simpo_beta"):
        simpo_loss(torch.zeros(1), torch.zeros(1), beta, 1.0)
