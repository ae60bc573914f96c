"""What each replica reports while it runs: its heartbeat and its per-round metrics.

    members/rank-<r>.json                heartbeat (:class:`Heartbeat`), overwritten every phase
    metrics/rank-<r>/<round:08d>.json    one record per round (:func:`write_metrics`)

Helpers take an ``ObjectStore`` rooted at the run (what :func:`diloco_serverless.run.load_run`
returns). Readers skip an unreadable object with a warning naming its key, so one bad heartbeat
never stops ``diloco status``.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from diloco_serverless.run.layout import (
    MEMBERS_PREFIX,
    METRICS_PREFIX,
    member_key,
    metrics_key,
    metrics_prefix,
)
from diloco_serverless.store.objectstore import ObjectStore

__all__ = [
    "HEARTBEAT_STATES",
    "Heartbeat",
    "read_members",
    "read_metrics",
    "write_heartbeat",
    "write_metrics",
]

#: The ``state`` a replica writes in its heartbeat, in the order a round goes through them.
HEARTBEAT_STARTING = "starting"
HEARTBEAT_HEALING = "healing"
HEARTBEAT_TRAINING = "training"
HEARTBEAT_SYNCING = "syncing"
HEARTBEAT_EVALUATING = "evaluating"
HEARTBEAT_CHECKPOINTING = "checkpointing"
HEARTBEAT_DONE = "done"
HEARTBEAT_FAILED = "failed"
HEARTBEAT_STATES = (HEARTBEAT_STARTING, HEARTBEAT_HEALING, HEARTBEAT_TRAINING, HEARTBEAT_SYNCING,
                    HEARTBEAT_EVALUATING, HEARTBEAT_CHECKPOINTING, HEARTBEAT_DONE, HEARTBEAT_FAILED)


# --------------------------------------------------------------------------------- heartbeats
@dataclass
class Heartbeat:
    """One replica's latest state, ``members/rank-<r>.json``. ``time`` is Unix seconds (UTC)."""

    rank: int
    round: int = 0
    step: int = 0
    loss: float | None = None
    attempt: int = 0
    time: float = field(default_factory=time.time)
    state: str = HEARTBEAT_STARTING
    bytes_up: int = 0
    bytes_down: int = 0
    message: str | None = None

    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["loss"] is not None and not math.isfinite(d["loss"]):
            d["loss"] = str(d["loss"])  # "nan"/"inf": keep it visible yet valid JSON
        return d

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> Heartbeat:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if isinstance(known.get("loss"), str):
            known["loss"] = float(known["loss"])
        return cls(**known)

    @property
    def age_s(self) -> float:
        """Seconds since this heartbeat was written (by the local clock)."""
        return max(0.0, time.time() - self.time)


def write_heartbeat(run_store: ObjectStore, heartbeat: Heartbeat) -> None:
    """Overwrite ``members/rank-<r>.json``. Raises ValueError for an unknown state."""
    if heartbeat.state not in HEARTBEAT_STATES:
        raise ValueError(f"heartbeat state {heartbeat.state!r} of rank {heartbeat.rank} not in {HEARTBEAT_STATES}")
    run_store.put(member_key(heartbeat.rank), json.dumps(heartbeat.to_json_dict(), indent=1).encode("utf-8"))


def read_members(run_store: ObjectStore) -> dict[int, Heartbeat]:
    """Every rank's latest heartbeat, by rank. Unreadable entries are skipped with a warning."""
    keys = [k for k in run_store.list(MEMBERS_PREFIX + "/") if k.endswith(".json")]
    blobs = run_store.get_many(keys, missing_ok=True)
    out: dict[int, Heartbeat] = {}
    for key, raw in blobs.items():
        try:
            hb = Heartbeat.from_json_dict(json.loads(raw.decode("utf-8")))
        except (ValueError, TypeError, AttributeError) as exc:
            warnings.warn(f"skipping unreadable heartbeat {run_store.url}/{key}: {exc}", stacklevel=2)
            continue
        out[hb.rank] = hb
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------------- metrics
def write_metrics(run_store: ObjectStore, rank: int, round: int, metrics: dict[str, Any]) -> None:
    """Write ``metrics/rank-<r>/<round>.json`` = ``{"rank", "round", "time", **metrics}``.

    Non-finite floats are stored as the strings "nan"/"inf"/"-inf" (valid JSON); read_metrics restores them.
    """
    record: dict[str, Any] = {"rank": rank, "round": round, "time": time.time()}
    for k, v in metrics.items():
        record[k] = str(v) if isinstance(v, float) and not math.isfinite(v) else v
    try:
        data = json.dumps(record, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metrics of rank {rank} round {round} are not JSON-serialisable: {exc}") from None
    run_store.put(metrics_key(rank, round), data)


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def read_metrics(run_store: ObjectStore, rank: int | None = None) -> list[dict[str, Any]]:
    """All metrics records (of one rank, or every rank), sorted by (round, rank). Bad files are skipped."""
    prefix = metrics_prefix(rank) + "/" if rank is not None else METRICS_PREFIX + "/"
    keys = [k for k in run_store.list(prefix) if k.endswith(".json")]
    out: list[dict[str, Any]] = []
    for key, raw in run_store.get_many(keys, missing_ok=True).items():
        try:
            rec = json.loads(raw.decode("utf-8"))
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            warnings.warn(f"skipping unreadable metrics {run_store.url}/{key}: {exc}", stacklevel=2)
            continue
        out.append({k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in rec.items()})
    return sorted(out, key=lambda r: (r.get("round", -1), r.get("rank", -1)))
