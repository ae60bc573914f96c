"""The rule that picks H (inner steps per round) from measured compute and exchange times.

With ``outer.delay = 1`` a round's exchange runs while the next round computes, so it costs no wall time
as long as it ends before that round does: the smallest H with ``H x compute per step >= margin x
exchange`` hides it (``margin`` > 1 leaves room for timings that drift). Without overlap a round waits
for its exchange, so H must make the exchange a small share of the round: the smallest H with
``exchange <= (1 - share) / share x H x compute`` keeps compute at ``share`` of the wall time. Smaller H
costs fewer tokens to a given loss (more frequent averaging), so the smallest H that meets the bound wins.

Used by ``benchmarks/time_to_loss.py`` to set its overlap arm's H from the timings it measured; the
replica does not re-decide H during a run (``inner.sync_every`` stays a number).
"""

from __future__ import annotations

import math

__all__ = ["choose_sync_every"]


def choose_sync_every(compute_s_per_step: float, exchange_s: float, *, overlap: bool, margin: float = 1.25,
                      share: float = 0.95, lo: int = 4, hi: int = 128, divides: int | None = None) -> int:
    """The smallest H in ``lo..hi`` (a divisor of ``divides`` when given) that hides the exchange
    (``overlap``) or keeps compute at ``share`` of each round; ``hi`` (or the largest divisor) when none does.

    Raises ValueError for non-positive or non-finite timings, or when no H in ``lo..hi`` divides ``divides``.
    """
    for name, value in (("compute_s_per_step", compute_s_per_step), ("exchange_s", exchange_s)):
        if not math.isfinite(value) or value < 0 or (name == "compute_s_per_step" and value == 0):
            raise ValueError(f"{name} must be a positive, finite number of seconds, got {value}")
    if not 0.0 < share < 1.0 or margin <= 0 or not 1 <= lo <= hi:
        raise ValueError(f"need 0 < share < 1, margin > 0 and 1 <= lo <= hi (got {share}, {margin}, {lo}, {hi})")
    candidates = [h for h in range(lo, hi + 1) if divides is None or divides % h == 0]
    if not candidates:
        raise ValueError(f"no H in {lo}..{hi} divides {divides}; widen the range or change the step count")
    need = margin * exchange_s if overlap else exchange_s * share / (1.0 - share)
    for h in candidates:
        if h * compute_s_per_step >= need:
            return h
    return candidates[-1]
