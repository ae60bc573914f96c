"""Large GCS objects as parallel parts (store/_gcs.py) against gcp-storage-emulator, with every request
recorded. Reads: no metadata request, the size from the first answer's ``Content-Range``, later ranges
pinned to the first answer's generation so a read never mixes two versions, bounded reads refusing an
oversized object, hedging. Writes: a composite of parallel part uploads, create-only kept by the
compose's precondition, no parts left behind.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from diloco_serverless.store._gcs import MAX_COMPOSE_SOURCES, PART_SUFFIX, compose_ranges
from diloco_serverless.store._transfer import MIN_PART_SIZE, TransferPolicy
from diloco_serverless.store.objectstore import ObjectStore, ObjectTooLarge
from diloco_serverless.store.retry import RetryPolicy

FAST = RetryPolicy(max_attempts=4, base_delay_s=0.01, max_delay_s=0.05, timeout_s=30.0)
PARTS = TransferPolicy(part_size=MIN_PART_SIZE, concurrency=4, hedge_quantile=None)


def _store(url: str, options: dict[str, Any], transfer: TransferPolicy = PARTS) -> ObjectStore:
    return ObjectStore(url + "/run", options, retry=FAST, transfer=transfer)


def _downloads(rec: Any, name: str) -> list[dict[str, Any]]:
    return [r for r in rec.requests if r["method"] == "GET" and "/download/" in r["path"] and name in r["path"]]


def _replace(request: Any, storage: Any, data: bytes) -> None:
    """Write a new version of the requested object straight into the emulator's storage (a new generation)."""
    from gcp_storage_emulator.handlers import objects

    bucket, name = request.params["bucket_name"], request.params["object_id"]
    resource = objects._make_object_resource(request.base_url, bucket, name, "application/octet-stream", len(data), {})
    storage.create_file(bucket, name, data, objects._checksums(data, resource))


def _metadata_reads(rec: Any, name: str) -> list[dict[str, Any]]:
    return [r for r in rec.requests if r["method"] == "GET" and "/download/" not in r["path"]
            and r["path"].endswith(name)]


def test_a_large_object_comes_down_in_ranges_sized_from_the_first_answer(
        gcs_store_url: str, gcs_storage_options: dict[str, Any], gcs_requests: Any) -> None:
    gcs_requests.enforce_generation_match = True
    store = _store(gcs_store_url, gcs_storage_options)
    data = os.urandom(2 * MIN_PART_SIZE + 12345)
    store.put("big.bin", data)
    gcs_requests.requests.clear()
    assert store.get("big.bin") == data
    gets = _downloads(gcs_requests, "big.bin")
    assert [g["range"] for g in gets][0] == f"bytes=0-{MIN_PART_SIZE - 1}"
    assert sorted(g["range"] for g in gets[1:]) == sorted(
        [f"bytes={MIN_PART_SIZE}-{2 * MIN_PART_SIZE - 1}", f"bytes={2 * MIN_PART_SIZE}-{len(data) - 1}"])
    first_generation = {g["query"].get("ifGenerationMatch", [None])[0] for g in gets[1:]}
    assert len(first_generation) == 1 and None not in first_generation  # pinned to the first answer's version
    assert "ifGenerationMatch" not in gets[0]["query"]
    assert not _metadata_reads(gcs_requests, "big.bin")  # no metadata request before (or during) the read


def test_a_small_object_is_one_ranged_get(gcs_store_url: str, gcs_storage_options: dict[str, Any],
                                          gcs_requests: Any) -> None:
    store = _store(gcs_store_url, gcs_storage_options)
    store.put("small", b"hello")
    store.put("empty", b"")
    gcs_requests.requests.clear()
    assert store.get("small") == b"hello" and store.get("empty") == b""
    assert store.get_many(["small", "empty"]) == {"small": b"hello", "empty": b""}
    assert len(_downloads(gcs_requests, "small")) == 2
    assert not _metadata_reads(gcs_requests, "small") and not _metadata_reads(gcs_requests, "empty")


@pytest.mark.parametrize("pinned", [True, False], ids=["generation", "size"])
def test_an_object_replaced_during_a_read_is_read_again_whole(
        gcs_store_url: str, gcs_storage_options: dict[str, Any], gcs_requests: Any, pinned: bool) -> None:
    """Real GCS pins the later ranges by generation (412 on a change), which catches a replacement of the
    same size. Without a generation (an emulator) a replacement of another size still shows in
    ``Content-Range``."""
    gcs_requests.enforce_generation_match = pinned
    store = _store(gcs_store_url, gcs_storage_options)
    old, new = os.urandom(2 * MIN_PART_SIZE + 7), os.urandom(2 * MIN_PART_SIZE + (7 if pinned else 99))
    store.put("replaced.bin", old)
    replaced: list[bool] = []

    def replace_once(request: Any, storage: Any) -> None:
        if not replaced and (request.get_header("range", "") or "").startswith(f"bytes={MIN_PART_SIZE}-"):
            replaced.append(True)
            _replace(request, storage, new)  # in the emulator, before this range is served

    gcs_requests.before_download = replace_once
    assert store.get("replaced.bin") == new
    assert replaced
    gets = _downloads(gcs_requests, "replaced.bin")
    assert sum(1 for g in gets if g["range"] == f"bytes=0-{MIN_PART_SIZE - 1}") == 2  # the read started over


def test_a_bounded_read_refuses_an_oversized_gcs_object_and_returns_one_in_bounds(
        gcs_store_url: str, gcs_storage_options: dict[str, Any], gcs_requests: Any) -> None:
    store = _store(gcs_store_url, gcs_storage_options)
    data = os.urandom(MIN_PART_SIZE + 100)
    store.put("obj", data)
    assert store.get("obj", max_bytes=len(data)) == data
    assert store.get_many(["obj"], max_bytes=2 * MIN_PART_SIZE) == {"obj": data}
    with pytest.raises(ObjectTooLarge, match=r"obj.*larger than the 1000 bytes"):
        store.get("obj", max_bytes=1000)
    with pytest.raises(ObjectTooLarge, match=r"larger than"):
        store.get_many(["obj"], max_bytes=MIN_PART_SIZE)


@pytest.mark.parametrize("size", [100, 2 * MIN_PART_SIZE + 5], ids=["one-request", "ranged-parts"])
def test_a_stuck_gcs_get_is_answered_by_its_backup(gcs_server: str, gcs_store_url: str, size: int) -> None:
    """The hedge covers a GCS GET up to its response headers: a download held at the store is answered by
    its backup while the first is still held."""
    from support.fault_proxy import FaultProxy

    held, release, seen = threading.Event(), threading.Event(), []

    def hold(req: Any, stage: str) -> None:
        if stage == "before" and req.method == "GET" and req.key.endswith("hedged.bin"):
            seen.append(req)
            if len(seen) == 1:
                held.set()
                release.wait(20)

    data = os.urandom(size)
    with FaultProxy(gcs_server, hooks=[hold]) as proxy:
        store = _store(gcs_store_url, {"endpoint_url": proxy.url, "token": "anon"},
                       TransferPolicy(part_size=MIN_PART_SIZE, concurrency=4))
        store.put("warm", b"w")
        for _ in range(20):  # the hedger learns the store's answer times
            store.get("warm")
        store.put("hedged.bin", data)
        try:
            assert store.get("hedged.bin") == data
            still_held = not release.is_set()
        finally:
            release.set()
    assert held.is_set() and still_held
    assert store.hedger.backups >= 1 and len(seen) >= 2


def _leftover_parts(store: ObjectStore) -> list[str]:
    return [p for p in store.fs.find(store.fs._strip_protocol(store.url)) if p.endswith(PART_SUFFIX)]


def test_a_large_object_goes_up_as_a_composite_of_parallel_parts(
        gcs_store_url: str, gcs_storage_options: dict[str, Any], gcs_requests: Any) -> None:
    store = _store(gcs_store_url, gcs_storage_options)
    data = os.urandom(2 * MIN_PART_SIZE + 4321)
    gcs_requests.requests.clear()
    store.put("ckpt/shard.bin", data)
    uploads = gcs_requests.uploads()  # the parts (the compose writes the object itself)
    composes = [r for r in gcs_requests.requests if r["method"] == "POST" and r["path"].endswith("/compose")]
    deletes = [r for r in gcs_requests.requests if r["method"] == "DELETE"]
    assert len(uploads) == 3 and len(composes) == 1 and len(deletes) == 3
    assert store.get("ckpt/shard.bin") == data
    assert not _leftover_parts(store)
    assert store.list("") == ["ckpt/shard.bin"]  # the parts are gone, and never were under the key's folder
    small = os.urandom(1000)
    gcs_requests.requests.clear()
    store.put("ckpt/small.bin", small)
    assert len(gcs_requests.uploads()) == 1 and not [r for r in gcs_requests.requests if r["method"] == "DELETE"]


def test_a_create_only_composite_upload_keeps_the_first_object_and_leaves_no_parts(
        gcs_store_url: str, gcs_storage_options: dict[str, Any], gcs_requests: Any) -> None:
    gcs_requests.enforce_generation_match = True  # compose with ifGenerationMatch=0 answers 412, as on GCS
    store = _store(gcs_store_url, gcs_storage_options)
    first, other = os.urandom(MIN_PART_SIZE + 10), os.urandom(MIN_PART_SIZE + 10)
    assert store.put_if_absent("once.bin", first) is True
    assert store.put_if_absent("once.bin", other) is False  # someone else's object: untouched
    assert store.put_if_absent("once.bin", first) is True  # the same bytes read back as ours (a lost answer)
    assert store.get("once.bin") == first
    composes = [r for r in gcs_requests.requests if r["method"] == "POST" and r["path"].endswith("/compose")]
    assert len(composes) == 3 and all(r["query"].get("ifGenerationMatch") == ["0"] for r in composes)
    assert not _leftover_parts(store)


def test_compose_ranges_never_exceed_gcs_source_limit() -> None:
    policy = TransferPolicy(part_size=MIN_PART_SIZE)
    spans = compose_ranges(100 * MIN_PART_SIZE + 1, policy)
    assert len(spans) <= MAX_COMPOSE_SOURCES and spans[0][0] == 0 and spans[-1][1] == 100 * MIN_PART_SIZE + 1
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert compose_ranges(3 * MIN_PART_SIZE, policy) == [(0, MIN_PART_SIZE), (MIN_PART_SIZE, 2 * MIN_PART_SIZE),
                                                          (2 * MIN_PART_SIZE, 3 * MIN_PART_SIZE)]


def test_a_listing_is_one_request_even_when_it_finds_nothing(gcs_store_url: str, gcs_storage_options: dict[str, Any],
                                                             gcs_requests: Any) -> None:
    """gcsfs's find() lists a folder that holds nothing a second time, as if it were a file: two requests per
    empty poll of the exchange. One listing now, whatever it finds."""
    store = _store(gcs_store_url, gcs_storage_options)
    store.put("rounds/00000001/ready/0003", b"x")
    store.put("rounds/00000001/readyish", b"a sibling key, not in the folder")
    gcs_requests.requests.clear()
    assert store.list("rounds/00000000/ready") == []
    assert store.list("rounds/00000001/ready") == ["rounds/00000001/ready/0003"]
    assert store.list("rounds") == ["rounds/00000001/ready/0003", "rounds/00000001/readyish"]
    assert [r["method"] for r in gcs_requests.requests] == ["GET"] * 3
    assert all(r["path"].endswith("/o") for r in gcs_requests.requests)  # object listings, no metadata read
