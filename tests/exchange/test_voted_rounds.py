"""Rounds without a quorum object (diloco_serverless.exchange.votes): each rank's create-only vote says
it contributed, and a tombstone at its vote key leaves it out.

Threads as replicas on memory:// and file://; a direct or flat round at N <= 16 is such a round. These
stores have no part size, so a direct round's share is one object (the contribution is the vote); the
``mode`` fixture also runs tests with a direct round's shares cut into 3 pieces and a separate vote (as
a store with a part size would cut a large tensor), and flat rounds (N x ``split`` shards, then the vote;
reduced and gathered over the voters), whole and split in 2.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.codec import pack, unpack
from diloco_serverless.exchange.errors import AbstainedError, CorruptObjectError, MismatchError, RoundPrunedError
from diloco_serverless.exchange.quorum import ReadyMarker
from diloco_serverless.exchange.votes import EXCLUDED, VotedRound, quorumless
from diloco_serverless.run.layout import contrib_key, quorum_key, ready_prefix, vote_key
from diloco_serverless.store.errors import ObjectNotFound
from diloco_serverless.store.objectstore import ObjectStore
from support.allreduce import FAST, DiesAfterReady, WithQuorum, assert_identical, randn, run_replicas
from support.recording_store import RecordingStore

DIRECT: dict[str, Any] = {"topology": "direct"}


@dataclass(frozen=True)
class Mode:
    """A kind of round without a quorum: its ``topology`` and ``split`` (split_for's answer)."""

    topology: str
    split: int

    @property
    def kw(self) -> dict[str, Any]:
        return {"topology": self.topology}

    def vote_key(self, round: int, rank: int) -> str:
        whole = self.topology == "direct" and self.split == 1
        return contrib_key(round, 0, rank) if whole else vote_key(round, rank)


@pytest.fixture(params=[Mode("direct", 1), Mode("direct", 3), Mode("flat", 1), Mode("flat", 2)],
                ids=["direct", "direct-pieces", "flat", "flat-split"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Mode:
    import diloco_serverless.exchange.allreduce as exchange

    m: Mode = request.param
    monkeypatch.setattr(exchange, "split_for", lambda numel, n, protocol, *a: m.split if protocol == m.topology else 1)
    return m


@pytest.fixture(params=["memory", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://direct-{uuid.uuid4().hex[:8]}"
    return (tmp_path / "store").as_uri()


def _ints(n: int, seed: int) -> torch.Tensor:
    """Small integers: sums are exact in fp32 whatever the order."""
    return torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(seed)).float()


def _store(url: str) -> ObjectStore:
    return ObjectStore(url).child("t")


def _header(url: str, round: int, rank: int, mode: Mode = Mode("direct", 1)) -> dict[str, Any]:
    """The header of rank ``rank``'s vote in ``round``."""
    key = mode.vote_key(round, rank)
    return unpack(_store(url).get(key), key=key)[1]


def test_which_rounds_go_without_a_quorum() -> None:
    def marker(n: int, protocol: str = "direct", split: int = 1) -> ReadyMarker:
        return ReadyMarker("r", 0, 0, n, 10, "torch.float32", [10], "fp32", protocol, split)

    assert quorumless(marker(2)) and quorumless(marker(16))
    assert quorumless(marker(4, split=2))  # a share in pieces votes with a separate object
    assert not quorumless(marker(17))  # data spread over several prefixes: the quorum's round
    assert quorumless(marker(4, "flat")) and quorumless(marker(16, "flat", split=3))
    assert not quorumless(marker(17, "flat"))
    assert not quorumless(marker(4, "hierarchical"))  # its partials need a fixed participant list up front
    assert not quorumless(marker(2), quorum=True) and not quorumless(marker(4, "flat"), quorum=True)


@pytest.mark.parametrize("pieces", [1, 3], ids=["whole", "pieces"])
def test_mean_is_the_flat_mean_with_no_marker_and_no_quorum(url: str, pieces: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import diloco_serverless.exchange.allreduce as exchange

    monkeypatch.setattr(exchange, "split_for", lambda numel, n, protocol, *a: pieces if protocol == "direct" else 1)
    xs = {r: randn(3001, r) for r in range(4)}
    outs, errors, stats = run_replicas(url, xs, 4, rounds=2, keep_rounds=None, **DIRECT)
    flat, _, _ = run_replicas(f"memory://flat-{uuid.uuid4().hex[:8]}", xs, 4, rounds=2, topology="flat")
    assert not errors
    assert_identical(outs)
    for k in range(2):  # the same operations in the same order as the sharded reduce: the same bits
        assert torch.equal(outs[0][k], flat[0][k])
    keys = _store(url).list("rounds")
    assert keys and not [k for k in keys if "/ready/" in k or k.endswith("quorum.json") or "/reduced/" in k]
    assert stats[2].participants == [0, 1, 2, 3] and not stats[2].late
    assert _header(url, 1, 2, Mode("direct", pieces))["marker"]["rank"] == 2  # the vote carries its ready marker
    assert _header(url, 1, 2, Mode("direct", pieces))["marker"]["split"] == pieces
    assert len([k for k in keys if "/00000001/contrib/" in k]) == 4 * pieces
    p = 3001 * 4
    assert stats[1].bytes_up < p + 2048 and 3 * p < stats[1].bytes_down < 3 * p + 8192  # P up, (N-1)P down


@pytest.mark.parametrize("split", [1, 2])
def test_a_flat_round_votes_and_gives_the_bits_of_a_round_with_a_quorum(url: str, split: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import diloco_serverless.exchange.allreduce as exchange

    monkeypatch.setattr(exchange, "split_for", lambda numel, n, protocol, *a: split)
    xs = {r: randn(3001, r) for r in range(4)}
    outs, errors, stats = run_replicas(url, xs, 4, rounds=2, keep_rounds=None, topology="flat")
    quorum, _, qstats = run_replicas(f"memory://quorum-{uuid.uuid4().hex[:8]}", xs, 4, rounds=2, topology="flat",
                                     make=WithQuorum)
    assert not errors
    assert_identical(outs)
    for k in range(2):  # the same reduce over the same participants: the same bits
        assert torch.equal(outs[0][k], quorum[0][k])
    keys = _store(url).list("rounds")
    assert not [k for k in keys if "/ready/" in k or k.endswith("quorum.json")]
    assert {k for k in keys if "/00000001/votes/" in k} == {vote_key(1, q) for q in range(4)}
    assert len([k for k in keys if "/00000001/reduced/" in k]) == 4 * split
    assert _header(url, 1, 2, Mode("flat", split))["marker"]["protocol"] == "flat"
    assert stats[2].participants == [0, 1, 2, 3] and len(stats[2].reduced_shards) == split
    p = 3001 * 4
    for r in range(4):  # P + P/N up and 2P(N-1)/N down, as with a quorum: only headers and votes differ
        assert p * 1.25 < stats[r].bytes_up < p * 1.25 + 6000
        assert p * 1.5 < stats[r].bytes_down < p * 1.5 + 12000
        assert abs(stats[r].bytes_up - qstats[r].bytes_up) < 2048
        assert abs(stats[r].bytes_down - qstats[r].bytes_down) < 4096


def test_straggler_is_tombstoned_and_adopts_the_result_when_it_comes(url: str, mode: Mode) -> None:
    xs = {r: _ints(500, r) for r in range(3)}
    outs, errors, stats = run_replicas(url, {0: xs[0], 1: xs[1]}, 3, min_replicas=2, keep_rounds=None, **mode.kw)
    assert not errors
    assert_identical(outs)
    assert torch.equal(outs[0][0], (xs[0] + xs[1]) / 2) and stats[0].participants == [0, 1]
    tomb = _header(url, 0, 2, mode)
    assert "straggler deadline" in tomb[EXCLUDED] and tomb["by"] in (0, 1)
    late = ObjectStoreAllReduce(url, 2, 3, run_id="t", **FAST, **mode.kw)
    got = late.allreduce(xs[2], round=0)
    assert torch.equal(got, outs[0][0])  # its values were not averaged in, by anyone
    assert late.last_stats is not None and late.last_stats.late and late.last_stats.participants == [0, 1]
    assert _header(url, 0, 2, mode)[EXCLUDED] == tomb[EXCLUDED]  # its create lost to the tombstone


@pytest.mark.parametrize("seed", range(6))
def test_a_contribution_racing_the_tombstones_is_in_for_everyone_or_for_no_one(
        tmp_path: Path, seed: int, mode: Mode) -> None:
    """Rank 2 arrives around the others' straggler deadline: whichever create wins, all three agree."""
    url = (tmp_path / "s").as_uri()
    xs = {r: _ints(800, r) for r in range(3)}
    delay = FAST["straggler_timeout_s"] * random.Random(seed).uniform(0.7, 1.3)
    outs: dict[int, torch.Tensor] = {}
    parts: dict[int, list[int]] = {}

    def one(r: int) -> None:
        if r == 2:
            time.sleep(delay)
        with ObjectStoreAllReduce(url, r, 3, run_id="t", min_replicas=2, **FAST, **mode.kw) as ar:
            outs[r] = ar.allreduce(xs[r])
            assert ar.last_stats is not None
            parts[r] = ar.last_stats.participants

    threads = [threading.Thread(target=one, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(outs) == 3 and parts[0] == parts[1] == parts[2]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.equal(outs[0], sum(xs[q] for q in parts[0]) / len(parts[0]))  # type: ignore[operator]


def test_abstention_leaves_the_replica_out_or_fails_everyone_alike(url: str, mode: Mode) -> None:
    xs = {r: _ints(300, r) for r in range(3)}
    bad = dict(xs)
    bad[1] = xs[1].clone()
    bad[1][7] = float("nan")
    outs, errors, stats = run_replicas(url, bad, 3, min_replicas=2, **mode.kw)
    assert not errors
    assert_identical(outs)
    assert torch.equal(outs[0][0], (xs[0] + xs[2]) / 2)
    assert stats[0].participants == [0, 2] and stats[1].late and "non-finite" in (stats[1].abstained or "")
    _, errors, _ = run_replicas(url.replace("direct-", "direct2-") if url.startswith("memory") else url + "2",
                                bad, 3, **mode.kw)  # min_replicas = 3: nobody waits for the deadline
    assert set(errors) == {0, 1, 2}
    assert all(isinstance(e, AbstainedError) and "rank 1" in str(e) and "non-finite" in str(e) for e in errors.values())


def test_a_restarted_replica_takes_part_with_what_it_stored_before(url: str, mode: Mode) -> None:
    xs = {r: _ints(400, r) for r in range(2)}
    _, errors, _ = run_replicas(url, {1: xs[1]}, 2, make=lambda u, r, w, **kw: DiesAfterReady(u, r, w, **kw),
                                **mode.kw)
    assert isinstance(errors[1], SystemExit)
    again = {0: xs[0], 1: xs[1] + 1000}  # the restarted rank 1 computed something else this time
    outs, errors, stats = run_replicas(url, again, 2, **mode.kw)
    assert not errors
    assert_identical(outs)
    assert torch.equal(outs[0][0], (xs[0] + xs[1]) / 2) and stats[1].participants == [0, 1]


def test_a_restarted_replica_that_died_before_voting_rewrites_its_pieces(url: str) -> None:
    """Pieces of an attempt that died before its vote are nobody's: the next attempt writes its own."""
    import diloco_serverless.exchange.allreduce as exchange

    xs = {r: _ints(600, r) for r in range(2)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(exchange, "split_for", lambda numel, n, protocol, *a: 3 if protocol == "direct" else 1)
        ar = ObjectStoreAllReduce(url, 1, 2, run_id="t", **FAST, **DIRECT)
        assert ar._io is not None
        me = ar._marker(0, xs[1], "direct")
        VotedRound(ar._io, me, ar._wait(time.monotonic() + 5))._put_pieces(xs[1] + 1000)
        assert not _store(url).exists(vote_key(0, 1)) and _store(url).exists(contrib_key(0, 2, 1))
        outs, errors, stats = run_replicas(url, xs, 2, **DIRECT)
    assert not errors
    assert_identical(outs)
    assert torch.equal(outs[0][0], (xs[0] + xs[1]) / 2) and stats[0].participants == [0, 1]


def test_a_dead_replicas_stored_contribution_is_all_the_others_need(url: str, mode: Mode) -> None:
    xs = {r: _ints(400, r) for r in range(3)}

    def make(u: str, r: int, w: int, **kw: Any) -> ObjectStoreAllReduce:
        return (DiesAfterReady if r == 0 else ObjectStoreAllReduce)(u, r, w, **kw)

    outs, errors, stats = run_replicas(url, xs, 3, make=make, **mode.kw)
    assert set(errors) == {0}
    del outs[0]
    assert_identical(outs)
    assert torch.equal(outs[1][0], (xs[0] + xs[1] + xs[2]) / 3) and stats[2].participants == [0, 1, 2]


def test_corrupt_and_foreign_contributions_are_refused_by_everyone(url: str) -> None:
    xs = {r: _ints(400, r) for r in range(3)}
    store = _store(url)
    key = contrib_key(0, 0, 2)
    store.put(key, pack({"values": torch.zeros(400)}, {"run_id": "other", "round": 0, "rank": 2}))
    _, errors, _ = run_replicas(url, xs, 3, **DIRECT, timeout_s=5.0)
    assert set(errors) == {0, 1, 2}
    assert all(isinstance(e, CorruptObjectError) and key in str(e) for e in errors.values())
    flipped = bytearray(pack({"v": torch.ones(4)}, {"run_id": "t", "round": 1, "rank": 2}))
    flipped[-1] ^= 0xFF
    store.put(contrib_key(1, 0, 2), bytes(flipped))
    _, errors, _ = run_replicas(url, {0: xs[0], 1: xs[1]}, 3, **DIRECT, timeout_s=5.0,
                                make=lambda u, r, w, **kw: _at_round(1, u, r, w, **kw))
    assert set(errors) == {0, 1} and all(isinstance(e, CorruptObjectError) for e in errors.values())


def _at_round(round: int, *args: Any, **kw: Any) -> ObjectStoreAllReduce:
    ar = ObjectStoreAllReduce(*args, **kw)
    ar._next_round = round
    return ar


def test_a_forged_tombstone_without_the_run_key_is_refused(url: str) -> None:
    key = b"k" * 32
    xs = {r: _ints(200, r) for r in range(2)}
    _store(url).put(contrib_key(0, 0, 1), pack({}, {"run_id": "t", "round": 0, "shard": 0, "rank": 1,
                                                    EXCLUDED: "forged", "by": 0}))
    _, errors, _ = run_replicas(url, xs, 2, run_key=key, **DIRECT, timeout_s=5.0)
    assert set(errors) == {0, 1}
    assert all(isinstance(e, CorruptObjectError) and "signature" in str(e) for e in errors.values())


def test_disagreement_is_the_same_mismatch_everywhere(url: str) -> None:
    xs = {0: randn(100, 0), 1: randn(101, 1), 2: randn(100, 2)}
    _, errors, _ = run_replicas(url, xs, 3, **DIRECT)
    assert set(errors) == {0, 1, 2} and all(isinstance(e, MismatchError) for e in errors.values())
    assert len({str(e) for r, e in errors.items() if r != 1}) == 1


def test_a_replica_on_another_topology_is_named(url: str) -> None:
    xs = {r: _ints(60, r) for r in range(2)}

    def make(u: str, r: int, w: int, **kw: Any) -> ObjectStoreAllReduce:
        return ObjectStoreAllReduce(u, r, w, **{**kw, "topology": "direct" if r == 0 else "flat"})

    _, errors, _ = run_replicas(url, xs, 2, make=make, timeout_s=3.0)
    assert isinstance(errors[0], MismatchError) and "exchange.topology" in str(errors[0])
    assert set(errors) == {0, 1}  # the flat replica waits for a ready marker that never comes, then says so


def test_timeout_names_the_missing_ranks(url: str) -> None:
    xs = {0: randn(100, 0), 1: randn(100, 1)}
    _, errors, _ = run_replicas(url, xs, 4, timeout_s=0.8, min_replicas=3, **DIRECT)
    assert set(errors) == {0, 1}
    assert all(isinstance(e, TimeoutError) and "[2, 3]" in str(e) for e in errors.values())
    assert not _store(url).list(ready_prefix(0)) and not _store(url).exists(quorum_key(0))


def test_read_reduced_replays_a_round_and_skips_it_for_a_participant(url: str, mode: Mode) -> None:
    xs = {r: randn(777, r) for r in range(3)}
    outs, errors, _ = run_replicas(url, {0: xs[0], 1: xs[1]}, 3, rounds=2, keep_rounds=None, min_replicas=2,
                                   codec="bf16", **mode.kw)
    assert not errors
    ar = ObjectStoreAllReduce(url, 2, 3, run_id="t", codec="bf16", **FAST, **mode.kw)
    for k in range(2):
        got = ar.read_reduced(k, xs[2])
        assert got is not None and torch.equal(got, outs[1][k])
        assert ar.read_reduced(k, xs[2], unless_participant=0) is None  # rank 0 re-trains it instead
        assert ar.read_reduced(k, xs[2], unless_participant=2) is not None  # rank 2 was left out
    assert ar.read_reduced(5, xs[2]) is None
    with pytest.raises(MismatchError, match="777"):
        ObjectStoreAllReduce(url, 2, 3, run_id="t", codec="bf16", **FAST, **mode.kw).read_reduced(0, torch.zeros(778))


def test_replica_behind_a_pruned_round_is_told_to_heal_and_closes_nothing(url: str, mode: Mode) -> None:
    xs = {r: _ints(100, r) for r in range(2)}
    run_replicas(url, xs, 2, rounds=3, keep_rounds=1, **mode.kw)
    ar = ObjectStoreAllReduce(url, 0, 2, run_id="t", **{**FAST, "min_replicas": 1}, **mode.kw)
    with pytest.raises(RoundPrunedError, match="round 0.*checkpoint"):
        ar.allreduce(xs[0], round=0)
    assert not _store(url).exists(mode.vote_key(0, 1)) and not _store(url).exists(vote_key(0, 1))  # no tombstone


def test_a_flat_vote_without_a_share_writer_is_refused_before_anything_is_written(url: str) -> None:
    ar = ObjectStoreAllReduce(url, 0, 2, run_id="t", topology="flat", **FAST)
    assert ar._io is not None
    me = ar._marker(0, _ints(50, 0), "flat")
    with pytest.raises(ValueError, match="flat round without a quorum needs put_share"):
        VotedRound(ar._io, me, ar._wait(time.monotonic() + 5)).publish(_ints(50, 0), None, fresh=True)
    assert not _store(url).list("rounds")


def test_votes_are_checked_from_the_listing_on_s3(s3_store_url: str, s3_storage_options: dict[str, Any]) -> None:
    """On S3 a listing shows each object's MD5 (its ETag): a replica computes the vote each peer must have
    written (its own but for the rank, MAC'd with the run key) and reads none of them, one round trip
    less before the reduce."""
    stores = {r: RecordingStore(s3_store_url, s3_storage_options) for r in range(3)}
    xs = {r: randn(3_001, r) for r in range(3)}

    def factory(u: str, rank: int, n: int, **opts: Any) -> ObjectStoreAllReduce:
        return ObjectStoreAllReduce(stores[rank], rank, n, run_key=b"k" * 32, **opts)

    outs, errors, stats = run_replicas(s3_store_url, xs, 3, make=factory, topology="flat")
    assert not errors, errors
    assert_identical(outs)
    torch.testing.assert_close(outs[0][0], torch.stack(list(xs.values())).mean(0), atol=1e-6, rtol=0)
    assert all(s.participants == [0, 1, 2] for s in stats.values())
    # (a replica's first round reads its own vote key before it publishes: a restarted one may have voted)
    read = {r: store.keys("GET", contains="/votes/") for r, store in stores.items()}
    assert read == {r: [vote_key(0, r)] for r in stores}


def test_a_vote_that_differs_is_still_read_on_s3(s3_store_url: str, s3_storage_options: dict[str, Any]) -> None:
    """A vote whose MD5 is not the expected one (here rank 2 averages another codec) is read and refused
    as before: every replica raises the mismatch, naming it."""
    stores = {r: RecordingStore(s3_store_url, s3_storage_options) for r in range(3)}
    xs = {r: randn(3_001, r) for r in range(3)}

    def factory(u: str, rank: int, n: int, **opts: Any) -> ObjectStoreAllReduce:
        return ObjectStoreAllReduce(stores[rank], rank, n, codec="bf16" if rank == 2 else "fp32", **opts)

    _, errors, _ = run_replicas(s3_store_url, xs, 3, make=factory, topology="flat", timeout_s=10.0)
    assert sorted(errors) == [0, 1, 2]
    assert all(isinstance(e, MismatchError) and "bf16" in str(e) for e in errors.values()), errors
    assert stores[0].keys("GET", contains="votes/rank-2")


class _MissesTheTombstone(RecordingStore):
    """Rank 1's store: its GETs of rank 2's vote in round 0 find nothing until one of its listings shows
    that round 1 has begun, i.e. every poll it made raced the tombstone rank 0 wrote there."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, **kw: Any) -> None:
        super().__init__(url, storage_options, **kw)
        self.revealed: list[bool] = [False]

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        if key.endswith(contrib_key(0, 0, 2)) and not self.revealed[0]:  # a direct round's vote
            self._record("GET", key)
            raise ObjectNotFound(key)
        return super().get(key, max_bytes=max_bytes)

    def list(self, prefix: str = "") -> list[str]:
        out = super().list(prefix)
        if any("/00000001/" in f"/{k}" for k in out):
            self.revealed[0] = True
        return out


def test_a_replica_whose_polls_missed_the_tombstone_finishes_the_round_when_the_run_moved_on(tmp_path: Path) -> None:
    """Rank 0 tombstones absent rank 2, finishes round 0 and starts round 1; rank 1's GETs of rank 2's vote
    all came back empty. When its check finds round 1 begun it reads the missing votes once more and
    finishes round 0 with the others' participants, instead of failing with RoundPrunedError."""
    url = f"file://{tmp_path}/s"
    hiding = _MissesTheTombstone(url)
    xs = {r: randn(257, r) for r in range(2)}

    def make(u: str, rank: int, n: int, **opts: Any) -> ObjectStoreAllReduce:
        return ObjectStoreAllReduce(hiding if rank == 1 else u, rank, n, **opts)

    outs, errors, _ = run_replicas(url, xs, 3, rounds=2, min_replicas=2, topology="direct", make=make)
    assert not errors, errors
    assert hiding.revealed[0], "rank 1 never saw round 1 begin: the race was not reproduced"
    for k in range(2):
        assert torch.equal(outs[0][k], outs[1][k])
