"""Use the latency tail of a replica's own uploads to start its downloads.

A replica PUTs its contribution objects concurrently. They share its link, so their bodies are through
at about the same time; after that, the replica only waits for answers, and the slowest of tens of
answers (a store's first-byte tail: p99 4x the median on S3) keeps its link idle for several round
trips. Meanwhile the other replicas' contributions are often already in the store. The exchange
(docs/exchange.md, "Round trips") prefetches them while it waits for the round's participants; this
module starts that earlier, once half of our own PUTs are answered (our bodies are through):

* :class:`EarlyFetch` (up to 16 replicas, where a shard's contributions share one folder): a background
  poller that lists the folders of the shards we will reduce and hands every other replica's contribution
  found there to the prefetch, from then until the round's participants are known. It does not wait for
  anyone's vote or ready marker: a contribution object is written create-only, so what it holds when we
  read it is what its writer vouches for when it votes.
* :func:`wait_prefetching` (above 16 replicas, for the ranks that list the ready markers anyway): lists
  who is ready while the rest of our answers come in, and hands the new ranks to the prefetch.

Nothing here changes what is written or who takes part: a prefetched object that the round does not use
is simply dropped, as with the prefetch during the quorum wait.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from typing import TypeVar

from diloco_serverless.exchange.polling import Backoff

T = TypeVar("T")

log = logging.getLogger(__name__)


def wait_half(futures: Sequence[Future[T]]) -> None:
    """Return once half of ``futures`` (our PUTs) are done, or all of them; a failed one raises at once."""
    pending: set[Future[T]] = set(futures)
    half = (len(futures) + 1) // 2
    while pending and len(futures) - len(pending) < half:  # our bodies are still going up
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for fut in done:
            fut.result()  # a failed PUT fails the publish now, not after more listings


class EarlyFetch:
    """Find the others' contribution objects as they appear and hand each to ``fetch`` once, on a thread
    of its own, until :meth:`stop` or until all ``expected`` keys were seen.

    ``look`` is one poll (the listings of our shards' folders); polls back off
    (:class:`~diloco_serverless.exchange.polling.Backoff`) up to ``poll_interval_s`` and start again fast
    after progress. The watch also ends after ``idle_polls`` polls in a row without a new key (polls are
    paced by the store's own latency and the backoff, so this scales with the store): a replica that is
    far behind (a straggler, one that died) is not listed for all the time the round waits for it; its
    objects are fetched when its vote is seen, as without the watch. A failed poll ends the watch
    (logged): it only moves downloads earlier, and the round's own reads find the objects anyway. After
    :meth:`stop` returns, ``fetch`` is not called again.
    """

    def __init__(self, look: Callable[[], set[str]], fetch: Callable[[set[str]], None], *, expected: set[str],
                 poll_interval_s: float, idle_polls: int | None = None) -> None:
        self._look, self._fetch, self._expected = look, fetch, frozenset(expected)
        self._poll_interval_s, self._idle_polls = poll_interval_s, idle_polls
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # held while handing keys, so that stop() waits for a hand-over
        self._thread = threading.Thread(target=self._run, name="exchange-early-fetch", daemon=True)
        self.seen: set[str] = set()
        self.polls = 0

    def start(self) -> EarlyFetch:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        backoff = Backoff(self._poll_interval_s)
        idle = 0  # polls in a row that found nothing new
        while not self._stopped.is_set() and self.seen < self._expected and idle != self._idle_polls:
            try:
                found = self._look() & self._expected
            except Exception as e:  # noqa: BLE001 - an optimisation must not fail the round; its reads retry
                log.info("early contribution fetch stopped after a failed listing: %s", e)
                return
            self.polls += 1
            new = found - self.seen
            if new:
                with self._lock:
                    if self._stopped.is_set():
                        return
                    self.seen |= new
                    self._fetch(new)
                backoff.reset()
                idle = 0
            else:
                idle += 1
            self._stopped.wait(backoff.next())


def wait_prefetching(
    futures: Sequence[Future[T]],
    look: Callable[[], set[int]],
    on_ready: Callable[[set[int]], None],
    *,
    others: int,
    poll_interval_s: float,
) -> list[T]:
    """The results of ``futures`` (our PUTs), in order. Once half of them are done, call ``look`` (one
    listing: the ranks whose contributions are complete) every poll, backing off
    (:class:`~diloco_serverless.exchange.polling.Backoff`) up to ``poll_interval_s``, and hand each new set
    to ``on_ready``, until all ``futures`` are done or ``others`` ranks were seen. An exception of a PUT
    or of ``look`` propagates."""
    wait_half(futures)
    pending = {fut for fut in futures if not fut.done()}
    backoff = Backoff(poll_interval_s)
    seen: set[int] = set()
    while pending and len(seen) < others:
        ready = look()
        if ready - seen:
            seen |= ready
            on_ready(set(seen))
            backoff.reset()
        done, pending = wait(pending, timeout=backoff.next(), return_when=ALL_COMPLETED)
        for fut in done:
            fut.result()
    return [fut.result() for fut in futures]
