"""ObjectStoreAllReduce over moto S3 and the GCS emulator (threads as replicas), and store failures."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch

from diloco_serverless.errors import StoreError
from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.errors import CorruptObjectError
from diloco_serverless.run.layout import contrib_key
from diloco_serverless.store._transfer import MIN_PART_SIZE, TransferPolicy
from diloco_serverless.store.objectstore import ObjectStore
from support.allreduce import FAST, assert_identical, randn, run_replicas


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_mean_over_moto_s3(s3_store_url: str, s3_storage_options: dict[str, Any], codec: str) -> None:
    xs = {r: randn(20_000, r) for r in range(3)}
    outs, errors, stats = run_replicas(s3_store_url, xs, 3, rounds=2, codec=codec, storage_options=s3_storage_options)
    assert not errors
    assert_identical(outs)
    tol = 1e-6 if codec == "fp32" else 0.06
    torch.testing.assert_close(outs[0][1], 2 * torch.stack(list(xs.values())).mean(0), atol=2 * tol, rtol=0)
    assert stats[0].participants == [0, 1, 2]


def test_mean_over_gcs_emulator(gcs_store_url: str, gcs_storage_options: dict[str, Any], gcs_requests: Any) -> None:
    gcs_requests.enforce_generation_match = True  # quorum/reduced creates behave like GCS
    xs = {r: randn(5_000, r) for r in range(2)}
    outs, errors, _ = run_replicas(gcs_store_url, xs, 2, storage_options=gcs_storage_options)
    assert not errors
    assert_identical(outs)
    torch.testing.assert_close(outs[0][0], (xs[0] + xs[1]) / 2, atol=1e-6, rtol=0)
    creates = [r for r in gcs_requests.uploads() if r["query"].get("ifGenerationMatch") == ["0"]]
    assert len(creates) >= 3  # quorum.json + reduced/0000 + reduced/0001 are create-only


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_direct_round_without_a_quorum_tombstones_a_straggler(backend: str, request: pytest.FixtureRequest) -> None:
    """On a real protocol server: create-only contributions, a tombstone for the absent rank, and the late
    rank's create refused (S3 If-None-Match, GCS ifGenerationMatch=0), so it adopts the others' mean."""
    if backend == "gcs":
        request.getfixturevalue("gcs_requests").enforce_generation_match = True
    url = request.getfixturevalue(f"{backend}_store_url")
    opts = request.getfixturevalue(f"{backend}_storage_options")
    xs = {r: randn(3_000, r) for r in range(3)}
    outs, errors, stats = run_replicas(url, {0: xs[0], 1: xs[1]}, 3, min_replicas=2, topology="direct",
                                       keep_rounds=None, storage_options=opts)
    assert not errors
    assert_identical(outs)
    assert stats[0].participants == [0, 1]
    late = ObjectStoreAllReduce(url, 2, 3, run_id="t", topology="direct", storage_options=opts, **FAST)
    assert torch.equal(late.allreduce(xs[2], round=0), outs[0][0])
    assert late.last_stats is not None and late.last_stats.late
    store = ObjectStore(url, opts).child("t")
    assert not [k for k in store.list("rounds/00000000") if "/ready/" in k or k.endswith("quorum.json")]


def test_the_exchange_cuts_its_gcs_objects_to_the_part_size(
        gcs_store_url: str, gcs_storage_options: dict[str, Any], gcs_requests: Any) -> None:
    """One GCS upload is one connection's stream: above the part size the exchange cuts the tensor into
    more objects, sent concurrently, as it does on S3 (topology.split_for)."""
    gcs_requests.enforce_generation_match = True
    n = 3 * (MIN_PART_SIZE - (128 << 10)) // 4  # fp32: a flat shard of N = 2 is 7.3 MiB, over the 5 MiB part
    xs = {r: torch.arange(n, dtype=torch.float32) * (r + 1) for r in range(2)}
    outs, errors, _ = run_replicas(gcs_store_url, xs, 2, storage_options=gcs_storage_options, topology="flat",
                                   transfer=TransferPolicy(part_size=MIN_PART_SIZE), keep_rounds=None)
    assert not errors
    assert_identical(outs)
    assert torch.equal(outs[0][0], (xs[0] + xs[1]) / 2)
    fs = ObjectStore(gcs_store_url, gcs_storage_options).fs
    sizes = {p: fs.info(p)["size"] for p in fs.find(gcs_store_url.removeprefix("gs://") + "/t/rounds")
             if "/contrib/" in p or "/reduced/" in p}
    assert sizes and max(sizes.values()) <= MIN_PART_SIZE
    assert len([p for p in sizes if "/contrib/" in p]) == 2 * 2 * 2  # 2 ranks x 2 shards x split 2
    assert not [r for r in gcs_requests.uploads() if r["query"].get("uploadType") == ["resumable"]]


def test_truncated_contribution_on_s3_is_refused(s3_store_url: str, s3_storage_options: dict[str, Any]) -> None:
    from support.allreduce import DiesAfterReady

    xs = {r: randn(2_000, r) for r in range(2)}
    opts = dict(storage_options=s3_storage_options)
    run_replicas(s3_store_url, {1: xs[1]}, 2, make=lambda u, r, w, **kw: DiesAfterReady(u, r, w, **kw), **opts)
    store = ObjectStore(s3_store_url, s3_storage_options).child("t")
    key = contrib_key(0, 0, 1)
    store.put(key, store.get(key)[:-100])
    _, errors, _ = run_replicas(s3_store_url, {0: xs[0]}, 2, **opts)
    assert isinstance(errors[0], CorruptObjectError) and key in str(errors[0]) and "truncated" in str(errors[0])


def test_unreachable_store_fails_within_the_round_timeout() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    opts = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "x",
        "secret": "y",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    ar = ObjectStoreAllReduce("s3://nowhere", 0, 2, **{**FAST, "timeout_s": 2.0}, storage_options=opts)
    with pytest.raises(StoreError, match="nowhere"):
        ar.allreduce(torch.ones(4))
