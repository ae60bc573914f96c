"""A run's metrics records turned into the series a tracker logs: one point per exchange round.

Input is what replicas write to ``<run>/metrics/rank-<r>/<round>.json`` (``trainer/loop.py``): per
rank and round the ``compose_loss`` components, tokens and tokens/s, wall / inner / wait seconds,
bytes up and down, the exchange's seconds and participants, and on rank 0 the eval loss. Pure
functions over plain data, no I/O: :func:`global_values` is the run's series of one round (sums or
means over the ranks that reported it), :func:`replica_values` each rank's own.

Metrics come from the bucket, so nothing here trusts their types: a value that is not a finite
JSON number is left out of the point (never raises).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

Metrics = Mapping[int, Sequence[Mapping[str, Any]]]

#: ``compose_loss`` components, as the metrics record names them; logged as ``loss/<name>``.
LOSS_COMPONENTS = ("total", "lm_ce", "sdpo_jsd", "trace_replay_dpo")
#: The keys of the global series (what :func:`global_values` may return), for docs and tests.
GLOBAL_KEYS = (
    *(f"loss/{c}" for c in LOSS_COMPONENTS),
    "eval/loss",
    "throughput/tokens",
    "throughput/tokens_per_s",
    "exchange/bytes_up",
    "exchange/bytes_down",
    "exchange/bytes_moved",
    "exchange/seconds",
    "exchange/wait_s",
    "time/round_s",
    "utilisation/compute",
    "utilisation/data_wait",
    "replicas/participants",
    "replicas/reporting",
    "replicas/abstained",
    "replicas/late",
    "optim/inner_lr",
    "outer_round",
)
#: RL runs (``loss.channel1 = "grpo" | "dppo"``, docs/rl.md): record key -> series, the mean over the
#: ranks; besides these, each reward function's ``reward/<name>/mean`` and ``/std`` become ``rl/reward/...``.
RL_SERIES = {
    "reward_mean": "rl/reward_mean", "reward_std": "rl/reward_std", "completion_length": "rl/completion_length",
    "generation_share": "rl/generation_share", "rl_kl": "rl/kl", "rl_entropy": "rl/entropy",
    "rl_clip_fraction": "rl/clip_fraction",
}  # fmt: skip
#: The round's H, logged when the records hold it (``inner.sync_every = "auto"`` changes it during a run).
SYNC_SERIES = "optim/sync_every"
#: Keys a record may hold ``compose_loss``'s total under (the trainer writes ``total``; older or other
#: writers ``loss``), first present wins, as ``diloco plot`` reads them.
TOTAL_LOSS_KEYS = ("total", "loss", "train_loss")
#: Running totals the tracker adds to each point (over every round logged so far).
TOTAL_KEYS = ("throughput/tokens_total", "exchange/bytes_moved_total")


def number(value: Any) -> float | None:
    """``value`` as a finite float when it is a finite JSON number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


def by_round(metrics: Metrics) -> dict[int, dict[int, Mapping[str, Any]]]:
    """``{round: {rank: record}}`` of every record whose ``round`` is a non-negative integer."""
    out: dict[int, dict[int, Mapping[str, Any]]] = {}
    for rank, records in metrics.items():
        for rec in records:
            if not isinstance(rec, Mapping):
                continue
            rnd = rec.get("round")
            if isinstance(rnd, int) and not isinstance(rnd, bool) and 0 <= rnd < 10**8:
                out.setdefault(rnd, {})[rank] = rec
    return out


def participants_of(records: Mapping[int, Mapping[str, Any]]) -> set[int] | None:
    """The ranks the round's quorum named (union of the records' ``participants``), or None if none says."""
    named: set[int] = set()
    for rec in records.values():
        value = rec.get("participants")
        if isinstance(value, list):
            named.update(r for r in value if isinstance(r, int) and not isinstance(r, bool))
    return named or None


def _first(record: Mapping[str, Any], keys: Sequence[str]) -> float | None:
    for key in keys:
        value = number(record.get(key))
        if value is not None:
            return value
    return None


def _values(records: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    keys = TOTAL_LOSS_KEYS if key == "total" else (key,)
    return [v for v in (_first(rec, keys) for rec in records) if v is not None]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _put(out: dict[str, float], key: str, value: float | None) -> None:
    if value is not None:
        out[key] = value


def global_values(records: Mapping[int, Mapping[str, Any]]) -> dict[str, float]:
    """The run's point for one round from ``{rank: record}`` of that round (see :data:`GLOBAL_KEYS`).

    Losses, exchange seconds, waits and the inner lr are means over the ranks that reported them;
    tokens, tokens/s and bytes are sums (the whole run's throughput and traffic); ``utilisation/compute``
    is the share of the replicas' wall time spent in inner steps rather than blocked on the exchange,
    ``utilisation/data_wait`` the share spent waiting for batches; ``eval/loss`` is the mean of what
    the ranks that evaluated reported (rank 0).
    """
    recs = [records[r] for r in sorted(records)]
    out: dict[str, float] = {}
    for name in LOSS_COMPONENTS:
        _put(out, f"loss/{name}", _mean(_values(recs, name)))
    _put(out, "eval/loss", _mean(_values(recs, "eval_loss")))
    tokens = _values(recs, "tokens")
    _put(out, "throughput/tokens", sum(tokens) if tokens else None)
    tps = _values(recs, "tokens_per_s")
    _put(out, "throughput/tokens_per_s", sum(tps) if tps else None)
    up, down = _values(recs, "bytes_up"), _values(recs, "bytes_down")
    _put(out, "exchange/bytes_up", sum(up) if up else None)
    _put(out, "exchange/bytes_down", sum(down) if down else None)
    _put(out, "exchange/bytes_moved", sum(up) + sum(down) if up or down else None)
    _put(out, "exchange/seconds", _mean(_values(recs, "exchange_s")))
    _put(out, "exchange/wait_s", _mean(_values(recs, "wait_s")))
    walls = _values(recs, "wall_s")
    _put(out, "time/round_s", max(walls) if walls else None)
    wall_sum = sum(walls)
    if wall_sum > 0:
        inner = _values(recs, "inner_s")
        if inner:
            out["utilisation/compute"] = min(1.0, sum(inner) / wall_sum)
        data_wait = _values(recs, "data_wait_s")
        if data_wait:
            out["utilisation/data_wait"] = min(1.0, sum(data_wait) / wall_sum)
    named = participants_of(records)
    if named is not None:
        out["replicas/participants"] = float(len(named))
    out["replicas/reporting"] = float(len(recs))
    out["replicas/abstained"] = float(sum(1 for rec in recs if rec.get("abstained")))
    out["replicas/late"] = float(sum(1 for rec in recs if rec.get("late") is True))
    _put(out, "optim/inner_lr", _mean(_values(recs, "lr")))
    _put(out, SYNC_SERIES, _mean(_values(recs, "sync_every")))  # H of the round (SYNC_SERIES)
    for key, series in RL_SERIES.items():
        _put(out, series, _mean(_values(recs, key)))
    for key in sorted({k for rec in recs for k in rec if isinstance(k, str) and k.startswith("reward/")}):
        _put(out, f"rl/{key}", _mean(_values(recs, key)))
    outer = _values(recs, "outer_round")
    _put(out, "outer_round", max(outer) if outer else None)
    return out


def replica_values(rank: int, record: Mapping[str, Any]) -> dict[str, float]:
    """One rank's own point for one round: ``replica/<rank>/<name>`` for its loss, tokens/s, bytes,
    exchange seconds and compute share."""
    prefix = f"replica/{rank}/"
    out: dict[str, float] = {}
    _put(out, prefix + "loss", _first(record, TOTAL_LOSS_KEYS))
    _put(out, prefix + "lm_ce", number(record.get("lm_ce")))
    _put(out, prefix + "tokens_per_s", number(record.get("tokens_per_s")))
    up, down = number(record.get("bytes_up")), number(record.get("bytes_down"))
    if up is not None or down is not None:
        out[prefix + "bytes_moved"] = (up or 0.0) + (down or 0.0)
    _put(out, prefix + "exchange_s", number(record.get("exchange_s")))
    wall, inner = number(record.get("wall_s")), number(record.get("inner_s"))
    if wall and inner is not None and wall > 0:
        out[prefix + "utilisation"] = min(1.0, inner / wall)
    return out
