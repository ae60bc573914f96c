"""outer.lr_schedule: the outer lr by round, through torchft's real outer step (trainer/outer_schedule.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_serverless.config import OuterConfig, RunConfig
from diloco_serverless.errors import ConfigError
from diloco_serverless.testing import MockGroup, MockManager
from diloco_serverless.trainer.diloco import build_diloco
from diloco_serverless.trainer.loop import ReplicaTrainer
from diloco_serverless.trainer.outer_schedule import schedule_outer_lr
from support.diloco_harness import (
    assert_close_params,
    assert_identical,
    create_tiny_run,
    make_inner,
    reference_run,
    run_replicas,
    tiny_model,
    write_jsonl,
)

SCHEDULE = OuterConfig(lr=0.7, momentum=0.9, lr_schedule=[(2, 0.35), (4, 1.2)])


def test_lr_at_is_piecewise_constant_from_each_round() -> None:
    assert [SCHEDULE.lr_at(r) for r in range(6)] == [0.7, 0.7, 0.35, 0.35, 1.2, 1.2]
    assert OuterConfig(lr=0.5).lr_at(100) == 0.5


def test_replicas_step_with_the_scheduled_lr_as_the_reference() -> None:
    """Two replicas, two fragments: every round's outer step uses lr_at(round) (recorded at the real SGD
    step) and the global parameters match a reference that sets the same lr per round without torchft."""
    base = tiny_model(6)
    group = MockGroup(2)
    managers: list[MockManager] = []
    seen: list[tuple[int, float]] = []

    def make(rank: int) -> MockManager:
        managers.append(MockManager(group, rank, fragments=2))
        return managers[-1]

    reps = run_replicas(base, make, 2, rounds=6, sync_every=4, fragments=2, lr_at=SCHEDULE.lr_at)
    assert_identical(reps)
    want = reference_run(base, 2, rounds=6, sync_every=4, fragments=2, lr_at=SCHEDULE.lr_at)
    assert_close_params(reps[0].global_named_parameters(), want)
    constant = reference_run(base, 2, rounds=6, sync_every=4, fragments=2)
    assert any(not torch.allclose(want[k], constant[k]) for k in want), "the schedule must change the result"

    # the lr the outer SGD actually stepped with, round by round (a fresh replica replaying the stored rounds)
    healer = MockManager(group, 0, fragments=2)
    model = copy.deepcopy(base)
    rep = build_diloco(healer, model, make_inner(model), sync_every=4, fragments=2)
    schedule_outer_lr(rep, SCHEDULE.lr_at)
    for opt in rep.outer_optimizers:
        def record(o: torch.optim.Optimizer, *_: Any) -> None:
            seen.append((healer.current_step() - 1, o.param_groups[0]["lr"]))  # should_commit counted the round
        opt.register_step_pre_hook(record)
    assert rep.catch_up() == 6
    assert seen == [(r, SCHEDULE.lr_at(r)) for r in range(6)]
    assert_identical([reps[0], rep])  # healing by replay applies the same lr: the same bits


def test_run_config_takes_the_schedule_from_toml_and_overrides() -> None:
    cfg = RunConfig.load(None, ["outer.lr=1.0", "outer.momentum=0", "outer.nesterov=false",
                                "outer.lr_schedule=[[10, 0.65]]"])
    assert cfg.outer.lr_schedule == [(10, 0.65)]
    assert (cfg.outer.lr_at(9), cfg.outer.lr_at(10)) == (1.0, 0.65)
    # none of lr, momentum, nesterov set: the measured (N, H) default keeps the schedule
    cfg = RunConfig.load(None, ["outer.lr_schedule=[[3, 0.5]]"])
    assert cfg.outer.lr_schedule == [(3, 0.5)] and cfg.outer.lr_at(3) == 0.5


@pytest.mark.parametrize(("value", "needle"), [
    ("[[0, 0.5]]", "round 0 must be >= 1"),
    ("[[5, 0.5], [5, 0.4]]", "round 5 must be >= 1 and greater than the entry before (5)"),
    ("[[5, 0.5], [3, 0.4]]", "round 3 must be >= 1 and greater than the entry before (5)"),
    ("[[5, 0.0]]", "lr 0.0 from round 5 must be > 0 and <= 10"),
    ("[[5, 11.0]]", "lr 11.0 from round 5 must be > 0 and <= 10"),
    ("[[5, nan]]", "lr nan from round 5"),
    ("[[2.5, 0.5]]", "lr_schedule"),
    ("[5, 0.5]", "lr_schedule"),
])
def test_bad_schedules_are_refused_by_name(value: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig.load(None, [f"outer.lr_schedule={value}"])
    assert needle in str(err.value)


@pytest.mark.slow  # a real replica end to end (~2-8 s)
def test_the_replica_loop_steps_with_the_configured_schedule(tmp_path: Path) -> None:
    """The real replica (ReplicaTrainer on file://) installs outer.lr_schedule: its outer SGD steps with
    lr_at(round), recorded at the step."""
    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(f"file://{tmp_path}/store", data, 1, rounds=3, sync_every=2, checkpoint_every=0,
                          eval_every=0, **{"outer.lr": "1.0", "outer.momentum": "0", "outer.nesterov": "false",
                                           "outer.lr_schedule": "[[1, 0.5], [2, 0.25]]"})
    trainer = ReplicaTrainer.from_run(url, 0)
    seen: list[float] = []
    for opt in trainer.rep.outer_optimizers:
        opt.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    trainer.run()
    assert seen == [1.0, 0.5, 0.25]
