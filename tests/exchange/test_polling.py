"""The sleeps between a waiting replica's polls (exchange/polling.py)."""

from __future__ import annotations

import pytest

import diloco_serverless.exchange.polling as polling
from diloco_serverless.exchange.polling import FIRST_POLL_S, WAITED_SHARE, Backoff


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(polling.time, "monotonic", c)
    return c


def test_sleeps_grow_by_half_per_empty_poll_up_to_the_longest(clock: Clock) -> None:
    b = Backoff(0.5)
    sleeps = []
    for _ in range(12):
        clock.now += 60.0  # waited long: the share of time waited does not bind
        sleeps.append(b.next())
    assert sleeps[:3] == pytest.approx([FIRST_POLL_S, FIRST_POLL_S * 1.5, FIRST_POLL_S * 2.25])
    assert max(sleeps) == sleeps[-1] == 0.5


def test_a_sleep_is_at_most_a_share_of_the_time_waited(clock: Clock) -> None:
    """Polls that answer fast do not grow the sleep beyond a tenth of the wait: what appears after t
    seconds of waiting is seen ~t/10 later, not a third of t later as growth alone allowed."""
    b = Backoff(0.5)
    for _ in range(10):  # ten empty polls within 50 ms: growth alone would sleep 0.02 * 1.5**9 = 0.77 s
        clock.now += 0.005
        assert b.next() == FIRST_POLL_S
    clock.now += 1.0
    assert b.next() == pytest.approx(WAITED_SHARE * 1.05)
    clock.now += 100.0
    assert b.next() == 0.5


def test_progress_starts_the_schedule_again(clock: Clock) -> None:
    b = Backoff(0.5)
    clock.now += 50.0
    assert [b.next() for _ in range(8)][-1] == pytest.approx(FIRST_POLL_S * 1.5**7)
    b.reset()
    assert b.next() == FIRST_POLL_S
    clock.now += 0.3  # waited 0.3 s since the progress: at most 30 ms, whatever the growth says
    assert b.next() == pytest.approx(0.03)


def test_a_longest_sleep_below_the_first_wins(clock: Clock) -> None:
    b = Backoff(0.005)
    clock.now += 10.0
    assert [b.next() for _ in range(3)] == [0.005] * 3


def test_the_first_sleep_is_read_when_a_sleep_is_computed(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark on a store slowed by a time scale stretches the exchange's first sleep with it."""
    b = Backoff(50.0)
    monkeypatch.setattr(polling, "FIRST_POLL_S", 2.0)
    clock.now += 1000.0
    assert [b.next() for _ in range(2)] == [2.0, 3.0]
