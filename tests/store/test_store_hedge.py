"""Hedged reads (store/hedge.py): a GET or listing stuck at the store gets a backup request and the
first answer wins, against moto behind the fault proxy; and the Hedger's rules on its own (when it
hedges, which answer it keeps, what it does with the loser and with failures)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from diloco_serverless.store._transfer import MIN_PART_SIZE, TransferPolicy
from diloco_serverless.store.hedge import Hedger
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.store.retry import RetryPolicy
from support.fault_proxy import FaultProxy, RequestInfo

MiB = 1 << 20
FAST = RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.05, timeout_s=30.0)


def _store(endpoint: str, bucket: str, transfer: TransferPolicy) -> ObjectStore:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}}
    return ObjectStore(f"s3://{bucket}", options, retry=FAST, transfer=transfer)


@pytest.fixture
def bucket(s3_server: str) -> str:
    import boto3

    name = f"hedge-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=name)
    return name


class Hold:
    """A proxy hook that holds the first request matching ``match`` until released (at most 20 s)."""

    def __init__(self, match: Callable[[RequestInfo], bool]) -> None:
        self.match = match
        self.seen: list[RequestInfo] = []
        self.released = threading.Event()
        self.held = threading.Event()

    def __call__(self, req: RequestInfo, stage: str) -> None:
        if stage != "before" or not self.match(req):
            return
        self.seen.append(req)
        if len(self.seen) == 1:
            self.held.set()
            self.released.wait(20)


def _warm(store: ObjectStore, hedger_samples: int = 20) -> None:
    """Reads enough for the store's Hedger to know its answer times."""
    store.put("warm/obj", b"w")
    for _ in range(hedger_samples):
        store.get("warm/obj")
    assert store.hedger.delay_s(store.transfer.hedge_quantile) is not None


@pytest.mark.parametrize("size", [100, 11 * MiB], ids=["one-request", "ranged-parts"])
def test_a_stuck_get_is_answered_by_its_backup(s3_server: str, bucket: str, size: int) -> None:
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    hold = Hold(lambda r: r.method == "GET" and r.key == "h/k/obj")
    with FaultProxy(s3_server, hooks=[hold]) as proxy:
        store = _store(proxy.url, bucket, TransferPolicy(part_size=MIN_PART_SIZE, concurrency=4))
        _warm(store)
        store.put("h/k/obj", data)
        backups = store.hedger.backups
        try:
            assert store.get("h/k/obj") == data
            still_held = not hold.released.is_set()  # the first GET has not been answered
        finally:
            hold.released.set()
    assert hold.held.is_set() and still_held
    assert store.hedger.backups > backups
    assert len(hold.seen) >= 2  # the held request and its backup, same key and range
    assert hold.seen[0].method == hold.seen[1].method == "GET"


def test_a_stuck_listing_is_answered_by_its_backup(s3_server: str, bucket: str) -> None:
    hold = Hold(lambda r: r.method == "GET" and not r.key and "list-type" in r.query)
    with FaultProxy(s3_server, hooks=[hold]) as proxy:
        store = _store(proxy.url, bucket, TransferPolicy())
        store.put("l/a", b"1")
        store.put("l/b", b"2")
        for _ in range(20):  # warm with listings, but leave them unheld
            hold.seen.clear()
            hold.released.set()
            store.list("l")
        hold.seen.clear()
        hold.released.clear()
        try:
            assert store.list("l") == ["l/a", "l/b"]
            still_held = not hold.released.is_set()
        finally:
            hold.released.set()
    assert hold.held.is_set() and still_held and len(hold.seen) == 2


@pytest.mark.parametrize("op", ["exists", "list_dirs"])
def test_a_stuck_head_or_folder_listing_is_answered_by_its_backup(s3_server: str, bucket: str, op: str) -> None:
    """``exists`` (a HEAD) and ``list_dirs`` (a delimited listing) are reads too: hedged like a GET."""
    if op == "exists":
        hold = Hold(lambda r: r.method == "HEAD" and r.key == "d/x/obj")
    else:
        hold = Hold(lambda r: r.method == "GET" and not r.key and "delimiter" in r.query)
    with FaultProxy(s3_server, hooks=[hold]) as proxy:
        store = _store(proxy.url, bucket, TransferPolicy())
        _warm(store)
        store.put("d/x/obj", b"1")
        try:
            assert (store.exists("d/x/obj") if op == "exists" else store.list_dirs("d") == ["d/x"])
            still_held = not hold.released.is_set()
        finally:
            hold.released.set()
    assert hold.held.is_set() and still_held and len(hold.seen) >= 2


def test_without_hedging_a_read_is_sent_once(s3_server: str, bucket: str) -> None:
    hold = Hold(lambda r: r.method == "GET" and r.key == "n/k/obj")
    with FaultProxy(s3_server, hooks=[hold]) as proxy:
        store = _store(proxy.url, bucket, TransferPolicy(hedge_quantile=None))
        store.put("warm/obj", b"w")
        for _ in range(20):
            store.get("warm/obj")
        store.put("n/k/obj", b"data")
        timer = threading.Timer(1.0, hold.released.set)  # the held GET answers after a second
        timer.start()
        try:
            assert store.get("n/k/obj") == b"data"
        finally:
            timer.cancel()
            hold.released.set()
    assert len(hold.seen) == 1 and store.hedger.backups == 0


def test_transfer_policy_refuses_a_bad_quantile() -> None:
    for bad in (0, 1, 1.5, -0.1, True, "0.75"):
        with pytest.raises(ValueError, match="hedge_quantile must be a number strictly between 0 and 1"):
            TransferPolicy(hedge_quantile=bad)  # type: ignore[arg-type]
    assert TransferPolicy.from_mb(16, 8, None).hedge_quantile is None


# ---------------------------------------------------------------------------- the Hedger on its own
class Answer:
    """A fake response whose release is recorded."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.released = False


def _learned(hedger: Hedger, seconds: float = 0.01) -> Hedger:
    for _ in range(hedger.min_samples):
        hedger.observe(seconds)
    return hedger


def _scripted(*steps: tuple[float, object]) -> Callable[[], asyncio.Future[Answer]]:
    """``make`` for Hedger.first: the i-th call waits ``steps[i][0]`` s, then returns or raises ``steps[i][1]``."""
    calls = iter(steps)

    async def one() -> Answer:
        delay, outcome = next(calls)
        await asyncio.sleep(delay)
        if isinstance(outcome, BaseException):
            raise outcome
        assert isinstance(outcome, Answer)
        return outcome

    return lambda: asyncio.ensure_future(one())


def _release(a: Answer) -> None:
    a.released = True


def test_hedger_waits_for_enough_samples_and_uses_its_quantile() -> None:
    h = Hedger(min_samples=4)
    assert h.delay_s(0.75) is None
    for s in (0.01, 0.02, 0.03, 0.04):
        h.observe(s)
    assert h.delay_s(0.75) == 0.04 and h.delay_s(0.5) == 0.03 and h.delay_s(None) is None
    assert Hedger(min_samples=1, floor_s=0.5).delay_s(0.5) is None
    h2 = Hedger(min_samples=1, floor_s=0.5)
    h2.observe(0.001)
    assert h2.delay_s(0.5) == 0.5  # never sooner than the floor


def test_hedger_keeps_the_first_answer_and_releases_the_other() -> None:
    slow, fast = Answer("slow"), Answer("fast")
    h = _learned(Hedger())
    got = asyncio.run(h.first(_scripted((0.5, slow), (0.0, fast)), quantile=0.75, release=_release))
    assert got is fast and h.backups == 1
    # the slow one was cancelled before it answered: nothing to release
    assert not slow.released and not fast.released


def test_hedger_releases_a_loser_that_answered_in_the_same_instant() -> None:
    a, b = Answer("a"), Answer("b")

    async def race() -> Answer:
        loop = asyncio.get_running_loop()
        answers = [loop.create_future(), loop.create_future()]
        requests = iter(answers)
        h = _learned(Hedger())
        task = asyncio.ensure_future(h.first(lambda: next(requests), quantile=0.75, release=_release))
        await asyncio.sleep(0.1)  # past the hedge delay: both requests are out
        answers[0].set_result(a)  # both answer in the same instant
        answers[1].set_result(b)
        return await task

    got = asyncio.run(race())
    other = b if got is a else a
    assert got in (a, b) and not got.released and other.released


def test_a_transient_failure_waits_for_the_backup_and_a_final_one_does_not() -> None:
    fast = Answer("backup")
    h = _learned(Hedger())
    got = asyncio.run(h.first(_scripted((0.03, ConnectionResetError("reset")), (0.05, fast)), quantile=0.75))
    assert got is fast
    with pytest.raises(FileNotFoundError):
        asyncio.run(_learned(Hedger()).first(
            _scripted((0.03, FileNotFoundError("no such key")), (1.0, Answer("late"))), quantile=0.75))
    with pytest.raises(ConnectionResetError):  # both failed transiently: the caller's retry decides
        asyncio.run(_learned(Hedger()).first(
            _scripted((0.03, ConnectionResetError("a")), (0.0, ConnectionResetError("b"))), quantile=0.75))


def test_an_unhedged_read_is_one_call() -> None:
    h = Hedger()
    calls: list[int] = []

    async def one() -> Answer:
        calls.append(1)
        await asyncio.sleep(0.05)
        return Answer("only")

    assert asyncio.run(h.first(one, quantile=0.75)).name == "only"  # no samples yet: no backup
    assert calls == [1] and h.backups == 0 and h.reads == 1


def test_a_cancelled_read_cancels_its_requests() -> None:
    started: list[asyncio.Task[Answer]] = []

    async def slow() -> Answer:
        await asyncio.sleep(30)
        return Answer("never")

    def make() -> asyncio.Task[Answer]:
        started.append(asyncio.ensure_future(slow()))
        return started[-1]

    async def caller(h: Hedger) -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(h.first(make, quantile=0.75), timeout=0.2)
        await asyncio.sleep(0.05)  # (asyncio.run would cancel leftovers itself when it ends)
        assert all(t.cancelled() for t in started)  # no request left running after the caller gave up

    # unhedged (no samples yet); cancelled while waiting for the hedge delay (5 s); with a backup out
    for hedger in (Hedger(), _learned(Hedger(), 5.0), _learned(Hedger())):
        started.clear()
        asyncio.run(caller(hedger))
        assert len(started) == (1 if hedger.backups == 0 else 2)


def test_a_transient_failure_pauses_backups() -> None:
    h = _learned(Hedger(quiet_s=0.3))
    assert h.delay_s(0.75) is not None
    with pytest.raises(ConnectionResetError):  # e.g. a 503 SlowDown: the store is shedding load
        asyncio.run(h.first(_scripted((0.0, ConnectionResetError("slow down"))), quantile=0.75))
    assert h.delay_s(0.75) is None  # no backups for a while: the caller's backoff alone retries
    slow, fast = Answer("slow"), Answer("fast")
    got = asyncio.run(h.first(_scripted((0.05, slow), (0.0, fast)), quantile=0.75))
    assert got is slow and h.backups == 0  # quiet: waited for the one request
    time.sleep(0.35)
    assert h.delay_s(0.75) is not None  # and back after quiet_s
    assert asyncio.run(h.first(_scripted((0.5, Answer("late")), (0.0, fast)), quantile=0.75)) is fast


def _pinned(**kw: Any) -> Hedger:
    """A Hedger whose quantile stays at 0.01 s through the reads below: 200 answer times of 0.01 s in a
    window of 1,000 (the reads' own answer times would otherwise move it)."""
    h = Hedger(window=1000, min_samples=16, **kw)
    for _ in range(200):
        h.observe(0.01)
    return h


def _reads(h: Hedger, n: int, backup_wins: Callable[[int], bool], slow_s: float = 0.3) -> None:
    """``n`` reads, each past the hedge delay; read i's backup answers first iff ``backup_wins(i)``."""
    for i in range(n):
        primary, backup = (slow_s, Answer("primary")), (0.0, Answer("backup"))
        if not backup_wins(i):
            primary, backup = (0.02, Answer("primary")), (0.3, Answer("backup"))
        asyncio.run(h.first(_scripted(primary, backup), quantile=0.75))


def test_backups_stay_within_their_budget_when_every_read_is_slow() -> None:
    """A store whose every read is past the quantile (answer times growing with load) gets at most
    ``budget`` backups per read, after the ``burst`` saved up, not one per read."""
    h = _pinned(budget=0.3, burst=2.0, min_win_rate=0.0)
    _reads(h, 30, lambda i: True, slow_s=0.1)
    assert h.reads == 30
    assert 0.3 * 30 <= h.backups <= 2 + 0.3 * 30  # the bucket binds: 9-11 of 30, not 30


def test_backups_pause_when_they_do_not_answer_first() -> None:
    h = _pinned(quiet_s=60.0, outcomes=16, min_win_rate=0.15)
    _reads(h, 30, lambda i: i % 10 == 0)  # 1 backup in 10 answers first: below 15%
    assert h.backups == 8 and h.wins == 1  # paused after half the window (8 outcomes, 1 win)
    assert h.delay_s(0.75) is None


def test_backups_that_answer_first_often_enough_go_on() -> None:
    """The presets' lognormal tail: a backup at the 0.75 quantile answers first ~29% of the time."""
    h = _pinned(outcomes=16, min_win_rate=0.15, burst=100.0)
    _reads(h, 40, lambda i: i % 4 == 0)  # 25%
    assert h.backups == 40 and h.wins == 10 and h.delay_s(0.75) is not None
