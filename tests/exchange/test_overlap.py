"""A replica downloads while its own writes wait for their answers: the others' contributions while its last
contribution PUTs wait (diloco_serverless.exchange.overlap), their reduced shards while its own reduced PUT waits."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce, RoundStats
from diloco_serverless.exchange.overlap import wait_prefetching
from diloco_serverless.run.layout import contrib_key, reduced_key
from support.allreduce import WithQuorum, assert_identical, randn, run_replicas
from support.recording_store import RecordingStore


def _finish_later(fut: Future[int], value: int, after_s: float) -> None:
    threading.Timer(after_s, fut.set_result, args=(value,)).start()


def test_nobody_is_listed_before_half_of_our_puts_are_answered() -> None:
    futures: list[Future[int]] = [Future() for _ in range(4)]
    looked_at: list[int] = []  # how many PUTs were done at each listing
    handed: list[set[int]] = []

    def look() -> set[int]:
        looked_at.append(sum(f.done() for f in futures))
        return {1, 2} if len(looked_at) == 1 else {1, 2, 3}

    _finish_later(futures[0], 0, 0.05)
    _finish_later(futures[1], 1, 0.10)
    _finish_later(futures[2], 2, 0.40)
    _finish_later(futures[3], 3, 0.45)
    assert wait_prefetching(futures, look, handed.append, others=3, poll_interval_s=0.02) == [0, 1, 2, 3]
    assert looked_at and min(looked_at) >= 2  # half answered: our bodies are through
    assert handed == [{1, 2}, {1, 2, 3}]  # each new set once, cumulative
    assert len(looked_at) == 2  # everyone seen: no more listings while the last PUTs finish


def test_a_failed_put_fails_at_once_and_nothing_is_listed_after_it() -> None:
    futures: list[Future[int]] = [Future() for _ in range(3)]
    futures[0].set_exception(OSError("PUT refused"))
    looks: list[int] = []
    with pytest.raises(OSError, match="PUT refused"):
        wait_prefetching(futures, lambda: looks.append(1) or set(), lambda ready: None, others=2,
                         poll_interval_s=0.02)
    assert not looks


def test_a_single_put_is_waited_for_without_listing() -> None:
    fut: Future[int] = Future()
    _finish_later(fut, 7, 0.05)
    looks: list[int] = []
    assert wait_prefetching([fut], lambda: looks.append(1) or {1}, lambda ready: None, others=1,
                            poll_interval_s=0.02) == [7]
    assert not looks


class HoldsOneWrite(RecordingStore):
    """Rank 0's store: its write of ``held`` waits (up to 10 s) until it has started a GET of a key that
    ``wanted`` accepts, and records whether it saw one in time."""

    def __init__(self, url: str, held: str, wanted: Callable[[str], bool]) -> None:
        super().__init__(url)
        self.held, self.wanted, self.fetched = held, wanted, threading.Event()
        self.in_time: list[bool] = []  # a list: the exchange's child stores share it

    def _hold(self, key: str) -> None:
        if key == self.held:
            self.in_time.append(self.fetched.wait(10))

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        if self.wanted(key):
            self.fetched.set()
        return super().get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes) -> None:
        self._hold(key)
        super().put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._hold(key)
        return super().put_if_absent(key, data)


def _run_with(url: str, held: HoldsOneWrite, make: type[ObjectStoreAllReduce], **kw: Any) -> dict[int, RoundStats]:
    """One flat round of 3 replicas, rank 0 on ``held``; checks the mean and that the held write was
    released by the GET it waited for, not by its timeout."""
    xs = {r: randn(3_001, r) for r in range(3)}

    def factory(u: str, rank: int, n: int, **opts: Any) -> ObjectStoreAllReduce:
        return make(held if rank == 0 else u, rank, n, **opts)

    t = time.monotonic()
    outs, errors, stats = run_replicas(url, xs, 3, make=factory, topology="flat", **kw)
    assert not errors
    assert held.in_time == [True], f"rank 0 made no GET wanted before its write of {held.held} was answered"
    assert time.monotonic() - t < 9
    assert_identical(outs)
    torch.testing.assert_close(outs[0][0], torch.stack(list(xs.values())).mean(0), atol=1e-6, rtol=0)
    assert all(s.participants == [0, 1, 2] for s in stats.values())
    return stats


@pytest.mark.parametrize("make", [ObjectStoreAllReduce, WithQuorum], ids=["votes", "quorum"])
def test_the_others_contributions_are_fetched_while_our_last_put_waits(make: type[ObjectStoreAllReduce]) -> None:
    theirs, url = re.compile(r".*/contrib/\d+/rank-[12]"), f"memory://overlap-{uuid.uuid4().hex[:8]}"
    held = HoldsOneWrite(url, contrib_key(0, 2, 0), lambda key: bool(theirs.fullmatch(key)))  # our piece of shard 2
    _run_with(url, held, make)
    # what rank 0 prefetched is what it sums for shard 0 (its own): read once, not again after the vote
    for q in (1, 2):
        assert held.keys("GET").count(contrib_key(0, 0, q)) == 1


@pytest.mark.parametrize("make", [ObjectStoreAllReduce, WithQuorum], ids=["votes", "quorum"])
def test_the_others_reduced_shards_are_fetched_while_our_reduced_put_waits(
    make: type[ObjectStoreAllReduce],
) -> None:
    url = f"memory://overlap-{uuid.uuid4().hex[:8]}"
    held = HoldsOneWrite(url, reduced_key(0, 0), lambda key: key in (reduced_key(0, 1), reduced_key(0, 2)))
    stats = _run_with(url, held, make, takeover_timeout_s=30.0)  # nobody takes rank 0's shard over meanwhile
    assert stats[0].reduced_shards == [0] and not stats[0].takeovers
    assert held.keys("PUT").count(reduced_key(0, 0)) == 1
