"""A replica downloads while its own writes wait for their answers: the others' contributions while its last
contribution PUTs wait, before their writers vote (diloco_serverless.exchange.overlap), their reduced shards
while its own reduced PUT waits. Contribution objects are create-only, so an early read is what counts."""

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
from diloco_serverless.exchange.overlap import EarlyFetch, wait_prefetching
from diloco_serverless.run.layout import contrib_key, reduced_key, vote_key
from diloco_serverless.store.objectstore import ObjectStore
from support.allreduce import FAST, WithQuorum, assert_identical, randn, run_replicas
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


def _fetch_all(look: Callable[[], set[str]], expected: set[str]) -> tuple[EarlyFetch, list[set[str]]]:
    handed: list[set[str]] = []
    return EarlyFetch(look, handed.append, expected=expected, poll_interval_s=0.02), handed


def test_early_fetch_hands_each_contribution_once_and_stops_when_all_are_seen() -> None:
    listings = iter([set(), {"a", "x"}, {"a", "x"}, {"a", "b", "x"}, {"a", "b", "c"}])
    polls: list[int] = []

    def look() -> set[str]:
        polls.append(1)
        return next(listings)

    early, handed = _fetch_all(look, {"a", "b", "c"})
    early.start().join(5)
    assert handed == [{"a"}, {"b"}, {"c"}]  # new keys only, never one we did not expect ("x")
    assert len(polls) == 5 and early.seen == {"a", "b", "c"}  # no listing once everything was seen


def test_early_fetch_hands_nothing_after_stop() -> None:
    found, stopped = threading.Event(), threading.Event()

    def look() -> set[str]:
        if found.is_set():
            stopped.wait(5)  # a listing still in flight when the participants become known
            return {"a", "b"}
        found.set()
        return {"a"}

    early, handed = _fetch_all(look, {"a", "b"})
    early.start()
    assert found.wait(5)
    early.stop()
    stopped.set()
    early.join(5)
    assert handed == [{"a"}]


def test_early_fetch_gives_up_after_polls_that_find_nothing_new() -> None:
    listings = iter([{"a"}] + [{"a"}] * 3 + [{"a", "b"}] + [{"a", "b"}] * 50)
    early = EarlyFetch(lambda: next(listings), lambda keys: None, expected={"a", "b", "c"}, poll_interval_s=0.01,
                       idle_polls=4)
    early.start().join(5)
    assert early.seen == {"a", "b"}  # "b", after three polls with nothing new, starts the count again
    assert early.polls == 5 + 4  # then four fruitless polls, and no more while "c" (a straggler) is missing


def test_a_failed_listing_ends_the_early_fetch_quietly() -> None:
    def look() -> set[str]:
        raise OSError("listing refused")

    early, handed = _fetch_all(look, {"a"})
    early.start().join(5)
    assert not early._thread.is_alive() and handed == [] and early.polls == 0


class HeldUntil(RecordingStore):
    """A replica's store whose writes of keys ``held`` accepts wait (up to 10 s) for ``until``; its GETs of
    keys ``signals`` accepts set ``signal``. With one event for both, a replica's write waits for its own
    read; with two stores and swapped events, one replica's write waits for another's read."""

    def __init__(self, url: str, held: Callable[[str], bool], until: threading.Event,
                 signals: Callable[[str], bool], signal: threading.Event) -> None:
        super().__init__(url)
        self.held, self.until, self.signals, self.signal = held, until, signals, signal
        self.in_time: list[bool] = []  # a list: the exchange's child stores share it

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        if self.signals(key):
            self.signal.set()
        return super().get(key, max_bytes=max_bytes)

    def _hold(self, key: str) -> None:
        if self.held(key):
            self.in_time.append(self.until.wait(10))

    def put(self, key: str, data: bytes) -> None:
        self._hold(key)
        super().put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._hold(key)
        return super().put_if_absent(key, data)


def holds_one_write(url: str, held: str, wanted: Callable[[str], bool]) -> HeldUntil:
    """Rank 0's store: its write of ``held`` waits until it has started a GET of a key ``wanted`` accepts."""
    fetched = threading.Event()
    return HeldUntil(url, lambda key: key == held, fetched, wanted, fetched)


def _run_with(url: str, held: HeldUntil, make: type[ObjectStoreAllReduce], **kw: Any) -> dict[int, RoundStats]:
    """One flat round of 3 replicas, rank 0 on ``held``; checks the mean and that the held write was
    released by the GET it waited for, not by its timeout."""
    xs = {r: randn(3_001, r) for r in range(3)}

    def factory(u: str, rank: int, n: int, **opts: Any) -> ObjectStoreAllReduce:
        return make(held if rank == 0 else u, rank, n, **opts)

    t = time.monotonic()
    outs, errors, stats = run_replicas(url, xs, 3, make=factory, topology="flat", **kw)
    assert not errors
    assert held.in_time == [True], "rank 0 made no GET wanted before its held write was answered"
    assert time.monotonic() - t < 9
    assert_identical(outs)
    torch.testing.assert_close(outs[0][0], torch.stack(list(xs.values())).mean(0), atol=1e-6, rtol=0)
    assert all(s.participants == [0, 1, 2] for s in stats.values())
    return stats


@pytest.mark.parametrize("make", [ObjectStoreAllReduce, WithQuorum], ids=["votes", "quorum"])
def test_the_others_contributions_are_fetched_while_our_last_put_waits(make: type[ObjectStoreAllReduce]) -> None:
    theirs, url = re.compile(r".*/contrib/\d+/rank-[12]"), f"memory://overlap-{uuid.uuid4().hex[:8]}"
    held = holds_one_write(url, contrib_key(0, 2, 0), lambda key: bool(theirs.fullmatch(key)))  # our piece of shard 2
    _run_with(url, held, make)
    # what rank 0 prefetched is what it sums for shard 0 (its own): read once, not again after the vote
    for q in (1, 2):
        assert held.keys("GET").count(contrib_key(0, 0, q)) == 1


@pytest.mark.parametrize("make", [ObjectStoreAllReduce, WithQuorum], ids=["votes", "quorum"])
def test_the_others_reduced_shards_are_fetched_while_our_reduced_put_waits(
    make: type[ObjectStoreAllReduce],
) -> None:
    url = f"memory://overlap-{uuid.uuid4().hex[:8]}"
    held = holds_one_write(url, reduced_key(0, 0), lambda key: key in (reduced_key(0, 1), reduced_key(0, 2)))
    stats = _run_with(url, held, make, takeover_timeout_s=30.0)  # nobody takes rank 0's shard over meanwhile
    assert stats[0].reduced_shards == [0] and not stats[0].takeovers
    assert held.keys("PUT").count(reduced_key(0, 0)) == 1


@pytest.mark.parametrize("make", [ObjectStoreAllReduce, WithQuorum], ids=["votes", "quorum"])
def test_contributions_are_fetched_before_their_writer_votes(make: type[ObjectStoreAllReduce]) -> None:
    """Rank 1's vote (its ready marker with a quorum) waits until rank 0 has read rank 1's contribution to
    shard 0, which rank 0 reduces: rank 0 finds it by listing the shard's folder, not through the vote."""
    url, read, never = f"memory://early-{uuid.uuid4().hex[:8]}", threading.Event(), threading.Event()
    theirs = contrib_key(0, 0, 1)
    vote = re.compile(r"rounds/\d+/(votes/rank-1|ready/rank-1\..*)")
    stores = {
        0: HeldUntil(url, lambda key: False, never, lambda key: key == theirs, read),
        1: HeldUntil(url, lambda key: bool(vote.fullmatch(key)), read, lambda key: False, never),
    }
    xs = {r: randn(3_001, r) for r in range(3)}

    def factory(u: str, rank: int, n: int, **opts: Any) -> ObjectStoreAllReduce:
        return make(stores.get(rank, u), rank, n, **opts)

    t = time.monotonic()
    outs, errors, _ = run_replicas(url, xs, 3, make=factory, topology="flat")
    assert not errors
    assert stores[1].in_time == [True], "rank 0 did not read rank 1's contribution before rank 1 voted"
    assert time.monotonic() - t < 9
    assert_identical(outs)
    torch.testing.assert_close(outs[0][0], torch.stack(list(xs.values())).mean(0), atol=1e-6, rtol=0)
    assert stores[0].keys("GET").count(theirs) == 1  # the early read is the one summed


class FailsOneVote(RecordingStore):
    """Rank 1's store: its first vote write fails, as if the replica died between its pieces and its vote."""

    failed = False

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if key == vote_key(0, 1) and not self.failed:
            type(self).failed = True
            raise ConnectionError("replica killed before its vote")
        return super().put_if_absent(key, data)


def test_a_replica_that_republishes_after_dying_before_its_vote_counts_its_stored_pieces() -> None:
    """Pieces are create-only: a replica that comes back with other values (a re-trained round) keeps the
    pieces it already wrote, which others may have read before its vote; every replica gets the same mean."""
    url = f"memory://republish-{uuid.uuid4().hex[:8]}"
    xs = {r: randn(3_001, r) for r in range(3)}
    again = randn(3_001, 99)
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def replica(rank: int) -> None:
        try:
            store = FailsOneVote(url) if rank == 1 else url
            with ObjectStoreAllReduce(store, rank, 3, run_id="t", topology="flat", **FAST) as ar:
                if rank == 1:
                    with pytest.raises(ConnectionError):
                        ar.allreduce(xs[1], round=0)
                    results[rank] = ar.allreduce(again, round=0)
                else:
                    results[rank] = ar.allreduce(xs[rank], round=0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors and FailsOneVote.failed
    assert_identical({r: [v] for r, v in results.items()})
    torch.testing.assert_close(results[0], torch.stack(list(xs.values())).mean(0), atol=1e-6, rtol=0)


def test_a_damaged_piece_left_by_a_dead_write_is_replaced_and_read_again() -> None:
    """A store may keep a write cut off by its writer's death (moto behind a proxy does). Create-only pieces
    must not make that permanent: the writer replaces a piece that does not decode, and a reader that read
    it early reads it again after the vote."""
    url = f"memory://damaged-{uuid.uuid4().hex[:8]}"
    damaged = contrib_key(0, 0, 1)  # rank 1's piece of shard 0, which rank 0 reduces
    ObjectStore(url).child("t").put(damaged, b"cut off mid-body")
    reader = RecordingStore(url)
    xs = {r: randn(3_001, r) for r in range(3)}

    def factory(u: str, rank: int, n: int, **opts: Any) -> ObjectStoreAllReduce:
        return ObjectStoreAllReduce(reader if rank == 0 else u, rank, n, **opts)

    outs, errors, _ = run_replicas(url, xs, 3, make=factory, topology="flat")
    assert not errors, errors
    assert_identical(outs)
    torch.testing.assert_close(outs[0][0], torch.stack(list(xs.values())).mean(0), atol=1e-6, rtol=0)
    assert reader.keys("GET").count(damaged) >= 1



class _TimesPieces(RecordingStore):
    """Records when each of rank 0's contribution writes starts."""

    def __init__(self, url: str, log: list[tuple[str, int, float]]) -> None:
        super().__init__(url)
        self.log = log

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if re.fullmatch(r".*/contrib/\d+/rank-0", key):
            self.log.append(("put", int(key.split("/")[-2]), time.monotonic()))
        return super().put_if_absent(key, data)


def test_contributions_go_up_as_they_are_encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one encoding at a time, our first piece is written while the others are still being encoded,
    not after all of them (which would leave the link idle for the whole encode)."""
    import diloco_serverless.exchange.allreduce as allreduce

    log: list[tuple[str, int, float]] = []
    running: list[int] = []
    real_pack = allreduce.pack

    def slow_pack(tensors: Any, header: Any, run_key: bytes | None = None, *, place: str | None = None) -> bytes:
        ours = header.get("kind") == "contrib" and header.get("rank") == 0
        if ours:
            running.append(1)
            log.append(("encode", len(running), time.monotonic()))
            time.sleep(0.3)
        try:
            return real_pack(tensors, header, run_key, place=place)
        finally:
            if ours:
                running.pop()

    monkeypatch.setattr(allreduce, "_ENCODE_AT_ONCE", 1)
    monkeypatch.setattr(allreduce, "pack", slow_pack)
    url = f"memory://encode-{uuid.uuid4().hex[:8]}"
    store = _TimesPieces(url, log)
    xs = {r: randn(3_001, r) for r in range(3)}

    def factory(u: str, rank: int, n: int, **opts: Any) -> ObjectStoreAllReduce:
        return ObjectStoreAllReduce(store if rank == 0 else u, rank, n, **opts)

    outs, errors, _ = run_replicas(url, xs, 3, make=factory, topology="flat")
    assert not errors, errors
    torch.testing.assert_close(outs[0][0], torch.stack(list(xs.values())).mean(0), atol=1e-6, rtol=0)
    encodes = [t for kind, _, t in log if kind == "encode"]
    puts = [t for kind, _, t in log if kind == "put"]
    assert len(encodes) == len(puts) == 3
    assert max(n for kind, n, _ in log if kind == "encode") == 1, "more than one piece was encoded at once"
    assert min(puts) < max(encodes), "no piece went up before the last one was encoded"
