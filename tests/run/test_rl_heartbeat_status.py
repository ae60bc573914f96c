"""An RL run's numbers of its last round in the heartbeat, ``diloco status`` and the model card; a
supervised run's heartbeats, status and card stay as they were."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from diloco_serverless.cli.app import app
from diloco_serverless.cli.render import rl_line, status_renderable, summary_lines
from diloco_serverless.config import RunConfig
from diloco_serverless.launcher.hub import model_card
from diloco_serverless.launcher.status import RunStatus, build_replica
from diloco_serverless.run.members import Heartbeat, heartbeat_bytes, read_members, write_heartbeat
from diloco_serverless.run.record import load_run
from diloco_serverless.run.rl_metrics import parse_rl, per_function, rl_rounds, rl_summary
from support.fake_executor import FakeExecutor, use_fake_executor

ROUND = {  # one GRPO round's metrics record, as trainer/steps.py writes it (and the supervised keys beside)
    "round": 3, "total": -0.12, "lm_ce": 0.0, "tokens": 512, "reward_mean": 0.4, "reward_std": 0.2,
    "reward/correct/mean": 0.5, "reward/correct/std": 0.3, "reward/format/mean": 0.3, "reward/format/std": 0.1,
    "completion_length": 37.5, "rl_kl": 0.0012, "rl_entropy": 1.234, "rl_clip_fraction": 0.021,
    "generation_share": 0.61, "generation_s": 3.1, "reward_s": 0.01,
}  # fmt: skip


def test_rl_summary_picks_the_round_numbers_and_nothing_of_a_supervised_round() -> None:
    summary = rl_summary({**ROUND, "rl_kl": float("nan")})
    assert summary is not None and "rl_kl" not in summary and "total" not in summary and "generation_s" not in summary
    assert summary["reward/format/std"] == 0.1 and summary["generation_share"] == 0.61
    assert per_function(summary) == {"correct": (0.5, 0.3), "format": (0.3, 0.1)}
    assert rl_summary({"round": 1, "total": 2.0, "lm_ce": 2.0}) is None


@pytest.mark.parametrize("stored", ["x", [1], {"reward_mean": "0.4"}, {"lm_ce": 1.0}, {"reward_mean": True},
                                    {f"reward/f{i}/mean": 0.0 for i in range(70)}])
def test_a_stored_rl_field_that_is_not_rl_numbers_is_refused(stored: Any) -> None:
    value, why = parse_rl(stored)
    assert value is None and why


def test_the_heartbeat_carries_the_last_rounds_rl_numbers_and_a_supervised_one_does_not() -> None:
    rl = rl_summary(ROUND)
    assert rl is not None
    back = Heartbeat.from_json_dict(json.loads(heartbeat_bytes(Heartbeat(rank=1, round=4, rl=rl))))
    assert back.rl == rl and back.invalid == {}
    assert "rl" not in json.loads(heartbeat_bytes(Heartbeat(rank=1, round=4)))  # supervised: unchanged
    planted = Heartbeat.from_json_dict({"rank": 0, "state": "training", "rl": {"reward_mean": "lots"}})
    assert planted.rl is None and planted.invalid == {"rl": "is not a mapping of RL metrics"}


def _status(rls: list[dict[str, float] | None]) -> RunStatus:
    replicas = []
    for rank, rl in enumerate(rls):
        hb = Heartbeat(rank=rank, round=4, step=32, loss=-0.1, state="training", rl=rl).to_json_dict()
        replicas.append(build_replica(rank, None, hb, now=hb["time"] + 1.0, stale_after_s=600.0))
    return RunStatus(run_id="rl", url="file:///runs/rl", executor="local", gpu=None, rounds_total=8,
                     replicas=replicas, state="running", elapsed_s=60.0)


def _shown(status: RunStatus) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, force_terminal=False)
    console.print(status_renderable(status))
    return console.export_text()


def test_status_shows_an_rl_table_and_line_for_an_rl_run_only() -> None:
    a = rl_summary(ROUND)
    b = rl_summary({**ROUND, "reward_mean": 0.2, "reward_std": 0.1, "completion_length": 12.5, "rl_kl": 0.0008})
    assert a is not None and b is not None
    status = _status([a, b])
    assert status.rl is not None and math.isclose(status.rl["reward_mean"], 0.3)
    shown = _shown(status)
    assert "RL, last round per replica" in shown
    row0 = next(line for line in shown.splitlines() if "│" in line and "0.400 ± 0.200" in line)
    assert row0.split("│")[1].strip() == "0"
    for cell in ("correct 0.500, format 0.300", "37.5", "0.0012", "1.234", "2.1%", "61.0%"):
        assert cell in row0, row0
    assert ("RL: reward 0.300 ± 0.150 | completion 25.0 tokens | KL 0.001 | entropy 1.234 | clip 2.1% | "
            "generation 61.0% of the round") in shown
    assert any(line.startswith("  last round      : RL: reward 0.300") for line in summary_lines(status))
    supervised = _status([None, None])
    assert supervised.rl is None and rl_line(supervised) is None
    assert "RL" not in _shown(supervised) and not any("RL:" in line for line in summary_lines(supervised))


def test_a_replica_not_yet_reporting_rl_numbers_is_left_out_of_the_means() -> None:
    a = rl_summary(ROUND)
    assert a is not None
    status = _status([a, None])
    assert status.rl is not None and status.rl["reward_mean"] == 0.4
    assert sum("±" in line for line in _shown(status).splitlines()) == 2  # rank 0's row and the RL line


def test_diloco_status_reads_the_rl_numbers_from_the_heartbeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    use_fake_executor(monkeypatch, FakeExecutor(rounds=2))
    runner = CliRunner()
    launched = runner.invoke(app, ["launch", "--run-id", "rl1", "--set", "rounds=2"])
    assert launched.exit_code == 0, launched.output
    store, _ = load_run(str(tmp_path / "runs" / "rl1"))
    write_heartbeat(store, Heartbeat(rank=0, round=2, step=32, loss=-0.4, state="training", rl=rl_summary(ROUND)))
    assert read_members(store)[0].rl == rl_summary(ROUND)
    result = runner.invoke(app, ["status", str(tmp_path / "runs" / "rl1")])
    assert result.exit_code == 0, result.output
    assert "RL, last round per replica" in result.stdout and "RL: reward 0.400 ± 0.200" in result.stdout


def _rl_config() -> RunConfig:
    return RunConfig.load(None, [
        'data.format="prompt"', 'data.source="prompts.jsonl"', 'loss.channel1="grpo"', "rl.num_generations=8",
        'rl.reward_funcs=["my_rewards:correct", "diloco_serverless.rl.rewards:format"]', "rl.max_completion_length=64",
    ])  # fmt: skip


def test_the_model_card_of_an_rl_run_reports_rewards_and_rollouts() -> None:
    first = {**ROUND, "round": 0, "reward_mean": 0.05, "reward_std": 0.02}
    metrics = {0: [first, ROUND], 1: [{**first, "reward_mean": 0.07}, {**ROUND, "reward_mean": 0.5}]}
    rounds = rl_rounds(metrics)
    assert sorted(rounds) == [0, 3] and math.isclose(rounds[3]["reward_mean"], 0.45)
    status = _status([rl_summary(ROUND)])
    card = model_card(repo_id="org/grpo", cfg=_rl_config(), status=status, tokens=1000, has_plot=False, rl=rounds)
    assert ("| channel 1 (RL) | grpo (dapo), G = 8 completions per prompt, at most 64 tokens; rewards "
            "`my_rewards:correct`, `diloco_serverless.rl.rewards:format` |") in card
    assert "| reward (mean over replicas) | 0.0600 ± 0.0200 in round 0 → 0.4500 ± 0.2000 in round 3 |" in card
    assert "| reward `correct` | 0.5000 ± 0.3000 (round 3) |" in card
    assert "| completion length | 37.5 tokens |" in card and "| KL to the initial model | 0.0012 |" in card
    assert "| clip fraction | 2.10% |" in card and "| generation share of a round | 61.0% |" in card
    assert "| entropy | 1.2340 |" in card
    plain = model_card(repo_id="org/lm", cfg=RunConfig.load(None, []), status=_status([None]), tokens=1,
                       has_plot=False, rl=rl_rounds({0: [{"round": 0, "total": 1.0}]}))
    assert "channel 1 (RL)" not in plain and "| reward" not in plain and "mean reward" not in plain
