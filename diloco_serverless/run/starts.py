"""Start records: one create-only object per start of a replica (every attempt, every launch).

    members/starts/rank-<r>/<time_ms:013d>-<token>.json   {"rank", "attempt", "time", "launch_id"[, "mac"]}

A replica writes its start record as soon as it has read run.json, before it builds the model. Status
reads them to tell ``running`` (this launch's replica has started) from ``starting`` (the platform
says running, but the replica has not started yet), to count the attempts of each rank, and to bill
each replica from when it started rather than from the launch. ``launch_id`` is the launcher's id
of the launch (or resume) that started the replica (:data:`LAUNCH_ID_ENV` in its environment), so a
start of an earlier launch is never taken for one of the current launch.

With the run key the record carries an HMAC (kind :data:`START_KIND`); a reader holding the key skips
a record that does not verify. The bucket is shared, so a reader without the key treats what it reads
as a hint: a record whose fields are of the wrong type is skipped with a warning naming its key.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from diloco_serverless.run.bounded import get_many_bounded
from diloco_serverless.run.integrity import mac_json, verify_json
from diloco_serverless.run.layout import STARTS_PREFIX, start_key
from diloco_serverless.store.objectstore import ObjectStore

__all__ = ["LAUNCH_ID_ENV", "START_KIND", "StartRecord", "read_starts", "write_start"]

#: The environment variable through which the launcher tells each replica the id of its launch.
LAUNCH_ID_ENV = "DILOCO_LAUNCH_ID"
#: What a start record's HMAC is bound to (see :mod:`diloco_serverless.run.integrity`).
START_KIND = "start"
_START_KEY = re.compile(rf"^{STARTS_PREFIX}/rank-(0|[1-9][0-9]{{0,5}})/[0-9]{{13}}-[A-Za-z0-9]+\.json$")
_LAUNCH_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class StartRecord:
    """One start of rank ``rank``'s replica: Unix ``time`` (s), its ``attempt`` as the executor counts
    them (0 where the platform cannot tell) and the ``launch_id`` of the launch that started it."""

    rank: int
    time: float
    attempt: int = 0
    launch_id: str | None = None


def write_start(run_store: ObjectStore, rank: int, attempt: int, *, launch_id: str | None = None,
                key: bytes | None = None, now: float | None = None) -> StartRecord:
    """Write rank ``rank``'s start record (create-only, a fresh key per start); signed with ``key``."""
    if launch_id is not None and not _LAUNCH_ID.match(launch_id):
        raise ValueError(f"launch id {launch_id!r} must be 1-64 letters, digits, '_' or '-'")
    record = StartRecord(rank, time.time() if now is None else now, attempt, launch_id)
    doc: dict[str, Any] = {"rank": rank, "attempt": attempt, "time": record.time, "launch_id": launch_id}
    where = start_key(rank, int(record.time * 1000), secrets.token_hex(4))
    if key is not None:
        doc = mac_json(key, START_KIND, doc, place=where)
    run_store.put_if_absent(where, json.dumps(doc).encode("utf-8"))
    return record


def read_starts(run_store: ObjectStore, *, key: bytes | None = None,
                cache: MutableMapping[str, StartRecord | None] | None = None) -> dict[int, list[StartRecord]]:
    """Every rank's start records, oldest first: one LIST, then a GET of each record not in ``cache``
    (records never change, so a caller polling status keeps one ``cache`` and reads each once).

    With ``key`` a record without this run's HMAC is skipped; so is one that is not a JSON object with
    a numeric time and a count attempt, and one whose signed rank differs from the rank its key names
    (a warning names its key). The signature binds the record's key, so a record copied to another
    rank's or start's key is skipped too.
    """
    seen: MutableMapping[str, StartRecord | None] = {} if cache is None else cache
    keys = [k for k in run_store.list(STARTS_PREFIX + "/") if _START_KEY.match(k)]
    new = [k for k in keys if k not in seen]
    for name, raw in get_many_bounded(run_store, new, "start").items():
        seen[name] = _parse(run_store.url, name, raw, key)
    out: dict[int, list[StartRecord]] = {}
    for name in keys:
        record = seen.get(name)
        if record is not None:
            out.setdefault(record.rank, []).append(record)
    return {rank: sorted(records, key=lambda r: r.time) for rank, records in sorted(out.items())}


def _parse(url: str, name: str, raw: bytes, key: bytes | None) -> StartRecord | None:
    match = _START_KEY.match(name)
    assert match is not None  # only matching keys are read
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        warnings.warn(f"skipping start record {url}/{name}: not a JSON object", stacklevel=3)
        return None
    if key is not None and not verify_json(key, START_KIND, doc, place=name):
        warnings.warn(f"skipping start record {url}/{name}: it does not carry this run's signature", stacklevel=3)
        return None
    stamp, attempt, launch_id = doc.get("time"), doc.get("attempt", 0), doc.get("launch_id")
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
        warnings.warn(f"skipping start record {url}/{name}: 'time' is not a timestamp", stacklevel=3)
        return None
    rank = doc.get("rank", int(match.group(1)))
    if rank != int(match.group(1)) or isinstance(rank, bool):
        warnings.warn(f"skipping start record {url}/{name}: it says rank {rank!r}, its key another", stacklevel=3)
        return None
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        attempt = 0
    if not isinstance(launch_id, str) or not _LAUNCH_ID.match(launch_id):
        launch_id = None
    return StartRecord(int(match.group(1)), float(stamp), attempt, launch_id)
