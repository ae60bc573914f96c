"""LocalProcessExecutor: N replicas as local processes, each under a detached supervisor.

Design (why a supervisor): restarting a crashed replica needs a process that outlives the replica,
and ``diloco launch --detach`` must return while the run goes on. So each rank gets its own
supervisor process (``executors/_supervisor.py``) started in a **new session**: it survives the
launching CLI (and its Ctrl-C), it leads a process group holding the replica and everything the
replica spawns, it restarts the replica up to ``retries`` times with ``DILOCO_ATTEMPT`` incremented,
and it records its state in a JSON file next to the replica's log. Any process can then

* poll a replica: read the state file, check the supervisor PID (+ its start time, so a recycled
  PID is never taken for ours);
* cancel it: SIGTERM to the group and the recorded process tree (SIGKILL after a grace period);
* read its log: the file ``<run>/logs/rank-<r>.log`` for file stores, else a local cache folder.

All of that is in the handle (PIDs, paths, host), which the launcher records in ``run.json``.
Handles are only actionable on the host that launched them; elsewhere poll reports the state file.

Failure: a replica that exhausts its retries is ``failed`` with its last exit code; a supervisor that
disappears without recording a result (killed by hand, OOM) is ``failed`` with that reason.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from diloco_serverless.errors import ExecutorError
from diloco_serverless.executors._proc import (
    kill_tree,
    pid_alive,
    proc_start_time,
    read_json,
    tail_file,
    write_json_atomic,
)
from diloco_serverless.executors.base import (
    ReplicaHandle,
    ReplicaResult,
    ReplicaState,
    ReplicaStatus,
    check_replica_count,
    collect_by_polling,
    run_id_from_url,
    run_url_from,
)

SUPERVISOR_MODULE = "diloco_serverless.executors._supervisor"


def local_run_path(run_url: str | None) -> Path | None:
    """The local folder of a run URL on a file store (bare path or ``file://``), else None."""
    if not run_url:
        return None
    if run_url.startswith("file://"):
        return Path(run_url[len("file://") :]).resolve()
    if "://" in run_url:
        return None
    return Path(run_url).expanduser().resolve()


def default_log_dir(run_url: str | None) -> Path:
    """``<run>/logs`` for a file store, else ``$XDG_CACHE_HOME/diloco-serverless/<run_id>/logs``."""
    run_path = local_run_path(run_url)
    if run_path is not None:
        return run_path / "logs"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "diloco-serverless"
    run_id = run_id_from_url(run_url) or time.strftime("launch-%Y%m%d-%H%M%S-") + str(os.getpid())
    return cache / run_id / "logs"


class LocalProcessExecutor:
    """Run replicas as local processes, restart crashed ones, cancel by process tree.

    Args:
        retries: restarts allowed per replica after a non-zero exit (0 = never restart).
        log_dir: folder for ``rank-<r>.log`` and the supervisors' state files; default
            :func:`default_log_dir` of the run URL found in the entrypoint args or env.
        python: interpreter for supervisors and replicas (default: this one).
        restart_delay_s: pause before restarting a crashed replica.
        cancel_grace_s: time between SIGTERM and SIGKILL on cancel.
        poll_interval_s: how often ``collect`` polls.
    """

    kind = "local"

    def __init__(
        self,
        *,
        retries: int = 2,
        log_dir: str | Path | None = None,
        python: str | None = None,
        restart_delay_s: float = 1.0,
        cancel_grace_s: float = 10.0,
        poll_interval_s: float = 0.5,
    ) -> None:
        if retries < 0:
            raise ValueError(f"local executor: retries must be >= 0, got {retries}")
        self.retries = retries
        self.log_dir = Path(log_dir).expanduser().resolve() if log_dir is not None else None
        self.python = python or sys.executable
        self.restart_delay_s = restart_delay_s
        self.cancel_grace_s = cancel_grace_s
        self.poll_interval_s = poll_interval_s
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    @classmethod
    def from_handle(cls, handle: ReplicaHandle, **options: Any) -> LocalProcessExecutor:
        """An executor able to poll/cancel/read ``handle`` (everything needed is in the handle)."""
        return cls(**options)

    # --- launch -----------------------------------------------------------------------------
    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: str,
        entrypoint_args: Sequence[str],
        env: Mapping[str, str] | None = None,
    ) -> list[ReplicaHandle]:
        """Start one supervisor (and so one replica) per rank; returns once all are started.

        If starting rank k fails, the ranks already started are cancelled and ExecutorError is raised.
        """
        check_replica_count(n_replicas, self.kind)
        log_dir = self.log_dir or default_log_dir(run_url_from(env, entrypoint_args))
        log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [self.python, "-m", entrypoint, *map(str, entrypoint_args)]
        handles: list[ReplicaHandle] = []
        try:
            for rank in range(n_replicas):
                handles.append(self._launch_one(rank, cmd, log_dir, env or {}))
        except OSError as exc:
            self.cancel(handles)
            raise ExecutorError(f"local executor: could not start rank {len(handles)}: {exc}") from exc
        return handles

    def _launch_one(self, rank: int, cmd: list[str], log_dir: Path, env: Mapping[str, str]) -> ReplicaHandle:
        log_path = log_dir / f"rank-{rank}.log"
        state_path = log_dir / f"rank-{rank}.state.json"
        for stale in (state_path, _cancel_marker(state_path)):
            stale.unlink(missing_ok=True)
        sup_cmd = [
            self.python, "-m", SUPERVISOR_MODULE, "--rank", str(rank), "--retries", str(self.retries),
            "--restart-delay-s", str(self.restart_delay_s), "--log", str(log_path), "--state", str(state_path),
            "--", *cmd,
        ]
        child_env = {**os.environ, **{k: str(v) for k, v in env.items()}}
        child_env.update(REPLICA_RANK=str(rank), PYTHONUNBUFFERED="1")
        with open(log_path, "ab") as log_fh:
            proc = subprocess.Popen(
                sup_cmd, env=child_env, stdin=subprocess.DEVNULL, stdout=log_fh, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True,
            )
        self._children[proc.pid] = proc
        data = {
            "pid": proc.pid,
            "pgid": proc.pid,
            "start": proc_start_time(proc.pid),
            "host": socket.gethostname(),
            "log_path": str(log_path),
            "state_path": str(state_path),
            "retries": self.retries,
        }
        return ReplicaHandle(kind=self.kind, rank=rank, data=data)

    # --- observe ----------------------------------------------------------------------------
    def poll(self, handles: Sequence[ReplicaHandle]) -> list[ReplicaState]:
        """Read each supervisor's state file and check its PID; never blocks."""
        self._reap()
        return [self._state(h) for h in handles]

    def _state(self, handle: ReplicaHandle) -> ReplicaState:
        d = handle.data
        state_path = Path(d["state_path"])
        st = read_json(state_path) or {}
        status = st.get("status", "pending")
        detail = {"pid": d["pid"], "child_pid": st.get("child_pid"), "log_path": d["log_path"]}
        common: dict[str, Any] = dict(rank=handle.rank, attempt=int(st.get("attempt", 0)), detail=detail)
        if status in ("succeeded", "failed", "cancelled"):
            return ReplicaState(status=ReplicaStatus(status), reason=st.get("reason"),
                                exit_code=st.get("exit_code"), **common)
        if d.get("host") != socket.gethostname() or pid_alive(int(d["pid"]), d.get("start")):
            live = ReplicaStatus.RUNNING if status == "running" else ReplicaStatus.PENDING
            return ReplicaState(status=live, reason=st.get("reason"), exit_code=st.get("exit_code"), **common)
        if _cancel_marker(state_path).exists():
            return ReplicaState(status=ReplicaStatus.CANCELLED, reason="cancelled", **common)
        reason = (f"supervisor process {d['pid']} exited without recording a result while the replica was "
                  f"{status} (killed by hand or out of memory?); see {d['log_path']}")
        return ReplicaState(status=ReplicaStatus.FAILED, reason=reason, exit_code=st.get("exit_code"), **common)

    def collect(
        self, handles: Sequence[ReplicaHandle], timeout: float | timedelta | None = None
    ) -> list[ReplicaResult]:
        """Wait for every replica; raise ReplicaFailedError naming failed ranks with their log tails."""
        return collect_by_polling(self, handles, timeout, poll_interval_s=self.poll_interval_s)

    def logs(self, handle: ReplicaHandle, tail: int | None = 200) -> str:
        """The last ``tail`` lines of the replica's log file (all of it if None)."""
        return tail_file(Path(handle.data["log_path"]), tail)

    def follow_logs(self, handle: ReplicaHandle, poll_interval_s: float = 0.5) -> Iterator[str]:
        """Yield log lines as they are written, until the replica is terminal and the file is drained."""
        path = Path(handle.data["log_path"])
        pos = 0
        while True:
            done = self._state(handle).terminal
            try:
                with open(path, "rb") as fh:
                    fh.seek(pos)
                    chunk = fh.read()
            except FileNotFoundError:
                chunk = b""
            complete, _, _rest = chunk.rpartition(b"\n")
            if complete:
                pos += len(complete) + 1
                yield from complete.decode("utf-8", "replace").splitlines()
            if done and not complete:
                return
            if not complete:
                time.sleep(poll_interval_s)

    # --- cancel -----------------------------------------------------------------------------
    def cancel(self, handles: Sequence[ReplicaHandle]) -> None:
        """End every replica's process tree (SIGTERM, SIGKILL after ``cancel_grace_s``); idempotent."""
        here = socket.gethostname()
        foreign = [h.rank for h in handles if h.data.get("host") != here]
        if foreign:
            raise ExecutorError(
                f"local executor: rank(s) {foreign} run on host {handles[0].data.get('host')!r}, not {here!r}; "
                "cancel from that machine"
            )
        if not handles:
            return
        with ThreadPoolExecutor(max_workers=min(16, len(handles))) as pool:
            list(pool.map(self._cancel_one, handles))
        self._reap()

    def _cancel_one(self, handle: ReplicaHandle) -> None:
        d = handle.data
        state_path = Path(d["state_path"])
        st = read_json(state_path) or {}
        if st.get("status") in ("succeeded", "failed", "cancelled"):
            return
        _cancel_marker(state_path).touch()
        roots = [(int(d["pid"]), d.get("start"))]
        if st.get("child_pid"):
            roots.append((int(st["child_pid"]), st.get("child_start")))
        kill_tree(roots, int(d["pgid"]), self.cancel_grace_s)
        self._reap()
        st = read_json(state_path) or {}
        if st.get("status") not in ("succeeded", "failed", "cancelled"):
            write_json_atomic(state_path, {**st, "status": "cancelled", "reason": "cancelled", "child_pid": None,
                                           "time": time.time()})

    def _reap(self) -> None:
        for pid, proc in list(self._children.items()):
            if proc.poll() is not None:
                del self._children[pid]


def _cancel_marker(state_path: Path) -> Path:
    return state_path.with_name(state_path.name.replace(".state.json", ".cancel"))
