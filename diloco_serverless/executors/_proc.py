"""Process helpers for the local executor: liveness by PID, process trees, kill, atomic JSON state.

Linux-first (``/proc``) with POSIX fallbacks; nothing here needs psutil. A PID is identified
together with its start time (``/proc/<pid>/stat`` field 22) where available, so a recycled PID is
never mistaken for a replica, and a zombie counts as dead.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


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


def kill_tree(roots: Iterable[tuple[int, int | None]], pgid: int, grace_s: float) -> None:
    """End the process trees under ``roots`` (``(pid, start_time)`` pairs) and process group ``pgid``.

    SIGTERM first, SIGKILL after ``grace_s``. Descendants are collected *before* signalling, so
    children that left the group (``setsid``) are reached even after their parent dies. The group is
    only signalled while a live root still belongs to it, so a recycled PGID is never hit.
    """
    live = [pid for pid, start in roots if pid_alive(pid, start)]
    if not live:
        return
    tree = sorted({p for pid in live for p in [pid, *descendants(pid)]})
    group = pgid if any(_pgid(pid) == pgid for pid in live) else -1
    signal_tree(group, tree, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in tree):
            return
        time.sleep(0.05)
    signal_tree(group, [*tree, *(d for pid in tree for d in descendants(pid))], signal.SIGKILL)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON so that readers see either the old or the new file, never a partial one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object at ``path``, or None if missing or unreadable (e.g. mid-write elsewhere)."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def tail_file(path: Path, lines: int | None) -> str:
    """The last ``lines`` lines of a text file (all if None); '' if the file does not exist."""
    try:
        with open(path, "rb") as fh:
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
