"""The fault proxy itself (support/fault_proxy.py), in process and fast: each fault kind does what it
says to an S3 client, targeted rules fire exactly where and as often as asked, random faults are seeded
and counted, the proxy binds 127.0.0.1 and stops by itself; and ObjectStore.put_if_absent reports
True when the response to its own create-only write is lost (the unit-level form of test (b))."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from diloco_serverless.store.objectstore import ObjectStore
from support.fault_proxy import ALL_KINDS, FaultProxy, FaultRule, Target

KEY, SECRET, REGION = "testing", "testing", "us-east-1"


def _client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                        region_name=REGION, config=Config(retries={"total_max_attempts": 1}))


@pytest.fixture
def bucket(s3_store_url: str) -> str:
    return s3_store_url.removeprefix("s3://")


def _store(proxy: FaultProxy, bucket: str) -> ObjectStore:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return ObjectStore(f"s3://{bucket}", {"endpoint_url": proxy.url, "key": KEY, "secret": SECRET,
                                          "client_kwargs": {"region_name": REGION}})


def test_error_answers_are_s3_errors(s3_server: str, bucket: str) -> None:
    from botocore.exceptions import ClientError

    rules = [FaultRule("slowdown", Target(methods=("GET",), key="^a$")),
             FaultRule("internal", Target(methods=("GET",), key="^a$"))]
    with FaultProxy(s3_server, rules=rules) as proxy:
        s3 = _client(proxy.url)
        s3.put_object(Bucket=bucket, Key="a", Body=b"1")
        for code, status in (("SlowDown", 503), ("InternalError", 500)):
            with pytest.raises(ClientError) as info:
                s3.get_object(Bucket=bucket, Key="a")
            assert info.value.response["Error"]["Code"] == code
            assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
        assert s3.get_object(Bucket=bucket, Key="a")["Body"].read() == b"1"  # rules fired once each
        assert proxy.snapshot() == {"slowdown": 1, "internal": 1, "drop_before": 0, "delay": 0, "drop_after": 0}


def test_drop_before_and_drop_after(s3_server: str, bucket: str) -> None:
    from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError

    closed = (ConnectionClosedError, EndpointConnectionError, ConnectionError)
    rules = [FaultRule("drop_before", Target(methods=("PUT",), key="^before$")),
             FaultRule("drop_after", Target(methods=("PUT",), create_only=True, key="^after$"))]
    direct = _client(s3_server)
    with FaultProxy(s3_server, rules=rules) as proxy:
        s3 = _client(proxy.url)
        with pytest.raises(closed):
            s3.put_object(Bucket=bucket, Key="before", Body=b"x")
        with pytest.raises(ClientError):  # the store did not act
            direct.head_object(Bucket=bucket, Key="before")
        with pytest.raises(closed):
            s3.put_object(Bucket=bucket, Key="after", Body=b"mine", IfNoneMatch="*")
        assert direct.get_object(Bucket=bucket, Key="after")["Body"].read() == b"mine"  # the store acted
        with pytest.raises(ClientError) as info:  # the rule fired once; now the store answers 412
            s3.put_object(Bucket=bucket, Key="after", Body=b"mine", IfNoneMatch="*")
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
        assert proxy.counts["drop_before"] == 1 and proxy.counts["drop_after"] == 1
        events = [(e[1], e[2], e[3]) for e in proxy.injected()]
        assert events == [("drop_before", "PUT", "before"), ("drop_after", "PUT", "after")]


@pytest.mark.slow
def test_random_faults_are_seeded_counted_and_delayed(s3_server: str, bucket: str) -> None:
    def sequence(seed: int) -> list[str]:
        with FaultProxy(s3_server, seed=seed, rate=0.5, kinds=("slowdown", "internal", "delay"),
                        delay_s=(0.05, 0.1)) as proxy:
            s3 = _client(proxy.url)
            t0 = time.monotonic()
            for i in range(30):
                try:
                    s3.put_object(Bucket=bucket, Key=f"k{i}", Body=b"x")
                except Exception:
                    pass
            kinds = [e[1] for e in proxy.injected()]
            assert sum(proxy.snapshot().values()) == len(kinds) == proxy.total_faults > 5
            assert time.monotonic() - t0 >= 0.05 * kinds.count("delay")
            return kinds

    assert sequence(3) == sequence(3)
    assert sequence(3) != sequence(4)


def test_binds_localhost_and_stops_by_itself(s3_server: str) -> None:
    proxy = FaultProxy(s3_server, lifetime_s=0.5).start()
    assert proxy.url.startswith("http://127.0.0.1:")
    port = int(proxy.url.rsplit(":", 1)[1])
    assert proxy.stopped.wait(10), "the proxy did not stop after its lifetime"
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    with pytest.raises(ValueError):
        FaultRule("teleport")
    assert set(ALL_KINDS) == {"slowdown", "internal", "drop_before", "drop_after", "delay"}


def test_put_if_absent_reports_its_own_create_after_a_lost_response(s3_server: str, bucket: str) -> None:
    """The store creates the object and the answer is lost; whoever re-sends (aiohttp silently, on a
    reused connection, or the store's retry) gets 412. put_if_absent must still say True — and False
    for an object someone else created."""
    rule = FaultRule("drop_after", Target(methods=("PUT",), create_only=True, key="^mine$"))
    with FaultProxy(s3_server, rules=[rule]) as proxy:
        store = _store(proxy, bucket)
        store.put("warm", b"a connection to reuse")
        assert store.put_if_absent("mine", b"my bytes") is True, "a lost response read as 'someone else created it'"
        assert proxy.counts["drop_after"] == 1
        assert store.get("mine") == b"my bytes"
        assert store.put_if_absent("mine", b"other bytes") is False
