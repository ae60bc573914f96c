"""The RL metrics of a round become tracker series (rl/...), means over the ranks; supervised
records add none."""

from __future__ import annotations

from diloco_serverless.tracking.series import RL_SERIES, global_values


def test_rl_series_are_rank_means() -> None:
    records = {
        0: {"total": 0.1, "reward_mean": 0.2, "generation_share": 0.5, "rl_kl": 0.0, "reward/format/mean": 1.0},
        1: {"total": 0.3, "reward_mean": 0.4, "generation_share": 0.7, "rl_kl": 0.2, "reward/format/mean": 0.0},
    }
    point = global_values(records)
    assert abs(point["rl/reward_mean"] - 0.3) < 1e-12
    assert abs(point["rl/generation_share"] - 0.6) < 1e-12 and abs(point["rl/kl"] - 0.1) < 1e-12
    assert point["rl/reward/format/mean"] == 0.5


def test_supervised_records_have_no_rl_series() -> None:
    point = global_values({0: {"total": 1.0, "lm_ce": 1.0}})
    assert not any(k.startswith("rl/") for k in point)
    assert set(RL_SERIES.values()).isdisjoint(point)
