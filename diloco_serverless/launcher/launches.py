"""The launches of each rank, as run.json's launch record keeps them across ``diloco resume``.

run.json's ``launch`` holds the newest handle of every rank in ``handles`` (what status, logs and
cancel use) and, in ``attempts``, every launch of every rank, oldest first::

    "launch_id": "a1b2c3d4e5f6",                      # the newest launch (or resume)
    "attempts": {"0": [{"launch_id": "...", "launched_at": "2025-...Z", "executor": "local",
                        "handle": {...}, "billed_s": 812.0}, ...], "1": [...]}

``billed_s`` is stamped on a rank's launch when a resume replaces it: the seconds that launch was
billed (see :func:`diloco_serverless.launcher.status.billed_seconds`). A replica of a launch writes
start records carrying its ``launch_id`` (:mod:`diloco_serverless.run.starts`), which is how status
tells this launch's replica from an earlier one. A record written before this existed has no
``attempts``: each handle is then one launch made at ``launched_at``.

run.json can be written by anyone with access to the bucket; what is read here is checked for type
and a malformed entry is left out, never trusted to decide more than what status shows.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from diloco_serverless.run.starts import StartRecord

__all__ = [
    "RankLaunch", "current_launches", "merge_launches", "new_launch_id", "of_launch", "parse_time", "utc_iso",
]


def new_launch_id() -> str:
    """A fresh id for one launch or resume (12 hex characters)."""
    return secrets.token_hex(6)


def utc_iso(now: float) -> str:
    """Unix seconds as ``2025-01-01T00:00:00Z`` (run.json's time format)."""
    return datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_time(stamp: Any) -> float | None:
    """run.json's ISO time as Unix seconds, or None when it is not one."""
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class RankLaunch:
    """One launch of one rank: its id, when it was made (Unix s) and what it was billed once replaced."""

    launch_id: str | None
    launched_at: float | None
    billed_s: float | None = None


def _entries(launch: Mapping[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """``attempts`` as rank -> entries (JSON objects only), or built from ``handles`` for an older record."""
    attempts = launch.get("attempts")
    out: dict[int, list[dict[str, Any]]] = {}
    if isinstance(attempts, Mapping):
        for rank, entries in attempts.items():
            if isinstance(rank, str) and rank.isdigit() and isinstance(entries, list):
                out[int(rank)] = [e for e in entries if isinstance(e, dict)]
        return out
    handles = launch.get("handles")
    for handle in handles if isinstance(handles, list) else []:
        if isinstance(handle, dict) and isinstance(handle.get("rank"), int):
            out[handle["rank"]] = [{"launch_id": launch.get("launch_id"), "launched_at": launch.get("launched_at"),
                                    "executor": launch.get("executor"), "handle": handle}]
    return out


def _rank_launch(entry: Mapping[str, Any]) -> RankLaunch:
    launch_id = entry.get("launch_id")
    billed = entry.get("billed_s")
    if isinstance(billed, bool) or not isinstance(billed, (int, float)) or not math.isfinite(billed) or billed < 0:
        billed = None
    return RankLaunch(launch_id if isinstance(launch_id, str) else None, parse_time(entry.get("launched_at")),
                      None if billed is None else float(billed))


def current_launches(launch: Mapping[str, Any] | None) -> dict[int, tuple[RankLaunch, float]]:
    """Rank -> (its current launch, seconds its earlier launches were billed)."""
    out: dict[int, tuple[RankLaunch, float]] = {}
    for rank, entries in _entries(launch or {}).items():
        if entries:
            launches = [_rank_launch(e) for e in entries]
            out[rank] = (launches[-1], sum(x.billed_s or 0.0 for x in launches[:-1]))
    return out


def of_launch(records: Sequence[StartRecord], current: RankLaunch) -> list[StartRecord]:
    """The start records written by ``current``'s replica: those carrying its launch id, or (from a replica
    too old to carry one) those written after it was made."""
    if current.launch_id is not None:
        mine = [r for r in records if r.launch_id == current.launch_id]
        if mine:
            return mine
    if current.launched_at is None:
        return []
    return [r for r in records if r.launch_id is None and r.time >= current.launched_at]


def merge_launches(previous: Mapping[str, Any] | None, kind: str, handles: Sequence[Mapping[str, Any]],
                   launch_id: str, now: float, billed: Mapping[int, float] | None = None
                   ) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """(``handles``, ``attempts``) of the launch record after launching ``handles`` (launch ``launch_id``):
    the new handles replace their ranks' ones, the other ranks keep theirs; each new handle's rank gets
    a new entry, and its previous entry ``billed_s`` from ``billed`` (rank -> seconds)."""
    attempts = {str(rank): [dict(e) for e in entries] for rank, entries in _entries(previous or {}).items()}
    newest = {rank: entries[-1]["handle"] for rank, entries in _entries(previous or {}).items()
              if entries and isinstance(entries[-1].get("handle"), dict)}
    for handle in handles:
        rank = int(handle["rank"])
        entries = attempts.setdefault(str(rank), [])
        if entries and billed is not None and rank in billed:
            entries[-1]["billed_s"] = round(float(billed[rank]), 1)
        entries.append({"launch_id": launch_id, "launched_at": utc_iso(now), "executor": kind, "handle": dict(handle)})
        newest[rank] = dict(handle)
    return [newest[r] for r in sorted(newest)], dict(sorted(attempts.items(), key=lambda item: int(item[0])))
