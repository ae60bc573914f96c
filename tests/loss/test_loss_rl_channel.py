"""compose_loss with an RL channel 1: the loss equals grpo_loss / dppo_loss of the model's own
per-token log-probs (computed here by hand from a bigram table), channels 2 and 3 still compose on
top, and a batch without rollouts falls back to the language-modelling loss."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from diloco_serverless.loss import compose_loss, dppo_loss, grpo_loss
from diloco_serverless.loss.rl_channel import RLLossSettings
from tests.loss.test_loss_compose import Bigram, make_batch


def _token_logprobs(model: Bigram, batch: dict[str, Any], temperature: float) -> torch.Tensor:
    """[B, T-1] log-prob of token t+1 under row W[token t] / temperature, by hand; 0 off the response."""
    ids, resp = batch["input_ids"], batch["response_mask"]
    table = model.table.detach().tolist()
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if not resp[b, t]:
                continue
            row = [x / temperature for x in table[int(ids[b, t - 1])]]
            lse = max(row) + math.log(sum(math.exp(x - max(row)) for x in row))
            out[b, t - 1] = row[int(ids[b, t])] - lse
    return out


def _rollouts(seed: int = 0) -> dict[str, Any]:
    batch = make_batch()
    gen = torch.Generator().manual_seed(seed)
    batch["advantages"] = torch.tensor([0.7, -1.1])
    batch["old_logprobs"] = -torch.rand(batch["input_ids"].shape, generator=gen) * 2
    batch["ref_logprobs"] = -torch.rand(batch["input_ids"].shape, generator=gen) * 2
    return batch


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_channel_is_grpo_loss_of_the_model_logprobs(loss_type: str) -> None:
    model, batch = Bigram(), _rollouts()
    settings = RLLossSettings(kind="grpo", loss_type=loss_type, beta=0.05, temperature=0.7, max_completion_length=5)
    out = compose_loss(model, batch, alpha_sdpo=0.0, beta_replay=0.0, channel1="grpo", rl=settings)
    lp = _token_logprobs(model, batch, 0.7)
    mask = (batch["response_mask"][:, 1:] != 0).float()
    want = grpo_loss(
        lp, batch["old_logprobs"][:, 1:], batch["advantages"], mask, loss_type=loss_type, beta=0.05,
        ref_logprobs=batch["ref_logprobs"][:, 1:], max_completion_length=5,
    )  # fmt: skip
    torch.testing.assert_close(out.total, want)
    assert out.rl is not None and torch.equal(out.rl, out.total.detach())
    torch.testing.assert_close(out.lm_ce, -(lp * mask).sum() / mask.sum())
    assert set(out.rl_stats) == {"rl_clip_fraction", "rl_kl", "rl_entropy"}
    assert out.rl_token_logprobs is not None
    torch.testing.assert_close(out.rl_token_logprobs[:, 1:], lp)
    floats = out.to_floats()
    assert {"rl", "rl_kl", "rl_entropy"} <= set(floats)


def test_on_policy_grpo_without_old_logprobs_has_the_policy_gradient() -> None:
    model, batch = Bigram(), _rollouts()
    del batch["old_logprobs"]
    out = compose_loss(model, batch, alpha_sdpo=0.0, beta_replay=0.0, channel1="grpo")
    (grad,) = torch.autograd.grad(out.total, model.table)
    lp_table = torch.log_softmax(model.table, dim=-1)
    mask = (batch["response_mask"][:, 1:] != 0).float()
    ids = batch["input_ids"]
    surrogate = sum(
        -float(batch["advantages"][b]) * lp_table[ids[b, t - 1], ids[b, t]]
        for b in range(ids.shape[0])
        for t in range(1, ids.shape[1])
        if batch["response_mask"][b, t]
    ) / mask.sum()  # dapo on-policy: the plain policy gradient over the batch's tokens
    (want,) = torch.autograd.grad(surrogate, model.table)
    torch.testing.assert_close(grad, want)


def test_dppo_channel_is_dppo_loss_over_token_count() -> None:
    model, batch = Bigram(), _rollouts(1)
    batch["num_items_in_batch"] = torch.tensor(11.0)
    out = compose_loss(model, batch, alpha_sdpo=0.0, beta_replay=0.0, channel1="dppo")
    lp = _token_logprobs(model, batch, 1.0)
    mask = (batch["response_mask"][:, 1:] != 0).float()
    want = dppo_loss(lp, batch["old_logprobs"][:, 1:], batch["advantages"], mask) / 11.0
    torch.testing.assert_close(out.total, want)
    assert "rl_clip_fraction" in out.rl_stats


def test_channels_two_and_three_compose_on_top_of_rl() -> None:
    batch = _rollouts()
    rl_only = compose_loss(Bigram(), batch, alpha_sdpo=0.0, beta_replay=0.0, channel1="grpo")
    full = compose_loss(Bigram(), batch, alpha_sdpo=0.5, beta_replay=0.1, channel1="grpo")
    assert float(full.sdpo_jsd.detach()) > 0 and float(full.trace_replay_dpo.detach()) > 0
    torch.testing.assert_close(full.total, rl_only.total + 0.5 * full.sdpo_jsd + 0.1 * full.trace_replay_dpo)


def test_batch_without_rollouts_trains_lm() -> None:
    batch = make_batch()
    lm = compose_loss(Bigram(), batch, alpha_sdpo=0.0, beta_replay=0.0)
    rl_kind = compose_loss(Bigram(), batch, alpha_sdpo=0.0, beta_replay=0.0, channel1="grpo")
    assert torch.equal(lm.total, rl_kind.total) and rl_kind.rl is None


def test_bad_rl_options_are_named() -> None:
    with pytest.raises(ValueError, match="channel1"):
        compose_loss(Bigram(), _rollouts(), channel1="ppo")
    with pytest.raises(ValueError, match="loss_type"):
        RLLossSettings(loss_type="gspo")
    with pytest.raises(ValueError, match="temperature"):
        RLLossSettings(temperature=0.0)
    batch = _rollouts()
    del batch["old_logprobs"]
    with pytest.raises(ValueError, match="old_logprobs"):
        compose_loss(Bigram(), batch, alpha_sdpo=0.0, beta_replay=0.0, channel1="dppo")
    batch = _rollouts()
    batch["old_logprobs"] = batch["old_logprobs"][:, 1:]
    with pytest.raises(ValueError, match="aligned with input_ids"):
        compose_loss(Bigram(), batch, alpha_sdpo=0.0, beta_replay=0.0, channel1="grpo")
