"""What an exchange round costs in round trips on S3: moto behind the store emulator, which logs every
request with the rank that sent it.

- A round whose shards would exceed the store's part size is cut into more, part-sized shards: no
  multipart upload (two extra round trips per object), every object at most one part, the same mean.
- The replica that writes ``quorum.json`` does not read it back.
- A round after one the replica finished does not start with a quorum read.
- Reduced shards are listed, then only those that exist are fetched (no GET that misses).
- A small direct round sends one PUT, polls its peers' votes by GET (no listing first), then one listing.
"""

from __future__ import annotations

import json
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.codec import unpack
from diloco_serverless.exchange.errors import MismatchError
from diloco_serverless.run.layout import contrib_key, quorum_key, reduced_key, vote_key
from diloco_serverless.store._transfer import MIN_PART_SIZE, TransferPolicy
from support.allreduce import WithQuorum, assert_identical, run_replicas
from support.store_emulator import Request, StoreEmulator, client_options
from support.store_presets import StorePreset

OPEN = StorePreset(name="open", first_byte_ms=0.01, first_byte_p99_ms=0.01, conn_mb_s=1e4, client_mb_s=1e4,
                   put_rate=1e6, get_rate=1e6, prefix_depth=2, usd_per_1k_put=0, usd_per_1k_get=0,
                   usd_per_gb_egress=0, source="test")
PART = TransferPolicy(part_size=MIN_PART_SIZE, concurrency=4)


def _boto(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1")


@pytest.fixture
def emu(s3_server: str) -> Iterator[StoreEmulator]:
    with StoreEmulator(s3_server, OPEN) as e:
        yield e


@pytest.fixture
def bucket(s3_server: str) -> str:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    name = f"rt-{uuid.uuid4().hex[:10]}"
    _boto(s3_server).create_bucket(Bucket=name)
    return name


def _maker(endpoint: str, transfer: dict[int, TransferPolicy] | None = None, *, quorum: bool = False) -> Any:
    """Replicas whose requests the emulator attributes to ``rank-<r>``; ``transfer`` per rank (default PART);
    with ``quorum``, every round has a quorum object (as a sliced exchange's do)."""

    def make(url: str, r: int, n: int, **kw: Any) -> ObjectStoreAllReduce:
        opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
                "client_kwargs": {"region_name": "us-east-1"}, **client_options(r)}
        return (WithQuorum if quorum else ObjectStoreAllReduce)(url, r, n, storage_options=opts,
                                                               transfer=(transfer or {}).get(r, PART), **kw)

    return make


def _ints(n: int, seed: int) -> torch.Tensor:
    """Small integers: their mean over 2 replicas is exact in fp32 whatever the order of addition."""
    return torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(seed)).float()


def _is_create_upload(r: Request) -> bool:
    return r.method == "POST" and "uploads" in r.query


@pytest.mark.parametrize(("topology", "split"), [("flat", 2), ("auto", 3)])  # auto at N=2: direct
def test_a_large_round_is_cut_into_part_sized_shards_not_multipart(
    emu: StoreEmulator, bucket: str, topology: str, split: int
) -> None:
    n = 3 * (MIN_PART_SIZE - (128 << 10)) // 4  # 14.6 MiB of fp32: a flat shard (7.3 MiB) or a whole share is over
    xs = {r: _ints(n, r) for r in range(2)}
    outs, errors, stats = run_replicas(f"s3://{bucket}", xs, 2, make=_maker(emu.url), topology=topology,
                                       keep_rounds=None)
    assert not errors
    assert_identical(outs)
    assert torch.equal(outs[0][0], (xs[0] + xs[1]) / 2)
    assert not [r for r in emu.requests() if _is_create_upload(r) or "partNumber" in r.query]
    listing = _boto(emu.url).list_objects_v2(Bucket=bucket, Prefix="t/rounds/00000000/")["Contents"]
    data = [o for o in listing if "/contrib/" in o["Key"] or "/reduced/" in o["Key"]]
    assert data and max(o["Size"] for o in data) <= MIN_PART_SIZE
    # a round without a quorum: the marker is in each rank's vote, written after all its contributions
    assert not [o for o in listing if "/ready/" in o["Key"] or o["Key"].endswith("quorum.json")]
    vote = _boto(emu.url).get_object(Bucket=bucket, Key=f"t/{vote_key(0, 0)}")["Body"].read()
    marker = unpack(vote, key="vote")[1]["marker"]
    assert marker["split"] == split
    shards = split * (2 if topology == "flat" else 1)
    for rank in range(2):
        puts = [r for r in emu.requests() if r.client == f"rank-{rank}" and r.method == "PUT"]
        (cast,) = [r for r in puts if r.key == f"t/{vote_key(0, rank)}"]
        pieces = [r for r in puts if "/contrib/" in r.key]
        assert len(pieces) == shards and all(p.answered <= cast.arrived for p in pieces)
    assert len([o for o in data if "/contrib/" in o["Key"]]) == 2 * shards
    if topology == "flat":
        assert sorted(stats[0].reduced_shards + stats[1].reduced_shards) == list(range(shards))


def test_replicas_that_would_cut_the_tensor_differently_fail_with_a_mismatch(emu: StoreEmulator, bucket: str) -> None:
    n = 3 * (MIN_PART_SIZE - (128 << 10)) // 4
    xs = {r: _ints(n, r) for r in range(2)}
    bigger = {1: TransferPolicy(part_size=4 * MIN_PART_SIZE)}  # rank 1 would not split at all
    _, errors, _ = run_replicas(f"s3://{bucket}", xs, 2, make=_maker(emu.url, bigger), topology="flat",
                                timeout_s=20.0)
    assert set(errors) == {0, 1}
    assert all(isinstance(e, MismatchError) and "pieces per share" in str(e) for e in errors.values())


def test_a_round_spends_no_round_trip_on_reading_back_or_missing(emu: StoreEmulator, bucket: str) -> None:
    xs = {r: _ints(3000, r) for r in range(3)}
    outs, errors, _ = run_replicas(f"s3://{bucket}", xs, 3, rounds=2, make=_maker(emu.url, quorum=True),
                                   topology="flat")
    assert not errors
    assert_identical(outs)
    log = emu.requests()
    # the gather lists the reduced shards (one request per poll) and GETs only those that exist
    assert [r for r in log if r.method == "GET" and "reduced" in r.query]
    assert not [r for r in log if r.method == "GET" and "/reduced/" in r.key and r.status == 404]
    for rnd in (0, 1):
        qkey = f"t/{quorum_key(rnd)}"
        created = json.loads(_boto(emu.url).get_object(Bucket=bucket, Key=qkey)["Body"].read())
        writer = f"rank-{created['created_by']}"
        mine = [r for r in log if r.client == writer]
        create_at = next(i for i, r in enumerate(mine) if r.method == "PUT" and r.key.endswith(qkey) and r.status < 300)
        # the writer reads it back once, at the end: the check that it was not deleted or replaced while the
        # round closed (docs/security.md, "Deletions never change a result"), never to learn what it wrote
        assert len([r for r in mine[create_at:] if r.method == "GET" and r.key.endswith(qkey)]) == 1
        for rank in range(3):
            own = [r for r in log if r.client == f"rank-{rank}" and f"/{rnd:08d}/" in r.key]
            first_put = next(i for i, r in enumerate(own) if r.method == "PUT")
            early_reads = [r for r in own[:first_put] if r.method == "GET" and r.key.endswith(qkey)]
            # the first round checks for a quorum before publishing (a restarted replica may have taken part);
            # the next one, after a round this object finished, does not
            assert len(early_reads) == (1 if rnd == 0 else 0)


SLOW = StorePreset(name="slow", first_byte_ms=400.0, first_byte_p99_ms=400.0, conn_mb_s=1e4, client_mb_s=1e4,
                   put_rate=1e6, get_rate=1e6, prefix_depth=2, usd_per_1k_put=0, usd_per_1k_get=0,
                   usd_per_gb_egress=0, source="test: every request waits 0.4 s")


@pytest.mark.slow
def test_on_a_slow_store_only_the_writer_creates_the_quorum(s3_server: str, bucket: str) -> None:
    """At 0.4 s per request a fixed half-second grace ran out before the writer's create landed, and every
    replica fetched the N ready markers and raced the create. The grace is four of the store's round trips."""
    xs = {r: _ints(1000, r) for r in range(3)}
    with StoreEmulator(s3_server, SLOW) as slow:
        outs, errors, _ = run_replicas(f"s3://{bucket}", xs, 3, make=_maker(slow.url, quorum=True), topology="flat",
                                       timeout_s=60.0, straggler_timeout_s=60.0, takeover_timeout_s=60.0)
        log = slow.requests()
    assert not errors
    assert_identical(outs)
    qkey = f"t/{quorum_key(0)}"
    created = json.loads(_boto(s3_server).get_object(Bucket=bucket, Key=qkey)["Body"].read())
    writer = f"rank-{created['created_by']}"
    creates = {r.client for r in log if r.method == "PUT" and r.key.endswith(qkey)}
    assert creates == {writer}
    for rank in {f"rank-{r}" for r in range(3)}:  # the others read the quorum, and the writer reads no marker:
        others = {r.key for r in log if r.client == rank and r.method == "GET" and "/ready/" in r.key}
        assert not others, f"{rank} fetched ready markers {sorted(others)}"  # their names carry their MACs


@pytest.mark.slow
def test_a_replica_puts_its_reduced_shards_concurrently(s3_server: str, bucket: str) -> None:
    """A split round gives each replica several shards to reduce; their PUTs (a round trip each) overlap."""
    n = 3 * (MIN_PART_SIZE - (128 << 10)) // 4  # split 2 at N = 2: four shards, two per replica
    xs = {r: _ints(n, r) for r in range(2)}
    with StoreEmulator(s3_server, SLOW) as slow:
        outs, errors, _ = run_replicas(f"s3://{bucket}", xs, 2, make=_maker(slow.url), topology="flat",
                                       timeout_s=60.0, straggler_timeout_s=60.0, takeover_timeout_s=60.0)
        log = slow.requests()
    assert not errors
    assert torch.equal(outs[0][0], (xs[0] + xs[1]) / 2)
    for rank in range(2):
        puts = [r for r in log if r.client == f"rank-{rank}" and r.method == "PUT" and "/reduced/" in r.key]
        assert len(puts) == 2, [r.key for r in puts]
        first, second = sorted(puts, key=lambda r: r.arrived)
        assert second.arrived < first.answered, f"rank {rank} PUT its reduced shards one after the other"


def _two_rounds_of_three(emu: StoreEmulator, bucket: str, topology: str) -> tuple[dict[int, Any], list[Request]]:
    """Two rounds of 3 replicas on small integers, checked bit-identical and exact; their stats and the
    emulator's request log."""
    xs = {r: _ints(3000, r) for r in range(3)}
    outs, errors, stats = run_replicas(f"s3://{bucket}", xs, 3, rounds=2, make=_maker(emu.url), topology=topology)
    assert not errors
    assert_identical(outs)
    assert torch.equal(outs[0][1], (xs[0] + xs[1] + xs[2]) * 2 / 3)
    return stats, emu.requests()


def test_a_small_direct_round_polls_its_peers_votes_by_get(emu: StoreEmulator, bucket: str) -> None:
    """A direct round without a quorum: per replica one (create-only) PUT, GETs of each peer's vote until it
    is there (a GET that misses is a poll: no listing before it), read once, then one listing (the
    confirmation). No ready marker, no quorum.json, no HEAD."""
    stats, log = _two_rounds_of_three(emu, bucket, "auto")
    assert not [r for r in log if "/ready/" in r.key or r.key.endswith("quorum.json") or "/reduced/" in r.key]
    assert not [r for r in log if r.method == "HEAD"]
    for rank in range(3):
        mine = [r for r in log if r.client == f"rank-{rank}"]
        for rnd in (0, 1):
            puts = [r.key for r in mine if r.method == "PUT" and f"/{rnd:08d}/" in r.key]
            assert puts == [f"t/{contrib_key(rnd, 0, rank)}"]
            gets = [r for r in mine if r.method == "GET" and f"/{rnd:08d}/contrib/" in r.key]
            peers = {f"t/{contrib_key(rnd, 0, q)}" for q in range(3) if q != rank}
            assert {r.key for r in gets} == peers  # only the peers' votes, never our own
            assert sorted(r.key for r in gets if r.status != 404) == sorted(peers)  # each read once
            listings = [r for r in mine if r.method == "GET" and f"{rnd:08d}" in urllib.parse.unquote(r.query)]
            assert len(listings) == 1, listings  # the confirmation, after every vote is read
            assert listings[0].arrived >= max(g.answered for g in gets if g.status != 404)
    assert stats[0].participants == [0, 1, 2]


def test_a_small_flat_round_votes_instead_of_writing_a_quorum(emu: StoreEmulator, bucket: str) -> None:
    """A flat round at N <= 16: per replica its N shards, then one create-only vote, then its reduced shard;
    it reads the others' contributions to its shard and the other reduced shards, and checks the others'
    votes from the listing (S3 shows each object's MD5; they are the votes it expects), reading none. No
    ready marker, no quorum.json, no HEAD; the one GET that misses is of its own vote, before its first
    round (a restarted replica may have voted already), as a round with a quorum reads the quorum then."""
    stats, log = _two_rounds_of_three(emu, bucket, "flat")
    assert not [r for r in log if "/ready/" in r.key or r.key.endswith("quorum.json")]
    missed = [(r.client, r.key) for r in log if r.method == "HEAD" or (r.method == "GET" and r.status == 404)]
    assert sorted(missed) == [(f"rank-{q}", f"t/{vote_key(0, q)}") for q in range(3)]
    for rank in range(3):
        mine = [r for r in log if r.client == f"rank-{rank}"]
        for rnd in (0, 1):
            puts = [r for r in mine if r.method == "PUT" and f"/{rnd:08d}/" in r.key]
            expected = [contrib_key(rnd, j, rank) for j in range(3)] + [vote_key(rnd, rank), reduced_key(rnd, rank)]
            assert sorted(r.key for r in puts) == sorted(f"t/{k}" for k in expected)
            (cast,) = [r for r in puts if r.key == f"t/{vote_key(rnd, rank)}"]
            assert all(r.answered <= cast.arrived for r in puts if "/contrib/" in r.key)  # shards before the vote
            got = {r.key for r in mine if r.method == "GET" and f"/{rnd:08d}/" in r.key}
            wanted = [k for q in range(3) if q != rank for k in (contrib_key(rnd, rank, q), reduced_key(rnd, q))]
            wanted += [vote_key(0, rank)] if rnd == 0 else []
            assert got == {f"t/{k}" for k in wanted}, sorted(got)
    assert stats[0].participants == [0, 1, 2] and stats[0].reduced_shards == [0]
