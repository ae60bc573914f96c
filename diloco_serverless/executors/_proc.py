"""Process helpers for the local executor: liveness by PID, process trees, kill, atomic JSON state.

Linux-first (``/proc``) with POSIX fallbacks; nothing here needs psutil. A PID is identified
together with its start time (``/proc/<pid>/stat`` field 22) and, where signals are sent on the
word of a stored handle, its command line (``/proc/<pid>/cmdline``), so a recycled PID is never
mistaken for a replica, and a zombie counts as dead. Signalling (``kill_tree``) needs the start
time: without ``/proc`` nothing is signalled.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO


def proc_start_time(pid: int) -> int | None:
    """The kernel start time of ``pid`` (clock ticks since boot), or None if unknown/gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3 (state)
    except (IndexError, ValueError):
        return None


def _proc_state(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()[0]


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """True if ``pid`` runs (not a zombie) and, when given, has the recorded ``start_time``."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if _proc_state(pid) in ("Z", "X"):
        return False
    if start_time is not None:
        now = proc_start_time(pid)
        if now is not None and now != start_time:
            return False
    return True


def proc_cmdline(pid: int) -> list[str] | None:
    """The argument vector of ``pid`` from ``/proc/<pid>/cmdline``, or None if unknown/gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if not raw:
        return None  # a zombie or a kernel thread
    return [arg.decode("utf-8", "surrogateescape") for arg in raw.rstrip(b"\0").split(b"\0")]


def same_process(pid: int, start_time: int | None) -> bool:
    """True if ``pid`` runs (not a zombie) and its start time is known and equals ``start_time``.

    Stricter than :func:`pid_alive`: an unknown start time (recorded or current) is never a match,
    so a recycled PID is never taken for the recorded process.
    """
    if start_time is None or not pid_alive(pid):
        return False
    return proc_start_time(pid) == start_time


def descendants(pid: int) -> list[int]:
    """All descendants of ``pid`` (children first), from ``/proc``; [] where ``/proc`` is absent."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(raw[raw.rfind(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop(0)
        out.append(child)
        stack.extend(children.get(child, []))
    return out


def signal_tree(pgid: int, pids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to process group ``pgid`` (if > 0) and to every pid in ``pids``; gone ones are skipped."""
    if pgid > 0:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _identities(pids: Iterable[int]) -> dict[int, int]:
    """``{pid: start_time}`` of the pids that run now with a known start time."""
    out: dict[int, int] = {}
    for pid in pids:
        start = proc_start_time(pid)
        if start is not None and pid_alive(pid):
            out[pid] = start
    return out


def kill_tree(roots: Iterable[tuple[int, int | None]], pgid: int, grace_s: float) -> None:
    """End the process trees under ``roots`` (``(pid, start_time)`` pairs) and process group ``pgid``.

    SIGTERM first, SIGKILL after ``grace_s``. Every process is identified by PID *and* start time:
    a root whose start time is unknown or differs is left alone, and before SIGKILL each process
    collected earlier is checked again, so a PID recycled during the grace period is never killed.
    Descendants are collected *before* signalling, so children that left the group (``setsid``) are
    reached even after their parent dies. The group is only signalled while a process we identified
    still belongs to it, so a recycled PGID is never hit.
    """
    live = [pid for pid, start in roots if same_process(pid, start)]
    if not live:
        return
    tree = _identities(sorted({p for pid in live for p in [pid, *descendants(pid)]}))
    group = pgid if pgid > 0 and any(_pgid(pid) == pgid for pid in live) else -1
    signal_tree(group, tree, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not any(same_process(p, s) for p, s in tree.items()):
            return
        time.sleep(0.05)
    # Re-identify right before SIGKILL: only processes that are still the ones collected above,
    # and the descendants they have now (identified at this moment).
    still = [p for p, s in tree.items() if same_process(p, s)]
    late = _identities(d for pid in still for d in descendants(pid) if d not in tree)
    group = group if group > 0 and any(_pgid(p) == group for p in still) else -1
    signal_tree(group, [*still, *late], signal.SIGKILL)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON so that readers see either the old or the new file, never a partial one.

    The temporary file is created exclusively and never through a symlink; ``os.replace`` swaps the
    name itself, so a symlink planted at ``path`` is replaced, not followed.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileExistsError:
        tmp.unlink()
        fd = os.open(tmp, flags, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(obj, sort_keys=True))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object at ``path``, or None if missing or unreadable (e.g. mid-write elsewhere)."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def open_no_follow(path: Path) -> BinaryIO:
    """``open(path, "rb")``, refusing (OSError) when the file itself is a symlink."""
    return os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb")


def tail_file(path: Path, lines: int | None) -> str:
    """The last ``lines`` lines of a text file (all if None); '' if the file does not exist.

    A symlink at ``path`` is not followed (OSError): logs are regular files the supervisor wrote.
    """
    try:
        with open_no_follow(path) as fh:
            if lines is None:
                return fh.read().decode("utf-8", "replace")
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            block = 8192
            data = b""
            while size > 0 and data.count(b"\n") <= lines:
                step = min(block, size)
                size -= step
                fh.seek(size)
                data = fh.read(step) + data
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:]) if lines else ""
