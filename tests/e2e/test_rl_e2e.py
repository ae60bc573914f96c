"""examples/grpo_toy.toml end to end on this machine: launched with the local executor (real replica
processes), two replicas sample, score and train GRPO on the toy letter task and average through the
store; the run succeeds, every round's metrics carry the RL series, and final/ is written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.launcher.api import launch
from support import REPO_ROOT

pytestmark = pytest.mark.slow


def test_grpo_toy_example_runs_locally(tmp_path: Path) -> None:
    example = REPO_ROOT / "examples" / "grpo_toy.toml"
    cfg = RunConfig.load(example, [
        f"store={json.dumps(str(tmp_path / 'runs'))}", 'run_id="grpo-toy"',
        f"data.source={json.dumps(str(REPO_ROOT / 'examples' / 'grpo_toy.jsonl'))}",
        "rounds=2", "inner.sync_every=2", "checkpoint_every=1", "eval_every=1", "data.batch_size=2",
        "rl.num_generations=4", "rl.max_completion_length=6", "data.eval_batches=1",
    ])  # fmt: skip
    assert cfg.loss.channel1 == "grpo" and cfg.data.format == "prompt"
    run = launch(cfg, executor="local", executor_options={"retries": 0})
    run_dir = tmp_path / "runs" / "grpo-toy"
    try:
        status = run.wait(poll_interval_s=0.5, timeout_s=400)
    except BaseException as exc:
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((run_dir / "logs").glob("*.log")))
        raise AssertionError(f"{exc}\n{logs}") from exc
    assert status.state == "succeeded"
    metrics = run.metrics()
    for rank in (0, 1):
        records = metrics[rank]
        assert [m["round"] for m in records] == [0, 1]
        for m in records:
            assert m["participants"] == [0, 1] and m["committed"]
            assert 0.0 <= m["reward_mean"] <= 1.0 and "reward/letter_fraction/mean" in m
            assert 0 < m["completion_length"] <= 6 and 0.0 < m["generation_share"] < 1.0
            assert math.isfinite(m["total"]) and math.isfinite(m["rl_entropy"])
    assert status.eval_loss is not None and -1.0 <= status.eval_loss <= 0.0
    assert (run_dir / "final" / "DONE.json").is_file()


def test_grpo_toy_example_raises_the_reward(tmp_path: Path) -> None:
    """The example as a user launches it (only its store and prompt file moved under tmp_path): the replicas'
    mean training reward rises well above where it started, and the held-out reward follows."""
    example = REPO_ROOT / "examples" / "grpo_toy.toml"
    cfg = RunConfig.load(example, [
        f"store={json.dumps(str(tmp_path / 'runs'))}", 'run_id="grpo-toy-learns"',
        f"data.source={json.dumps(str(REPO_ROOT / 'examples' / 'grpo_toy.jsonl'))}",
    ])  # fmt: skip
    run = launch(cfg, executor="local", executor_options={"retries": 0})
    run_dir = tmp_path / "runs" / "grpo-toy-learns"
    try:
        status = run.wait(poll_interval_s=1.0, timeout_s=900)
    except BaseException as exc:
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((run_dir / "logs").glob("*.log")))
        raise AssertionError(f"{exc}\n{logs}") from exc
    assert status.state == "succeeded"
    metrics = run.metrics()
    per_round = [
        sum(recs[r]["reward_mean"] for recs in metrics.values()) / len(metrics) for r in range(cfg.rounds)
    ]
    first, last = per_round[0], max(per_round[-2:])
    # random sampling scores ~1/259 per character; a policy that learned nothing stays there. The rise asked
    # for is a quarter of the possible gain (the benchmark measures half or more: benchmarks/README.md)
    assert last - first >= 0.25 * (1.0 - first), per_round
    evals = [-m["eval_loss"] for m in metrics[0] if "eval_loss" in m]  # held-out prompts, rounds 3 and 7
    assert len(evals) >= 2 and evals[-1] >= evals[0], evals
    assert evals[-1] - first >= 0.25 * (1.0 - first), (evals, per_round)
