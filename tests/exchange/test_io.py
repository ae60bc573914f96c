"""CountingStore's size limits on exchange objects (diloco_serverless.exchange._io)."""

from __future__ import annotations

import json
import uuid

import pytest

from diloco_serverless.exchange._io import CONTROL_MAX_BYTES, QUORUM_MAX_BYTES, CountingStore, RoundLayout
from diloco_serverless.exchange.codec import max_object_bytes
from diloco_serverless.exchange.errors import CorruptObjectError
from diloco_serverless.run.layout import (
    contrib_key,
    control_spread,
    quorum_copy_key,
    quorum_key,
    ready_key,
    reduced_key,
    spread_count,
)
from diloco_serverless.store.objectstore import ObjectStore


def _marker(rank: int, numel: int = 1001, world_size: int = 2, codec: str = "int8") -> dict[str, object]:
    return {"run_id": "t", "round": 3, "rank": rank, "world_size": world_size, "numel": numel,
            "dtype": "torch.float32", "shape": [numel], "codec": codec}


@pytest.fixture
def io() -> CountingStore:
    return CountingStore(ObjectStore(f"memory://io-{uuid.uuid4().hex[:8]}"))


def test_no_limit_until_the_round_layout_is_known(io: CountingStore) -> None:
    assert io.max_bytes(contrib_key(3, 0, 1)) is None
    # control objects have their own fixed bounds (docs/security.md, bounded reads)
    assert io.max_bytes(ready_key(3, 0)) == CONTROL_MAX_BYTES and io.max_bytes(quorum_key(3)) == QUORUM_MAX_BYTES


def test_own_ready_marker_bounds_contributions_and_reduced_shards(io: CountingStore) -> None:
    io.put(ready_key(3, 0), json.dumps(_marker(0)).encode())  # 1001 values over 2 shards: 501 + 500
    assert io.max_bytes(contrib_key(3, 0, 1)) == max_object_bytes("int8", 501)
    assert io.max_bytes(reduced_key(3, 1)) == max_object_bytes("int8", 500)
    assert io.max_bytes(reduced_key(3, 7)) == max_object_bytes("int8", 0)  # no such shard: only a header fits
    assert io.max_bytes(reduced_key(4, 0)) is None  # another round
    assert io.max_bytes(ready_key(3, 1)) == CONTROL_MAX_BYTES  # markers are bounded as control objects


def test_a_sparse_rounds_contributions_are_bounded_by_the_sparse_codec(io: CountingStore) -> None:
    """Contributions by the round's codec, reduced shards by the reduced codec (int8): a 1.8 MB sparse
    contribution bounded as a 65 MB int8 object would be read as one ranged GET per transfer part."""
    io.put(ready_key(3, 0), json.dumps(_marker(0, numel=1 << 24, codec="sparse-64of4096-2bit")).encode())
    assert io.max_bytes(contrib_key(3, 0, 1)) == max_object_bytes("sparse-64of4096-2bit", 1 << 23)
    assert io.max_bytes(contrib_key(3, 0, 1)) < max_object_bytes("int8", 1 << 23) // 10
    assert io.max_bytes(reduced_key(3, 1)) == max_object_bytes("int8", 1 << 23)


def test_quorum_bounds_a_late_replica_but_never_overrides_its_own_marker(io: CountingStore) -> None:
    quorum = {"run_id": "t", "round": 3, "participants": [1, 0], "created_by": 1,
              "markers": {"0": _marker(0, numel=10, codec="fp32"), "1": _marker(1, numel=10, codec="fp32")}}
    io.store.put(quorum_key(3), json.dumps(quorum).encode())
    assert io.get_many([quorum_key(3)], missing_ok=True)
    assert io.max_bytes(reduced_key(3, 0)) == max_object_bytes("fp32", 5)
    io.put(ready_key(3, 0), json.dumps(_marker(0, numel=1001)).encode())
    assert io.max_bytes(reduced_key(3, 0)) == max_object_bytes("int8", 501)
    io.get(quorum_key(3))
    assert io.max_bytes(reduced_key(3, 0)) == max_object_bytes("int8", 501)  # ours wins


@pytest.mark.parametrize("data", [b"not json", b"[1]", b'{"participants": []}', b'{"participants": [0], "markers": 1}',
                                  b'{"participants": [0], "markers": {"0": {"numel": -1, "world_size": 2}}}',
                                  b"[" * 100_000])
def test_malformed_quorum_leaves_no_limit_and_raises_nothing_here(io: CountingStore, data: bytes) -> None:
    io.store.put(quorum_key(3), data)
    assert io.get(quorum_key(3)) == data  # parsing it is the exchange's job (Quorum.parse)
    assert io.max_bytes(reduced_key(3, 0)) is None


def test_oversized_object_is_corrupt_and_named(io: CountingStore) -> None:
    io.expect_round(3, RoundLayout(numel=10, world_size=2, codec="fp32"))
    limit = max_object_bytes("fp32", 5)
    io.store.put(reduced_key(3, 0), b"x" * limit)
    io.store.put(reduced_key(3, 1), b"x" * (limit + 1))
    assert io.get(reduced_key(3, 0)) == b"x" * limit
    for read in (lambda: io.get(reduced_key(3, 1)), lambda: io.get_many([reduced_key(3, 0), reduced_key(3, 1)]),
                 lambda: io.get_or_none(reduced_key(3, 1)), lambda: io.get_async(reduced_key(3, 1)).result()):
        with pytest.raises(CorruptObjectError, match=f"{reduced_key(3, 1)}.*larger than the {limit} bytes"):
            read()
    assert io.bytes_down == limit  # what was refused is not counted
    with pytest.raises(CorruptObjectError, match="larger than the 3 bytes"):
        io.get(reduced_key(3, 0), max_bytes=3)  # an explicit limit wins


def test_only_the_newest_rounds_are_remembered(io: CountingStore) -> None:
    for r in range(20):
        io.expect_round(r, RoundLayout(10, 2, "fp32"))
    assert io.max_bytes(reduced_key(0, 0)) is None and io.max_bytes(reduced_key(19, 0)) is not None


def test_the_exchange_store_takes_the_runs_transfer_policy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``store_part_size_mb`` / ``store_part_concurrency`` reach the exchange's own store (the trainer passes
    ``transfer=transfer_policy(cfg)``); without one the store keeps its default policy."""
    from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
    from diloco_serverless.store import TransferPolicy

    policy = TransferPolicy.from_mb(5, 3)
    tuned = ObjectStoreAllReduce(str(tmp_path), 0, 2, run_id="r", transfer=policy)
    plain = ObjectStoreAllReduce(str(tmp_path), 1, 2, run_id="r")
    assert tuned._io is not None and plain._io is not None
    assert tuned._io.store.transfer == policy
    assert plain._io.store.transfer == ObjectStore(str(tmp_path)).transfer != policy


def test_a_spread_marker_and_a_quorum_copy_teach_the_layout_too(io: CountingStore) -> None:
    """Above 64 replicas our marker is under x<hh>/ (control_spread); a reader gets the quorum from a copy."""
    n = 130  # 3 ready prefixes, 32 data prefixes
    io.put(ready_key(3, 5, spread=control_spread(n)), json.dumps(_marker(5, numel=1300, world_size=n)).encode())
    assert io.max_bytes(contrib_key(3, 0, 1, spread_count(n))) == max_object_bytes("int8", 10)
    late = CountingStore(io.store)
    quorum = {"run_id": "t", "round": 3, "participants": [0], "created_by": 0,
              "markers": {"0": _marker(0, numel=1300, codec="fp32", world_size=n)}}
    late.store.put(quorum_copy_key(3, 2, spread_count(n)), json.dumps(quorum).encode())
    late.get(quorum_copy_key(3, 2, spread_count(n)))
    assert late.max_bytes(reduced_key(3, 129, spread_count(n))) == max_object_bytes("fp32", 10)
