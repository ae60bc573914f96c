"""Large S3 objects as parallel parts (store/_transfer.py) against moto, with every request counted
by the store emulator or the fault proxy in front of it: multipart PUTs and ranged GETs round-trip
bytes exactly, small objects stay one request, the GET path never sends a HEAD, create-only holds
for multipart uploads, SlowDown is retried, and a read never mixes two versions of an object.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from diloco_serverless.store._transfer import MIN_PART_SIZE, TransferPolicy
from diloco_serverless.store.objectstore import ObjectStore, ObjectTooLarge, StoreUnavailable
from diloco_serverless.store.retry import RetryPolicy
from support.fault_proxy import FaultProxy, FaultRule, RequestInfo, Target
from support.store_emulator import Request, StoreEmulator
from support.store_presets import StorePreset

MiB = 1 << 20
FAST = RetryPolicy(max_attempts=4, base_delay_s=0.01, max_delay_s=0.05, timeout_s=30.0)
PARTS = TransferPolicy(part_size=MIN_PART_SIZE, concurrency=4)
OPEN = StorePreset(name="open", first_byte_ms=0.01, first_byte_p99_ms=0.01, conn_mb_s=1e4, client_mb_s=1e4,
                   put_rate=1e6, get_rate=1e6, prefix_depth=2, usd_per_1k_put=0, usd_per_1k_get=0,
                   usd_per_gb_egress=0, source="test")


def _boto(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1")


@pytest.fixture
def bucket(s3_server: str) -> str:
    name = f"xfer-{uuid.uuid4().hex[:10]}"
    _boto(s3_server).create_bucket(Bucket=name)
    return name


@pytest.fixture
def emu(s3_server: str) -> Iterator[StoreEmulator]:
    with StoreEmulator(s3_server, OPEN) as e:
        yield e


def _store(endpoint: str, bucket: str, transfer: TransferPolicy = PARTS) -> ObjectStore:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}}
    return ObjectStore(f"s3://{bucket}", options, retry=FAST, transfer=transfer)


def _kinds(reqs: list[Request]) -> Counter[str]:
    """Requests by what they are: create/part/complete of an upload, put, ranged/plain get, head."""
    out: Counter[str] = Counter()
    for r in reqs:
        if r.method == "POST" and "uploads" in r.query:
            out["create_upload"] += 1
        elif r.method == "PUT" and "partNumber" in r.query:
            out["upload_part"] += 1
        elif r.method == "POST" and "uploadId" in r.query:
            out["complete_upload"] += 1
        elif r.method == "DELETE" and "uploadId" in r.query:
            out["abort_upload"] += 1
        elif r.method == "GET" and r.key:
            out["ranged_get" if r.range else "get"] += 1
        else:
            out[r.method.lower() if r.key else f"bucket_{r.method.lower()}"] += 1
    return out


def test_large_object_goes_up_in_parts_and_comes_down_in_ranges_without_head(emu: StoreEmulator,
                                                                              bucket: str) -> None:
    store = _store(emu.url, bucket)
    data = os.urandom(12 * MiB + 123)  # 3 parts of 5 MiB (the last shorter)
    store.put("run/contrib/0000/rank-0", data)
    up = _kinds(emu.requests())
    emu.reset()
    got = store.get("run/contrib/0000/rank-0")
    down = _kinds(emu.requests())
    assert got == data
    assert up == {"create_upload": 1, "upload_part": 3, "complete_upload": 1}
    assert down == {"ranged_get": 3}  # first range tells the size; no HEAD
    ranges = sorted(r.range or "" for r in emu.requests())
    assert ranges == sorted([f"bytes=0-{MIN_PART_SIZE - 1}", f"bytes={MIN_PART_SIZE}-{2 * MIN_PART_SIZE - 1}",
                             f"bytes={2 * MIN_PART_SIZE}-{len(data) - 1}"])


def test_small_objects_stay_single_requests(emu: StoreEmulator, bucket: str) -> None:
    store = _store(emu.url, bucket)
    data = os.urandom(MIN_PART_SIZE)  # exactly the part size: still one request
    store.put("a/b/small", data)
    assert store.put_if_absent("a/b/created", b"x" * 1000) is True
    assert store.get("a/b/small") == data
    assert store.get_many(["a/b/small", "a/b/created", "a/b/missing"], missing_ok=True) == {
        "a/b/small": data, "a/b/created": b"x" * 1000}
    kinds = _kinds(emu.requests())
    assert kinds == {"put": 2, "ranged_get": 4}  # get_many: 3 GETs (one 404), no HEAD anywhere


def test_get_many_of_large_objects_uses_ranges_and_no_head(emu: StoreEmulator, bucket: str) -> None:
    store = _store(emu.url, bucket)
    blobs = {f"r/x/{i}": os.urandom(6 * MiB + i) for i in range(3)}
    for k, v in blobs.items():
        store.put(k, v)
    emu.reset()
    assert store.get_many(list(blobs)) == blobs
    assert _kinds(emu.requests()) == {"ranged_get": 6}  # two ranges per object


def test_create_only_multipart_keeps_the_first_object(emu: StoreEmulator, bucket: str, s3_server: str) -> None:
    store = _store(emu.url, bucket)
    first, second = os.urandom(11 * MiB), os.urandom(11 * MiB)
    assert store.put_if_absent("run/reduced/0001", first) is True
    assert store.put_if_absent("run/reduced/0001", second) is False  # exists: left untouched
    assert store.put_if_absent("run/reduced/0001", first) is True  # same bytes: "mine, or the same as mine"
    assert store.get("run/reduced/0001") == first
    assert _boto(s3_server).list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []  # losers aborted
    assert _kinds(emu.requests())["abort_upload"] == 2


def test_size_limited_read_of_a_large_object_is_one_request(emu: StoreEmulator, bucket: str) -> None:
    store = _store(emu.url, bucket)
    store.put("big", os.urandom(11 * MiB))
    emu.reset()
    with pytest.raises(ObjectTooLarge, match="larger than the 1000 bytes allowed"):
        store.get("big", max_bytes=1000)
    assert [(r.method, r.range) for r in emu.requests()] == [("GET", "bytes=0-1000")]


def test_slowdown_on_parts_is_retried_and_the_transfer_succeeds(s3_server: str, bucket: str) -> None:
    rules = [FaultRule("slowdown", Target(methods=("PUT",), key=r"obj$"), first_n=2),
             FaultRule("slowdown", Target(methods=("GET",), key=r"obj$"), first_n=2)]
    data = os.urandom(11 * MiB)
    with FaultProxy(s3_server, rules=rules) as proxy:
        store = _store(proxy.url, bucket)
        store.put("p/q/obj", data)
        assert store.get("p/q/obj") == data
        assert proxy.snapshot()["slowdown"] == 4


def test_persistent_slowdown_fails_with_store_unavailable_naming_it(s3_server: str, bucket: str) -> None:
    rules = [FaultRule("slowdown", Target(methods=("GET",)), first_n=None)]
    with FaultProxy(s3_server, rules=rules) as proxy:
        _store(s3_server, bucket).put("p/q/obj", b"x")
        store = _store(proxy.url, bucket)
        with pytest.raises(StoreUnavailable, match="SlowDown|reduce your request rate") as info:
            store.get("p/q/obj")
    assert f"s3://{bucket}/p/q/obj" in str(info.value)


def test_a_read_never_mixes_two_versions(s3_server: str, bucket: str) -> None:
    old, new = b"o" * (11 * MiB), b"n" * (11 * MiB)
    direct = _boto(s3_server)
    direct.put_object(Bucket=bucket, Key="v/w/obj", Body=old)
    gets: list[int] = []

    def replace_after_first_range(req: RequestInfo, stage: str) -> None:
        if req.method == "GET" and req.key == "v/w/obj" and stage == "after":
            gets.append(req.n)
            if len(gets) == 1:  # the first range came back old; the object changes before the rest
                direct.put_object(Bucket=bucket, Key="v/w/obj", Body=new)

    with FaultProxy(s3_server, hooks=[replace_after_first_range]) as proxy:
        got = _store(proxy.url, bucket, TransferPolicy(part_size=MIN_PART_SIZE, concurrency=1)).get("v/w/obj")
    assert got == new  # the If-Match ranges failed (412), the read restarted on the new version
    assert len(gets) > 3


def test_transfer_policy_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="part_size must be an int >= 5242880"):
        TransferPolicy(part_size=MiB)
    with pytest.raises(ValueError, match="concurrency must be an int >= 1"):
        TransferPolicy(concurrency=0)
    assert TransferPolicy.from_mb(16, 8) == TransferPolicy()
    assert TransferPolicy().part_size_for(10_000 * 32 * MiB) == 32 * MiB  # at most 10,000 parts
    assert TransferPolicy(part_size=MIN_PART_SIZE).ranges(12 * MiB) == [
        (0, 5 * MiB), (5 * MiB, 10 * MiB), (10 * MiB, 12 * MiB)]


def test_run_config_sets_the_transfer_policy_of_the_run_store() -> None:
    from diloco_serverless.config import RunConfig
    from diloco_serverless.run.record import transfer_policy

    assert transfer_policy(RunConfig()) == TransferPolicy()  # config defaults = the store's defaults
    cfg = RunConfig.load(None, ["store_part_size_mb=32", "store_part_concurrency=4"])
    assert transfer_policy(cfg) == TransferPolicy(part_size=32 * MiB, concurrency=4)
    with pytest.raises(Exception, match="store_part_size_mb"):
        RunConfig.load(None, ["store_part_size_mb=4"])
    assert transfer_policy(RunConfig.load(None, ["store_hedge_quantile=0.9"])).hedge_quantile == 0.9
    assert transfer_policy(RunConfig.load(None, ["store_hedge_quantile=none"])).hedge_quantile is None
    with pytest.raises(Exception, match="store_hedge_quantile"):
        RunConfig.load(None, ["store_hedge_quantile=1"])
    store = ObjectStore("memory://xfer-policy").with_transfer(transfer_policy(cfg))
    assert store.transfer.part_size == 32 * MiB and store.retry == RetryPolicy()


def test_a_size_bound_sends_every_range_at_once(emu: StoreEmulator, bucket: str) -> None:
    store = _store(emu.url, bucket)
    data = os.urandom(11 * MiB)
    store.put("s/t/obj", data)
    store.put("s/t/empty", b"")
    emu.reset()
    assert store.get("s/t/obj", max_bytes=20 * MiB) == data  # MiB 0-5, 5-10, 10-15 (short); 15-20, 20-20+ (416)
    assert sorted(r.status for r in emu.requests()) == [206, 206, 206, 416, 416]
    assert store.get_many(["s/t/obj", "s/t/empty"], max_bytes=11 * MiB) == {"s/t/obj": data, "s/t/empty": b""}
    with pytest.raises(ObjectTooLarge, match=f"larger than the {10 * MiB} bytes allowed"):
        store.get("s/t/obj", max_bytes=10 * MiB)
    assert all(r.method == "GET" and r.range for r in emu.requests())  # never a HEAD


@pytest.mark.slow
def test_the_other_ranges_start_when_the_first_answer_arrives_not_its_body(s3_server: str, bucket: str) -> None:
    """The first range's headers size the object; waiting for its body too would add one part's transfer
    time to every large read. At 2.5 MB/s per connection a 5 MiB part takes 2 s to arrive."""
    from dataclasses import replace

    with StoreEmulator(s3_server, replace(OPEN, conn_mb_s=2.5)) as slow:
        store = _store(slow.url, bucket)
        data = os.urandom(2 * MIN_PART_SIZE + 4096)
        store.put("h/f/obj", data)
        slow.reset()
        assert store.get("h/f/obj") == data
        gets = sorted((r for r in slow.requests() if r.method == "GET"), key=lambda r: r.arrived)
    assert len(gets) == 3 and gets[0].range == f"bytes=0-{MIN_PART_SIZE - 1}"
    for later in gets[1:]:
        assert later.arrived - gets[0].answered < 1.0, "a later range waited for the first range's body"


def test_a_listing_is_one_request_even_when_it_finds_nothing(emu: StoreEmulator, bucket: str) -> None:
    """s3fs's find() follows an empty listing with a HEAD and a second LIST (is the folder a file?): every
    empty poll of the exchange cost three requests, one after the other. One LIST now, whatever it finds."""
    store = _store(emu.url, bucket)
    store.put("run/rounds/00000001/ready/0003", b"x")
    store.put("run/rounds/00000001/ready/0003x", b"a sibling whose name extends the folder's")
    store.put("run/rounds/00000001/readyish", b"a sibling key, not in the folder")
    emu.reset()
    assert store.list("run/rounds/00000000/ready") == []
    assert store.list("run/rounds/00000001/ready") == ["run/rounds/00000001/ready/0003",
                                                        "run/rounds/00000001/ready/0003x"]
    assert store.list("nothing") == []
    assert store.list("") == ["run/rounds/00000001/ready/0003", "run/rounds/00000001/ready/0003x",
                              "run/rounds/00000001/readyish"]
    assert _kinds(emu.requests()) == {"bucket_get": 4}  # four listings, no HEAD, no second LIST
