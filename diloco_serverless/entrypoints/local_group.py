"""Start the G local processes of a multi-device replica and keep them one unit.

When a run's ``parallel.devices`` is G > 1, ``python -m diloco_serverless.entrypoints.replica``
(the *parent*) starts G copies of itself, one per device, with ``LOCAL_RANK=g``,
``LOCAL_WORLD_SIZE=G``, ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT`` (and
``DILOCO_DEVICE=cuda:g`` on a CUDA machine unless a device was given), then waits:

* all exit 0: the parent exits 0;
* one exits non-zero or is killed (OOM, ``kill -9``): the parent stops the others (SIGTERM, then
  SIGKILL after a grace period) and exits non-zero (2 when the child reported a setup error, 1
  otherwise), so the executor restarts the replica as a unit and it heals from the store;
* all exit 0 or 75 (the replica stopped before its attempt's deadline, one decision for all): the
  parent exits 75 when any did, so the executor starts a fresh attempt;
* the parent gets SIGTERM/SIGINT (cancel): it forwards it to the children and exits with their code.

On Linux each child also dies with the parent (``PR_SET_PDEATHSIG``), so no local process outlives
its replica.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diloco_serverless.executors.base import CONTINUE_EXIT_CODE

__all__ = [
    "LOCAL_RANK_ENV", "LOCAL_WORLD_SIZE_ENV", "child_env", "cuda_device_count", "free_port", "has_cuda_devices",
    "run_local_group",
]

logger = logging.getLogger("diloco_serverless.replica")

#: Where a local process stands in its replica (torchrun's names), read by the trainer's ``LocalGroup``.
#: Defined here as well as in ``trainer.local_group`` so that the parent, which only watches, never loads
#: torch (tests/entrypoints checks that both say the same).
LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV = "LOCAL_RANK", "LOCAL_WORLD_SIZE"

#: Seconds between SIGTERM and SIGKILL when the replica's other processes are stopped.
STOP_GRACE_S = 5.0
_POLL_S = 0.2


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the local group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _visible_count(value: str) -> int:
    """Devices ``CUDA_VISIBLE_DEVICES=value`` names, as the CUDA runtime reads it: the list ends at the
    first entry that is empty or an invalid index (``-1`` hides every device)."""
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return count


def cuda_device_count(dev: Path = Path("/dev"), env: Mapping[str, str] | None = None) -> int:
    """NVIDIA GPUs this process may use, without loading torch: the GPU device files (``nvidia0``,
    ``nvidia1``...; a container sees its own), no more than ``CUDA_VISIBLE_DEVICES`` names when set."""
    if not (dev / "nvidiactl").exists():
        return 0
    count = sum(1 for p in dev.glob("nvidia*") if re.fullmatch(r"nvidia[0-9]+", p.name))
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    return count if visible is None else min(count, _visible_count(visible))


def has_cuda_devices() -> bool:
    """True when this machine has NVIDIA GPUs this process may use (:func:`cuda_device_count`)."""
    return cuda_device_count() > 0


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def child_env(base: Mapping[str, str], local_rank: int, size: int, port: int, *, cuda: bool) -> dict[str, str]:
    """The environment of local process ``local_rank`` of ``size``."""
    env = dict(base)
    env.update({LOCAL_RANK_ENV: str(local_rank), LOCAL_WORLD_SIZE_ENV: str(size), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"})
    if cuda and not base.get("DILOCO_DEVICE"):
        env["DILOCO_DEVICE"] = f"cuda:{local_rank}"
    return env


def run_local_group(argv: Sequence[str], devices: int, *, cuda: bool, python: str | None = None,
                    module: str = "diloco_serverless.entrypoints.replica") -> int:
    """Run ``python -m module *argv`` as ``devices`` local processes; returns the replica's exit code."""
    port = free_port()
    cmd = [python or sys.executable, "-m", module, *argv]
    children: list[subprocess.Popen[bytes]] = []
    stopping: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        stopping.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    in_main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)} if in_main else {}
    try:
        for g in range(devices):
            children.append(subprocess.Popen(cmd, env=child_env(os.environ, g, devices, port, cuda=cuda),
                                             stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        logger.info("replica runs as %d local processes (pids %s), rendezvous 127.0.0.1:%d", devices,
                    [c.pid for c in children], port)
        return _wait(children, stopping)
    finally:
        _stop(children)
        for s, handler in old.items():
            signal.signal(s, handler)


def _wait(children: list[subprocess.Popen[bytes]], stopping: list[int]) -> int:
    while True:
        codes = [c.poll() for c in children]
        failed = [(g, code) for g, code in enumerate(codes) if code not in (None, 0, CONTINUE_EXIT_CODE)]
        if failed:
            g, code = failed[0]
            assert code is not None
            if not stopping:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                print(f"error: local process {g} of this replica {how}; stopping the other "
                      f"{len(children) - 1} and exiting so the replica restarts as a unit", file=sys.stderr)
            _stop(children)
            return 130 if stopping else (2 if code == 2 else 1)
        if all(code in (0, CONTINUE_EXIT_CODE) for code in codes):  # the replica stopped before its deadline
            return CONTINUE_EXIT_CODE if CONTINUE_EXIT_CODE in codes else 0
        time.sleep(_POLL_S)


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every live child, SIGKILL those still alive after :data:`STOP_GRACE_S`."""
    live = [c for c in children if c.poll() is None]
    for c in live:
        c.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for c in live:
        try:
            c.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
