"""The H rule: the smallest H whose round hides (overlap) or dwarfs (no overlap) the exchange."""

from __future__ import annotations

import pytest

from diloco_serverless.trainer.sync_every import choose_sync_every


def test_overlap_picks_the_smallest_h_that_hides_the_exchange() -> None:
    # 0.15 s per step, 0.9 s exchange: 1.25 x 0.9 = 1.125 s of compute needed -> 8 steps (1.2 s)
    assert choose_sync_every(0.15, 0.9, overlap=True) == 8
    assert choose_sync_every(0.15, 0.9, overlap=True, divides=96) == 8
    assert choose_sync_every(0.15, 1.0, overlap=True, divides=96) == 12  # 9 and 10 do not divide 96


def test_without_overlap_h_keeps_compute_at_the_share() -> None:
    # 0.9 s x 19 = 17.1 s of compute per round at 95 %: 114 steps at 0.15 s
    assert choose_sync_every(0.15, 0.9, overlap=False) == 114
    assert choose_sync_every(0.15, 0.9, overlap=False, divides=96) == 96  # none meets it: the largest divisor


def test_a_free_exchange_takes_the_lower_bound() -> None:
    assert choose_sync_every(0.1, 0.0, overlap=True, lo=4) == 4


@pytest.mark.parametrize("compute,exchange", [(0.0, 1.0), (-1.0, 1.0), (0.1, float("nan")), (0.1, -0.5)])
def test_bad_timings_are_refused(compute: float, exchange: float) -> None:
    with pytest.raises(ValueError, match="seconds"):
        choose_sync_every(compute, exchange, overlap=True)


def test_no_divisor_in_range_is_refused() -> None:
    with pytest.raises(ValueError, match="divides 7"):
        choose_sync_every(0.1, 1.0, overlap=True, lo=2, hi=6, divides=7)
