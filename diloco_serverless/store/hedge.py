"""Backup requests for the latency tail of an object store ("hedged requests").

An object store answers most requests in tens of milliseconds and a few in several times that (S3:
~60 ms median, ~250 ms p99). A phase of the exchange waits for the slowest of its 10-100 requests,
so it pays the tail on almost every round. A hedged read (Dean and Barroso, "The Tail at Scale",
CACM 2013) sends the same read a second time when the first has not answered after the
``quantile`` of the store's recent answer times, and keeps whichever answers first; the other is
cancelled (an answer that arrives anyway is released unread). With the quantile at 0.75 about one
read in four sends a backup, and the slowest of 40 reads drops from the 97.5th percentile of one
request to that of the faster of two.

Only reads are hedged (a GET's headers, a listing): sending them twice changes nothing in the store.
A store that sheds load must not get more requests: after any transient failure (503 SlowDown, a reset
connection) a Hedger sends no backup for ``quiet_s`` (5 s, or ten hedge delays if longer); the failed
read itself is retried by the caller's backoff as before.
Backups are also bounded where hedging cannot help. A store whose answer times grow with its own load
(a local S3 server, an endpoint near saturation) answers a backup no sooner than the request it
duplicates, and every backup adds load: on moto, N = 8 replicas' 64 MB exchange sent a backup for 69%
of the naive method's reads, and at most 14% of those answered first. So a Hedger (1) spends at most
``budget`` backups per read over time (a token bucket: each read earns ``budget``, a backup costs one,
at most ``burst`` saved), and (2) pauses backups for ``quiet_s`` when, of its last ``outcomes``
backups (at least half of them seen), fewer than ``min_win_rate`` answered first. Under the presets'
random lognormal tail a backup sent at the 0.75 quantile answers first about 29% of the time (then
16 backups with at most one answering first, the least on which it pauses, have a chance of ~3%).
Writes are not hedged. A create-only write sent twice would be safe (the request that lands second is
refused, and ``put_if_absent`` reads back an object it finds), but a backup must send its whole body
again, on a link the round's other transfers keep busy: tried on the exchange's batches of writes (a
backup for each write still waiting once 9 in 10 had answered), 1 of 80 backups answered first in the
``s3-standard`` emulation, for 11% more bytes up and no faster round (benchmarks/README.md, "Hedged
writes, tried and reverted"). :class:`Hedger` learns
the store's answer times from the reads it makes (the first ``min_samples`` reads go unhedged). It
records the time the caller waited, which keeps its quantile the store's own: a hedged read is slower
than the quantile exactly when its first request is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from diloco_serverless.store.errors import is_transient

__all__ = ["Hedger", "HEDGE_QUANTILE"]

T = TypeVar("T")

#: Default quantile of recent answer times after which a read gets a backup (about one read in four).
HEDGE_QUANTILE = 0.75
_WINDOW = 128  # answer times a Hedger keeps (the newest)
_MIN_SAMPLES = 16  # reads before the first backup: the store's latency must be known first
_FLOOR_S = 0.005  # never hedge sooner than this (a local or in-memory endpoint)
_QUIET_S = 5.0  # no backups for this long (or ten hedge delays) after a transient failure
_BUDGET = 0.3  # backups per read, at most, over time (the 0.75 quantile alone sends ~0.25)
_BURST = 10.0  # backups a quiet stretch may save up
_OUTCOMES = 32  # recent backups whose outcome (answered first or not) a Hedger keeps
_MIN_WIN_RATE = 0.1  # below this share of backups answering first, pause backups for quiet_s


class Hedger:
    """The answer times of one store's reads, and the hedged call built on them (thread-safe)."""

    def __init__(self, *, window: int = _WINDOW, min_samples: int = _MIN_SAMPLES, floor_s: float = _FLOOR_S,
                 quiet_s: float = _QUIET_S, budget: float = _BUDGET, burst: float = _BURST,
                 outcomes: int = _OUTCOMES, min_win_rate: float = _MIN_WIN_RATE) -> None:
        self._times: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.min_samples = min_samples
        self.floor_s = floor_s
        self.quiet_s = quiet_s
        self.budget, self.burst, self.min_win_rate = budget, burst, min_win_rate
        self._tokens = burst  # backups this Hedger may send now (see the module docstring)
        self._outcomes: deque[bool] = deque(maxlen=outcomes)  # recent backups: did each answer first?
        self._quiet_until = 0.0  # time.monotonic() before which no backup is sent (after a transient failure)
        self.reads = 0  # hedgeable reads made
        self.backups = 0  # of which sent a backup request
        self.wins = 0  # of which the backup answered first

    def observe(self, seconds: float) -> None:
        """Record one read's answer time."""
        with self._lock:
            self._times.append(seconds)

    def delay_s(self, quantile: float | None) -> float | None:
        """Seconds after which a read gets its backup; ``None`` (no backup) when hedging is off, fewer
        than ``min_samples`` answer times are known, or a transient failure was seen less than
        ``quiet_s`` ago."""
        if quantile is None:
            return None
        with self._lock:
            if (len(self._times) < self.min_samples or time.monotonic() < self._quiet_until
                    or self._tokens < 1.0):
                return None
            ordered = sorted(self._times)
        return max(self.floor_s, ordered[min(len(ordered) - 1, int(quantile * len(ordered)))])

    def _quiet(self, quantile: float | None) -> None:
        """A transient failure, or backups that do not answer first: send no backups for a while (the
        store may be shedding load, or its answer times grow with its load)."""
        delay = self.delay_s(quantile) or 0.0
        with self._lock:
            self._quiet_until = max(self._quiet_until, time.monotonic() + max(self.quiet_s, 10 * delay))

    def _outcome(self, backup_won: bool, quantile: float | None) -> None:
        """Record whether a backup answered first; pause backups if too few of the recent ones did."""
        with self._lock:
            self._outcomes.append(backup_won)
            seen = len(self._outcomes)
            useless = 2 * seen >= (self._outcomes.maxlen or 0) and sum(self._outcomes) < self.min_win_rate * seen
            if useless:
                self._outcomes.clear()  # after the pause, judge afresh
        if useless:
            self._quiet(quantile)

    async def first(self, make: Callable[[], Awaitable[T]], *, quantile: float | None,
                    release: Callable[[T], None] | None = None) -> T:
        """``await make()``; if it has not answered after :meth:`delay_s`, ``make()`` again and return
        (or raise) whichever answers first. A transient failure of one waits for the other. The loser
        is cancelled, and so is everything when the caller is; an answer a loser still produced goes
        to ``release`` (e.g. to close a body unread)."""
        started = time.monotonic()
        with self._lock:
            self.reads += 1
            self._tokens = min(self.burst, self._tokens + self.budget)
        delay = self.delay_s(quantile)
        first_sent: asyncio.Future[T] = asyncio.ensure_future(make())
        tasks: set[asyncio.Future[T]] = {first_sent}
        try:
            if delay is not None:
                done, _ = await asyncio.wait(tasks, timeout=delay)
                if not done:
                    with self._lock:
                        self.backups += 1
                        self._tokens -= 1.0
                    tasks.add(asyncio.ensure_future(make()))
            pending = set(tasks)
            while True:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                finished = [t for t in done if t.exception() is None]
                failed = [t for t in done if t.exception() is not None]
                if any(is_transient(t.exception() or Exception()) for t in failed):
                    self._quiet(quantile)
                if not finished and pending and all(is_transient(t.exception() or Exception()) for t in failed):
                    continue  # the other request may still answer
                winner = finished[0] if finished else failed[0]
                if len(tasks) > 1:
                    self.wins += winner is not first_sent
                    self._outcome(winner is not first_sent, quantile)
                tasks.discard(winner)
                self.observe(time.monotonic() - started)
                return winner.result()
        finally:
            await _cancel(tasks, release)


async def _cancel(tasks: set[asyncio.Future[T]], release: Callable[[T], None] | None) -> None:
    """Cancel ``tasks``; release any answer one produced before the cancel reached it."""
    for t in tasks:
        t.cancel()
    for value in await asyncio.gather(*tasks, return_exceptions=True):
        if release is not None and not isinstance(value, BaseException):
            release(value)
