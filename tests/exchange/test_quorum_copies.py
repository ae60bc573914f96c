"""Above 16 replicas the quorum is read from copies in the spread prefixes, and above 64 the ready markers
are spread too (exchange/quorum.py, run/layout.py ``control_spread``).

Ranks below QUORUM_LISTERS list the ready markers on every poll and read ``quorum.json``; the others
(readers) poll their copy, and list and read ``quorum.json`` only every ``reader_list_s``: so at
N = 1,024 no key prefix sees the N replicas' polls. A copy that never comes, or a forged one, costs a
reader one slow listing, never the round; a run whose listers are all gone still closes its rounds.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_serverless.exchange._io import CountingStore
from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.quorum import (
    QUORUM_LISTERS,
    Quorum,
    QuorumWait,
    ReadyMarker,
    copy_to_read,
    marker_tag,
    quorum_copies,
    reader_list_s,
    signed_json,
    wait_for_quorum,
)
from diloco_serverless.run.layout import (
    control_spread,
    quorum_copy_key,
    quorum_key,
    ready_key,
    ready_prefix,
    ready_prefixes,
    reduced_copy_key,
    reduced_key,
    spread_count,
)
from diloco_serverless.store.objectstore import ObjectStore
from support.allreduce import assert_identical, run_replicas
from support.recording_store import RecordingStore

N = 20  # spread (8 prefixes), one copy, readers 16-19
KEY = b"k" * 32


def _marker(rank: int, n: int = N) -> ReadyMarker:
    return ReadyMarker("t", 0, rank, n, 8, "torch.float32", [8], "fp32", "flat")


def _wait(poll_s: float, run_key: bytes | None = KEY, n: int = N) -> QuorumWait:
    return QuorumWait(n, n, straggler_timeout_s=60.0, deadline=time.monotonic() + 30.0, poll_interval_s=poll_s,
                      run_key=run_key)


def _quorum_bytes(ranks: list[int], run_key: bytes | None = KEY, created_by: int = 0) -> bytes:
    markers = {r: _marker(r) for r in ranks}
    return signed_json(run_key, "quorum", Quorum("t", 0, ranks, markers, created_by).to_json(), quorum_key(0))


def _ready_all(store: RecordingStore) -> None:
    for r in range(N):
        key = ready_key(0, r, marker_tag(_marker(r), KEY))
        store.put(key, signed_json(KEY, "ready", _marker(r).__dict__, key))


def _later(delay_s: float, fn: Any) -> threading.Thread:
    t = threading.Timer(delay_s, fn)
    t.start()
    return t


def test_copies_grow_with_n_and_only_ranks_from_16_read_them() -> None:
    assert [quorum_copies(n) for n in (2, 16, 17, 64, 65, 256, 1024)] == [0, 0, 1, 1, 2, 4, 16]
    assert [copy_to_read(_marker(r, 16)) for r in (0, 15)] == [None, None]  # N <= 16: everyone lists
    assert copy_to_read(_marker(QUORUM_LISTERS - 1, 1024)) is None
    readers = {copy_to_read(_marker(r, 1024)) for r in range(QUORUM_LISTERS, 1024)}
    assert readers == {quorum_copy_key(0, c, spread_count(1024)) for c in range(16)}
    assert len({k.split("/")[0] for k in readers if k}) == 16  # 16 prefixes: x00 ... x0f
    with pytest.raises(ValueError, match="spread runs"):
        quorum_copy_key(0, 0, 1)


def test_a_reader_polls_its_copy_and_neither_lists_nor_reads_quorum_json(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path.as_uri())
    io, me = CountingStore(store), _marker(18)
    p = _wait(poll_s=0.5)  # grace 2 s: the reader's first listing is 2-4 s away
    copy = copy_to_read(me)
    assert copy is not None
    data = _quorum_bytes(list(range(N)))

    def form() -> None:
        store.put(quorum_key(0), data)
        store.put(copy, data)

    _later(0.1, form)
    t = time.monotonic()
    q = wait_for_quorum(io, me, p)
    assert q.participants == list(range(N)) and time.monotonic() - t < reader_list_s(io, p)
    assert store.keys("LIST") == []
    assert store.keys("GET", contains="quorum.json") and set(store.keys("GET")) == {copy}


def test_a_reader_whose_copy_never_comes_reads_quorum_json_at_its_listing(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path.as_uri())
    _ready_all(store)
    store.put(quorum_key(0), _quorum_bytes(list(range(N)), created_by=3))  # its writer died before the copies
    store.requests.clear()
    io, me = CountingStore(store), _marker(17)
    p = _wait(poll_s=0.05)
    t = time.monotonic()
    q = wait_for_quorum(io, me, p)
    assert q.created_by == 3 and q.participants == list(range(N))
    assert time.monotonic() - t >= reader_list_s(io, p)  # not before its first listing
    assert store.keys("LIST") == [ready_prefix(0)]
    assert store.keys("GET", contains=quorum_key(0)) == [quorum_key(0)]
    assert not store.keys("PUT", contains="quorum")  # it found the quorum: no create, no copy


def test_a_forged_copy_is_refused_and_the_reader_reads_quorum_json(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = RecordingStore(tmp_path.as_uri())
    io, me = CountingStore(store), _marker(19)
    copy = copy_to_read(me)
    assert copy is not None
    store.put(copy, _quorum_bytes([19], run_key=b"x" * 32))  # someone without the run key: only rank 19
    _later(0.2, lambda: store.put(quorum_key(0), _quorum_bytes(list(range(N)))))
    with caplog.at_level(logging.WARNING, logger="diloco_serverless.exchange.quorum"):
        q = wait_for_quorum(io, me, _wait(poll_s=0.05))
    assert q.participants == list(range(N))  # the signed quorum.json, not the forged copy
    assert any(copy in r.getMessage() and "signature" in r.getMessage() for r in caplog.records)


def test_the_writer_puts_the_copies_its_readers_read(tmp_path: Path) -> None:
    n = 130  # three copies
    store = RecordingStore(tmp_path.as_uri())
    io = CountingStore(store)
    for r in range(n):  # named by their tags: never read; in 3 prefixes (control_spread(130))
        store.put(ready_key(0, r, marker_tag(_marker(r, n), KEY), control_spread(n)), b"{}")
    q = wait_for_quorum(io, _marker(0, n), _wait(poll_s=0.05, n=n))
    io.close()  # waits for the copies, put in the background
    assert q.created_by == 0 and q.participants == list(range(n))
    canonical = (tmp_path / quorum_key(0)).read_bytes()
    copies = {quorum_copy_key(0, c, spread_count(n)) for c in range(quorum_copies(n))}
    assert len(copies) == 3 and {copy_to_read(_marker(r, n)) for r in range(QUORUM_LISTERS, n)} == copies
    assert all((tmp_path / k).read_bytes() == canonical for k in copies)


def _ints(n: int, seed: int) -> torch.Tensor:
    return torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(seed)).float()


def _recording(stores: dict[int, RecordingStore]) -> Any:
    def make(url: str, r: int, n: int, **kw: Any) -> ObjectStoreAllReduce:
        stores[r] = RecordingStore(url)
        return ObjectStoreAllReduce(stores[r], r, n, **kw)

    return make


@pytest.mark.parametrize("topology", ["flat", "hierarchical"])
def test_a_large_round_is_read_from_copies_and_ends_identical(tmp_path: Path, topology: str) -> None:
    xs = {r: _ints(340, r) for r in range(N)}
    stores: dict[int, RecordingStore] = {}
    outs, errors, _ = run_replicas(tmp_path.as_uri(), xs, N, rounds=2, topology=topology, make=_recording(stores),
                                   straggler_timeout_s=30.0)
    assert not errors
    assert_identical(outs)
    mean = torch.stack(list(xs.values())).sum(0) / N
    assert torch.equal(outs[0][0], mean) and torch.equal(outs[0][1], mean * 2)
    for rnd in (0, 1):
        canonical = (tmp_path / "t" / quorum_key(rnd)).read_bytes()
        assert (tmp_path / "t" / quorum_copy_key(rnd, 0, spread_count(N))).read_bytes() == canonical
    listers = [len(stores[r].keys("LIST", contains="/ready")) for r in range(QUORUM_LISTERS)]
    readers = [len(stores[r].keys("LIST", contains="/ready")) for r in range(QUORUM_LISTERS, N)]
    assert all(stores[r].keys("GET", contains="x00/") for r in range(QUORUM_LISTERS, N))  # each read its copy
    assert sum(readers) / len(readers) < sum(listers) / len(listers)


def test_a_large_run_whose_listers_are_all_gone_still_closes_its_round(tmp_path: Path) -> None:
    """Ranks 0-15 never come: after the straggler deadline a reader's slow listing finds 4 ready ranks
    (min_replicas = 4), the lowest of them writes the quorum, and the 4 average among themselves."""
    xs = {r: _ints(64, r) for r in range(QUORUM_LISTERS, N)}
    outs, errors, stats = run_replicas(tmp_path.as_uri(), xs, N, topology="flat", min_replicas=4,
                                       straggler_timeout_s=0.3)
    assert not errors
    assert_identical(outs)
    assert torch.equal(outs[N - 1][0], torch.stack(list(xs.values())).sum(0) / 4)
    assert all(s.participants == list(range(QUORUM_LISTERS, N)) for s in stats.values())


@pytest.mark.slow  # 65+ replicas in threads
def test_above_64_replicas_the_ready_markers_and_abstentions_are_spread(tmp_path: Path) -> None:
    """N = 65: two ready prefixes (x00, x01). One replica abstains (non-finite values); the other 64
    average among themselves, and every marker and the abstention sit in their rank's prefix."""
    n = 65
    assert control_spread(n) == 2 and ready_prefixes(3, 2) == ["x00/00000003/ready", "x01/00000003/ready"]
    xs = {r: _ints(130, r) for r in range(n)}
    xs[7] = torch.full((130,), float("nan"))
    outs, errors, stats = run_replicas(tmp_path.as_uri(), xs, n, topology="hierarchical", min_replicas=n - 1,
                                       straggler_timeout_s=30.0)
    assert not errors
    assert_identical(outs)  # the abstainer adopts the mean of the others
    assert torch.equal(outs[0][0], sum(x for r, x in xs.items() if r != 7) / (n - 1))
    assert stats[0].participants == [r for r in range(n) if r != 7]
    keys = [k for k in ObjectStore(tmp_path.as_uri()).child("t").list("") if "/ready/" in k]
    assert len(keys) == n and not [k for k in keys if k.startswith("rounds/")]
    for k in keys:
        rank = int(k.rsplit("-", 1)[1].split(".")[0])
        assert k.startswith(f"x{rank % 2:02x}/00000000/ready/"), k
    assert any(k.endswith("/abstain-7") and k.startswith("x01/") for k in keys)


class NoCopies(RecordingStore):
    """A store that refuses every copy of a reduced shard (as if its writer died before putting them)."""

    def put(self, key: str, data: bytes) -> None:
        if ".copy-" in key:
            raise OSError(f"refused {key}")
        super().put(key, data)


@pytest.mark.slow  # 65+ replicas in threads
@pytest.mark.parametrize("copies_fail", [False, True], ids=["copies", "copies-refused"])
def test_above_64_replicas_small_reduced_shards_are_read_from_copies(tmp_path: Path, copies_fail: bool) -> None:
    """Hierarchical, N = 65: each small reduced shard's writer puts 2 copies and everyone else reads copy
    rank mod 2; without copies every replica reads the original after half the takeover timeout."""
    n = 65
    xs = {r: _ints(130, r) for r in range(n)}
    stores: dict[int, RecordingStore] = {}

    def make(url: str, r: int, world: int, **kw: Any) -> ObjectStoreAllReduce:
        stores[r] = (NoCopies if copies_fail else RecordingStore)(url)
        return ObjectStoreAllReduce(stores[r], r, world, **kw)

    # readers fall back to the original after half the takeover timeout: with copies, give 65 replica
    # threads on 2 loaded cores 10 s for the copies to land (in CI one came after the 2 s of a 4 s timeout)
    outs, errors, stats = run_replicas(tmp_path.as_uri(), xs, n, topology="hierarchical", make=make,
                                       straggler_timeout_s=30.0, takeover_timeout_s=4.0 if copies_fail else 20.0)
    assert not errors
    assert_identical(outs)
    assert torch.equal(outs[0][0], torch.stack(list(xs.values())).sum(0) / n)
    spread = spread_count(n)
    owners = {j: r for r, s in stats.items() for j in s.reduced_shards}
    for j, owner in owners.items():
        original = (tmp_path / "t" / reduced_key(0, j, spread)).read_bytes()
        for c in range(2):
            copy = tmp_path / "t" / reduced_copy_key(0, j, c, spread)
            assert copy.exists() != copies_fail and (copies_fail or copy.read_bytes() == original)
        for r in (q for q in range(n) if q != owner):
            if reduced_key(0, j, spread) in stats[r].takeover_keys:
                continue  # a replica on 2 loaded cores may take a slow shard over: it computed it
            read = stores[r].keys("GET", contains=f"/reduced/{j:04d}")
            if copies_fail:  # tried its copy, then the original
                assert reduced_key(0, j, spread) in read
            else:
                assert set(read) == {reduced_copy_key(0, j, r % 2, spread)}, (r, read)  # polled until it came
