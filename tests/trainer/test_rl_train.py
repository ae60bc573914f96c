"""An RL run of the replica loop in-process (GRPO on the toy letter task, 2 replicas in threads,
file:// store): rollouts in every replica, DiLoCo between them, RL metrics per round, the
num_iterations reuse of a generation batch, and exact resume of a replica killed mid-round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_train import _assert_equal, _globals, _train

from diloco_serverless.config import RunConfig
from diloco_serverless.data.prompts import PromptBatcher
from diloco_serverless.loss import compose_loss
from diloco_serverless.rl.toy import toy_rows, write_toy_jsonl
from diloco_serverless.run.members import read_metrics
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer import checkpoint as ckpt
from diloco_serverless.trainer.model import build_model
from diloco_serverless.trainer.steps import RLSteps
from support.crash_harness import run_two_with_crash
from support.diloco_harness import create_tiny_run

RL = {
    "data.format": '"prompt"', "loss.channel1": '"grpo"', "loss.alpha_sdpo": 0, "loss.beta_replay": 0,
    "rl.reward_funcs": '["diloco_serverless.rl.toy:letter_fraction"]', "rl.num_generations": 4,
    "rl.max_completion_length": 6, "data.seq_len": 48, "inner.lr": 0.01,
}  # fmt: skip


def _cfg(**extra: Any) -> RunConfig:
    sets = {**RL, "data.source": '"toy.jsonl"', "replicas": 1, "data.batch_size": 2, **extra}
    return RunConfig.load(None, [f"{k}={v}" for k, v in sets.items()])


def test_num_iterations_reuses_the_batch_with_old_logprobs() -> None:
    cfg = _cfg(**{"rl.num_iterations": 2, "inner.sync_every": 2})
    model, tok = build_model(cfg.model, 0)
    steps = RLSteps(cfg, PromptBatcher.from_config(cfg, tok, rank=0, rows=toy_rows(16)), model, tok, rank=0)
    first = steps.next_batch()
    assert "old_logprobs" not in first  # on-policy: ratio 1 (TRL: old = logprobs.detach())
    out = compose_loss(model, first, alpha_sdpo=0, beta_replay=0, **steps.loss_kwargs())
    steps.after_step(out)
    second = steps.next_batch()
    assert second["input_ids"] is first["input_ids"] and steps.data.position == 4
    assert out.rl_token_logprobs is not None
    torch.testing.assert_close(second["old_logprobs"], out.rl_token_logprobs)
    third = steps.next_batch()  # a new generation batch from the next prompts
    assert "old_logprobs" not in third and not torch.equal(third["input_ids"], first["input_ids"])
    assert steps.data.prompt_position() == 2 and steps.data.state_dict()["position"] == 6  # prompts 2-3 in flight
    metrics = steps.round_metrics(inner_s=1e6)
    assert {"reward_mean", "reward/letter_fraction/mean", "completion_length", "rl_entropy", "rl_clip_fraction"} <= set(
        metrics
    )
    assert metrics["generation_share"] == metrics["generation_s"] / 1e6 and metrics["generation_s"] > 0


def test_rl_config_refuses_generation_batches_across_rounds() -> None:
    from diloco_serverless.errors import ConfigError

    with pytest.raises(ConfigError, match="multiple of rl.num_iterations"):
        _cfg(**{"rl.num_iterations": 3, "inner.sync_every": 4})


def _rl_run(tmp: Path, name: str, **kw: Any) -> str:
    data = write_toy_jsonl(tmp / "toy.jsonl", 24)
    url: str = create_tiny_run(f"file://{tmp}/{name}", data, 2, rounds=3, **{**RL, "data.seq_len": 48, **kw})
    return url


@pytest.mark.slow
def test_rl_run_trains_every_replica_and_ends_identical(tmp_path: Path) -> None:
    url = _rl_run(tmp_path, "store")
    results = _train(url, [0, 1])
    (r0, t0), (_, t1) = results[0], results[1]
    assert r0.rounds == 3
    _assert_equal(_globals(t0), _globals(t1))
    metrics = read_metrics(ObjectStore(url), 0)
    assert metrics and all("reward_mean" in m and "generation_share" in m and "rl_kl" in m for m in metrics)
    assert all(0.0 < m["generation_share"] < 1.0 for m in metrics)
    assert "eval_loss" in metrics[-1] and -1.0 <= metrics[-1]["eval_loss"] <= 0.0  # minus the mean reward


@pytest.mark.slow
def test_a_crashed_rl_replica_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling RNG and rollout position are part of the replica state: a replica killed mid-round ends
    bit-identical to the run without the kill."""
    ref_url = _rl_run(tmp_path, "ref", checkpoint_every=1)
    crash_url = _rl_run(tmp_path, "crash", checkpoint_every=1)
    reference = run_two_with_crash(ref_url, None, monkeypatch)
    ObjectStore(crash_url).put(ckpt.INITIAL_KEY, ObjectStore(ref_url).get(ckpt.INITIAL_KEY))
    crashed = run_two_with_crash(crash_url, 4, monkeypatch)  # H=2: the 2nd inner step of round 1
    assert crashed[1].attempt == 1
    for rank in (0, 1):
        _assert_equal(_globals(crashed[rank]), _globals(reference[rank]))


def test_dppo_steps_use_the_sampler_logprobs() -> None:
    cfg = _cfg(**{"loss.channel1": '"dppo"'})
    model, tok = build_model(cfg.model, 0)
    steps = RLSteps(cfg, PromptBatcher.from_config(cfg, tok, rank=0, rows=toy_rows(16)), model, tok, rank=0)
    batch = steps.next_batch()
    assert batch["old_logprobs"] is batch["sampling_logprobs"]
    out = compose_loss(model, batch, alpha_sdpo=0, beta_replay=0, **steps.loss_kwargs())
    assert out.rl is not None and torch.isfinite(out.total)
    # on the sampler's own parameters the ratio is 1 up to float error: nothing is masked, the KL is ~0
    assert float(out.rl_stats["rl_clip_fraction"]) == 0.0 and float(out.rl_stats["rl_kl"]) < 1e-6
