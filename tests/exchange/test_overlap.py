"""A replica starts downloading the others' contributions while its own last PUTs wait for their answers
(diloco_serverless.exchange.overlap)."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.overlap import wait_prefetching
from diloco_serverless.run.layout import contrib_key
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


class HoldsItsLastPiece(RecordingStore):
    """Rank 0's store: the PUT of its contribution to the last shard waits (up to 10 s) until rank 0 has
    started a GET of another rank's contribution, and records whether it saw one in time."""

    def __init__(self, url: str, held: str) -> None:
        super().__init__(url)
        self.held, self.fetched = held, threading.Event()
        self.in_time: list[bool] = []  # a list: the exchange's child stores share it

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        if "/contrib/" in key and not key.endswith("/rank-0"):
            self.fetched.set()
        return super().get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes) -> None:
        if key == self.held:
            self.in_time.append(self.fetched.wait(10))
        super().put(key, data)


@pytest.mark.parametrize("make", [ObjectStoreAllReduce, WithQuorum], ids=["votes", "quorum"])
def test_the_others_contributions_are_fetched_while_our_last_put_waits(make: type[ObjectStoreAllReduce]) -> None:
    url = f"memory://overlap-{uuid.uuid4().hex[:8]}"
    held = HoldsItsLastPiece(url, contrib_key(0, 2, 0))  # rank 0's piece of shard 2 (of 3)
    xs = {r: randn(3_001, r) for r in range(3)}

    def factory(u: str, rank: int, n: int, **kw: Any) -> ObjectStoreAllReduce:
        return make(held if rank == 0 else u, rank, n, **kw)

    t = time.monotonic()
    outs, errors, stats = run_replicas(url, xs, 3, make=factory, topology="flat")
    assert not errors
    assert held.in_time == [True], "rank 0 fetched nobody's contribution before its own last PUT was answered"
    assert time.monotonic() - t < 9  # the held PUT was released by the prefetch, not by its timeout
    assert_identical(outs)
    torch.testing.assert_close(outs[0][0], torch.stack(list(xs.values())).mean(0), atol=1e-6, rtol=0)
    assert all(s.participants == [0, 1, 2] for s in stats.values())
    # what rank 0 prefetched is what it sums for shard 0 (its own): read once, not again after the vote
    for q in (1, 2):
        assert held.keys("GET").count(contrib_key(0, 0, q)) == 1
