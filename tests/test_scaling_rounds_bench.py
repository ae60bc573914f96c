"""``benchmarks/scaling_rounds.py``: the H sequence it feeds the loss simulation is the product's auto rule
with the product's timing of decisions, and its variable-H loop is ``outer_sweep.py``'s arithmetic."""

from __future__ import annotations

from types import ModuleType

import pytest

from support import import_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return import_benchmark("scaling_rounds")


def test_auto_plan_with_overlap_decides_round_3_first_and_keeps_h(bench: ModuleType) -> None:
    # 1.25 x 663 ms hidden behind 74 ms steps needs H >= 11.2: 12; with delay round 0 has no exchange,
    # round 0's is measured at the end of round 1, so round 2 (decided at the end of round 0) keeps 8
    plans = bench.auto_plan(100, 0.074, 0.663, overlap=True)
    assert plans[:4] == [(8, "initial"), (8, "initial"), (8, "kept"), (12, "measured")]
    assert {h for h, _ in plans[4:-1]} == {12} and {r for _, r in plans[4:]} == {"kept"}
    assert sum(h for h, _ in plans) == 100 and plans[-1][0] == 100 - 24 - 12 * (len(plans) - 4)


def test_auto_plan_without_overlap_keeps_compute_at_95_percent_and_cuts_the_last_round(bench: ModuleType) -> None:
    # compute >= 95 %: H x 74 ms >= 19 x 663 ms needs H = 171, clamped to 128; decided for round 2
    assert bench.auto_plan(300, 0.074, 0.663, overlap=False) == [
        (8, "initial"), (8, "initial"), (128, "measured"), (128, "kept"), (28, "kept")]
    # a fast store: the smallest H allowed
    assert bench.auto_plan(40, 0.1, 0.01, overlap=True)[3] == (4, "measured")


@pytest.mark.slow
def test_variable_h_and_dp_loops_match_outer_sweeps_loops(bench: ModuleType) -> None:
    sweep = bench.sweep
    sim = sweep.Sim(2, 1, 2)
    for outer, delay in ((sweep.Outer.parse("0.7,0.9n"), 0), (sweep.Outer.parse("1.0,0"), 1)):
        assert bench.run_diloco_plan(sim, 2, [1, 1], outer, delay) == sweep.run_diloco(sim, 2, 1, 2, outer, delay)
    seen: list[int] = []
    assert bench.run_dp_rounds(sim, 2, 2, 1, on_eval=lambda c: seen.append(len(c))) == sweep.run_dp(sim, 2, 2, 1)
    assert seen == [1, 2]
