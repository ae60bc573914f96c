"""How long a replica waiting for the store sleeps between two polls: one schedule for every wait.

A poll is a listing or a GET, one round trip of the store; between two of them the replica sleeps.
Waits in a round are short when the replicas are in step (a few round trips: the last vote, the last
reduced shard) and long when one is late (seconds to minutes). The sleep starts at
:data:`FIRST_POLL_S`, grows 1.5x per poll that found nothing new, and is never longer than
:data:`WAITED_SHARE` of the time waited since the last progress, nor than the exchange's
``poll_interval_s``. So an object that appears after t seconds of waiting is seen at most ~t/10 (plus
a round trip) after it appears: on S3 (~60 ms a request) a wait of 0.3 s polls back to back, while a
straggler minutes late costs one poll per ``poll_interval_s``. Growth alone (the previous schedule)
reached a sleep of a third of the time waited within a second, which on a round of ~1 s of transfers
added a round trip to every wait on the round's path.
"""

from __future__ import annotations

import time

__all__ = ["Backoff", "FIRST_POLL_S", "WAITED_SHARE"]

#: The first sleep of a wait, and the sleep after progress. Read when a sleep is computed: a benchmark
#: that emulates a slower store may stretch it with the store's time scale.
FIRST_POLL_S = 0.02
#: A sleep is at most this share of the time waited since the last progress (at least FIRST_POLL_S).
WAITED_SHARE = 0.1
_GROWTH = 1.5


class Backoff:
    """The sleeps between the polls of one wait, at most ``longest_s`` each (see the module docstring)."""

    def __init__(self, longest_s: float) -> None:
        self.longest_s = longest_s
        self.reset()

    def reset(self) -> None:
        """Progress: the next sleep is the first one again, and the time waited counts from now."""
        self._since = time.monotonic()
        self._polls = 0

    def next(self) -> float:
        """The sleep before the next poll (each call counts one poll that found nothing new)."""
        first = min(FIRST_POLL_S, self.longest_s)
        grown = first * _GROWTH ** min(self._polls, 64)
        self._polls += 1
        return min(grown, max(first, WAITED_SHARE * (time.monotonic() - self._since)), self.longest_s)
