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
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from diloco_serverless.run.bounded import get_many_bounded
from diloco_serverless.run.layout import (
    MEMBERS_PREFIX,
    METRICS_PREFIX,
    member_key,
    metrics_key,
    metrics_prefix,
)
from diloco_serverless.run.rl_metrics import parse_rl
from diloco_serverless.store.objectstore import ObjectStore

__all__ = [
    "HEARTBEAT_FIELDS",
    "HEARTBEAT_STATES",
    "Heartbeat",
    "heartbeat_bytes",
    "metrics_bytes",
    "parse_heartbeat_field",
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
#: the attempt stopped before its platform deadline with its state saved; a fresh attempt continues
HEARTBEAT_CONTINUING = "continuing"
HEARTBEAT_STATES = (HEARTBEAT_STARTING, HEARTBEAT_HEALING, HEARTBEAT_TRAINING, HEARTBEAT_SYNCING,
                    HEARTBEAT_EVALUATING, HEARTBEAT_CHECKPOINTING, HEARTBEAT_DONE, HEARTBEAT_FAILED,
                    HEARTBEAT_CONTINUING)


# --------------------------------------------------------------------------------- heartbeats
#: ``members/rank-<r>.json`` with a canonical rank (no leading zeros): the only keys read as heartbeats.
_MEMBER_KEY = re.compile(rf"^{MEMBERS_PREFIX}/rank-(0|[1-9][0-9]{{0,5}})\.json$")
#: Longest heartbeat ``message`` kept (the rest is cut): a reason, not a log.
MESSAGE_LIMIT = 1000
#: Largest count a heartbeat field may hold (round, step, attempt, bytes).
_MAX_COUNT = 2**63 - 1


@dataclass
class Heartbeat:
    """One replica's latest state, ``members/rank-<r>.json``. ``time`` is Unix seconds (UTC).

    A heartbeat read back from the store may carry fields that are not what a replica writes (the
    bucket is shared: anyone who can write under the run can write there). Such a field is None
    and :attr:`invalid` names it with the reason, e.g. ``{"round": "is not an integer"}``.
    """

    rank: int
    round: int | None = 0
    step: int | None = 0
    loss: float | None = None
    attempt: int | None = 0
    time: float | None = field(default_factory=time.time)
    state: str | None = HEARTBEAT_STARTING
    bytes_up: int | None = 0
    bytes_down: int | None = 0
    message: str | None = None
    #: An RL run's numbers of the last round (:func:`~diloco_serverless.run.rl_metrics.rl_summary`:
    #: reward mean/std, per function too, completion length, KL, entropy, clip fraction, generation
    #: share); None (and not stored) for a supervised run or before the first round.
    rl: dict[str, float] | None = None
    #: Field name -> why the stored value was unusable; set only by :meth:`from_json_dict`, never stored.
    invalid: dict[str, str] = field(default_factory=dict, compare=False)

    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["loss"] is not None and not math.isfinite(d["loss"]):
            d["loss"] = str(d["loss"])  # "nan"/"inf": keep it visible yet valid JSON
        if d["rl"] is None:
            d.pop("rl")
        invalid = d.pop("invalid")
        if invalid:
            d["invalid"] = invalid
        return d

    @classmethod
    def from_json_dict(cls, d: Any, *, rank: int | None = None) -> Heartbeat:
        """Parse a stored heartbeat; a field of the wrong type or range is None and named in ``invalid``.

        ``rank`` is the rank the key names (``members/rank-<r>.json``); it wins over the body's.
        A missing field is None (shown as unknown), except ``rank``. Raises ValueError when ``d``
        is not a JSON object or no rank can be told.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a heartbeat must be a JSON object, got {type(d).__name__}")
        invalid: dict[str, str] = {}
        body_rank, why = _count(d["rank"]) if "rank" in d else (None, None)
        if rank is None:
            if body_rank is None:
                raise ValueError(f"heartbeat field 'rank' {why or 'is missing'}")
            rank = body_rank
        elif "rank" in d and body_rank != rank:
            invalid["rank"] = why or f"says {body_rank}, but the heartbeat is rank-{rank}.json"
        values: dict[str, Any] = {}
        for name, parse in _FIELDS.items():
            if d.get(name) is None:  # absent, or written as null (e.g. no loss yet): unknown, not invalid
                values[name] = None
                continue
            values[name], why = parse(d[name])
            if why is not None:
                invalid[name] = why
        return cls(rank=rank, invalid=invalid, **values)

    @property
    def age_s(self) -> float | None:
        """Seconds since this heartbeat was written (by the local clock); None when its time is unknown."""
        return None if self.time is None else max(0.0, time.time() - self.time)


_Parsed = tuple[Any, str | None]


def _count(v: Any) -> _Parsed:
    """A non-negative integer (an integral float such as 3.0 too), or (None, why)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None, "is not an integer"
    if isinstance(v, float):
        if not math.isfinite(v) or not v.is_integer():
            return None, "is not an integer"
        v = int(v)
    if not 0 <= v <= _MAX_COUNT:
        return None, "is out of range"
    return v, None


def _loss(v: Any) -> _Parsed:
    """A float; "nan"/"inf"/"-inf" (as written for non-finite losses) and other numeric strings too."""
    if isinstance(v, str) and len(v) <= 32:
        try:
            return float(v), None
        except ValueError:
            return None, "is not a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None, "is not a number"
    try:
        return float(v), None
    except OverflowError:  # an integer too large for a float
        return None, "is out of range"


def _timestamp(v: Any) -> _Parsed:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None, "is not a timestamp"
    try:
        t = float(v)
    except OverflowError:
        return None, "is out of range"
    return (t, None) if math.isfinite(t) else (None, "is not a timestamp")


def _state(v: Any) -> _Parsed:
    if not isinstance(v, str):
        return None, "is not a string"
    return (v, None) if len(v) <= 64 else (None, "is too long")


def _message(v: Any) -> _Parsed:
    if v is None:
        return None, None
    if not isinstance(v, str):
        return None, "is not a string"
    return (v if len(v) <= MESSAGE_LIMIT else v[: MESSAGE_LIMIT - 3] + "..."), None


_FIELDS: dict[str, Any] = {
    "round": _count, "step": _count, "loss": _loss, "attempt": _count, "time": _timestamp,
    "state": _state, "bytes_up": _count, "bytes_down": _count, "message": _message, "rl": parse_rl,
}
#: The heartbeat fields besides ``rank``, in the order status reports problems with them.
HEARTBEAT_FIELDS = tuple(_FIELDS)


def parse_heartbeat_field(name: str, value: Any) -> tuple[Any, str | None]:
    """One stored heartbeat field: ``(value, None)``, or ``(None, why)`` (e.g. "is not an integer")."""
    parse = _FIELDS.get(name)
    if parse is None:
        raise KeyError(f"{name!r} is not a heartbeat field; fields: {', '.join(HEARTBEAT_FIELDS)}")
    value, why = parse(value)
    return value, why


def heartbeat_bytes(heartbeat: Heartbeat) -> bytes:
    """The object :func:`write_heartbeat` writes. Raises ValueError for an unknown state."""
    if heartbeat.state not in HEARTBEAT_STATES:
        raise ValueError(f"heartbeat state {heartbeat.state!r} of rank {heartbeat.rank} not in {HEARTBEAT_STATES}")
    return json.dumps(heartbeat.to_json_dict(), indent=1).encode("utf-8")


def write_heartbeat(run_store: ObjectStore, heartbeat: Heartbeat) -> None:
    """Overwrite ``members/rank-<r>.json``. Raises ValueError for an unknown state."""
    run_store.put(member_key(heartbeat.rank), heartbeat_bytes(heartbeat))


def read_members(run_store: ObjectStore) -> dict[int, Heartbeat]:
    """Every rank's latest heartbeat, by rank (the rank its key names).

    Only ``members/rank-<r>.json`` keys are read. An object that is not a JSON object is skipped
    with a warning naming its key; a field of the wrong type is None and named in
    :attr:`Heartbeat.invalid`, so one bad heartbeat never stops ``diloco status``.
    """
    keys = [k for k in run_store.list(MEMBERS_PREFIX + "/") if _MEMBER_KEY.match(k)]
    blobs = get_many_bounded(run_store, keys, "heartbeat")
    out: dict[int, Heartbeat] = {}
    for key, raw in blobs.items():
        match = _MEMBER_KEY.match(key)
        if match is None:
            continue
        try:
            hb = Heartbeat.from_json_dict(json.loads(raw.decode("utf-8")), rank=int(match.group(1)))
        except (ValueError, TypeError, RecursionError) as exc:
            warnings.warn(f"skipping unreadable heartbeat {run_store.url}/{key}: {exc}", stacklevel=2)
            continue
        out[hb.rank] = hb
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------------- metrics
def metrics_bytes(rank: int, round: int, metrics: dict[str, Any]) -> bytes:
    """The object :func:`write_metrics` writes, time-stamped now. Raises ValueError if it is not JSON."""
    record: dict[str, Any] = {"rank": rank, "round": round, "time": time.time()}
    for k, v in metrics.items():
        record[k] = str(v) if isinstance(v, float) and not math.isfinite(v) else v
    try:
        return json.dumps(record, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metrics of rank {rank} round {round} are not JSON-serialisable: {exc}") from None


def write_metrics(run_store: ObjectStore, rank: int, round: int, metrics: dict[str, Any]) -> None:
    """Write ``metrics/rank-<r>/<round>.json`` = ``{"rank", "round", "time", **metrics}``.

    Non-finite floats are stored as the strings "nan"/"inf"/"-inf" (valid JSON); read_metrics restores them.
    """
    run_store.put(metrics_key(rank, round), metrics_bytes(rank, round, metrics))


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def read_metrics(run_store: ObjectStore, rank: int | None = None) -> list[dict[str, Any]]:
    """All metrics records (of one rank, or every rank), sorted by (round, rank). Bad files are skipped."""
    prefix = metrics_prefix(rank) + "/" if rank is not None else METRICS_PREFIX + "/"
    keys = [k for k in run_store.list(prefix) if k.endswith(".json")]
    out: list[dict[str, Any]] = []
    for key, raw in get_many_bounded(run_store, keys, "metrics").items():
        try:
            rec = json.loads(raw.decode("utf-8"))
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except (ValueError, RecursionError) as exc:
            warnings.warn(f"skipping unreadable metrics {run_store.url}/{key}: {exc}", stacklevel=2)
            continue
        out.append({k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in rec.items()})
    return sorted(out, key=_round_rank)


def _round_rank(record: dict[str, Any]) -> tuple[int, int]:
    """Sort key of a metrics record; a round or rank that is not a count sorts first (as -1)."""
    round_, _ = _count(record.get("round"))
    rank, _ = _count(record.get("rank"))
    return (-1 if round_ is None else round_, -1 if rank is None else rank)
