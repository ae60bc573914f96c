"""LocalProcessExecutor: real processes under detached supervisors (tests/support/fake_replica.py as replica)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from diloco_serverless.errors import ExecutorError
from diloco_serverless.executors import ReplicaStatus, _proc
from diloco_serverless.executors._proc import pid_alive, proc_start_time
from diloco_serverless.executors.base import (
    CollectTimeout,
    ReplicaFailedError,
    handle_from_json,
)
from diloco_serverless.executors.local import LocalProcessExecutor, default_log_dir, replica_paths
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


def test_setup_error_exit_code_2_is_not_retried(tmp_path: Path, env: dict[str, str]) -> None:
    """Finding 5: exit code 2 means the input is wrong (entrypoints/replica.py); restarting cannot help."""
    ex = _executor(tmp_path, retries=3)
    handles = ex.launch_replicas(1, FAKE, ["--exit-code", "2"], env=env)
    with pytest.raises(ReplicaFailedError) as info:
        ex.collect(handles, timeout=60)
    (result,) = info.value.results
    assert result.exit_code == 2 and result.attempt == 0
    assert "setup error, not retried" in (result.reason or "") and "rank 0 fails with boom" in (result.reason or "")
    log = ex.logs(handles[0], tail=None)
    assert log.count("fake replica rank=0") == 1 and "restarting in" not in log and "not restarting" in log


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
    # the log dir (chosen at launch here) comes from the caller, never from the handle
    other = executor_for_handle(other_handles[0], run_url=env["DILOCO_RUN_URL"], log_dir=tmp_path / "logs",
                                cancel_grace_s=2.0)
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


# --- run.json is writable by every replica credential: forged handles must not be acted on ---------

def _raised(action: Callable[[], object]) -> object:
    """The exception ``action`` raises, or what it returns."""
    try:
        return action()
    except Exception as exc:
        return exc


def _unrelated_sleep() -> subprocess.Popen[bytes]:
    """A process that is not ours to kill (own session, so a group signal cannot reach pytest)."""
    return subprocess.Popen(["sleep", "600"], start_new_session=True)


def _forged(pid: int, **data: object) -> dict[str, object]:
    return {"kind": "local", "rank": 0, "pid": pid, "pgid": pid, "host": socket.gethostname(), **data}


@pytest.mark.parametrize("case", ["start None", "start ok, cmdline differs", "start ok, its own cmdline"])
def test_cancel_never_signals_a_process_the_handle_cannot_identify(tmp_path: Path, case: str) -> None:
    """Finding 3: pid/pgid of an unrelated process with "start": null (or the right start time but a
    command line that is not the supervisor recorded at launch) is refused, naming the pid."""
    sleep = _unrelated_sleep()
    try:
        _wait_for(lambda: Path(f"/proc/{sleep.pid}/cmdline").read_bytes() == b"sleep\x00600\x00", 10)
        logs = tmp_path / "store" / "run-x" / "logs"
        logs.mkdir(parents=True)
        log_path, state_path = replica_paths(logs, 0)
        paths = {"log_path": str(log_path), "state_path": str(state_path)}
        start = None if case == "start None" else proc_start_time(sleep.pid)
        cmdline = ["sleep", "600"] if case == "start ok, its own cmdline" else ["python", "-m", "x"]
        record = _forged(sleep.pid, start=start, cmdline=cmdline, **paths)
        other = executor_for_handle(json.loads(json.dumps(record)), cancel_grace_s=0.5)
        error = _raised(lambda: other.cancel([handle_from_json(record)]))
        time.sleep(0.7)  # past the grace period: a SIGKILL would have landed
        assert sleep.poll() is None, "an unrelated process was signalled"
        assert not state_path.with_name("rank-0.cancel").exists() and not state_path.exists()
        assert isinstance(error, ExecutorError), error
        assert re.search(rf"pid {sleep.pid}\b.*refusing to signal it", str(error)) and "\n" not in str(error), error
    finally:
        sleep.kill()
        sleep.wait()


def test_logs_and_poll_refuse_a_forged_log_or_state_path(tmp_path: Path, env: dict[str, str]) -> None:
    """Finding 2: log_path=/etc/hostname is not printed; paths come from the run URL and the rank."""
    run_url = env["DILOCO_RUN_URL"]
    ex = LocalProcessExecutor(retries=0, poll_interval_s=0.05)  # default log dir: <run>/logs
    handles = ex.launch_replicas(1, FAKE, ["--run-url", run_url], env=env)
    ex.collect(handles, timeout=60)
    _wait_for(lambda: not pid_alive(handles[0].data["pid"]), 10)  # the supervisor exits after its last write
    record = handles[0].to_json()
    assert record["log_path"] == str(Path(run_url) / "logs" / "rank-0.log")
    forged = handle_from_json({**record, "log_path": "/etc/hostname"})
    secret = Path("/etc/hostname").read_text().strip() if Path("/etc/hostname").exists() else None

    # rebuilt as `diloco logs` does, from run.json alone: the supervisor is gone, so nothing can be checked
    error = _raised(lambda: executor_for_handle(forged).logs(forged))
    assert not isinstance(error, str), f"logs printed the forged log_path: {error!r}"
    assert isinstance(error, ExecutorError) and re.search("rank 0.*run URL is unknown", str(error)), error
    # rebuilt with the run URL: the path is checked against the derived one, naming the field
    other = executor_for_handle(forged, run_url=run_url)
    with pytest.raises(ExecutorError, match=r"log_path='/etc/hostname', not '.*/run-x/logs/rank-0\.log'") as info:
        other.logs(forged)
    assert secret is None or secret not in str(info.value)
    with pytest.raises(ExecutorError, match="log_path"):
        other.poll([forged])
    bad_state = handle_from_json({**record, "state_path": str(tmp_path / "victim.json")})
    with pytest.raises(ExecutorError, match="state_path="):
        other.poll([bad_state])
    # the genuine handle still works, with the run URL or through the launching executor
    assert "fake replica rank=0" in other.logs(handle_from_json(record))
    assert [s.status for s in other.poll([handle_from_json(record)])] == [ReplicaStatus.SUCCEEDED]


def test_cancel_refuses_a_forged_state_path_and_leaves_the_file(tmp_path: Path, env: dict[str, str]) -> None:
    """Finding 2: state_path pointing at another file makes cancel refuse; the file is not overwritten."""
    run_url = env["DILOCO_RUN_URL"]
    ex = LocalProcessExecutor(retries=0, poll_interval_s=0.05, cancel_grace_s=2.0)
    hb = tmp_path / "hb"
    handles = ex.launch_replicas(1, FAKE, ["--run-url", run_url, "--sleep-s", "600", "--heartbeat-dir", str(hb)],
                                 env=env)
    try:
        _wait_for(lambda: (hb / "rank-0.json").exists())
        victim = tmp_path / "victim.json"
        victim.write_text('{"keep": true}')
        forged = handle_from_json({**handles[0].to_json(), "state_path": str(victim)})
        error = _raised(lambda: executor_for_handle(forged).cancel([forged]))  # as `diloco cancel` does
        assert victim.read_text() == '{"keep": true}', "cancel overwrote the file a forged state_path named"
        assert ex.poll(handles)[0].status is ReplicaStatus.RUNNING
        state_error = r"state_path='.*victim\.json', not '.*rank-0\.state\.json'"
        assert isinstance(error, ExecutorError) and re.search(state_error, str(error)), error
        with pytest.raises(ExecutorError, match=state_error):
            executor_for_handle(forged, run_url=run_url).cancel([forged])
        assert victim.read_text() == '{"keep": true}'
    finally:
        ex.cancel(handles)
    assert ex.poll(handles)[0].status is ReplicaStatus.CANCELLED


def test_rebuilt_executor_derives_paths_from_the_run_and_cancels(tmp_path: Path, env: dict[str, str]) -> None:
    """The genuine handle, rebuilt without options: paths derived from the live supervisor's own
    (verified) command line; after it ends, from the run URL the caller passes."""
    run_url = env["DILOCO_RUN_URL"]
    ex = LocalProcessExecutor(retries=1, poll_interval_s=0.05)
    handles = ex.launch_replicas(2, FAKE, ["--run-url", run_url, "--sleep-s", "600"], env=env)
    try:
        records = json.loads(json.dumps([h.to_json() for h in handles]))
        assert records[0]["cmdline"][1:3] == ["-m", "diloco_serverless.executors._supervisor"]
        other_handles = [handle_from_json(r) for r in records]
        other = executor_for_handle(other_handles[0], cancel_grace_s=2.0)
        _wait_for(lambda: [s.status for s in other.poll(other_handles)] == [ReplicaStatus.RUNNING] * 2)
        other.cancel(other_handles)
        for h in handles:
            _wait_for(lambda hh=h: not pid_alive(hh.data["pid"]), 10)
    finally:
        ex.cancel(handles)
    with_url = executor_for_handle(other_handles[0], run_url=run_url)
    assert [s.status for s in with_url.poll(other_handles)] == [ReplicaStatus.CANCELLED] * 2
    other.cancel(other_handles)  # idempotent: nothing runs, nothing is touched


def _ignores_sigterm() -> subprocess.Popen[bytes]:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"1"  # the handler is installed
    return proc


def test_kill_tree_rechecks_identity_before_sigkill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 4: a PID collected before the grace period whose start time differs afterwards (a
    recycled PID: here the same process made to look new) is not SIGKILLed."""
    proc = _ignores_sigterm()
    try:
        start = _proc.proc_start_time(proc.pid)
        assert start is not None
        recycled = {"now": False}
        real_start_time, real_signal_tree = _proc.proc_start_time, _proc.signal_tree

        def start_time(pid: int) -> int | None:
            value = real_start_time(pid)
            return value + 1 if recycled["now"] and pid == proc.pid and value is not None else value

        def signal_tree(pgid: int, pids: object, sig: int) -> None:
            real_signal_tree(pgid, pids, sig)  # type: ignore[arg-type]
            if sig == signal.SIGTERM:
                recycled["now"] = True  # during the grace period, proc.pid "is another process" now

        monkeypatch.setattr(_proc, "proc_start_time", start_time)
        monkeypatch.setattr(_proc, "signal_tree", signal_tree)
        _proc.kill_tree([(proc.pid, start)], proc.pid, grace_s=0.3)
        time.sleep(0.2)
        assert proc.poll() is None, "a PID whose identity changed was SIGKILLed"
    finally:
        proc.kill()
        proc.wait()


def test_kill_tree_sigkills_what_ignores_sigterm_when_identity_holds() -> None:
    proc = _ignores_sigterm()
    try:
        _proc.kill_tree([(proc.pid, _proc.proc_start_time(proc.pid))], proc.pid, grace_s=0.3)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_supervisor_caught_exiting_is_gone_not_foreign(tmp_path: Path, env: dict[str, str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An exiting process loses its command line a moment before it becomes a zombie: a cancel or poll
    that looks in that moment sees a live pid with no command line. It must wait for the exit to show,
    not refuse the handle as tampered with (a flake of the test above, from before this wait)."""
    from diloco_serverless.executors import local

    ex = LocalProcessExecutor(retries=1, poll_interval_s=0.05)
    handles = ex.launch_replicas(1, FAKE, ["--run-url", env["DILOCO_RUN_URL"], "--sleep-s", "600"], env=env)
    try:
        pid = handles[0].data["pid"]
        looks = {"n": 0}
        real_same = local.same_process

        def exiting_same(p: int, start: int | None) -> bool:  # alive for three more looks, then gone
            if p != pid:
                return real_same(p, start)
            looks["n"] += 1
            return looks["n"] <= 3

        monkeypatch.setattr(local, "proc_cmdline", lambda p: None if p == pid else _proc.proc_cmdline(p))
        monkeypatch.setattr(local, "same_process", exiting_same)
        assert ex._live_supervisor(handles[0]) is None
        assert looks["n"] > 3
    finally:
        monkeypatch.undo()
        ex.cancel(handles)


def test_finding_6_the_supervisor_state_lives_outside_the_store(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A file store's run folder is writable by every replica credential: the state the executor reports
    from must not be there (a planted ``"status": "succeeded"`` was believed)."""
    import stat

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "private"))
    logs = tmp_path / "store" / "run-x" / "logs"
    log_path, state_path = replica_paths(logs, 0)
    assert log_path.parent == logs
    assert tmp_path / "store" not in state_path.parents and tmp_path / "private" in state_path.parents
    assert stat.S_IMODE(state_path.parent.stat().st_mode) == 0o700
