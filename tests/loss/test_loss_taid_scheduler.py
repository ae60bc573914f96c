"""TAIDScheduler: the linear mode and the adaptive momentum mode (TAID, arXiv 2501.16937)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diloco_serverless.loss import TAIDScheduler


def test_starts_at_t_start() -> None:
    assert TAIDScheduler(100).t == 0.4
    assert TAIDScheduler(100, t_start=0.1).t == 0.1


def test_linear_mode_follows_the_line_and_ignores_loss() -> None:
    sched = TAIDScheduler(10, t_start=0.2, t_end=0.8, disable_adaptive=True)
    seen = [sched.update_t(loss, step) for step, loss in zip(range(11), [5.0, 1.0, 9.0, 0.1] * 3)]
    assert seen == pytest.approx([0.2 + 0.06 * step for step in range(11)])
    assert sched.update_t(1.0, 25) == pytest.approx(0.8)  # progress is clamped at the end


def test_adaptive_first_call_only_records_the_loss() -> None:
    sched = TAIDScheduler(1000)
    assert sched.update_t(3.0, 0) == 0.4
    assert sched.prev_loss == 3.0 and sched.momentum == 0.0


def test_adaptive_step_matches_hand_computation() -> None:
    sched = TAIDScheduler(1000, t_start=0.4, alpha=0.1, beta=0.9)
    sched.update_t(2.0, 0)
    t = sched.update_t(1.0, 1)
    momentum = 0.1 * ((2.0 - 1.0) / (2.0 + 1e-15))
    delta = 0.1 * (1.0 / (1.0 + math.exp(-momentum))) * (1.0 - 0.4)
    assert sched.momentum == pytest.approx(momentum)
    assert t == pytest.approx(max(0.4 + 0.6 * 1 / 1000, 0.4 + delta))


def test_adaptive_moves_t_toward_t_end_faster_than_linear_and_stays_bounded() -> None:
    adaptive = TAIDScheduler(1000, alpha=0.05)
    linear = TAIDScheduler(1000, alpha=0.05, disable_adaptive=True)
    previous = adaptive.t
    for step in range(200):
        loss = torch.tensor(5.0 * 0.98**step)  # a steadily improving loss, as a tensor
        t = adaptive.update_t(loss, step)
        linear.update_t(loss, step)
        assert previous <= t <= 1.0  # monotone, never past t_end
        previous = t
    assert adaptive.t > linear.t + 0.3
    assert adaptive.t > 0.9


def test_adaptive_never_falls_behind_linear_even_when_loss_rises() -> None:
    sched = TAIDScheduler(100, alpha=1e-4)
    for step in range(101):
        t = sched.update_t(1.0 + step, step)  # worsening loss: momentum < 0
        assert t >= sched.target(step) - 1e-12
    assert sched.t == pytest.approx(1.0)


def test_state_dict_round_trips_through_json() -> None:
    sched = TAIDScheduler(100)
    for step, loss in enumerate([3.0, 2.5, 2.0]):
        sched.update_t(loss, step)
    restored = TAIDScheduler(100)
    restored.load_state_dict(json.loads(json.dumps(sched.state_dict())))
    assert restored.update_t(1.5, 3) == sched.update_t(1.5, 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_train_steps": 0},
        {"num_train_steps": 10, "t_start": 1.0},
        {"num_train_steps": 10, "t_end": 0.0},
        {"num_train_steps": 10, "t_start": 0.8, "t_end": 0.5},
        {"num_train_steps": 10, "alpha": 2.0},
        {"num_train_steps": 10, "beta": 1.0},
    ],
)
def test_invalid_arguments_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="TAIDScheduler"):
        TAIDScheduler(**kwargs)  # type: ignore[arg-type]


def test_non_finite_loss_raises_naming_step() -> None:
    sched = TAIDScheduler(10)
    with pytest.raises(ValueError, match="global_step 3"):
        sched.update_t(float("nan"), 3)


def test_adaptive_moves_faster_when_the_loss_improves_faster() -> None:
    fast, flat = TAIDScheduler(10_000, alpha=0.01), TAIDScheduler(10_000, alpha=0.01)
    for step in range(50):
        fast.update_t(10.0 * 0.8**step, step)
        flat.update_t(10.0, step)
    assert fast.momentum > 0.0 == flat.momentum
    assert fast.t > flat.t > 0.4
