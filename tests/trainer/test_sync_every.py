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


def test_auto_h_reacts_to_a_slower_store_and_does_not_flap() -> None:
    from diloco_serverless.trainer.sync_every import AutoSyncEvery

    rule = AutoSyncEvery(overlap=True, lo=4, hi=128)
    assert rule.decide(8, measured_before=False) == (8, "kept")  # no timings yet: the initial H stays
    rule.observe(0.1, 0.5)  # 0.5 s exchange: 1.25 x 0.5 / 0.1 -> 7 steps
    assert rule.decide(8, measured_before=False) == (7, "measured")
    for exchange in (0.52, 0.55, 0.6):  # wobble: the rule says 7-8, inside the band around 7
        rule.observe(0.1, exchange)
        assert rule.decide(7, measured_before=True) == (7, "kept")
    for _ in range(2):  # the store slows down to 2 s per exchange: the median follows after two rounds
        rule.observe(0.1, 2.0)
    assert rule.decide(7, measured_before=True) == (25, "drift")
    for _ in range(3):  # and back to fast: H comes down again
        rule.observe(0.1, 0.3)
    assert rule.decide(25, measured_before=True) == (4, "drift")


def test_auto_h_without_overlap_keeps_compute_at_95_percent() -> None:
    from diloco_serverless.trainer.sync_every import AutoSyncEvery

    rule = AutoSyncEvery(overlap=False, lo=4, hi=64)
    rule.observe(0.1, 0.2)  # 0.2 s x 19 = 3.8 s of compute per round -> 38 steps
    assert rule.decide(8, measured_before=False) == (38, "measured")
    rule.observe(0.1, 100.0)  # unmeasured rounds are not passed; one huge one does not move the median
    rule.observe(0.1, 0.2)
    assert rule.decide(38, measured_before=True) == (38, "kept")
