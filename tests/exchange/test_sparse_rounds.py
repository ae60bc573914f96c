"""Sparse rounds through a real store (threads as replicas): the mean of the decoded contributions,
bit-identical everywhere, in every protocol; SparseLoCo's error feedback against a reference; the
robust-aggregation guard; abstention and late replicas as with the dense codecs; ``auto``'s choice."""

from __future__ import annotations

import logging
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_serverless.exchange import sparse
from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.codec import payload_bytes, roundtrip, unpack
from diloco_serverless.exchange.robust import CLIP_RATIO, guard_factors, stable_norm
from diloco_serverless.exchange.topology import resolve, sharded_round_bytes
from diloco_serverless.run.layout import contrib_key
from diloco_serverless.store.objectstore import ObjectStore
from support.allreduce import FAST, WithQuorum, assert_identical, randn, run_replicas

CODEC = "sparse-8of256-2bit"
SPEC = sparse.parse(CODEC)


@pytest.fixture(params=["memory", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://sparse-{uuid.uuid4().hex[:8]}"
    return (tmp_path / "store").as_uri()


def dec(x: torch.Tensor) -> torch.Tensor:
    return sparse.decode(sparse.encode(x, SPEC), SPEC, x.numel())


def rank_order_mean(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros_like(parts[0])
    for p in parts:
        acc += p
    return acc / len(parts)


def test_direct_round_is_the_exact_mean_of_the_decoded_contributions(url: str) -> None:
    n, world = 5_000, 4
    xs = {r: randn(n, r) for r in range(world)}
    outs, errors, stats = run_replicas(url, xs, world, codec=CODEC, topology="auto")
    assert not errors
    assert_identical(outs)
    assert torch.equal(outs[0][0], rank_order_mean([dec(xs[r]) for r in range(world)]))
    s = stats[0]
    assert s.participants == [0, 1, 2, 3]
    # one object up (payload + its header), N - 1 down
    assert s.bytes_up < payload_bytes(CODEC, n) + 2048
    assert s.bytes_down < (world - 1) * (payload_bytes(CODEC, n) + 2048)


def test_a_direct_round_with_a_quorum_gives_the_same_result(url: str) -> None:
    xs = {r: randn(3_000, r) for r in range(3)}
    outs, errors, _ = run_replicas(url, xs, 3, codec=CODEC, topology="direct", make=WithQuorum)
    assert not errors
    assert_identical(outs)
    assert torch.equal(outs[0][0], rank_order_mean([dec(xs[r]) for r in range(3)]))


@pytest.mark.parametrize("topology", ["flat", "hierarchical"])
def test_sharded_rounds_sum_sparse_shards_and_store_int8(url: str, topology: str) -> None:
    n, world = 4_000, 4
    xs = {r: randn(n, r) for r in range(world)}
    outs, errors, stats = run_replicas(url, xs, world, codec=CODEC, topology=topology)
    assert not errors
    assert_identical(outs)
    shards = world if topology == "flat" else 2  # hierarchical: branching(4) shards
    bounds = [(j * n // shards, (j + 1) * n // shards) for j in range(shards)]
    want = torch.cat([roundtrip(rank_order_mean([dec(xs[r][a:b]) for r in range(world)]), "int8")
                      for a, b in bounds])
    if topology == "flat":
        assert torch.equal(outs[0][0], want)
    else:  # group partials are summed first: the same values up to fp32 reassociation
        torch.testing.assert_close(outs[0][0], want, atol=1e-5, rtol=0)


def test_error_feedback_is_sparseloco(url: str) -> None:
    """e = beta * e + delta; c = Q(topk(e)); e -= c; the round's result is the mean of the c's."""
    n, world, rounds, beta = 2_000, 2, 4, 0.95
    xs = {r: randn(n, 20 + r) for r in range(world)}
    outs, errors, _ = run_replicas(url, xs, world, rounds=rounds, codec=CODEC, error_feedback=True,
                                   feedback_decay=beta, keep_rounds=None, topology="direct")
    assert not errors
    store = ObjectStore(url).child("t")
    sent: dict[int, list[torch.Tensor]] = {}
    for r in range(world):
        e = torch.zeros(n)
        sent[r] = []
        for k in range(rounds):
            key = contrib_key(k, 0, r)
            tensors, header = unpack(store.get(key), key=key)
            assert header["codec"] == CODEC
            stored = sparse.decode(tensors, SPEC, n)
            e = torch.add(xs[r] * (k + 1), e, alpha=beta)  # delta + beta * e (the exchange's op order)
            c = dec(e)
            assert torch.equal(stored, c), f"rank {r} round {k}"
            e = e - c
            sent[r].append(c)
    for k in range(rounds):
        assert torch.equal(outs[0][k], rank_order_mean([sent[r][k] for r in range(world)]))
    # what is not sent stays in the buffer: most of a chunk's mass waits for a later round
    assert int((sent[0][0] != 0).sum()) == SPEC.k * (n // SPEC.chunk) + min(SPEC.k, n % SPEC.chunk)


def test_error_feedback_buffer_resumes_exactly(tmp_path: Path) -> None:
    """Replicas stopped after two rounds, restarted with the buffers their checkpoint holds (``residuals``),
    apply the third round bit-identically to replicas that never stopped."""
    n, world = 1_500, 2
    xs = {r: randn(n, 40 + r) for r in range(world)}
    opts: dict[str, Any] = {"codec": CODEC, "error_feedback": True, "feedback_decay": 0.9, "topology": "direct",
                            "keep_rounds": None}
    whole, errors, _ = run_replicas((tmp_path / "a").as_uri(), xs, world, rounds=3, **opts)
    assert not errors
    url = (tmp_path / "b").as_uri()
    _, errors, _ = run_replicas(url, xs, world, rounds=2, make=_Keep, **opts)
    assert not errors
    resumed: dict[int, torch.Tensor] = {}

    def again(r: int) -> None:
        with ObjectStoreAllReduce(url, r, world, run_id="t", **FAST, **opts) as fresh:
            assert fresh.residuals() == {}  # a restarted replica has no buffer...
            fresh.load_residuals(_Keep.kept[r])  # ... until it loads its checkpointed one
            resumed[r] = fresh.allreduce(xs[r] * 3, round=2)

    threads = [threading.Thread(target=again, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(resumed) == set(range(world))
    assert torch.equal(resumed[0], whole[0][2]) and torch.equal(resumed[1], whole[0][2])


class _Keep(ObjectStoreAllReduce):
    """Keeps each rank's residuals when it closes (what the trainer's replica state saves)."""

    kept: dict[int, dict[str, torch.Tensor]] = {}

    def close(self) -> None:
        _Keep.kept[self.rank] = self.residuals()
        super().close()


# --------------------------------------------------------------------------- the guard


def test_guard_factors_and_stable_norms() -> None:
    assert guard_factors([1.0, 100.0]) == [1.0, 1.0]  # two: no median to trust
    f = guard_factors([1.0, 1.2, 0.9, 50.0])
    assert f[:3] == [1.0, 1.0, 1.0] and f[3] == pytest.approx(CLIP_RATIO * 1.1 / 50.0)
    x = randn(10_000, 3)
    assert stable_norm(x) == pytest.approx(float(x.norm()), rel=2**-19)
    assert stable_norm(x) == stable_norm(x.flip(0))  # another summation order, the same rounded norm
    assert stable_norm(torch.zeros(5)) == 0.0


def test_a_huge_contribution_is_scaled_alike_on_every_replica(url: str, caplog: pytest.LogCaptureFixture) -> None:
    n, world = 3_000, 4
    xs = {r: randn(n, r) for r in range(world)}
    xs[2] = xs[2] * 1e4  # finite, diverging
    with caplog.at_level(logging.WARNING, logger="diloco_serverless.exchange.robust"):
        outs, errors, _ = run_replicas(url, xs, world, codec=CODEC, topology="auto")
    assert not errors
    assert_identical(outs)
    parts = [dec(xs[r]) for r in range(world)]
    norms = [stable_norm(p) for p in parts]
    factor = guard_factors(norms)[2]
    assert factor < 1e-3
    parts[2] = parts[2] * factor
    assert torch.equal(outs[0][0], rank_order_mean(parts))
    assert float(outs[0][0].norm()) < 2 * max(norms[0], norms[1], norms[3])
    assert any("contribution of rank 2" in m and "scaled by" in m for m in caplog.messages)


def test_hierarchical_rounds_guard_each_groups_partial(caplog: pytest.LogCaptureFixture) -> None:
    """N = 9: three groups of three, three shards. A huge contribution is scaled against the median of its
    group's norms of each shard before the group's partial is summed; the result is the tree's sum of the
    guarded partials, bit-identical on every replica."""
    n, world, c = 2_700, 9, 3
    url = f"memory://sparse-{uuid.uuid4().hex[:8]}"
    xs = {r: randn(n, 60 + r) for r in range(world)}
    xs[4] = xs[4] * 1e4
    with caplog.at_level(logging.WARNING, logger="diloco_serverless.exchange.robust"):
        outs, errors, _ = run_replicas(url, xs, world, codec=CODEC, topology="hierarchical")
    assert not errors
    assert_identical(outs)
    bounds = [(j * n // c, (j + 1) * n // c) for j in range(c)]
    want = []
    for a, b in bounds:
        top = torch.zeros(b - a)
        for k in range(c):  # group k: ranks 3k .. 3k + 2, its partial guarded against its own median
            parts = [dec(xs[q][a:b]) for q in range(c * k, c * k + c)]
            factors = guard_factors([stable_norm(p) for p in parts])
            assert (factors[1] < 1e-3) == (k == 1) and factors[0] == factors[2] == 1.0
            partial = torch.zeros(b - a)
            for p, f in zip(parts, factors):
                partial += p if f == 1.0 else p * f
            top += partial
        want.append(roundtrip(top / world, "int8"))
    assert torch.equal(outs[0][0], torch.cat(want))
    assert any("group 1 shard 0" in m and "contribution of rank 4" in m for m in caplog.messages)


def test_non_finite_replica_abstains_as_with_dense_codecs(url: str) -> None:
    xs = {r: randn(2_000, r) for r in range(4)}
    xs[1][7] = float("nan")
    outs, errors, stats = run_replicas(url, xs, 4, codec=CODEC, min_replicas=3, topology="auto")
    assert not errors
    assert_identical(outs)
    assert stats[1].abstained is not None and stats[0].participants == [0, 2, 3]
    assert torch.equal(outs[0][0], rank_order_mean([dec(xs[r]) for r in (0, 2, 3)]))


# --------------------------------------------------------------------------- auto


def test_auto_never_moves_more_than_an_int8_sharded_round() -> None:
    numel = 64 << 20
    ps, p8 = payload_bytes("sparse", numel), payload_bytes("int8", numel)
    assert p8 / ps > 35
    chosen = {w: resolve("auto", w, ps, compressed=(ps, p8)) for w in range(2, 1025)}
    last_direct = max(w for w, p in chosen.items() if p == "direct")
    assert 100 <= last_direct <= 110
    assert all(p == "direct" for w, p in chosen.items() if w <= last_direct)
    for w, p in chosen.items():
        if p == "direct":
            sparse_bytes = w * ps
        else:  # sparse contributions, int8 reduced shards: at most a flat int8 round
            sparse_bytes = ps + ps * (w - 1) // w + p8 // w + p8 * (w - 1) // w
        assert sparse_bytes <= sharded_round_bytes(p8, w), w
    assert chosen[1024] == "hierarchical" and chosen[8] == "direct"
    assert resolve("auto", 8, 4 * numel) == "flat"  # a dense tensor of this size: unchanged


@pytest.mark.parametrize("topology", ["flat", "direct"])
def test_a_replica_rerunning_a_round_it_contributed_to_keeps_the_same_buffer(url: str, topology: str) -> None:
    """A restarted replica re-running a round whose contribution it stored before the crash (it does not
    write it again) ends the round with the buffer it would have had: the chaos suite's exact resume."""
    n, world = 2_000, 2
    xs = {r: randn(n, 60 + r) for r in range(world)}
    opts: dict[str, Any] = {"codec": CODEC, "error_feedback": True, "feedback_decay": 0.95, "topology": topology,
                            "keep_rounds": None}
    _, errors, _ = run_replicas(url, xs, world, rounds=1, make=_Keep, **opts)
    assert not errors
    before = {r: _Keep.kept[r] for r in range(world)}
    with ObjectStoreAllReduce(url, 0, world, run_id="t", **FAST, **opts) as again:
        out = again.allreduce(xs[0], round=0)  # its contribution and vote are stored: read, not written
        assert again.last_stats is not None and not again.last_stats.late
        if topology == "flat":  # it finds its vote first and writes nothing (direct: its create-only PUT loses)
            assert again.last_stats.bytes_up == 0
        assert torch.equal(again.residuals()["default"], before[0]["default"])
    assert torch.isfinite(out).all()
