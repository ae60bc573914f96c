"""Collect a round's reduced shards as they appear, with listing and downloading overlapped.

The gather of a flat round (docs/architecture.md, "The exchange protocol", step 4) waits for shards that
their owners write at different times. Listing, then downloading what the listing showed, then listing
again makes every poll as long as its slowest download: on a store with a latency tail the gather becomes
a chain of round trips. :class:`ReducedShards` starts the download of a shard as soon as it is seen
and keeps polling while downloads run, so the gather ends one detection and one download after the last
shard appears.

It reads nothing else: unspread rounds list the ``reduced/`` folder (one request per poll, and only
shards that exist are fetched); rounds spread over prefixes GET the missing shards directly (a missing
one answers 404 and is asked again at the next poll). At most ``budget_bytes`` of shard downloads are in
flight at once (at least one shard), so memory stays bounded whatever the tensor size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from diloco_serverless.exchange._io import CountingStore, shards_in


class ReducedShards:
    """Downloads of the reduced shards ``keys`` (shard -> key), ``sizes`` bytes each at most.

    ``listing``: the folder to list for unspread rounds, or ``None`` to GET missing shards directly.
    """

    def __init__(self, io: CountingStore, keys: dict[int, str], sizes: dict[int, int], listing: str | None,
                 budget_bytes: int) -> None:
        self._io, self._keys, self._sizes, self._listing = io, keys, sizes, listing
        self._budget = budget_bytes
        self._flight: dict[int, Future[bytes | None]] = {}
        self._placed: set[int] = set()

    def in_flight(self) -> set[int]:
        """Shards being downloaded now (they exist: a takeover must leave them alone)."""
        return set(self._flight)

    def poll(self, todo: set[int], place: Callable[[int, bytes], None]) -> bool:
        """Hand every finished download to ``place``, then start downloads of the shards of ``todo``
        that exist (or, unlisted, may exist); True if a shard was placed or a download started."""
        progressed = self._harvest(place)
        waiting = sorted(j for j in todo if j not in self._flight and j not in self._placed)
        if waiting and self._listing is not None:
            waiting = sorted(shards_in(self._io.list(self._listing)) & set(waiting))
            progressed = self._harvest(place) or progressed  # downloads that ended during the listing
            waiting = [j for j in waiting if j not in self._placed]
        flying = sum(self._sizes[j] for j in self._flight)
        for j in waiting:
            if self._flight and flying + self._sizes[j] > self._budget:
                break
            self._flight[j] = self._io.get_async(self._keys[j])
            flying += self._sizes[j]
            progressed = progressed or self._listing is not None
        return progressed

    def wait(self, timeout_s: float, also: Sequence[Future[Any]] = ()) -> None:
        """Sleep until a download (or one of the futures ``also``) finishes or ``timeout_s`` passes."""
        futures = [*self._flight.values(), *also]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)
        else:
            time.sleep(timeout_s)

    def _harvest(self, place: Callable[[int, bytes], None]) -> bool:
        placed = False
        for j in [j for j, fut in self._flight.items() if fut.done()]:
            data = self._flight.pop(j).result()
            if data is not None:  # None: not there yet (unlisted rounds), asked again at the next poll
                place(j, data)
                self._placed.add(j)
                placed = True
        return placed
