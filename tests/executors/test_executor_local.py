"""LocalProcessExecutor: real processes under detached supervisors (tests/support/fake_replica.py as replica)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from diloco_serverless.executors import ReplicaStatus
from diloco_serverless.executors._proc import pid_alive
from diloco_serverless.executors.base import (
    CollectTimeout,
    ReplicaFailedError,
    handle_from_json,
)
from diloco_serverless.executors.local import LocalProcessExecutor, default_log_dir
from diloco_serverless.executors.registry import executor_for_handle, get_executor
from support import FAKE_REPLICA, pythonpath_env

pytestmark = pytest.mark.slow

FAKE = FAKE_REPLICA


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    path = pythonpath_env()
    return {"PYTHONPATH": path, "DILOCO_RUN_URL": str(tmp_path / "store" / "run-x")}


def _executor(tmp_path: Path, **kw: object) -> LocalProcessExecutor:
    kw.setdefault("restart_delay_s", 0.05)
    kw.setdefault("poll_interval_s", 0.05)
    kw.setdefault("cancel_grace_s", 2.0)
    return LocalProcessExecutor(log_dir=tmp_path / "logs", **kw)  # type: ignore[arg-type]


def _wait_for(pred, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_launch_poll_collect_success(tmp_path: Path, env: dict[str, str]) -> None:
    ex = _executor(tmp_path, retries=0)
    handles = ex.launch_replicas(3, FAKE, ["--sleep-s", "0.2"], env=env)
    assert [h.rank for h in handles] == [0, 1, 2]
    assert all(s.status in (ReplicaStatus.PENDING, ReplicaStatus.RUNNING, ReplicaStatus.SUCCEEDED)
               for s in ex.poll(handles))
    results = ex.collect(handles, timeout=60)
    assert [r.status for r in results] == [ReplicaStatus.SUCCEEDED] * 3
    assert all(r.exit_code == 0 for r in results)
    for rank in range(3):
        log = ex.logs(handles[rank])
        assert f"fake replica rank={rank} attempt=0" in log
        assert f"env DILOCO_RUN_URL={env['DILOCO_RUN_URL']}" in log


def test_failure_names_rank_exit_code_and_log_tail(tmp_path: Path, env: dict[str, str]) -> None:
    ex = _executor(tmp_path, retries=0)
    handles = ex.launch_replicas(2, FAKE, ["--exit-code", "7", "--fail-rank", "1"], env=env)
    with pytest.raises(ReplicaFailedError) as info:
        ex.collect(handles, timeout=60)
    msg = str(info.value)
    assert "rank(s) 1" in msg and "exit code 7" in msg
    assert "rank 1 fails with boom (exit 7)" in msg  # the log tail
    assert [r.ok for r in info.value.results] == [True, False]
    assert info.value.failed[0].rank == 1


def test_crashing_replica_is_restarted_with_incremented_attempt(tmp_path: Path, env: dict[str, str]) -> None:
    ex = _executor(tmp_path, retries=2)
    hb = tmp_path / "hb"
    handles = ex.launch_replicas(2, FAKE, ["--crash-attempts", "2", "--heartbeat-dir", str(hb)], env=env)
    results = ex.collect(handles, timeout=60)
    assert all(r.ok for r in results)
    assert [r.attempt for r in results] == [2, 2]
    assert json.loads((hb / "rank-0.json").read_text())["attempt"] == 2
    log = ex.logs(handles[0], tail=None)
    assert "attempt=0" in log and "attempt=1" in log and "attempt=2" in log
    assert "restarting" in log


def test_retries_exhausted_fails(tmp_path: Path, env: dict[str, str]) -> None:
    ex = _executor(tmp_path, retries=1)
    handles = ex.launch_replicas(1, FAKE, ["--crash-attempts", "5"], env=env)
    with pytest.raises(ReplicaFailedError, match="exit code 3"):
        ex.collect(handles, timeout=60)
    assert ex.poll(handles)[0].attempt == 1


def test_killed_replica_is_restarted(tmp_path: Path, env: dict[str, str]) -> None:
    ex = _executor(tmp_path, retries=1)
    hb = tmp_path / "hb"
    handles = ex.launch_replicas(1, FAKE, ["--sleep-s", "0.5", "--heartbeat-dir", str(hb)], env=env)
    _wait_for(lambda: (hb / "rank-0.json").exists())
    first = json.loads((hb / "rank-0.json").read_text())
    os.kill(first["pid"], 9)
    results = ex.collect(handles, timeout=60)
    assert results[0].ok and results[0].attempt == 1
    assert "killed by signal SIGKILL" in ex.logs(handles[0], tail=None)


def test_cancel_from_another_executor_kills_the_tree(tmp_path: Path, env: dict[str, str]) -> None:
    ex = _executor(tmp_path, retries=3)
    hb = tmp_path / "hb"
    handles = ex.launch_replicas(2, FAKE, ["--sleep-s", "600", "--spawn-child", "--heartbeat-dir", str(hb)], env=env)
    _wait_for(lambda: all((hb / f"rank-{r}.json").exists() for r in range(2)))
    beats = [json.loads((hb / f"rank-{r}.json").read_text()) for r in range(2)]
    records = json.loads(json.dumps([h.to_json() for h in handles]))  # as stored in run.json

    other_handles = [handle_from_json(r) for r in records]
    other = executor_for_handle(other_handles[0], cancel_grace_s=2.0)
    assert isinstance(other, LocalProcessExecutor)
    assert [s.status for s in other.poll(other_handles)] == [ReplicaStatus.RUNNING] * 2
    other.cancel(other_handles)

    for beat in beats:
        _wait_for(lambda b=beat: not pid_alive(b["pid"]) and not pid_alive(b["child_pid"]), 10)
    for h in handles:
        _wait_for(lambda hh=h: not pid_alive(hh.data["pid"]), 10)
    assert [s.status for s in other.poll(other_handles)] == [ReplicaStatus.CANCELLED] * 2
    assert [s.status for s in ex.poll(handles)] == [ReplicaStatus.CANCELLED] * 2
    with pytest.raises(ReplicaFailedError, match="cancelled"):
        ex.collect(handles, timeout=10)
    other.cancel(other_handles)  # idempotent


def test_collect_timeout_names_running_ranks(tmp_path: Path, env: dict[str, str]) -> None:
    ex = _executor(tmp_path, retries=0)
    handles = ex.launch_replicas(1, FAKE, ["--sleep-s", "600"], env=env)
    try:
        with pytest.raises(CollectTimeout) as info:
            ex.collect(handles, timeout=0.3)
        assert info.value.pending_ranks == [0]
        assert ex.poll(handles)[0].status in (ReplicaStatus.PENDING, ReplicaStatus.RUNNING)
    finally:
        ex.cancel(handles)


def test_handle_json_round_trip_and_factory(tmp_path: Path) -> None:
    ex = get_executor("local", retries=1, log_dir=tmp_path)
    assert isinstance(ex, LocalProcessExecutor) and ex.retries == 1
    with pytest.raises(ValueError, match="unknown executor 'slurm'.*hf-jobs, local, modal"):
        get_executor("slurm")
    with pytest.raises(ValueError, match="n_replicas"):
        ex.launch_replicas(0, FAKE, [])
    h = handle_from_json('{"kind": "local", "rank": 3, "pid": 1, "log_path": "x"}')
    assert h.rank == 3 and h.to_json() == {"kind": "local", "rank": 3, "pid": 1, "log_path": "x"}
    assert handle_from_json(h.to_json()) == h


def test_default_log_dir(tmp_path: Path) -> None:
    assert default_log_dir(str(tmp_path / "runs" / "r1")) == tmp_path / "runs" / "r1" / "logs"
    assert default_log_dir(f"file://{tmp_path}/runs/r1") == tmp_path / "runs" / "r1" / "logs"
    remote = default_log_dir("s3://bucket/runs/r2")
    assert remote.parts[-2:] == ("r2", "logs") and "diloco-serverless" in remote.parts


def test_supervisor_killed_is_reported_failed(tmp_path: Path, env: dict[str, str]) -> None:
    ex = _executor(tmp_path, retries=0)
    hb = tmp_path / "hb"
    handles = ex.launch_replicas(1, FAKE, ["--sleep-s", "600", "--heartbeat-dir", str(hb)], env=env)
    _wait_for(lambda: (hb / "rank-0.json").exists())
    os.kill(handles[0].data["pid"], 9)
    _wait_for(lambda: ex.poll(handles)[0].terminal, 10)
    state = ex.poll(handles)[0]
    assert state.status is ReplicaStatus.FAILED and "supervisor process" in (state.reason or "")
    os.kill(json.loads((hb / "rank-0.json").read_text())["pid"], 9)  # the orphaned replica


def test_follow_logs_streams_until_the_replica_ends(tmp_path: Path, env: dict[str, str]) -> None:
    ex = _executor(tmp_path, retries=0)
    handles = ex.launch_replicas(1, FAKE, ["--sleep-s", "0.3"], env=env)
    lines = list(ex.follow_logs(handles[0], poll_interval_s=0.05))
    assert any("fake replica rank=0" in ln for ln in lines)
    assert any("rank 0 done" in ln for ln in lines)
    assert ex.poll(handles)[0].status is ReplicaStatus.SUCCEEDED
