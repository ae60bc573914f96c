"""The real-store emulator (tests/support/store_emulator.py) in front of moto: first-byte latency,
per-connection and per-client bandwidth, per-prefix SlowDown, and its counters.

Each test builds its own small preset so that the effect under test dominates (seconds in all).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest

from support.store_emulator import StoreEmulator, client_of, prefix_of
from support.store_presets import PRESETS, StorePreset

MB = 1_000_000

#: Nothing limits except what a test sets: no latency worth measuring, fast links, high rates.
BASE = StorePreset(
    name="test", first_byte_ms=0.01, first_byte_p99_ms=0.01, conn_mb_s=10_000.0, client_mb_s=10_000.0,
    put_rate=1e6, get_rate=1e6, prefix_depth=2, usd_per_1k_put=0.0, usd_per_1k_get=0.0,
    usd_per_gb_egress=0.0, source="test",
)


def _client(endpoint: str, agent: str = "") -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1",
                        config=Config(retries={"total_max_attempts": 1}, user_agent_extra=agent or None,
                                      max_pool_connections=16))


@pytest.fixture
def bucket(s3_server: str) -> Iterator[str]:
    name = f"emu-{uuid.uuid4().hex[:10]}"
    _client(s3_server).create_bucket(Bucket=name)
    yield name


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_first_byte_latency_is_applied_and_scaled(s3_server: str, bucket: str) -> None:
    fixed = replace(BASE, first_byte_ms=150.0, first_byte_p99_ms=150.0)  # sigma 0: every request waits 150 ms
    _client(s3_server).put_object(Bucket=bucket, Key="a/b/c", Body=b"x")
    for scale, expected in ((1.0, 0.150), (3.0, 0.050)):
        with StoreEmulator(s3_server, fixed, scale=scale) as emu:
            s3 = _client(emu.url)
            s3.get_object(Bucket=bucket, Key="a/b/c")["Body"].read()  # connection set up
            took = min(_timed(lambda c=s3: c.get_object(Bucket=bucket, Key="a/b/c")["Body"].read()) for _ in range(3))
        assert expected <= took < expected + 0.1, (scale, took)


def test_latency_draws_follow_the_presets_lognormal() -> None:
    s3 = PRESETS["s3-standard"]
    emu = StoreEmulator("http://127.0.0.1:1", s3, seed=3)
    draws = sorted(emu._first_byte_s() for _ in range(4000))
    median, p99 = draws[len(draws) // 2], draws[int(len(draws) * 0.99)]
    assert median == pytest.approx(s3.first_byte_ms / 1000, rel=0.1)
    assert p99 == pytest.approx(s3.first_byte_p99_ms / 1000, rel=0.25)
    first = [StoreEmulator("http://127.0.0.1:1", s3, seed=9)._first_byte_s() for _ in range(1)]
    same, other = StoreEmulator("http://127.0.0.1:1", s3, seed=9), StoreEmulator("http://127.0.0.1:1", s3, seed=10)
    assert [same._first_byte_s()] == first and [other._first_byte_s()] != first


def test_bodies_are_paced_per_connection_both_ways(s3_server: str, bucket: str) -> None:
    slow = replace(BASE, conn_mb_s=4.0)  # 1 MB takes 0.25 s on one connection
    body = b"\x01" * MB
    with StoreEmulator(s3_server, slow) as emu:
        s3 = _client(emu.url)
        up = _timed(lambda: s3.put_object(Bucket=bucket, Key="p/q/obj", Body=body))
        down = _timed(lambda: s3.get_object(Bucket=bucket, Key="p/q/obj")["Body"].read())
        assert s3.get_object(Bucket=bucket, Key="p/q/obj")["Body"].read() == body
    assert 0.24 <= up < 0.6, up
    assert 0.24 <= down < 0.6, down


def test_client_cap_is_shared_by_one_clients_connections_only(s3_server: str, bucket: str) -> None:
    capped = replace(BASE, conn_mb_s=2.0, client_mb_s=2.0)  # one client: 2 MB/s over all its connections
    body = b"\x02" * MB
    _client(s3_server).put_object(Bucket=bucket, Key="r/s/obj", Body=body)
    with StoreEmulator(s3_server, capped) as emu:
        same = [_client(emu.url, "emu-rank-0") for _ in range(4)]
        apart = [_client(emu.url, f"emu-rank-{r + 1}") for r in range(4)]
        for c in same + apart:  # connections and signing set up before timing
            c.head_object(Bucket=bucket, Key="r/s/obj")

        def four(clients: list[Any]) -> float:
            with ThreadPoolExecutor(4) as pool:
                return _timed(lambda: list(pool.map(
                    lambda c: c.get_object(Bucket=bucket, Key="r/s/obj")["Body"].read(), clients)))

        shared, separate = four(same), four(apart)
        by_client = emu.bytes_by_client()
    assert shared >= 1.95, shared  # 4 MB through one 2 MB/s client link
    assert separate < shared * 0.6, (separate, shared)  # four links: each 1 MB at 2 MB/s (0.5 s)
    assert by_client["rank-0"] == (0, 4 * MB)
    assert all(by_client[f"rank-{r + 1}"] == (0, MB) for r in range(4))


def test_slowdown_past_the_prefix_rate_and_the_store_does_not_act(s3_server: str, bucket: str) -> None:
    from botocore.exceptions import ClientError

    limited = replace(BASE, put_rate=5.0, get_rate=1000.0)  # burst of 5 PUTs per prefix, 5/s after
    with StoreEmulator(s3_server, limited) as emu:
        s3 = _client(emu.url)
        codes: list[str] = []
        for i in range(10):
            try:
                s3.put_object(Bucket=bucket, Key=f"hot/pre/obj-{i}", Body=b"x")
                codes.append("ok")
            except ClientError as exc:
                codes.append(exc.response["Error"]["Code"])
                assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        s3.put_object(Bucket=bucket, Key="cold/pre/obj", Body=b"y")  # another prefix has its own bucket
        assert s3.get_object(Bucket=bucket, Key="hot/pre/obj-0")["Body"].read() == b"x"  # GETs: own limit
        peak = emu.peak_rate("hot/pre", "PUT")
        slowdowns = emu.slowdowns
    assert codes[:5] == ["ok"] * 5
    assert "SlowDown" in codes[5:] and set(codes) <= {"ok", "SlowDown"}
    assert slowdowns == codes.count("SlowDown")
    assert peak >= 5
    listed = _client(s3_server).list_objects_v2(Bucket=bucket, Prefix="hot/")
    stored = {o["Key"] for o in listed.get("Contents", [])}
    assert stored == {f"hot/pre/obj-{i}" for i, c in enumerate(codes) if c == "ok"}


def test_counters_count_requests_bytes_and_prefixes(s3_server: str, bucket: str) -> None:
    with StoreEmulator(s3_server, BASE) as emu:
        s3 = _client(emu.url, "emu-rank-7")
        s3.put_object(Bucket=bucket, Key="run/rounds/1/a", Body=b"a" * 1000)
        s3.put_object(Bucket=bucket, Key="run/rounds/2/b", Body=b"b" * 500)
        got = s3.get_object(Bucket=bucket, Key="run/rounds/1/a", Range="bytes=0-99")["Body"].read()
        s3.head_object(Bucket=bucket, Key="run/rounds/2/b")
        reqs = emu.requests()
        assert emu.bytes_by_client()["rank-7"] == (1500, 100)
        assert emu.requests_by_method == {"PUT": 2, "GET": 1, "HEAD": 1}
        assert emu.requests_by_prefix() == {("run/rounds", "PUT"): 2, ("run/rounds", "GET"): 2}
        assert 1 <= emu.peak_rate("run/rounds", "PUT") <= 2  # 2 unless a second boundary fell between
        assert emu.peak_rate("elsewhere") == 0
        emu.reset()
        assert emu.bytes_by_client() == {} and emu.requests() == []
    assert got == b"a" * 100
    assert [(r.method, r.range) for r in reqs if r.method == "GET"] == [("GET", "bytes=0-99")]
    assert {r.client for r in reqs} == {"rank-7"}


def test_client_and_prefix_identification() -> None:
    assert client_of({"User-Agent": "Boto3/1 bench-rank-3"}, "127.0.0.1") == "rank-3"
    auth = "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20260101/us-east-1/s3/aws4_request, SignedHeaders=host"
    assert client_of({"User-Agent": "Boto3/1", "Authorization": auth}, "127.0.0.1") == "key-AKIDEXAMPLE"
    assert client_of({}, "10.0.0.2") == "addr-10.0.0.2"
    assert prefix_of("run/rounds/00000001/contrib/0000/rank-1", "", 2) == "run/rounds"
    assert prefix_of("top", "", 2) == ""
    assert prefix_of("", "list-type=2&prefix=run%2Frounds%2F00000001%2F", 2) == "run/rounds"
    assert prefix_of("", "list-type=2&prefix=run%2Fro", 2) == "run"


def test_bad_arguments_are_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="upstream must be http://host:port"):
        StoreEmulator("s3://bucket", BASE)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        StoreEmulator("http://127.0.0.1:9", BASE, scale=0.0)


def test_a_read_abandoned_during_the_first_byte_wait_is_not_served(s3_server: str, bucket: str) -> None:
    import socket

    slow = replace(BASE, first_byte_ms=400.0, first_byte_p99_ms=400.0)
    body = b"z" * 300_000
    _client(s3_server).put_object(Bucket=bucket, Key="a/b/obj", Body=body)
    with StoreEmulator(s3_server, slow) as emu:
        host, port = emu.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:  # a GET whose client gives up at once
            sock.sendall(f"GET /{bucket}/a/b/obj HTTP/1.1\r\nHost: {host}\r\nUser-Agent: x rank-7\r\n\r\n".encode())
        deadline = time.monotonic() + 10
        while emu.abandoned == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        s3 = _client(emu.url, "rank-8")  # a read that waits is served as before
        assert s3.get_object(Bucket=bucket, Key="a/b/obj")["Body"].read() == body
        events = emu.requests()
        assert emu.abandoned == 1
        assert [(e.client, e.status) for e in events] == [("rank-7", 499), ("rank-8", 200)]
        assert emu.bytes_by_client().get("rank-7", (0, 0))[1] == 0  # nothing sent to the one that left
        assert emu.bytes_by_client()["rank-8"][1] == len(body)
