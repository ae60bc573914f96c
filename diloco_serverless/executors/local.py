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

The handle (PIDs, start time, the supervisor's command line, paths, host) is recorded in ``run.json``,
which every replica credential can rewrite, so nothing in it is taken on trust:

* the log and state paths are derived from the run URL and the rank by the rule ``launch_replicas``
  uses (:func:`default_log_dir`, or the ``log_dir`` option); a handle naming other paths is refused;
* a process is signalled only when its PID, its start time *and* its command line (``/proc``) match
  the handle, and that command line is the supervisor of this rank writing this run's state file.

Handles are only actionable on the host that launched them; elsewhere poll reports the state file.

Failure: a replica that exhausts its retries is ``failed`` with its last exit code; a supervisor that
disappears without recording a result (killed by hand, OOM) is ``failed`` with that reason.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

from diloco_serverless.errors import ExecutorError
from diloco_serverless.executors._proc import (
    kill_tree,
    open_no_follow,
    pid_alive,
    proc_cmdline,
    proc_start_time,
    read_json,
    same_process,
    tail_file,
    write_json_atomic,
)
from diloco_serverless.executors.base import (
    ReplicaHandle,
    ReplicaResult,
    ReplicaState,
    ReplicaStatus,
    collect_by_polling,
    ranks_to_start,
    run_id_from_url,
    run_url_from,
)
from diloco_serverless.executors.user_code import UserModule

SUPERVISOR_MODULE = "diloco_serverless.executors._supervisor"
#: How long a supervisor with no command line may still look alive before it counts as foreign: an
#: exiting process's ``/proc/<pid>/cmdline`` is empty for a moment before it becomes a zombie.
_EXIT_SETTLE_S = 1.0


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
            :func:`default_log_dir` of the run URL found in the entrypoint args or env. A run launched
            with another ``log_dir`` is followed by passing the same ``log_dir`` to
            ``executor_for_handle``: handles naming other paths are refused.
        python: interpreter for supervisors and replicas (default: this one).
        restart_delay_s: pause before restarting a crashed replica.
        cancel_grace_s: time between SIGTERM and SIGKILL on cancel.
        poll_interval_s: how often ``collect`` polls.
        devices_per_replica: run each replica as this many local CPU processes (sets the run's
            ``parallel.devices``; the replica's batch and exchange are split over them). Default: the
            config's ``parallel.devices``.
        attempt_timeout_s: rehearse a platform's time cap (``-x attempt_timeout_s=S``): every attempt of
            a replica gets ``DILOCO_ATTEMPT_TIMEOUT_S=S``, stops before it at a round boundary with its
            state saved (exit code 75) and the supervisor starts the next attempt at once, without
            using a retry. Nothing kills a replica at S; None (default): no deadline.
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
        devices_per_replica: int | str | None = None,
        attempt_timeout_s: float | None = None,
    ) -> None:
        if retries < 0:
            raise ValueError(f"local executor: retries must be >= 0, got {retries}")
        if devices_per_replica is not None:
            text = str(devices_per_replica).strip()
            if not text.isdigit() or not 1 <= int(text) <= 64:
                raise ValueError("local executor: devices_per_replica must be an integer in 1..64 (local processes "
                                 f"per replica), got {devices_per_replica!r}")
            devices_per_replica = int(text)
        self.devices_per_replica: int | None = devices_per_replica
        if attempt_timeout_s is not None and (
            isinstance(attempt_timeout_s, bool) or not isinstance(attempt_timeout_s, (int, float))
            or not 0 < attempt_timeout_s < float("inf")
        ):
            raise ValueError(f"local executor: attempt_timeout_s must be a number of seconds above 0 (or None for "
                             f"no deadline), got {attempt_timeout_s!r}")
        self.attempt_timeout_s = None if attempt_timeout_s is None else float(attempt_timeout_s)
        self.retries = retries
        self.log_dir = Path(log_dir).expanduser().resolve() if log_dir is not None else None
        self.python = python or sys.executable
        self.restart_delay_s = restart_delay_s
        self.cancel_grace_s = cancel_grace_s
        self.poll_interval_s = poll_interval_s
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        #: (rank, supervisor pid) -> (log dir, run URL) of the replicas this object launched
        self._launched: dict[tuple[int, int], tuple[Path, str | None]] = {}
        #: the run the handles belong to, when rebuilt by :meth:`from_handle` (trusted: the caller's)
        self._run_url: str | None = None
        #: the user's modules the replicas import (:meth:`set_user_modules`)
        self.user_modules: tuple[UserModule, ...] = ()

    @classmethod
    def from_handle(
        cls, handle: ReplicaHandle, *, run_url: str | None = None, **options: Any
    ) -> LocalProcessExecutor:
        """An executor able to poll/cancel/read the handles of the run at ``run_url``.

        The handle's paths are checked against those derived from ``run_url`` (or ``log_dir``)
        and its processes against ``/proc``. Without ``run_url``, paths can only be derived for a
        replica whose supervisor still runs (from its verified command line).
        """
        ex = cls(**options)
        ex._run_url = run_url
        return ex

    @property
    def attempt_cap_s(self) -> float | None:
        """The rehearsal cap ``attempt_timeout_s`` (None: attempts have no deadline)."""
        return self.attempt_timeout_s

    # --- launch -----------------------------------------------------------------------------
    def set_user_modules(self, modules: Sequence[UserModule]) -> None:
        """The user's own modules the replicas import (``rl.reward_funcs``): replicas run on this machine,
        so nothing is copied; the folders holding them go first on the replicas' ``PYTHONPATH`` (a module
        found beside a launch script or on this process's ``sys.path`` imports in the replica as well)."""
        self.user_modules = tuple(modules)

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: str,
        entrypoint_args: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        ranks: Sequence[int] | None = None,
    ) -> list[ReplicaHandle]:
        """Start one supervisor (and so one replica) per rank (every rank, or only ``ranks``); returns
        once all are started.

        If starting rank k fails, the ranks already started are cancelled and ExecutorError is raised.
        """
        chosen = ranks_to_start(n_replicas, ranks, self.kind)
        run_url = run_url_from(env, entrypoint_args)
        log_dir = self.log_dir or default_log_dir(run_url)
        log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [self.python, "-m", entrypoint, *map(str, entrypoint_args)]
        handles: list[ReplicaHandle] = []
        try:
            for rank in chosen:
                handles.append(self._launch_one(rank, cmd, log_dir, run_url, env or {}))
        except OSError as exc:
            self.cancel(handles)
            raise ExecutorError(f"local executor: could not start rank {chosen[len(handles)]}: {exc}") from exc
        return handles

    def _launch_one(
        self, rank: int, cmd: list[str], log_dir: Path, run_url: str | None, env: Mapping[str, str]
    ) -> ReplicaHandle:
        log_path, state_path = replica_paths(log_dir, rank)
        for stale in (state_path, _cancel_marker(state_path)):
            stale.unlink(missing_ok=True)
        sup_cmd = [
            self.python, "-m", SUPERVISOR_MODULE, "--rank", str(rank), "--retries", str(self.retries),
            "--restart-delay-s", str(self.restart_delay_s), "--log", str(log_path), "--state", str(state_path),
            *(["--attempt-timeout-s", repr(self.attempt_timeout_s)] if self.attempt_timeout_s is not None else []),
            "--", *cmd,
        ]
        child_env = {**os.environ, **{k: str(v) for k, v in env.items()}}
        child_env.update(REPLICA_RANK=str(rank), PYTHONUNBUFFERED="1")
        roots = list(dict.fromkeys(str(m.root) for m in self.user_modules))
        if roots:
            child_env["PYTHONPATH"] = os.pathsep.join([*roots, *filter(None, [child_env.get("PYTHONPATH")])])
        if log_dir.is_symlink():  # a link planted as a file store's <run>/logs is never written through
            raise OSError(f"{log_dir} is a symbolic link; remove it (logs are never written through links)")
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "ab") as log_fh:
            proc = subprocess.Popen(
                sup_cmd, env=child_env, stdin=subprocess.DEVNULL, stdout=log_fh, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True,
            )
        self._children[proc.pid] = proc
        self._launched[(rank, proc.pid)] = (log_dir, run_url)
        data = {
            "pid": proc.pid,
            "pgid": proc.pid,
            "start": proc_start_time(proc.pid),
            "cmdline": sup_cmd,  # Popen returns after exec: /proc/<pid>/cmdline is this now
            "host": socket.gethostname(),
            "log_path": str(log_path),
            "state_path": str(state_path),
            "retries": self.retries,
        }
        return ReplicaHandle(kind=self.kind, rank=rank, data=data)

    # --- checking a handle (run.json is writable by every replica: nothing in it is trusted) -------
    def _trusted_origin(self, handle: ReplicaHandle) -> tuple[Path | None, str | None]:
        """(log dir, run URL) of ``handle``'s run from what this process knows, not from the handle."""
        launched = self._launched.get((handle.rank, _as_int(handle.data.get("pid")) or 0))
        if launched is not None:
            return self.log_dir or launched[0], launched[1]
        if self.log_dir is not None:
            return self.log_dir, self._run_url
        if self._run_url is not None:
            return default_log_dir(self._run_url), self._run_url
        return None, None

    def _checked_paths(self, handle: ReplicaHandle, live: _Supervisor | None = None) -> tuple[Path, Path]:
        """The log and state paths of ``handle``'s rank, derived from its run; ExecutorError naming
        the field when the handle records other ones."""
        log_dir, _ = self._trusted_origin(handle)
        if log_dir is None:
            if live is None and _on_this_host(handle):
                live = self._live_supervisor(handle)
            if live is None or live.run_url is None:
                raise ExecutorError(
                    f"local executor: cannot check the log and state paths of rank {handle.rank}: the run URL is "
                    "unknown here and its supervisor is not running; rebuild the executor with "
                    "executor_for_handle(handle, run_url=RUN_URL)"
                )
            log_dir = default_log_dir(live.run_url)
        log_path, state_path = replica_paths(log_dir, handle.rank)
        for name, want in (("log_path", log_path), ("state_path", state_path)):
            got = handle.data.get(name)
            if got != str(want):
                raise ExecutorError(
                    f"local executor: rank {handle.rank}'s handle has {name}={got!r}, not {str(want)!r} as derived "
                    "from the run; refusing it (run.json may have been tampered with); pass log_dir= if the run "
                    "was launched with one"
                )
        return log_path, state_path

    def _live_supervisor(self, handle: ReplicaHandle) -> _Supervisor | None:
        """The running supervisor of ``handle``, identified by PID, start time and command line;
        None when it is gone. ExecutorError naming the pid when the handle cannot be verified."""
        d, rank = handle.data, handle.rank
        pid, start = _as_int(d.get("pid")), d.get("start")
        if pid is None or pid <= 0:
            raise ExecutorError(f"local executor: rank {rank}'s handle has no valid pid ({d.get('pid')!r}); "
                                "refusing it (run.json may have been tampered with)")
        if not isinstance(start, int) or isinstance(start, bool):
            raise ExecutorError(
                f"local executor: rank {rank}'s handle records no start time for pid {pid}, so the pid may name "
                "another process now; refusing to signal it (stop the replica by hand if it is yours)"
            )
        if not same_process(pid, start):
            return None
        argv, recorded = proc_cmdline(pid), d.get("cmdline")
        settle = time.monotonic() + _EXIT_SETTLE_S
        while argv is None and same_process(pid, start) and time.monotonic() < settle:
            time.sleep(0.01)  # an exiting process drops its command line a moment before it is a zombie
            argv = proc_cmdline(pid)
        if argv is None and not same_process(pid, start):
            return None  # it ended between the reads
        parsed = _parse_supervisor_argv(argv) if argv is not None and argv == recorded else None
        if parsed is None or parsed[0] != str(rank):
            seen = "none" if argv is None else " ".join(argv[:4])
            raise ExecutorError(
                f"local executor: pid {pid} is not the supervisor of rank {rank} recorded at launch (its command "
                f"line differs: {seen} ...); refusing to signal it (run.json may have been tampered with)"
            )
        _, log, state, replica_cmd = parsed
        return _Supervisor(pid, start, Path(log), Path(state), run_url_from(None, replica_cmd[3:]), replica_cmd)

    # --- observe ----------------------------------------------------------------------------
    def poll(self, handles: Sequence[ReplicaHandle]) -> list[ReplicaState]:
        """Read each supervisor's state file and check its PID; never blocks."""
        self._reap()
        return [self._state(h) for h in handles]

    def _state(self, handle: ReplicaHandle) -> ReplicaState:
        return self._state_at(handle, *self._checked_paths(handle))

    def _state_at(self, handle: ReplicaHandle, log_path: Path, state_path: Path) -> ReplicaState:
        d = handle.data
        st = read_json(state_path) or {}
        status = st.get("status", "pending")
        detail = {"pid": d.get("pid"), "child_pid": st.get("child_pid"), "log_path": str(log_path)}
        common: dict[str, Any] = dict(rank=handle.rank, attempt=int(st.get("attempt", 0)), detail=detail)
        if status in ("succeeded", "failed", "cancelled"):
            return ReplicaState(status=ReplicaStatus(status), reason=st.get("reason"),
                                exit_code=st.get("exit_code"), **common)
        if not _on_this_host(handle) or _supervisor_runs(handle):
            live = ReplicaStatus.RUNNING if status == "running" else ReplicaStatus.PENDING
            return ReplicaState(status=live, reason=st.get("reason"), exit_code=st.get("exit_code"), **common)
        if _cancel_marker(state_path).exists():
            return ReplicaState(status=ReplicaStatus.CANCELLED, reason="cancelled", **common)
        reason = (f"supervisor process {d['pid']} exited without recording a result while the replica was "
                  f"{status} (killed by hand or out of memory?); see {log_path}")
        return ReplicaState(status=ReplicaStatus.FAILED, reason=reason, exit_code=st.get("exit_code"), **common)

    def collect(
        self, handles: Sequence[ReplicaHandle], timeout: float | timedelta | None = None
    ) -> list[ReplicaResult]:
        """Wait for every replica; raise ReplicaFailedError naming failed ranks with their log tails."""
        return collect_by_polling(self, handles, timeout, poll_interval_s=self.poll_interval_s)

    def logs(self, handle: ReplicaHandle, tail: int | None = 200) -> str:
        """The last ``tail`` lines of the replica's log file (all of it if None)."""
        log_path, _ = self._checked_paths(handle)
        return tail_file(log_path, tail)

    def follow_logs(self, handle: ReplicaHandle, poll_interval_s: float = 0.5) -> Iterator[str]:
        """Yield log lines as they are written, until the replica is terminal and the file is drained."""
        path, state_path = self._checked_paths(handle)  # checked once: the supervisor may exit meanwhile
        pos = 0
        while True:
            done = self._state_at(handle, path, state_path).terminal
            try:
                with open_no_follow(path) as fh:
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
        """End every replica's process tree (SIGTERM, SIGKILL after ``cancel_grace_s``); idempotent.

        Only processes identified by PID, start time and command line are signalled; a rank whose
        handle does not check out is left alone and named in the ExecutorError raised at the end.
        """
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
            errors = [e for e in pool.map(self._try_cancel_one, handles) if e]
        self._reap()
        if errors:
            raise ExecutorError("local executor: could not cancel " + "; ".join(errors))

    def _try_cancel_one(self, handle: ReplicaHandle) -> str | None:
        try:
            self._cancel_one(handle)
        except ExecutorError as exc:
            return f"rank {handle.rank}: {str(exc).removeprefix('local executor: ')}"
        return None

    def _cancel_one(self, handle: ReplicaHandle) -> None:
        live = self._live_supervisor(handle)
        log_dir, run_url = self._trusted_origin(handle)
        if live is None and log_dir is None:
            return  # nothing of it runs, and without the run URL no path can be checked: touch nothing
        log_path, state_path = self._checked_paths(handle, live)
        if live is not None and (live.log_path, live.state_path) != (log_path, state_path):
            raise ExecutorError(
                f"local executor: pid {live.pid} supervises {live.state_path}, not rank {handle.rank}'s "
                f"{state_path} of this run; refusing to signal it (run.json may have been tampered with)"
            )
        st = read_json(state_path) or {}
        if st.get("status") in ("succeeded", "failed", "cancelled"):
            return
        _cancel_marker(state_path).touch()
        if live is not None:
            kill_tree([(live.pid, live.start)], live.pid, self.cancel_grace_s)
        else:
            orphan = _orphan_replica(handle, st, run_url)
            if orphan is not None:
                kill_tree([orphan], int(handle.data["pid"]), self.cancel_grace_s)
        self._reap()
        st = read_json(state_path) or {}
        if st.get("status") not in ("succeeded", "failed", "cancelled"):
            write_json_atomic(state_path, {**st, "status": "cancelled", "reason": "cancelled", "child_pid": None,
                                           "time": time.time()})

    def _reap(self) -> None:
        # cancel() reaps from one thread per replica: another thread may have removed ``pid`` already
        for pid, proc in list(self._children.items()):
            if proc.poll() is not None:
                self._children.pop(pid, None)


def _cancel_marker(state_path: Path) -> Path:
    return state_path.with_name(state_path.name.replace(".state.json", ".cancel"))


def replica_paths(log_dir: Path, rank: int) -> tuple[Path, Path]:
    """``(log, state)`` file of ``rank``: the log in ``log_dir``, the supervisor's state file in
    :func:`state_dir` (outside the store, even when ``log_dir`` is a file store's ``<run>/logs``: what the
    executor reports comes from this machine only). Where launch creates them, and the only paths a
    handle of that rank may name."""
    return log_dir / f"rank-{rank}.log", state_dir(log_dir) / f"rank-{rank}.state.json"


def state_dir(log_dir: Path) -> Path:
    """This user's private folder (0700) for the supervisors' state files of the replicas logging to
    ``log_dir``: ``$XDG_STATE_HOME/diloco-serverless/local/<hash of log_dir>`` (``~/.local/state/...``)."""
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    digest = hashlib.sha256(str(Path(log_dir).absolute()).encode("utf-8")).hexdigest()[:16]
    folder = base / "diloco-serverless" / "local" / digest
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


class _Supervisor(NamedTuple):
    """A running supervisor, identified by PID + start time + command line (from ``/proc``)."""

    pid: int
    start: int
    log_path: Path
    state_path: Path
    run_url: str | None
    replica_cmd: list[str]


def _parse_supervisor_argv(argv: Sequence[str]) -> tuple[str, str, str, list[str]] | None:
    """``(rank, log, state, replica command)`` of a supervisor command line as ``_launch_one``
    builds it (``python -m <SUPERVISOR_MODULE> --opt value ... -- <replica command>``), else None."""
    if len(argv) < 3 or list(argv[1:3]) != ["-m", SUPERVISOR_MODULE] or "--" not in argv:
        return None
    split = list(argv).index("--")
    opts, replica_cmd = list(argv[3:split]), list(argv[split + 1 :])
    if len(opts) % 2 or len(replica_cmd) < 3 or replica_cmd[1] != "-m":
        return None
    values = dict(zip(opts[::2], opts[1::2]))
    if not all(isinstance(values.get(k), str) for k in ("--rank", "--log", "--state")):
        return None
    return values["--rank"], values["--log"], values["--state"], replica_cmd


def _orphan_replica(handle: ReplicaHandle, state: Mapping[str, Any], run_url: str | None) -> tuple[int, int] | None:
    """``(pid, start)`` of the replica a vanished supervisor left running, if it is verifiably this
    run's: same start time as recorded, the command line recorded at launch, naming ``run_url``."""
    pid, start = _as_int(state.get("child_pid")), state.get("child_start")
    recorded = _parse_supervisor_argv(handle.data.get("cmdline") or [])
    if pid is None or not isinstance(start, int) or recorded is None or run_url is None:
        return None
    replica_cmd = recorded[3]
    if run_url_from(None, replica_cmd[3:]) != run_url or not same_process(pid, start):
        return None
    return (pid, start) if proc_cmdline(pid) == replica_cmd else None


def _supervisor_runs(handle: ReplicaHandle) -> bool:
    """Whether the handle's supervisor runs (PID + start time; a bare PID where no start is known)."""
    pid, start = _as_int(handle.data.get("pid")), handle.data.get("start")
    if pid is None:
        return False
    return same_process(pid, start) if isinstance(start, int) else pid_alive(pid)


def _on_this_host(handle: ReplicaHandle) -> bool:
    return handle.data.get("host") == socket.gethostname()


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
