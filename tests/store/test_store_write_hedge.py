"""Hedged create-only writes (store/hedge.py, ``WriteBatch``): the straggler of a batch of writes sent
together gets a second PUT once most of the batch has answered, against moto behind the fault proxy; the
first request that creates the object counts, a refusal counts only when both are refused."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from diloco_serverless.exchange._io import CountingStore
from diloco_serverless.store._transfer import TransferPolicy
from diloco_serverless.store.hedge import WriteBatch
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.store.retry import RetryPolicy
from support.fault_proxy import FaultProxy, Hold

FAST = RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.05, timeout_s=30.0)


def _store(endpoint: str, bucket: str, transfer: TransferPolicy | None = None) -> ObjectStore:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}}
    return ObjectStore(f"s3://{bucket}", options, retry=FAST, transfer=transfer or TransferPolicy())


@pytest.fixture
def bucket(s3_server: str) -> str:
    import boto3

    name = f"whedge-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=name)
    return name


def _put_batch(put: ..., keys: list[str], data: dict[str, bytes], batch: WriteBatch | None) -> dict[str, bool]:
    with ThreadPoolExecutor(len(keys)) as pool:
        futures = {k: pool.submit(put, k, data[k], batch=batch) for k in keys}
        return {k: f.result(timeout=60) for k, f in futures.items()}


def _held_put(key: str) -> Hold:
    return Hold(lambda r: r.method == "PUT" and r.key == key)


@pytest.mark.parametrize("n", [4, 8])
def test_the_straggler_of_a_batch_is_answered_by_its_backup(s3_server: str, bucket: str, n: int) -> None:
    keys = [f"b/k{i}" for i in range(n)]
    data = {k: f"bytes of {k}".encode() * 100 for k in keys}
    hold = _held_put(keys[-1])
    with FaultProxy(s3_server, hooks=[hold]) as proxy:
        store = _store(proxy.url, bucket)
        batch = WriteBatch(n)
        try:
            created = _put_batch(store.put_if_absent, keys, data, batch)
            still_held = not hold.released.is_set()  # the first PUT of the straggler has not been answered
        finally:
            hold.released.set()
        assert created == dict.fromkeys(keys, True)
        assert {k: store.get(k) for k in keys} == data
    assert hold.held.is_set() and still_held
    assert len(hold.seen) == 2 and all(r.create_only for r in hold.seen)  # the held PUT and its backup
    assert batch.backed_up == {keys[-1]}  # nobody else: they answered before the batch was due
    assert store.hedger.write_backups == 1 and store.hedger.write_wins == 1


def test_a_counting_store_counts_the_backups_bytes(s3_server: str, bucket: str) -> None:
    keys = [f"c/k{i}" for i in range(4)]
    data = {k: bytes([i]) * 1000 for i, k in enumerate(keys)}
    hold = _held_put(keys[0])
    with FaultProxy(s3_server, hooks=[hold]) as proxy:
        io = CountingStore(_store(proxy.url, bucket))
        try:
            assert _put_batch(io.put_if_absent, keys, data, WriteBatch(4)) == dict.fromkeys(keys, True)
        finally:
            hold.released.set()
    assert io.bytes_up == 5 * 1000  # four writes and one backup


def test_a_batch_too_small_or_unhedged_sends_each_write_once(s3_server: str, bucket: str) -> None:
    for name, n, transfer in [("small", 3, TransferPolicy()), ("off", 4, TransferPolicy(hedge_quantile=None))]:
        keys = [f"{name}/k{i}" for i in range(n)]
        data = {k: b"x" for k in keys}
        hold = _held_put(keys[-1])
        with FaultProxy(s3_server, hooks=[hold]) as proxy:
            store = _store(proxy.url, bucket, transfer)
            timer = threading.Timer(1.0, hold.released.set)  # the held PUT answers after a second
            timer.start()
            try:
                t0 = time.monotonic()
                assert _put_batch(store.put_if_absent, keys, data, WriteBatch(n)) == dict.fromkeys(keys, True)
                waited = time.monotonic() - t0
            finally:
                timer.cancel()
                hold.released.set()
        assert len(hold.seen) == 1 and store.hedger.write_backups == 0, name
        assert waited >= 0.9, name  # it waited for its own answer


def test_an_object_someone_else_created_is_refused_by_both_requests(s3_server: str, bucket: str) -> None:
    """The straggler's key already holds other bytes: its backup is refused, then (released) so is the
    first request; the write answers False after the read-back, like any create that finds another's object."""
    keys = [f"f/k{i}" for i in range(4)]
    data = {k: b"ours" for k in keys}
    hold = _held_put(keys[-1])
    with FaultProxy(s3_server, hooks=[hold]) as proxy:
        _store(s3_server, bucket).put(keys[-1], b"theirs")  # around the proxy
        store = _store(proxy.url, bucket)
        timer = threading.Timer(1.0, hold.released.set)
        timer.start()
        try:
            created = _put_batch(store.put_if_absent, keys, data, WriteBatch(4))
        finally:
            timer.cancel()
            hold.released.set()
        assert created == {**dict.fromkeys(keys[:-1], True), keys[-1]: False}
        assert store.get(keys[-1]) == b"theirs"
    assert len(hold.seen) == 2 and store.hedger.write_wins == 0


def test_a_write_that_starts_after_the_batch_is_due_gets_no_backup() -> None:
    batch = WriteBatch(4)
    assert batch.due_after == 3
    for _ in range(3):
        batch.answered()
    assert batch.due(lambda: False) is False  # late to start: not a tail


def test_a_write_in_the_tail_is_due_when_enough_answered_and_not_once_done() -> None:
    batch = WriteBatch(10)
    assert batch.due_after == 9
    done = threading.Event()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(batch.due(done.is_set)))
    waiter.start()
    for _ in range(8):
        batch.answered()
    waiter.join(0.2)
    assert waiter.is_alive()  # eight of ten answered: not due yet
    batch.answered()
    waiter.join(5)
    assert result == [True]
    answer = threading.Event()
    late = WriteBatch(10)
    waiter = threading.Thread(target=lambda: result.append(late.due(answer.is_set)))
    waiter.start()
    answer.set()  # its own answer came first: no backup
    late.wake()
    waiter.join(5)
    assert result == [True, False]


def test_batch_sizes_and_shares() -> None:
    assert WriteBatch(3).due_after is None and WriteBatch(1).due_after is None
    assert WriteBatch(5).due_after == 4 and WriteBatch(40).due_after == 36
    assert WriteBatch(40, share=0.5).due_after == 20
    with pytest.raises(ValueError, match="share"):
        WriteBatch(8, share=1.0)
