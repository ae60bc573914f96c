"""Exchange protocols by N (direct, flat, hierarchical) and exchange keys spread over prefixes, with
threads as replicas on file:// and memory:// stores."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_serverless.config import ExchangeConfig
from diloco_serverless.exchange import topology
from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.errors import CorruptObjectError, MismatchError
from diloco_serverless.exchange.topology import (
    branching,
    direct_extra_bytes,
    group_count,
    group_size,
    levels,
    resolve,
    shard_count,
)
from diloco_serverless.run.layout import (
    contrib_key,
    partial_key,
    reduced_key,
    spread_count,
    spread_prefixes,
)
from diloco_serverless.store.objectstore import ObjectStore
from support.allreduce import DiesAfterReady, assert_identical, randn, run_replicas


def _ints(n: int, seed: int) -> torch.Tensor:
    """Small integers: every sum of them is exact in fp32, whatever the order of addition."""
    return torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(seed)).float()


def _mean(xs: dict[int, torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(xs.values())).mean(0)


def test_protocol_is_picked_by_n() -> None:
    assert [resolve("auto", n) for n in (2, 3, 63, 64, 1024)] == ["direct", "flat", "flat", "hierarchical"] + [
        "hierarchical"
    ]
    assert resolve("flat", 2) == "flat" and resolve("hierarchical", 2) == "hierarchical"
    assert resolve("direct", 8) == "direct" and resolve("direct", 1024, 1 << 30) == "direct"
    assert [group_size(n) for n in (2, 4, 8, 9, 10, 127, 1024)] == [2, 2, 3, 3, 4, 12, 11]
    assert shard_count(1024, "hierarchical") == 11 and shard_count(2, "direct") == 1 and shard_count(9, "flat") == 9
    with pytest.raises(ValueError, match="topology must be one of flat, hierarchical, direct, auto, got 'ring'"):
        resolve("ring", 4)
    with pytest.raises(ValueError, match="(?s)topology.*'flat', 'hierarchical', 'direct' or 'auto'"):
        ExchangeConfig(topology="ring")
    assert ExchangeConfig().topology == "auto"


def test_auto_sends_small_tensors_whole_and_shards_large_ones() -> None:
    """Below 64 replicas ``auto`` uses direct while direct's extra download stays under 32 MiB:
    ((N-1)(N-2) - 1) P / N more than flat."""
    mib = 1 << 20
    assert direct_extra_bytes(12 * mib, 4) == 15 * mib  # 36 MiB down against flat's 18, less flat's 3 MiB more up
    assert direct_extra_bytes(mib, 2) < 0  # at N = 2 direct is the lighter one
    assert resolve("auto", 4, 25 * mib) == "direct" and resolve("auto", 4, 26 * mib) == "flat"
    assert resolve("auto", 8, 6 * mib) == "direct" and resolve("auto", 8, 7 * mib) == "flat"
    assert resolve("auto", 2, 1 << 30) == "direct"  # any size at N = 2
    assert resolve("auto", 64, 1) == "hierarchical"  # O(N) GETs each is too many from 64 on
    assert resolve("auto", 8) == "flat"  # size unknown
    assert resolve("flat", 8, 1) == "flat"


def test_spread_keys_land_in_the_top_components_and_balance() -> None:
    assert [spread_count(n) for n in (1, 16, 17, 64, 256, 1024, 4096)] == [1, 1, 8, 16, 64, 256, 256]
    assert contrib_key(3, 1, 2) == "rounds/00000003/contrib/0001/rank-2"  # small runs: unchanged layout
    prefixes = spread_prefixes(1024)
    keys = [contrib_key(3, j, q, 256) for j in range(32) for q in range(1024)]
    counts: dict[str, int] = {}
    for k in keys:
        head, rnd = k.split("/")[:2]
        assert head in prefixes and rnd == "00000003"  # the spread component is the first one under the run
        counts[head] = counts.get(head, 0) + 1
    assert len(counts) == 256 and max(counts.values()) < 1.3 * len(keys) / 256  # within 30% of uniform
    assert partial_key(3, 5, 7, 256).split("/")[0] in prefixes and reduced_key(3, 7, 256).startswith("x")
    with pytest.raises(ValueError, match="group"):
        partial_key(0, 10_000, 0)
    assert partial_key(3, 5, 7, level=2) == "rounds/00000003/partial/l2/0005/0007"
    assert partial_key(3, 5, 7, 256, level=2).split("/")[0] in prefixes
    with pytest.raises(ValueError, match=r"partial level must be an int in \[1, 9\], got 0"):
        partial_key(0, 0, 0, level=0)


@pytest.mark.parametrize("n", [4, 9])
def test_hierarchical_equals_flat_bit_for_bit(tmp_path: Path, n: int) -> None:
    xs = {r: _ints(1001, r) for r in range(n)}
    flat, e1, _ = run_replicas((tmp_path / "flat").as_uri(), xs, n, topology="flat")
    hier, e2, stats = run_replicas((tmp_path / "hier").as_uri(), xs, n, topology="hierarchical")
    assert not e1 and not e2
    assert_identical(flat)
    assert_identical(hier)
    assert torch.equal(flat[0][0], hier[0][0]) and torch.equal(hier[0][0], _mean(xs))
    g = group_size(n)
    assert sorted(j for s in stats.values() for j in s.reduced_shards) == list(range(g))  # each reduced once
    assert not any(s.takeover_keys for s in stats.values())


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_hierarchical_mean_is_bit_identical_on_every_replica(codec: str) -> None:
    xs = {r: randn(3001, r) for r in range(9)}
    outs, errors, stats = run_replicas(
        f"memory://hier-{uuid.uuid4().hex[:8]}", xs, 9, rounds=2, codec=codec, topology="hierarchical"
    )
    assert not errors
    assert_identical(outs)
    tol = {"fp32": 1e-6, "int8": 0.06}[codec]
    torch.testing.assert_close(outs[3][1], _mean(xs) * 2, atol=tol * 2, rtol=0)
    p, wire = 3001 * 4, {"fp32": 1.0, "int8": 0.25}[codec]
    for s in stats.values():  # contributions (P on the wire) + at most one fp32 partial and one reduced shard (P/3)
        assert s.bytes_up < p * (wire + 1 / 3 + wire / 3) + 4096
        assert s.bytes_down < p * (2 * wire + 1) + 8192  # group's contributions, 3 partials, 3 reduced shards


def test_hierarchical_takes_over_a_dead_group_member(tmp_path: Path) -> None:
    """Rank 8 publishes and dies: it owned group 2's partial of shard 2 and the reduced shard 0."""
    xs = {r: _ints(900, r) for r in range(9)}

    def make(url: str, r: int, n: int, **kw: Any) -> ObjectStoreAllReduce:
        return (DiesAfterReady if r == 8 else ObjectStoreAllReduce)(url, r, n, **kw)

    outs, errors, stats = run_replicas(tmp_path.as_uri(), xs, 9, make=make, topology="hierarchical")
    assert set(errors) == {8} and isinstance(errors[8], SystemExit)
    assert_identical({r: o for r, o in outs.items() if r != 8})
    assert torch.equal(outs[0][0], _mean(xs))  # its stored contribution still counts
    taken = {k.split("/", 2)[2] for s in stats.values() for k in s.takeover_keys}
    assert "reduced/0000" in taken and "partial/0002/0002" in taken


def test_hierarchical_refuses_a_corrupt_partial(tmp_path: Path) -> None:
    url = tmp_path.as_uri()
    ObjectStore(url).child("t").put(partial_key(0, 0, 0), b"\x00" * 64)  # planted where group 0's partial goes
    xs = {r: _ints(90, r) for r in range(4)}
    _, errors, _ = run_replicas(url, xs, 4, topology="hierarchical", timeout_s=5.0)
    assert set(errors) == {0, 1, 2, 3}
    for e in errors.values():
        assert isinstance(e, CorruptObjectError) and partial_key(0, 0, 0) in str(e)


def test_replicas_on_different_topologies_fail_with_a_mismatch(tmp_path: Path) -> None:
    xs = {r: _ints(50, r) for r in range(3)}

    def make(url: str, r: int, n: int, **kw: Any) -> ObjectStoreAllReduce:
        return ObjectStoreAllReduce(url, r, n, **{**kw, "topology": "flat" if r else "hierarchical"})

    _, errors, _ = run_replicas(tmp_path.as_uri(), xs, 3, make=make)
    assert set(errors) == {0, 1, 2}
    assert all(isinstance(e, MismatchError) and "exchange.topology" in str(e) for e in errors.values())


def test_direct_at_two_is_as_light_as_naive_and_survives_a_dead_peer(tmp_path: Path) -> None:
    xs = {r: _ints(4000, r) for r in range(2)}
    direct, errors, dstats = run_replicas((tmp_path / "d").as_uri(), xs, 2, topology="auto")
    flat, _, fstats = run_replicas((tmp_path / "f").as_uri(), xs, 2, topology="flat")
    assert not errors
    assert torch.equal(direct[0][0], direct[1][0]) and torch.equal(direct[0][0], flat[0][0])
    p = 4000 * 4
    for r in (0, 1):  # naive: P up, P down (+ headers, markers, quorum)
        assert dstats[r].bytes_up < p + 2048 and dstats[r].bytes_down < p + 2048
        assert dstats[r].bytes_up + dstats[r].bytes_down < fstats[r].bytes_up + fstats[r].bytes_down
    assert not list(ObjectStore((tmp_path / "d").as_uri()).list("t/rounds/00000000/reduced"))

    def make(url: str, r: int, n: int, **kw: Any) -> ObjectStoreAllReduce:
        return (DiesAfterReady if r == 1 else ObjectStoreAllReduce)(url, r, n, **kw)

    outs, errors, _ = run_replicas((tmp_path / "dead").as_uri(), xs, 2, make=make, topology="auto")
    assert set(errors) == {1} and torch.equal(outs[0][0], _mean(xs))


@pytest.mark.parametrize("topology", ["flat", "hierarchical"])
def test_spread_run_keeps_data_out_of_rounds_and_prunes_every_prefix(tmp_path: Path, topology: str) -> None:
    n = 17  # the first N whose data objects are spread (8 prefixes)
    xs = {r: _ints(340, r) for r in range(n)}
    outs, errors, _ = run_replicas(tmp_path.as_uri(), xs, n, rounds=2, topology=topology, keep_rounds=1)
    assert not errors
    assert_identical(outs)
    assert torch.equal(outs[0][1], _mean(xs) * 2)
    keys = ObjectStore(tmp_path.as_uri()).child("t").list("")
    data = [k for k in keys if k.startswith("x")]
    assert not [k for k in keys if "/contrib/" in k and k.startswith("rounds/")]
    assert {k.split("/")[0] for k in data} == set(spread_prefixes(n))  # all 8 prefixes used
    assert {k.split("/")[1] for k in data} == {"00000001"}  # round 0 pruned from every prefix


def test_three_levels_from_128_cut_requests_to_a_cube_root() -> None:
    assert [levels(n) for n in (8, 127, 128, 1024)] == [2, 2, 3, 3]
    assert [branching(n) for n in (127, 128, 1000, 1024)] == [12, 6, 10, 11]
    assert (group_count(1024), group_count(1024, 2)) == (94, 9)  # 11 ranks, then 121 ranks per group
    assert shard_count(1024, "hierarchical") == 11


@pytest.fixture
def three_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three-level hierarchical rounds from N = 8 (c = 2 at 8, 3 at 10), so threads can run them."""
    monkeypatch.setattr(topology, "THREE_LEVELS_FROM", 8)


@pytest.mark.parametrize("n", [8, 10])
def test_three_levels_equal_flat_bit_for_bit(tmp_path: Path, three_levels: None, n: int) -> None:
    xs = {r: _ints(1001, r) for r in range(n)}
    flat, e1, _ = run_replicas((tmp_path / "flat").as_uri(), xs, n, topology="flat")
    # a generous takeover timeout: "nobody took over" must not depend on the machine's load
    hier, e2, stats = run_replicas(
        (tmp_path / "hier").as_uri(), xs, n, topology="hierarchical", takeover_timeout_s=10.0
    )
    assert not e1 and not e2
    assert_identical(hier)
    assert torch.equal(flat[0][0], hier[0][0]) and torch.equal(hier[0][0], _mean(xs))
    assert sorted(j for s in stats.values() for j in s.reduced_shards) == list(range(branching(n)))
    assert not any(s.takeover_keys for s in stats.values())
    keys = ObjectStore((tmp_path / "hier").as_uri()).child("t").list("rounds/00000000/partial")
    assert {k.split("/")[4] for k in keys if "/l2/" in k} == {"0000", "0001"}  # two level-2 groups wrote


def test_three_levels_take_over_a_dead_member_at_every_level(tmp_path: Path, three_levels: None) -> None:
    """N = 8, c = 2: rank 7 owns group 3's partial of shard 1, level-2 group 1's of shard 0 and reduced 0."""
    xs = {r: _ints(900, r) for r in range(8)}

    def make(url: str, r: int, n: int, **kw: Any) -> ObjectStoreAllReduce:
        return (DiesAfterReady if r == 7 else ObjectStoreAllReduce)(url, r, n, **kw)

    outs, errors, stats = run_replicas(tmp_path.as_uri(), xs, 8, make=make, topology="hierarchical")
    assert set(errors) == {7} and isinstance(errors[7], SystemExit)
    assert_identical({r: o for r, o in outs.items() if r != 7})
    assert torch.equal(outs[0][0], _mean(xs))  # its stored contribution still counts
    taken = {k.split("/", 2)[2] for s in stats.values() for k in s.takeover_keys}
    assert {"reduced/0000", "partial/l2/0001/0000", "partial/0003/0001"} <= taken


def test_three_levels_refuse_a_corrupt_level_two_partial(tmp_path: Path, three_levels: None) -> None:
    url = tmp_path.as_uri()
    planted = partial_key(0, 0, 0, level=2)
    ObjectStore(url).child("t").put(planted, b"\x00" * 64)
    xs = {r: _ints(90, r) for r in range(8)}
    _, errors, _ = run_replicas(url, xs, 8, topology="hierarchical", timeout_s=5.0)
    assert set(errors) == set(range(8))
    for e in errors.values():
        assert isinstance(e, CorruptObjectError) and planted in str(e)
