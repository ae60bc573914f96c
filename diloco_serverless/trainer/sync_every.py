"""The rule that picks H (inner steps per round) from measured compute and exchange times.

With ``outer.delay = 1`` a round's exchange runs while the next round computes, so it costs no wall time
as long as it ends before that round does: the smallest H with ``H x compute per step >= margin x
exchange`` hides it (``margin`` > 1 leaves room for timings that drift). Without overlap a round waits
for its exchange, so H must make the exchange a small share of the round: the smallest H with
``exchange <= (1 - share) / share x H x compute`` keeps compute at ``share`` of the wall time. Smaller H
costs fewer tokens to a given loss (more frequent averaging), so the smallest H that meets the bound wins.

:class:`AutoSyncEvery` is rank 0's side of ``inner.sync_every = "auto"``: it keeps the last rounds' timings
and re-decides H only when the rule's answer drifts out of a band around the current H (hysteresis: timings
that wobble do not make H flap). The decision travels through the store (:mod:`diloco_serverless.run.sync_plan`).
``benchmarks/time_to_loss.py`` also uses :func:`choose_sync_every` directly.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["DRIFT", "TAU_SHARE", "WINDOW", "AutoSyncEvery", "choose_sync_every", "choose_tau"]

#: rounds whose timings the decision looks at (their median: one slow round does not move H)
WINDOW = 3
#: H changes only when the rule's answer leaves [H / (1 + DRIFT), H x (1 + DRIFT)]
DRIFT = 0.25
#: in-round overlap (exchange.fragment_sync_delay with auto): at most this share of a round's steps overlap its
#: exchange. benchmarks/outer_sweep.py --tau (N = 4, eager merge, loss at equal tokens against DP): H = 8 plain +4.4 %,
#: tau = 1 +5.6 %, 2 +7.7 % (replace +6.8 %), 4 +9.7 %; H = 16 plain +7.0 %, tau = 2 +8.5 %, 4 +11.3 %, 8 +14.5 %: the
#: cost grows with tau / H, and at 1/2 it reaches a whole-round delay's (+12.8 % at H = 8): a quarter at most
TAU_SHARE = 0.25


def choose_tau(compute_s_per_step: float, exchange_s: float, *, margin: float = 1.25) -> int:
    """The fewest inner steps whose compute covers ``margin`` x the exchange (at least 1): the in-round
    overlap (``exchange.fragment_sync_delay``) that hides it."""
    if not math.isfinite(compute_s_per_step) or compute_s_per_step <= 0 or not math.isfinite(exchange_s) \
            or exchange_s < 0:
        raise ValueError(f"need positive, finite timings (got {compute_s_per_step}, {exchange_s})")
    return max(1, math.ceil(margin * exchange_s / compute_s_per_step - 1e-9))


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


class AutoSyncEvery:
    """Rank 0's choice of H for ``inner.sync_every = "auto"``: :meth:`observe` each round's measured compute
    per inner step and exchange time, then :meth:`decide` the next round's H from the current one.

    The first decision after the initial H is made as soon as one round's timings are known; from then on
    the rule's answer (on the median of the last :data:`WINDOW` rounds) replaces H only when it leaves the
    band ``[H / (1 + drift), H x (1 + drift)]``. With ``overlap`` (``outer.delay = 1``) the rule is the
    smallest H whose compute hides ``margin`` x the exchange behind the next round; without, the smallest H
    that keeps compute at ``share`` of the round.
    """

    def __init__(self, *, overlap: bool, lo: int, hi: int, drift: float = DRIFT, window: int = WINDOW,
                 margin: float = 1.25, share: float = 0.95, tau_share: float | None = None) -> None:
        if not 1 <= lo <= hi or drift < 0 or window < 1:
            raise ValueError(f"need 1 <= lo <= hi, drift >= 0 and window >= 1 (got {lo}, {hi}, {drift}, {window})")
        if tau_share is not None and not 0.0 < tau_share < 1.0:
            raise ValueError(f"tau_share must lie in (0, 1), got {tau_share}")
        self.overlap, self.lo, self.hi, self.drift = overlap, lo, hi, drift
        #: in-round overlap: H is the smallest whose last tau_share of steps hide the exchange (see :meth:`tau`)
        self.tau_share = tau_share
        self.margin, self.share = margin, share
        self.compute: deque[float] = deque(maxlen=window)
        self.exchange: deque[float] = deque(maxlen=window)

    def observe(self, compute_s_per_step: float, exchange_s: float) -> None:
        """Record one round's timings; rounds without a measured exchange (replayed, late, failed, the first
        round with overlap) are not passed here."""
        if compute_s_per_step > 0 and math.isfinite(compute_s_per_step) and exchange_s >= 0 \
                and math.isfinite(exchange_s):
            self.compute.append(compute_s_per_step)
            self.exchange.append(exchange_s)

    def timings(self) -> tuple[float, float] | None:
        """(compute per step, exchange) the decision uses: medians of the window, None before any round."""
        if not self.compute:
            return None
        return statistics.median(self.compute), statistics.median(self.exchange)

    def decide(self, current: int, *, measured_before: bool) -> tuple[int, str]:
        """The next round's H and why: ``"kept"`` (no timings, or the rule's answer is within the band),
        ``"measured"`` (the first decision from timings when ``measured_before`` is False: no band) or
        ``"drift"``."""
        timed = self.timings()
        if timed is None:
            return current, "kept"
        if self.tau_share is not None:  # the smallest H whose last tau_share of steps cover the exchange
            tau = choose_tau(timed[0], timed[1], margin=self.margin)
            want = min(self.hi, max(self.lo, tau + 1, math.ceil(tau / self.tau_share - 1e-9)))
        else:
            want = choose_sync_every(timed[0], timed[1], overlap=self.overlap, margin=self.margin,
                                     share=self.share, lo=self.lo, hi=self.hi)
        if not measured_before:
            return want, "measured"
        if want > current * (1.0 + self.drift) or want * (1.0 + self.drift) < current:
            return want, "drift"
        return current, "kept"

    def tau(self, h: int, initial: int) -> int:
        """In-round overlap: the tau of a round of ``h`` steps (:func:`choose_tau` on the timings, ``initial``
        before any), below ``h``; 0 without in-round overlap."""
        if self.tau_share is None:
            return 0
        timed = self.timings()
        tau = initial if timed is None else choose_tau(timed[0], timed[1], margin=self.margin)
        return max(0, min(tau, h - 1))
