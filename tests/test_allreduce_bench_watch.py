"""``benchmarks/allreduce.py``: a replica process that dies (the kernel's OOM killer sends SIGKILL, no
traceback) ends the driver's wait at once with an error naming it, instead of the driver waiting 30
minutes for its result while the other replicas idle at a barrier (the int8 P = 256 MB "stall")."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from types import ModuleType, SimpleNamespace

import pytest

from support import import_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    # imported by name from its folder: the forkserver's replica processes import replica_main the same way
    return import_benchmark("allreduce")


def test_the_watch_ends_the_drivers_waits_when_a_replica_is_killed(bench: ModuleType) -> None:
    procs = [SimpleNamespace(pid=100, exitcode=None), SimpleNamespace(pid=101, exitcode=None)]
    barrier, results = threading.Barrier(2), queue.Queue()  # type: ignore[var-annotated]
    watch = bench.ReplicaWatch(procs, barrier, results, what="s3-standard, N=2", poll_s=0.01,
                               peak_rss_mb=2200.0).start()
    try:
        procs[1].exitcode = -9
        t0 = time.monotonic()
        with pytest.raises(bench.ReplicaDied) as err:
            watch.barrier_wait(30, "case 0 (256 MB int8 sharded)")
        assert time.monotonic() - t0 < 5
        text = str(err.value)
        assert "case 0 (256 MB int8 sharded)" in text and "replica rank 1 (pid 101) killed by SIGKILL" in text
        assert "OOM killer" in text and "dmesg" in text and "2,200 MB" in text and "rank 0" not in text
        with pytest.raises(bench.ReplicaDied):  # a wait for results ends too
            watch.get(30, "case 0")
    finally:
        watch.stop()


def test_a_replica_that_exits_with_an_error_is_named_without_the_oom_hint(bench: ModuleType) -> None:
    procs = [SimpleNamespace(pid=7, exitcode=1)]
    watch = bench.ReplicaWatch(procs, threading.Barrier(2), queue.Queue(), what="file, N=1")
    text = str(watch.error("case 3"))
    assert "replica rank 0 (pid 7) exit code 1" in text and "OOM" not in text


@pytest.mark.slow
def test_run_group_raises_promptly_when_a_replica_process_is_killed(bench: ModuleType, tmp_path: object) -> None:
    """The driver with real replica processes: one is SIGKILLed before its first barrier. The old driver
    waited at ``barrier.wait(timeout=1800)``; now ``run_group`` raises ReplicaDied within seconds and
    stops the surviving replica."""
    root = tmp_path / "store"  # type: ignore[operator]
    root.mkdir()
    before = {p.pid for p in multiprocessing.active_children()}
    outcome: dict[str, BaseException | None] = {}

    def drive() -> None:
        try:
            bench.run_group("file", 2, [bench.Case("file", 2, 1, "fp32", "sharded")], root.as_uri(), {}, None,
                            lambda run: None)
            outcome["error"] = None
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = e

    driver = threading.Thread(target=drive, daemon=True)  # the old code blocks for 30 minutes here
    driver.start()
    deadline = time.monotonic() + 60
    mine: list[multiprocessing.process.BaseProcess] = []
    while len(mine) < 2 and time.monotonic() < deadline:
        mine = [p for p in multiprocessing.active_children() if p.pid not in before]
        time.sleep(0.05)
    assert len(mine) == 2, "the driver did not start its two replica processes"
    victim = mine[0]
    victim.kill()
    driver.join(timeout=60)
    assert not driver.is_alive(), "run_group kept waiting for a dead replica"
    error = outcome["error"]
    assert isinstance(error, bench.ReplicaDied), error
    assert f"(pid {victim.pid}) killed by SIGKILL" in str(error)
    for p in mine:
        p.join(timeout=10)
        assert p.exitcode is not None, "the surviving replica was left running"
