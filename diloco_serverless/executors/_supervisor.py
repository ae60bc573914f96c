"""Per-replica supervisor of the local executor: run a replica, restart it when it crashes.

    python -m diloco_serverless.executors._supervisor --rank R --retries K --log FILE --state FILE \
        [--restart-delay-s S] [--attempt-timeout-s T] -- python -m diloco_serverless.entrypoints.replica ...

The local executor starts one supervisor per rank in a new session (so it survives the launching
CLI and owns a process group: the supervisor, the replica and anything the replica spawns). The
supervisor appends the replica's stdout/stderr to ``--log`` and keeps ``--state`` (JSON, atomically
replaced) current: ``{"status", "attempt", "child_pid", "child_start", "exit_code", "reason", ...}``.
Any process can therefore poll a replica by reading the state file and checking the supervisor's
PID, and cancel it by signalling the process group (see ``local.py``).

A replica that exits non-zero (including one killed by a signal, e.g. an OOM kill or ``kill -9``) is
restarted with ``DILOCO_ATTEMPT`` incremented, up to ``--retries`` times, like a preempted cloud
replica; it heals from the store's latest checkpoint. Exit code 2 (a setup error: bad run.json,
rank outside the run, unreachable store; see entrypoints/replica.py) is not retried: the state
becomes ``failed`` at once, with the replica's ``error: ...`` line as the reason. SIGTERM to the
supervisor means "cancel": the replica is not restarted and the state becomes ``cancelled``.

Exit code 75 (``CONTINUE_EXIT_CODE``: the replica stopped before its attempt's deadline with its
state saved) starts the next attempt at once, with ``DILOCO_ATTEMPT`` incremented, and uses no retry;
the state file lists it under ``continuations``. ``--attempt-timeout-s T`` gives every attempt
``DILOCO_ATTEMPT_TIMEOUT_S=T``: a platform cap rehearsed locally (nothing kills the replica at T).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from diloco_serverless.executors._proc import proc_start_time, tail_file, write_json_atomic
from diloco_serverless.executors.base import (
    ATTEMPT_TIMEOUT_ENV,
    CONTINUE_EXIT_CODE,
    SETUP_ERROR_EXIT_CODE,
    setup_error_reason,
)

_cancelled = False


def _on_sigterm(signum: int, frame: Any) -> None:
    global _cancelled
    _cancelled = True


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class _State:
    """The supervisor's state file, rewritten atomically on every change."""

    def __init__(self, path: Path, rank: int, retries: int) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "rank": rank,
            "retries": retries,
            "status": "pending",
            "attempt": 0,
            "supervisor_pid": os.getpid(),
            "child_pid": None,
            "child_start": None,
            "exit_code": None,
            "reason": None,
            "restarts": [],
            "continuations": [],
        }

    def update(self, **changes: Any) -> None:
        self.data.update(changes, time=time.time())
        write_json_atomic(self.path, self.data)


def _log(log_fh: Any, message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    log_fh.write(f"[diloco supervisor {stamp}] {message}\n".encode())
    log_fh.flush()


def _log_tail(log_path: Path) -> str:
    try:
        return tail_file(log_path, 40)
    except OSError:
        return ""


def _run_attempt(cmd: list[str], attempt: int, log_fh: Any, state: _State, timeout_s: float | None = None) -> int:
    env = {**os.environ, "DILOCO_ATTEMPT": str(attempt)}
    if timeout_s is not None:
        env[ATTEMPT_TIMEOUT_ENV] = repr(float(timeout_s))
    child = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log_fh, stderr=subprocess.STDOUT)
    state.update(status="running", attempt=attempt, child_pid=child.pid, child_start=proc_start_time(child.pid))
    return child.wait()


def supervise(cmd: list[str], rank: int, retries: int, log_path: Path, state_path: Path, restart_delay_s: float,
              attempt_timeout_s: float | None = None) -> int:
    """Run ``cmd`` until it succeeds, is cancelled, or has failed ``retries + 1`` times (attempts that
    exit with CONTINUE_EXIT_CODE are followed by the next one at once and are not failures). Returns 0/1."""
    state = _State(state_path, rank, retries)
    state.update()
    # O_NOFOLLOW: a link planted at the log's path (in a file store's run folder) is never appended to
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "ab", buffering=0) as log_fh:
        attempt = failures = 0
        while True:
            _log(log_fh, f"rank {rank} attempt {attempt}: starting {' '.join(cmd)}")
            code = _run_attempt(cmd, attempt, log_fh, state, attempt_timeout_s)
            _log(log_fh, f"rank {rank} attempt {attempt}: {_describe_exit(code)}")
            if _cancelled:
                state.update(status="cancelled", exit_code=code, reason="cancelled", child_pid=None)
                return 0
            if code == 0:
                state.update(status="succeeded", exit_code=0, reason=None, child_pid=None)
                return 0
            if code == SETUP_ERROR_EXIT_CODE:
                why = setup_error_reason(_log_tail(log_path))
                reason = f"{_describe_exit(code)}: a setup error, not retried ({why})"
                _log(log_fh, f"rank {rank}: not restarting: exit code {code} is a setup error that a retry cannot fix")
                state.update(status="failed", exit_code=code, reason=reason, child_pid=None)
                return 1
            if code == CONTINUE_EXIT_CODE:
                continuations = [*state.data["continuations"], {"attempt": attempt, "time": time.time()}]
                state.update(status="running", exit_code=code, child_pid=None, continuations=continuations,
                             reason=f"continuing: attempt {attempt} stopped before its deadline with its state saved")
                _log(log_fh, f"rank {rank}: attempt {attempt} stopped before its deadline with its state saved; "
                     "starting the next attempt now (not a retry)")
                attempt += 1
                continue
            if failures >= retries:
                reason = f"{_describe_exit(code)} (attempt {attempt}, no retries left of {retries})"
                state.update(status="failed", exit_code=code, reason=reason, child_pid=None)
                return 1
            restarts = [*state.data["restarts"], {"attempt": attempt, "exit_code": code, "time": time.time()}]
            state.update(status="running", exit_code=code, reason=f"restarting: {_describe_exit(code)}",
                         child_pid=None, restarts=restarts)
            _log(log_fh, f"rank {rank}: restarting in {restart_delay_s:g} s ({retries - failures} retries left)")
            deadline = time.monotonic() + restart_delay_s
            while time.monotonic() < deadline and not _cancelled:
                time.sleep(0.05)
            if _cancelled:
                state.update(status="cancelled", reason="cancelled")
                return 0
            attempt += 1
            failures += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="diloco-supervisor", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--retries", type=int, default=0)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--restart-delay-s", type=float, default=1.0)
    parser.add_argument("--attempt-timeout-s", type=float, default=None)
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("missing the replica command after --")
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigterm)
    return supervise(cmd, args.rank, args.retries, args.log, args.state, args.restart_delay_s, args.attempt_timeout_s)


if __name__ == "__main__":
    sys.exit(main())
