"""Use the latency tail of a replica's own uploads to start its downloads.

A replica PUTs its contribution objects concurrently. They share its link, so their bodies are through
at about the same time; after that, the replica only waits for answers, and the slowest of tens of
answers (a store's first-byte tail: p99 4x the median on S3) keeps its link idle for several round
trips. Meanwhile the other replicas' contributions are often already in the store. The exchange
(docs/exchange.md, "Round trips") prefetches them while it waits for the round's participants;
:func:`wait_prefetching` starts that earlier, once half of our own PUTs are answered: it lists who is
ready and hands the new ranks to the prefetch while the rest of our answers come in. The slowest
replica of a round, which everyone else waits for, then arrives at the reduce with its downloads done.

Nothing here changes what is written or who takes part: a prefetched object that the round does not use
is simply dropped, as with the prefetch during the quorum wait.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from typing import TypeVar

from diloco_serverless.exchange._io import FIRST_POLL_S

T = TypeVar("T")


def wait_prefetching(
    futures: Sequence[Future[T]],
    look: Callable[[], set[int]],
    on_ready: Callable[[set[int]], None],
    *,
    others: int,
    poll_interval_s: float,
) -> list[T]:
    """The results of ``futures`` (our PUTs), in order. Once half of them are done, call ``look`` (one
    listing: the ranks whose contributions are complete) every poll, backing off from
    :data:`~diloco_serverless.exchange._io.FIRST_POLL_S` to ``poll_interval_s``, and hand each new set
    to ``on_ready``, until all ``futures`` are done or ``others`` ranks were seen. An exception of a PUT
    or of ``look`` propagates."""
    pending: set[Future[T]] = set(futures)
    half = (len(futures) + 1) // 2
    while pending and len(futures) - len(pending) < half:  # our bodies are still going up
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for fut in done:
            fut.result()  # a failed PUT fails the publish now, not after more listings
    sleep_s = min(FIRST_POLL_S, poll_interval_s)
    seen: set[int] = set()
    while pending and len(seen) < others:
        ready = look()
        if ready - seen:
            seen |= ready
            on_ready(set(seen))
            sleep_s = min(FIRST_POLL_S, poll_interval_s)
        else:
            sleep_s = min(sleep_s * 1.5, poll_interval_s)
        done, pending = wait(pending, timeout=sleep_s, return_when=ALL_COMPLETED)
        for fut in done:
            fut.result()
    return [fut.result() for fut in futures]
