"""The function a remote container runs for one replica (Modal); no cloud SDK imports here.

``run_replica_process`` starts ``python -m <entrypoint> <args>`` as a child process with the given
environment plus ``REPLICA_RANK``, streams its output to this process's stdout (which the cloud
captures as the replica's log) and returns ``{"rank", "exit_code": 0}`` on success.

A setup error (exit code 2, :data:`~diloco_serverless.executors.base.SETUP_ERROR_EXIT_CODE`: the input
is wrong, a retry cannot fix it) is *returned*, not raised: ``{"rank", "exit_code": 2, "reason",
"retried": False}``, after printing :data:`~diloco_serverless.executors.base.SETUP_ERROR_MARKER`. The
call then ends normally, so the platform's retry policy (``modal.Retries``, which cannot be
conditioned on the error) does not run it again; the executor's ``poll`` reports it ``failed``.
Any other non-zero exit raises :class:`ReplicaProcessError` (a RuntimeError, so it deserialises
anywhere) whose message holds the rank, exit code and the last lines of output; the platform's
retry policy then decides whether to run the replica again.

Runs longer than the call's cap (a chain of calls): with ``DILOCO_CALL_TIMEOUT_S`` in ``env`` (the
function's timeout) the replica gets ``DILOCO_ATTEMPT_DEADLINE`` = the call's start + that timeout,
and ``DILOCO_ATTEMPT`` = the call's place in the chain (``env``'s, default 0). A replica that stops
before the deadline with its state saved (exit code 75) makes this call start the next one itself:
``modal.Function.from_id($DILOCO_MODAL_FUNCTION_ID).spawn(...)`` with the same inputs and
``DILOCO_ATTEMPT`` + 1; the call then *returns* ``{"rank", "exit_code": 75, "next_call_id": "fc-...",
"attempt"}`` after printing :data:`~diloco_serverless.executors.base.CONTINUE_MARKER` (a normal end,
so no retry is used); the executor's ``poll`` follows ``next_call_id``. If the next call cannot be
started, ReplicaProcessError: the platform's retry runs the replica again, and it resumes from the
saved state all the same.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from diloco_serverless.errors import DilocoError
from diloco_serverless.executors.base import (
    ATTEMPT_DEADLINE_ENV,
    CONTINUE_EXIT_CODE,
    CONTINUE_MARKER,
    SETUP_ERROR_EXIT_CODE,
    SETUP_ERROR_MARKER,
    setup_error_reason,
)

TAIL_LINES = 40
#: in a call's ``env`` input: the object id of the function to spawn the next call of a chain from
FUNCTION_ID_ENV = "DILOCO_MODAL_FUNCTION_ID"
#: in a call's ``env`` input: the function's timeout in seconds (the call's cap)
CALL_TIMEOUT_ENV = "DILOCO_CALL_TIMEOUT_S"


class ReplicaProcessError(DilocoError, RuntimeError):
    """A replica process exited non-zero; the message names rank, exit code and output tail."""


def run_replica_process(
    rank: int, entrypoint: str, args: Sequence[str], env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Run one replica to completion in this container.

    Returns ``{"rank", "exit_code": 0}`` on success, ``{"rank", "exit_code": 2, "reason",
    "retried": False}`` on a setup error and ``{"rank", "exit_code": 75, "next_call_id", "attempt"}``
    when the replica stopped before the call's deadline and the next call of the chain was started;
    raises ReplicaProcessError on any other failure.
    """
    started = time.time()
    inputs = {k: str(v) for k, v in (env or {}).items()}
    attempt = _attempt(inputs)
    child_env = {**os.environ, **inputs}
    child_env.update(REPLICA_RANK=str(rank), PYTHONUNBUFFERED="1", DILOCO_ATTEMPT=str(attempt))
    timeout = inputs.get(CALL_TIMEOUT_ENV, "").strip()
    if timeout:
        child_env[ATTEMPT_DEADLINE_ENV] = repr(started + float(timeout))
    cmd = [sys.executable, "-m", entrypoint, *map(str, args)]
    print(f"[diloco] rank {rank}: starting {' '.join(cmd)}", flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        tail.append(line)
        print(line, flush=True)
    code = proc.wait()
    if code == 0:
        return {"rank": rank, "exit_code": 0}
    last = "\n".join(tail)
    if code == SETUP_ERROR_EXIT_CODE:
        reason = setup_error_reason(last)
        print(f"{SETUP_ERROR_MARKER}: {reason}", flush=True)
        return {"rank": rank, "exit_code": code, "reason": reason, "retried": False}
    if code == CONTINUE_EXIT_CODE:
        return _start_next_call(rank, entrypoint, args, inputs, attempt)
    raise ReplicaProcessError(f"replica rank {rank} exited with code {code}; last output:\n{last}")


def _attempt(inputs: Mapping[str, str]) -> int:
    raw = inputs.get("DILOCO_ATTEMPT", "0").strip() or "0"
    return int(raw) if raw.isdigit() else 0


def _start_next_call(rank: int, entrypoint: str, args: Sequence[str], inputs: Mapping[str, str],
                     attempt: int) -> dict[str, Any]:
    """Spawn the next call of this replica's chain (same function, same inputs, ``DILOCO_ATTEMPT`` + 1)."""
    function_id = inputs.get(FUNCTION_ID_ENV, "").strip()
    if not function_id:
        raise ReplicaProcessError(
            f"replica rank {rank} stopped before the call's deadline with its state saved (exit code "
            f"{CONTINUE_EXIT_CODE}), but the call has no {FUNCTION_ID_ENV} to start the next one from; the retry "
            "policy runs it again (relaunch with this version to chain calls without using retries)")
    import modal  # only in a Modal container, and only here

    nxt = {**inputs, "DILOCO_ATTEMPT": str(attempt + 1)}
    try:
        call = modal.Function.from_id(function_id).spawn(rank, entrypoint, list(args), nxt)
    except Exception as exc:
        raise ReplicaProcessError(
            f"replica rank {rank} stopped before the call's deadline with its state saved, but starting the next "
            f"call of function {function_id} failed ({type(exc).__name__}: {exc}); the retry policy runs it again"
        ) from exc
    next_id = str(call.object_id)
    print(f"{CONTINUE_MARKER}: attempt {attempt + 1} of rank {rank} runs in call {next_id}", flush=True)
    return {"rank": rank, "exit_code": CONTINUE_EXIT_CODE, "next_call_id": next_id, "attempt": attempt}
