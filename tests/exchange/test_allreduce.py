"""ObjectStoreAllReduce with threads as replicas, on memory:// and file:// (fast unit tests)."""

from __future__ import annotations

import threading
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_serverless.exchange._io import shard_bounds
from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.codec import (
    INT8_BLOCK,
    MAX_HEADER_BYTES,
    ShardHeader,
    decode_shard,
    max_object_bytes,
    pack,
    roundtrip,
)
from diloco_serverless.exchange.errors import (
    CorruptObjectError,
    MismatchError,
    RoundPrunedError,
)
from diloco_serverless.run.layout import contrib_key, quorum_key, reduced_key
from diloco_serverless.store.objectstore import ObjectStore, ObjectTooLarge
from support.allreduce import (
    FAST,
    DiesAfterReady,
    WithQuorum,
    assert_identical,
    randn,
    run_replicas,
)


@pytest.fixture(params=["memory", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://exchange-{uuid.uuid4().hex[:8]}"
    return (tmp_path / "store").as_uri()


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_mean_matches_torch_and_is_bit_identical(url: str, codec: str) -> None:
    xs = {r: randn(10_001, r) for r in range(3)}
    outs, errors, stats = run_replicas(url, xs, 3, rounds=2, codec=codec)
    assert not errors
    assert_identical(outs)
    expected = torch.stack(list(xs.values())).mean(0)
    tol = {"fp32": 1e-6, "bf16": 0.05, "int8": 0.06}[codec]
    for k in range(2):
        torch.testing.assert_close(outs[0][k], expected * (k + 1), atol=tol * (k + 1), rtol=0)
    assert all(s.participants == [0, 1, 2] and not s.late and s.round == 1 for s in stats.values())


def test_dtype_shape_preserved_and_fp32_reduction(url: str) -> None:
    xs = {r: randn(0, r, (5, 7)).to(torch.bfloat16) for r in range(2)}
    outs, errors, _ = run_replicas(url, xs, 2)
    assert not errors
    assert outs[0][0].shape == (5, 7) and outs[0][0].dtype == torch.bfloat16
    expected = (xs[0].float() + xs[1].float()) / 2
    assert torch.equal(outs[0][0], expected.to(torch.bfloat16))
    assert_identical(outs)


def test_tiny_tensor_with_empty_shards(url: str) -> None:
    xs = {r: torch.tensor([float(r)]) for r in range(4)}
    outs, errors, _ = run_replicas(url, xs, 4)
    assert not errors
    assert outs[0][0].tolist() == [1.5]
    assert_identical(outs)


def test_bytes_per_replica_near_lower_bound(url: str) -> None:
    n, world = 1 << 18, 4
    xs = {r: randn(n, r) for r in range(world)}
    _, errors, stats = run_replicas(url, xs, world, codec="fp32")
    assert not errors
    p = 4 * n
    for s in stats.values():
        assert p * (1 + 1 / world) <= s.bytes_up <= p * (1 + 1 / world) * 1.01
        assert 2 * p * (world - 1) / world <= s.bytes_down <= 2 * p * (world - 1) / world * 1.01
    _, _, s8 = run_replicas(url.replace("exchange-", "exchange8-") if url.startswith("memory") else url + "8",
                            xs, world, codec="int8")
    assert sum(s.bytes_up + s.bytes_down for s in s8.values()) <= 0.27 * sum(
        s.bytes_up + s.bytes_down for s in stats.values()
    )


def test_world_size_one_touches_no_store(monkeypatch: pytest.MonkeyPatch) -> None:
    import diloco_serverless.store as store_mod

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("world_size=1 must not open a store")

    monkeypatch.setattr(store_mod.ObjectStore, "__init__", boom)
    ar = ObjectStoreAllReduce("s3://no-such-bucket-anywhere", 0, 1, codec="int8")
    x = torch.randn(10)
    y = ar.allreduce(x)
    assert torch.equal(x, y) and y is not x
    assert ar.read_reduced(0, x) is None
    assert ar.last_stats is not None and ar.last_stats.participants == [0] and ar.last_stats.bytes_up == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(rank=4, world_size=4), "0 <= rank < world_size=4"),
        (dict(rank=-1, world_size=2), "rank=-1"),
        (dict(rank=0, world_size=0), "world_size must be >= 1"),
        (dict(rank=0, world_size=2, min_replicas=3), "min_replicas"),
        (dict(rank=0, world_size=2, codec="fp4"), "fp4"),
        (dict(rank=0, world_size=2, timeout_s=0), "timeout_s"),
        (dict(rank=0, world_size=2, keep_rounds=0), "keep_rounds"),
    ],
)
def test_invalid_configuration(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ObjectStoreAllReduce("memory://x", **kwargs)


def test_element_count_mismatch_raises_on_every_replica(url: str) -> None:
    xs = {0: randn(100, 0), 1: randn(100, 1), 2: randn(120, 2, (12, 10))}
    _, errors, _ = run_replicas(url, xs, 3)
    assert set(errors) == {0, 1, 2}
    for e in errors.values():
        assert isinstance(e, MismatchError)
        msg = str(e)
        assert "rank 0" in msg and "rank 2" in msg and "(100,)" in msg and "(12, 10)" in msg


def test_dtype_mismatch_raises(url: str) -> None:
    xs = {0: randn(64, 0), 1: randn(64, 1).double()}
    _, errors, _ = run_replicas(url, xs, 2)
    assert set(errors) == {0, 1} and all(isinstance(e, MismatchError) and "float64" in str(e) for e in errors.values())


def test_straggler_left_out_after_deadline(url: str) -> None:
    xs = {r: randn(1000, r) for r in range(2)}  # rank 2 never shows up
    outs, errors, stats = run_replicas(url, xs, 3, min_replicas=2)
    assert not errors
    torch.testing.assert_close(outs[0][0], (xs[0] + xs[1]) / 2, atol=1e-6, rtol=0)
    assert_identical(outs)
    assert stats[0].participants == [0, 1]


def test_timeout_names_missing_ranks(url: str) -> None:
    xs = {0: randn(100, 0), 1: randn(100, 1)}
    _, errors, _ = run_replicas(url, xs, 4, timeout_s=0.6, min_replicas=3)
    assert set(errors) == {0, 1}
    for e in errors.values():
        assert isinstance(e, TimeoutError) and "[2, 3]" in str(e) and "round 0" in str(e)


def test_late_replica_adopts_round_result(url: str) -> None:
    xs = {r: randn(500, r) for r in range(3)}
    outs, errors, _ = run_replicas(url, {0: xs[0], 1: xs[1]}, 3, min_replicas=2, keep_rounds=None)
    assert not errors
    late = ObjectStoreAllReduce(url, 2, 3, run_id="t", **FAST)
    got = late.allreduce(xs[2], round=0)
    assert torch.equal(got, outs[0][0])
    assert late.last_stats is not None and late.last_stats.late and late.last_stats.bytes_up == 0
    assert late.last_stats.participants == [0, 1]


def test_dead_owner_shard_is_taken_over(url: str) -> None:
    xs = {r: randn(3000, r) for r in range(3)}

    def make(u: str, r: int, w: int, **kw: Any) -> ObjectStoreAllReduce:
        return (DiesAfterReady if r == 1 else ObjectStoreAllReduce)(u, r, w, **kw)

    outs, errors, stats = run_replicas(url, xs, 3, make=make)
    assert set(errors) == {1}
    del outs[1]
    assert_identical(outs)
    torch.testing.assert_close(outs[0][0], torch.stack(list(xs.values())).mean(0), atol=1e-6, rtol=0)
    assert any(1 in s.takeovers for s in stats.values())


def test_quorum_writer_and_owner_dead_after_ready(url: str) -> None:
    """Rank 0 (the preferred quorum writer and owner of shard 0) dies right after its ready marker."""
    xs = {r: randn(3000, r) for r in range(3)}

    def make(u: str, r: int, w: int, **kw: Any) -> ObjectStoreAllReduce:
        return (DiesAfterReady if r == 0 else ObjectStoreAllReduce)(u, r, w, **kw)

    outs, errors, stats = run_replicas(url, xs, 3, make=make)
    assert set(errors) == {0}
    del outs[0]
    assert_identical(outs)
    torch.testing.assert_close(outs[1][0], torch.stack(list(xs.values())).mean(0), atol=1e-6, rtol=0)
    assert stats[1].participants == [0, 1, 2] and any(0 in s.takeovers for s in stats.values())


def test_corrupt_contribution_is_refused(url: str) -> None:
    xs = {r: randn(2000, r) for r in range(2)}
    _, errors, _ = run_replicas(url, {1: xs[1]}, 2, make=lambda u, r, w, **kw: DiesAfterReady(u, r, w, **kw))
    store = ObjectStore(url).child("t")
    key = contrib_key(0, 0, 1)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0xFF
    store.put(key, bytes(data))
    _, errors, _ = run_replicas(url, {0: xs[0]}, 2)
    assert isinstance(errors[0], CorruptObjectError)
    assert f"t/{key}" in str(errors[0]) or key in str(errors[0])


def test_foreign_reduced_object_is_refused_on_every_replica(url: str) -> None:
    xs = {r: randn(2000, r) for r in range(2)}
    outs, errors, _ = run_replicas(url, xs, 2, run_id="other", keep_rounds=None)
    assert not errors
    root = ObjectStore(url)
    root.put(f"t/{reduced_key(0, 1)}", root.get(f"other/{reduced_key(0, 1)}"))  # another run's object at our key
    _, errors, _ = run_replicas(url, xs, 2)
    assert set(errors) == {0, 1}
    for e in errors.values():
        assert isinstance(e, CorruptObjectError) and "another run" in str(e) and reduced_key(0, 1) in str(e)


def _forged_reduced(codec: str, numel: int, tensors: dict[str, torch.Tensor], shard: int = 1) -> bytes:
    """A reduced shard for run "t", round 0 that passes its checksum (which is no secret)."""
    header = ShardHeader("t", 0, shard, "reduced", codec, numel, None, "torch.float32", [2 * numel], [0, 1])
    return pack(tensors, asdict(header))


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_forged_non_finite_reduced_shard_is_refused_on_every_replica(url: str, codec: str) -> None:
    """Non-finite values never leave the store, even with a valid checksum: every replica refuses them."""
    nan_values = torch.ones(1000)
    nan_values[10] = float("nan")
    tensors = {
        "fp32": {"values": nan_values},
        "bf16": {"values": nan_values.to(torch.bfloat16)},
        "int8": {"q": torch.ones(1000, dtype=torch.int8), "scales": torch.tensor([1.0, float("nan"), 1.0, 1.0])},
    }[codec]
    key = reduced_key(0, 1)
    ObjectStore(url).child("t").put(key, _forged_reduced(codec, 1000, tensors))
    xs = {r: randn(2000, r) for r in range(2)}
    outs, errors, _ = run_replicas(url, xs, 2, codec=codec)
    assert set(errors) == {0, 1}, outs  # the owner of shard 1 finds it (create lost) and so does the other
    for e in errors.values():
        assert isinstance(e, CorruptObjectError) and key in str(e), e
        assert "NaN" in str(e)


def test_oversized_reduced_shard_is_refused_before_it_is_read_in_full(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    key = reduced_key(0, 1)
    huge = _forged_reduced("fp32", 1000, {"values": torch.ones(1000 + (1 << 20))})  # 4 MiB for a 4 KB shard
    ObjectStore(url).child("t").put(key, huge)
    reads: list[tuple[str, int | None, int]] = []
    original = ObjectStore.get

    def get(self: ObjectStore, k: str, *, max_bytes: int | None = None) -> bytes:
        try:
            data = original(self, k, max_bytes=max_bytes)
        except ObjectTooLarge:
            reads.append((k, max_bytes, -1))
            raise
        reads.append((k, max_bytes, len(data)))
        return data

    monkeypatch.setattr(ObjectStore, "get", get)
    _, errors, _ = run_replicas(url, {r: randn(2000, r) for r in range(2)}, 2)
    assert set(errors) == {0, 1}
    for e in errors.values():
        assert isinstance(e, CorruptObjectError) and key in str(e) and "larger than" in str(e), e
    limit = max_object_bytes("fp32", 1000)
    assert limit < len(huge)
    shard_reads = [r for r in reads if "/contrib/" in r[0] or "/reduced/" in r[0]]
    # every shard GET was bounded: by the object bound, or tighter (a create-only write that found the
    # object there reads it back bounded by the size of what it wrote, to see whether it is its own)
    assert shard_reads and all(m is not None and m <= limit for _, m, _ in shard_reads)
    assert (key, limit, -1) in shard_reads  # and the oversized one was refused, not returned


def test_oversized_contribution_is_refused(url: str) -> None:
    xs = {r: randn(2000, r) for r in range(2)}
    run_replicas(url, {1: xs[1]}, 2, make=lambda u, r, w, **kw: DiesAfterReady(u, r, w, **kw))
    store = ObjectStore(url).child("t")
    key = contrib_key(0, 0, 1)
    store.put(key, store.get(key) + b"\0" * (MAX_HEADER_BYTES + 8))  # one shard's payload and header bound + 8
    _, errors, _ = run_replicas(url, {0: xs[0]}, 2)
    assert isinstance(errors[0], CorruptObjectError) and key in str(errors[0]) and "larger than" in str(errors[0])


def test_foreign_quorum_is_refused(url: str) -> None:
    root = ObjectStore(url)
    run_replicas(url, {r: randn(10, r) for r in range(2)}, 2, run_id="other", keep_rounds=None, make=WithQuorum)
    root.put(f"t/{quorum_key(0)}", root.get(f"other/{quorum_key(0)}"))
    _, errors, _ = run_replicas(url, {r: randn(10, r) for r in range(2)}, 2, make=WithQuorum)
    assert errors and all(isinstance(e, CorruptObjectError) and "another run" in str(e) for e in errors.values())


def test_rounds_are_numbered_and_pruned(url: str) -> None:
    xs = {r: randn(100, r) for r in range(2)}
    outs, errors, stats = run_replicas(url, xs, 2, rounds=4, keep_rounds=2)
    assert not errors and stats[0].round == 3
    rounds = {k.split("/")[1] for k in ObjectStore(url).child("t").list("rounds")}
    assert rounds == {"00000002", "00000003"}


def test_read_reduced_replays_and_prune(url: str) -> None:
    xs = {r: randn(777, r) for r in range(2)}
    outs, errors, _ = run_replicas(url, xs, 2, rounds=3, keep_rounds=None, codec="int8")
    assert not errors
    ar = ObjectStoreAllReduce(url, 0, 2, run_id="t", codec="int8", **FAST)
    for k in range(3):
        got = ar.read_reduced(k, xs[0])
        assert got is not None and torch.equal(got, outs[1][k])
    assert ar.read_reduced(7, xs[0]) is None
    with pytest.raises(MismatchError, match="777"):
        ar.read_reduced(0, torch.zeros(778))
    ar.prune(2)
    assert ar.read_reduced(0, xs[0]) is None and ar.read_reduced(1, xs[0]) is None
    assert ar.read_reduced(2, xs[0]) is not None


@pytest.mark.parametrize("with_quorum", [False, True], ids=["votes", "quorum"])
def test_holds_round_tells_stored_rounds_from_pruned_and_future_ones(url: str, with_quorum: bool) -> None:
    """What a restarted replica checks before it re-trains the run from its start: True for a round whose
    outcome (quorum, or all votes) is stored, False once pruned and for a round not run yet."""
    xs = {r: randn(300, r) for r in range(2)}
    make = WithQuorum if with_quorum else ObjectStoreAllReduce
    _, errors, _ = run_replicas(url, xs, 2, rounds=3, keep_rounds=None, make=make)
    assert not errors
    ar = make(url, 1, 2, run_id="t", **FAST)
    assert [ar.holds_round(k, xs[1]) for k in range(4)] == [True, True, True, False]
    ar.prune(2)
    assert [ar.holds_round(k, xs[1]) for k in range(4)] == [False, False, True, False]


def test_replica_behind_a_pruned_round_is_told_to_heal(url: str) -> None:
    xs = {r: randn(100, r) for r in range(2)}
    run_replicas(url, xs, 2, rounds=3, keep_rounds=1)
    ar = ObjectStoreAllReduce(url, 0, 2, run_id="t", **FAST)
    with pytest.raises(RoundPrunedError, match="round 0.*checkpoint"):
        ar.allreduce(xs[0], round=0)


def test_error_feedback_carries_the_codec_residual(url: str) -> None:
    world, n, rounds = 2, 3 * INT8_BLOCK + 5, 4
    xs = {r: randn(n, 10 + r) for r in range(world)}
    _, errors, _ = run_replicas(url, xs, world, rounds=rounds, codec="int8", error_feedback=True, keep_rounds=None)
    assert not errors
    store = ObjectStore(url).child("t")
    bounds = shard_bounds(n, world)
    for r in range(world):
        sent = torch.zeros(n)
        for k in range(rounds):
            for j, (a, b) in enumerate(bounds):
                key = contrib_key(k, j, r)
                head = ShardHeader("t", k, j, "contrib", "int8", b - a, r, "torch.float32", [n])
                sent[a:b] += decode_shard(store.get(key), key=key, expect=head)
        truth = xs[r] * sum(range(1, rounds + 1))
        # telescoping: total sent == total input minus the last residual (< one quantisation step)
        step = (truth.abs().max() + xs[r].abs().max() * rounds) / 127
        assert (sent - truth).abs().max() <= step
        no_ef = sum(roundtrip(xs[r] * (k + 1), "int8") for k in range(rounds))
        assert (sent - truth).abs().sum() < (no_ef - truth).abs().sum()


def test_error_feedback_residuals_are_per_key(url: str) -> None:
    xs = {r: randn(600, r) for r in range(2)}
    errors: list[BaseException] = []
    ars = [ObjectStoreAllReduce(url, r, 2, run_id="t", codec="int8", error_feedback=True, **FAST) for r in range(2)]

    def one(r: int) -> None:
        try:
            ars[r].allreduce(xs[r], residual_key="a")
            ars[r].allreduce(xs[r][:300], residual_key="b")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert ars[0]._residuals["a"].numel() == 600 and ars[0]._residuals["b"].numel() == 300
