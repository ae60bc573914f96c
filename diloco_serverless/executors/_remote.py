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
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from diloco_serverless.errors import DilocoError
from diloco_serverless.executors.base import SETUP_ERROR_EXIT_CODE, SETUP_ERROR_MARKER, setup_error_reason

TAIL_LINES = 40


class ReplicaProcessError(DilocoError, RuntimeError):
    """A replica process exited non-zero; the message names rank, exit code and output tail."""


def run_replica_process(
    rank: int, entrypoint: str, args: Sequence[str], env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Run one replica to completion in this container.

    Returns ``{"rank", "exit_code": 0}`` on success and ``{"rank", "exit_code": 2, "reason",
    "retried": False}`` on a setup error; raises ReplicaProcessError on any other failure.
    """
    child_env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
    child_env.update(REPLICA_RANK=str(rank), PYTHONUNBUFFERED="1")
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
    raise ReplicaProcessError(f"replica rank {rank} exited with code {code}; last output:\n{last}")
