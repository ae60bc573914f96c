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
Writes are never hedged: a create-only PUT sent twice could lose to itself. :class:`Hedger` learns
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


class Hedger:
    """The answer times of one store's reads, and the hedged call built on them (thread-safe)."""

    def __init__(self, *, window: int = _WINDOW, min_samples: int = _MIN_SAMPLES, floor_s: float = _FLOOR_S,
                 quiet_s: float = _QUIET_S) -> None:
        self._times: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.min_samples = min_samples
        self.floor_s = floor_s
        self.quiet_s = quiet_s
        self._quiet_until = 0.0  # time.monotonic() before which no backup is sent (after a transient failure)
        self.reads = 0  # hedgeable reads made
        self.backups = 0  # of which sent a backup request

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
            if len(self._times) < self.min_samples or time.monotonic() < self._quiet_until:
                return None
            ordered = sorted(self._times)
        return max(self.floor_s, ordered[min(len(ordered) - 1, int(quantile * len(ordered)))])

    def _quiet(self, quantile: float | None) -> None:
        """A transient failure: send no backups for a while (the store may be shedding load)."""
        delay = self.delay_s(quantile) or 0.0
        with self._lock:
            self._quiet_until = max(self._quiet_until, time.monotonic() + max(self.quiet_s, 10 * delay))

    async def first(self, make: Callable[[], Awaitable[T]], *, quantile: float | None,
                    release: Callable[[T], None] | None = None) -> T:
        """``await make()``; if it has not answered after :meth:`delay_s`, ``make()`` again and return
        (or raise) whichever answers first. A transient failure of one waits for the other. The loser
        is cancelled, and so is everything when the caller is; an answer a loser still produced goes
        to ``release`` (e.g. to close a body unread)."""
        started = time.monotonic()
        self.reads += 1
        delay = self.delay_s(quantile)
        tasks: set[asyncio.Future[T]] = {asyncio.ensure_future(make())}
        try:
            if delay is not None:
                done, _ = await asyncio.wait(tasks, timeout=delay)
                if not done:
                    self.backups += 1
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
