"""``grpo_loss`` / ``group_advantages`` / ``dppo_loss`` against references written out per sequence.

The references below are plain Python loops over rows and tokens (floats, ``math``), written from
TRL 1.16's ``GRPOTrainer._compute_loss`` / advantage code and PRIME-RL's ``default_loss_fn``; they do
not call the functions under test. The ``*_trl`` tests also run TRL's own ``_compute_loss`` and
``nanstd``: ``trl`` is in the dev extra (pinned to 1.16.0 in constraints.txt, so CI runs them); without it
they skip.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diloco_serverless.loss import dppo_loss, group_advantages, grpo_loss
from diloco_serverless.loss.advantages import weighted_rewards
from diloco_serverless.loss.dppo import dppo_terms
from diloco_serverless.loss.grpo import grpo_terms

B, T = 6, 9


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3 - 0.05
    old = lp + torch.randn(B, T, generator=g) * 0.3  # ratios well outside [0.8, 1.2] for some tokens
    ref = lp + torch.randn(B, T, generator=g) * 0.5
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return {"lp": lp, "old": old, "ref": ref, "adv": adv, "mask": mask}


def _reference(
    x: dict[str, torch.Tensor], loss_type: str, eps_low: float, eps_high: float, delta: float | None,
    beta: float, level: str, max_len: int, items: float | None,
) -> float:  # fmt: skip
    lp, old, ref, adv, mask = (x[k].tolist() for k in ("lp", "old", "ref", "adv", "mask"))
    rows: list[list[float]] = []
    for b in range(B):
        n_b = sum(mask[b])
        seq_log_ratio = sum((lp[b][t] - old[b][t]) * mask[b][t] for t in range(T)) / max(n_b, 1.0)
        row = []
        for t in range(T):
            log_ratio = lp[b][t] - old[b][t] if level == "token" else seq_log_ratio
            r = math.exp(log_ratio)
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            r1 = r if delta is None else min(r, delta)
            term = -min(r1 * adv[b], clipped * adv[b])
            if beta:
                d = ref[b][t] - lp[b][t]
                term += beta * (math.exp(d) - d - 1)
            row.append(term * mask[b][t])
        rows.append(row)
    total = sum(sum(r) for r in rows)
    tokens = sum(sum(m) for m in mask)
    if loss_type == "grpo":
        return float(sum(sum(rows[b]) / max(sum(mask[b]), 1.0) for b in range(B)) / B)
    if loss_type == "bnpo":
        return float(total / tokens)
    if loss_type == "dr_grpo":
        return float(total / (B * max_len))
    return float(total / (tokens if items is None else items))


CASES = list(
    itertools.product(
        ("grpo", "bnpo", "dr_grpo", "dapo"),
        ((0.2, 0.2), (0.2, 0.28)),
        (None, 1.5),
        (0.0, 0.04),
        ("token", "sequence"),
    )
)


@pytest.mark.parametrize(("loss_type", "eps", "delta", "beta", "level"), CASES)
def test_grpo_loss_matches_reference(
    loss_type: str, eps: tuple[float, float], delta: float | None, beta: float, level: str
) -> None:
    for seed in range(3):
        x = _inputs(seed)
        items = 40.0 if seed == 2 else None
        got = grpo_loss(
            x["lp"], x["old"], x["adv"], x["mask"], loss_type=loss_type, epsilon_low=eps[0], epsilon_high=eps[1],
            delta=delta, beta=beta, ref_logprobs=x["ref"], importance_sampling_level=level,
            max_completion_length=12, num_items_in_batch=items,
        )  # fmt: skip
        want = _reference(x, loss_type, eps[0], eps[1], delta, beta, level, 12, items)
        assert got.dtype == torch.float32
        assert got.item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_on_policy_gradient_is_the_policy_gradient() -> None:
    """old_logprobs=None: ratio 1, so d loss / d lp[b, t] = -A_b / tokens for dapo (no clipping)."""
    x = _inputs(0)
    lp = x["lp"].clone().requires_grad_(True)
    loss = grpo_loss(lp, None, x["adv"], x["mask"], loss_type="dapo")
    (grad,) = torch.autograd.grad(loss, lp)
    expected = -x["adv"].unsqueeze(1) * x["mask"] / x["mask"].sum()
    torch.testing.assert_close(grad, expected)


def test_dapo_micro_batches_add_up() -> None:
    x = _inputs(1)
    kw: dict[str, Any] = {"loss_type": "dapo", "num_items_in_batch": x["mask"].sum()}
    whole = grpo_loss(x["lp"], x["old"], x["adv"], x["mask"], loss_type="dapo")
    parts = sum(grpo_loss(x["lp"][s], x["old"][s], x["adv"][s], x["mask"][s], **kw) for s in (slice(0, 2), slice(2, B)))
    torch.testing.assert_close(parts, whole)


def test_clip_fractions_and_kl_metrics() -> None:
    x = _inputs(0)
    terms = grpo_terms(x["lp"], x["old"], x["adv"], x["mask"], beta=0.1, ref_logprobs=x["ref"])
    lp, old, adv, mask, ref = (x[k].tolist() for k in ("lp", "old", "adv", "mask", "ref"))
    low = high = kl = tokens = 0.0
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            tokens += 1
            r = math.exp(lp[b][t] - old[b][t])
            low += float(r < 0.8 and adv[b] < 0)
            high += float(r > 1.2 and adv[b] > 0)
            d = ref[b][t] - lp[b][t]
            kl += math.exp(d) - d - 1
    assert terms.clip_low.item() == pytest.approx(low / tokens)
    assert terms.clip_high.item() == pytest.approx(high / tokens)
    assert terms.clip_fraction.item() > 0  # the random inputs do clip
    assert terms.kl.item() == pytest.approx(kl / tokens, rel=1e-5)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"importance_sampling_level": "row"}, "importance_sampling_level"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"delta": 0.9}, "delta"),
        ({"beta": 0.1}, "ref_logprobs"),
        ({"max_completion_length": 0}, "max_completion_length"),
    ],
)
def test_grpo_bad_options_are_named(kw: dict[str, Any], match: str) -> None:
    x = _inputs(0)
    with pytest.raises(ValueError, match=match):
        grpo_loss(x["lp"], x["old"], x["adv"], x["mask"], **kw)


# --- advantages ---------------------------------------------------------------------------------


def _std(values: list[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    if len(vals) < 2:
        return math.nan
    mean = sum(vals) / len(vals)
    return math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def _adv_reference(rewards: list[float], g: int, scale: str) -> list[float]:
    out = []
    batch_std = _std(rewards)
    for start in range(0, len(rewards), g):
        group = rewards[start : start + g]
        scorable = [r for r in group if not math.isnan(r)]
        mean = sum(scorable) / len(scorable) if scorable else math.nan
        std = _std(group) if g > 1 else 0.0
        for r in group:
            a = r - mean
            if scale == "group":
                a = a / (std + 1e-4)
            elif scale == "batch":
                a = a / (batch_std + 1e-4)
            out.append(0.0 if math.isnan(a) else a)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("g", [1, 2, 4])
def test_group_advantages_match_reference(scale: str, g: int) -> None:
    gen = torch.Generator().manual_seed(g)
    rewards = torch.randn(4 * g, generator=gen).tolist()
    rewards[1] = math.nan  # unscorable: out of its group's baseline, advantage 0
    if g == 4:
        rewards[8:12] = [1.0, 1.0, 1.0, 1.0]  # zero std group
        rewards[12:15] = [math.nan] * 3  # a group with one scorable completion
    with_none = [None if math.isnan(r) else r for r in rewards]
    got = group_advantages(with_none, g, scale=scale)
    want = _adv_reference(rewards, g, scale)
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert got[1].item() == 0.0
    torch.testing.assert_close(group_advantages(torch.tensor(rewards), g, scale=scale), got)


def test_group_advantages_bad_input() -> None:
    with pytest.raises(ValueError, match="scale"):
        group_advantages([1.0, 2.0], 2, scale="std")
    with pytest.raises(ValueError, match="multiple"):
        group_advantages([1.0, 2.0, 3.0], 2)


def test_weighted_rewards_nansum_and_unscorable() -> None:
    per_func = torch.tensor([[1.0, math.nan], [math.nan, math.nan], [0.5, 2.0]])
    out = weighted_rewards(per_func, [2.0, 0.5])
    assert out[0].item() == 2.0 and math.isnan(out[1].item()) and out[2].item() == 2.0
    with pytest.raises(ValueError, match="one weight per function"):
        weighted_rewards(per_func, [1.0])


# --- DPPO ---------------------------------------------------------------------------------------


def _dppo_reference(x: dict[str, torch.Tensor], high: float, low: float, adv_tau: float, kl_tau: float) -> float:
    lp, inf, adv, mask = (x[k].tolist() for k in ("lp", "old", "adv", "mask"))
    total = 0.0
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            r = math.exp(lp[b][t] - inf[b][t])
            diff = math.exp(lp[b][t]) - math.exp(inf[b][t])
            masked = diff > high if adv[b] > 0 else diff < -low
            pg = 0.0 if masked else adv_tau * adv[b] * r
            total += -pg + kl_tau * (lp[b][t] - inf[b][t]) ** 2
    return total


@pytest.mark.parametrize(("high", "low", "adv_tau", "kl_tau"), [(0.2, 0.2, 1.0, 1e-3), (0.05, 0.1, 0.5, 0.1)])
def test_dppo_loss_matches_reference(high: float, low: float, adv_tau: float, kl_tau: float) -> None:
    for seed in range(3):
        x = _inputs(seed)
        got = dppo_loss(
            x["lp"], x["old"], x["adv"], x["mask"], dppo_mask_high=high, dppo_mask_low=low, adv_tau=adv_tau,
            kl_tau=kl_tau,
        )  # fmt: skip
        assert got.item() == pytest.approx(_dppo_reference(x, high, low, adv_tau, kl_tau), rel=1e-5, abs=1e-6)
        per_token_adv = x["adv"].unsqueeze(1).expand(B, T)
        same = dppo_loss(
            x["lp"], x["old"], per_token_adv, x["mask"], dppo_mask_high=high, dppo_mask_low=low,
            adv_tau=adv_tau, kl_tau=kl_tau, token_count=4.0,
        )  # fmt: skip
        torch.testing.assert_close(same, got / 4.0)


def test_dppo_masks_by_advantage_sign() -> None:
    """A token whose probability rose past the bound is dropped only when its advantage is positive."""
    lp = torch.log(torch.tensor([[0.9, 0.9]]))
    inf = torch.log(torch.tensor([[0.5, 0.5]]))
    mask = torch.ones(1, 2)
    up = dppo_terms(lp, inf, torch.tensor([1.0]), mask, kl_tau=0.0)
    assert up.loss.item() == 0.0 and up.is_masked.item() == 1.0
    down = dppo_terms(lp, inf, torch.tensor([-1.0]), mask, kl_tau=0.0)
    assert down.loss.item() == pytest.approx(2 * 0.9 / 0.5) and down.is_masked.item() == 0.0
    with pytest.raises(ValueError, match="kl_tau"):
        dppo_loss(lp, inf, torch.tensor([1.0]), mask, kl_tau=-1.0)


# --- TRL's own code (optional) ------------------------------------------------------------------


def _trl_compute_loss(
    x: dict[str, torch.Tensor], loss_type: str, eps: tuple[float, float], delta: float | None, beta: float,
    level: str,
) -> torch.Tensor:  # fmt: skip
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    from collections import defaultdict

    accelerator = SimpleNamespace(
        num_processes=1,
        reduce=lambda t, reduction="sum": t,
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
    )
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (x["lp"], torch.zeros_like(x["lp"]), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=eps[0], epsilon_high=eps[1],
        args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=1),
        use_vllm=False, model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=12, accelerator=accelerator, _metrics={"train": defaultdict(list)},
        _entropy_bonus_enabled=False,
    )  # fmt: skip
    n = x["mask"].shape[0]
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1),
        "completion_ids": torch.zeros(n, T, dtype=torch.long), "completion_mask": x["mask"],
        "advantages": x["adv"], "old_per_token_logps": x["old"], "ref_per_token_logps": x["ref"],
        "num_items_in_batch": x["mask"].sum(),
    }  # fmt: skip
    return grpo_trainer.GRPOTrainer._compute_loss(fake, None, inputs)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("loss_type", "eps", "delta", "beta", "level"), CASES[::3])
def test_grpo_loss_equals_trl(
    loss_type: str, eps: tuple[float, float], delta: float | None, beta: float, level: str
) -> None:
    x = _inputs(5)
    want = _trl_compute_loss(x, loss_type, eps, delta, beta, level)
    got = grpo_loss(
        x["lp"], x["old"], x["adv"], x["mask"], loss_type=loss_type, epsilon_low=eps[0], epsilon_high=eps[1],
        delta=delta, beta=beta, ref_logprobs=x["ref"], importance_sampling_level=level, max_completion_length=12,
    )  # fmt: skip
    torch.testing.assert_close(got, want.float())


def test_nanstd_equals_trl() -> None:
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from diloco_serverless.loss.advantages import nanstd

    values = torch.tensor([[1.0, math.nan, 3.0, 0.5], [2.0, 2.0, math.nan, math.nan]])
    torch.testing.assert_close(nanstd(values, dim=1), trl_utils.nanstd(values, dim=1), equal_nan=True)
    torch.testing.assert_close(nanstd(values), trl_utils.nanstd(values).reshape(()), equal_nan=True)
