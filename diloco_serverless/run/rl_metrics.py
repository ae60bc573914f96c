"""The RL numbers of a round, as heartbeats, ``diloco status`` and the model card show them.

A GRPO/DPPO replica's round metrics carry ``reward_mean``, ``reward_std``, ``reward/<f>/mean|std`` (per
reward function), ``completion_length``, ``rl_kl``, ``rl_entropy``, ``rl_clip_fraction`` and
``generation_share`` (docs/rl.md). :func:`rl_summary` picks them out of one record (the replica puts
its last round's in its heartbeat, field ``rl``); :func:`parse_rl` reads that field back from the
store, where anyone who can write the run can write anything; :func:`mean_over` averages records of
the same round over replicas; :func:`rl_rounds` gives the first and last round with RL numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["RL_KEYS", "mean_over", "parse_rl", "per_function", "rl_rounds", "rl_summary"]

#: the round-level RL metrics, in the order they are shown
RL_KEYS = ("reward_mean", "reward_std", "completion_length", "rl_kl", "rl_entropy", "rl_clip_fraction",
           "generation_share")
#: at most this many entries in a heartbeat's ``rl`` field (7 + 2 per reward function)
MAX_ENTRIES = 64
_MAX_KEY = 120


def _is_rl_key(key: str) -> bool:
    return key in RL_KEYS or (key.startswith("reward/") and key.endswith(("/mean", "/std")))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        v = float(value)
    except OverflowError:
        return None
    return v if math.isfinite(v) else None


def rl_summary(record: Mapping[str, Any]) -> dict[str, float] | None:
    """The RL numbers of one round's metrics record (finite ones only); None for a supervised round."""
    out: dict[str, float] = {}
    for key, value in record.items():
        number = _number(value) if isinstance(key, str) and _is_rl_key(key) else None
        if number is not None:
            out[key] = number
    return out if "reward_mean" in out else None


def parse_rl(value: Any) -> tuple[dict[str, float] | None, str | None]:
    """A heartbeat's stored ``rl`` field: ``(numbers, None)``, or ``(None, why)``."""
    if not isinstance(value, Mapping):
        return None, "is not a mapping of RL metrics"
    if len(value) > MAX_ENTRIES:
        return None, f"has more than {MAX_ENTRIES} entries"
    out: dict[str, float] = {}
    for key, v in value.items():
        number = _number(v)
        if not isinstance(key, str) or len(key) > _MAX_KEY or not _is_rl_key(key) or number is None:
            return None, "is not a mapping of RL metrics"
        out[key] = number
    return out, None


def per_function(summary: Mapping[str, float]) -> dict[str, tuple[float, float | None]]:
    """``{function: (mean, std)}`` from the ``reward/<f>/mean|std`` entries, in order of appearance."""
    out: dict[str, tuple[float, float | None]] = {}
    for key, value in summary.items():
        if key.startswith("reward/") and key.endswith("/mean"):
            name = key[len("reward/"):-len("/mean")]
            out[name] = (value, summary.get(f"reward/{name}/std"))
    return out


def mean_over(summaries: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each key's mean over the summaries that have it (e.g. one round's replicas)."""
    keys = list(dict.fromkeys(k for s in summaries for k in s))
    return {k: sum(vals) / len(vals) for k in keys if (vals := [s[k] for s in summaries if k in s])}


def rl_rounds(metrics: Mapping[int, Sequence[Any]]) -> dict[int, dict[str, float]]:
    """``{round: RL numbers averaged over the replicas that reported them}`` for every round with RL
    numbers, in round order (metrics as ``Run.metrics()`` returns them: rank -> records)."""
    by_round: dict[int, list[dict[str, float]]] = {}
    for records in metrics.values():
        for record in records:
            if not isinstance(record, Mapping):
                continue
            rnd = record.get("round")
            summary = rl_summary(record)
            if summary is None or isinstance(rnd, bool) or not isinstance(rnd, int):
                continue
            by_round.setdefault(rnd, []).append(summary)
    return {rnd: mean_over(by_round[rnd]) for rnd in sorted(by_round)}
