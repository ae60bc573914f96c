"""A spending ceiling that cannot be overshot by calls in flight.

Before each attempt a caller reserves the attempt's worst-case cost (prompt-token bound x input price +
``max_tokens`` x output price); the reservation is granted only when what is already spent plus every
reservation in flight plus this one fits under ``max_usd``. After the attempt the caller settles it:
the reservation is released and the actual cost added to ``spent``. So ``spent`` stays at or below
``max_usd`` whatever the order in which concurrent calls finish, as long as each call costs at most
its reservation (the teachers' prices are upper bounds; a call reported dearer than its reservation
stops the run, :attr:`Budget.overrun`).

A reservation that does not fit waits while other calls are in flight (they usually settle below
their worst case); when nothing is in flight and it still does not fit, the budget is *exhausted*:
no further reservation is granted and the run stops cleanly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

__all__ = ["Budget", "Reservation"]

_EPS = 1e-12


@dataclass
class Reservation:
    """A granted worst case; settle it exactly once."""

    usd: float
    settled: bool = False


class Budget:
    """``max_usd`` shared by the calls of one replay (one event loop)."""

    def __init__(self, max_usd: float) -> None:
        if not max_usd >= 0:
            raise ValueError(f"max_usd must be a number >= 0, got {max_usd}")
        self.max_usd = float(max_usd)
        self.spent = 0.0
        self.in_flight = 0.0
        self.peak_committed = 0.0  # max of spent + in_flight ever reached (tests check it <= max_usd)
        self.exhausted = False
        self.overrun: str | None = None
        self._changed: asyncio.Condition | None = None
        self._waiting = 0

    @property
    def remaining(self) -> float:
        return max(0.0, self.max_usd - self.spent - self.in_flight)

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def try_reserve(self, usd: float) -> Reservation | None:
        """A reservation of ``usd`` if it fits now, else None (never waits)."""
        if self.exhausted or self.overrun:
            return None
        if self.spent + self.in_flight + usd > self.max_usd + _EPS:
            return None
        self.in_flight += usd
        self.peak_committed = max(self.peak_committed, self.spent + self.in_flight)
        return Reservation(usd)

    async def reserve(self, usd: float) -> Reservation | None:
        """A reservation of ``usd``, waiting for calls in flight to settle while it does not fit; None
        once the budget is exhausted (it can never fit)."""
        granted = self.try_reserve(usd)  # the common case: it fits (one event loop: no lock needed)
        if granted is not None:
            return granted
        cond = self._cond()
        async with cond:
            while True:
                granted = self.try_reserve(usd)
                if granted is not None:
                    return granted
                if self.exhausted or self.overrun:
                    return None
                if self.in_flight <= _EPS:
                    self.exhausted = True
                    cond.notify_all()
                    return None
                self._waiting += 1
                try:
                    await cond.wait()
                finally:
                    self._waiting -= 1

    async def settle(self, reservation: Reservation, actual_usd: float) -> None:
        """Release ``reservation`` and add ``actual_usd`` to what was spent."""
        if reservation.settled:
            raise RuntimeError("a budget reservation was settled twice")
        reservation.settled = True
        self.in_flight = max(0.0, self.in_flight - reservation.usd)
        self.spent += actual_usd
        if actual_usd > reservation.usd + _EPS:
            self.overrun = (f"a call cost ${actual_usd:.6f}, more than its worst case ${reservation.usd:.6f}; the "
                            "teacher's prices or max_tokens are not upper bounds, fix them in the teacher file")
        if self._waiting:
            cond = self._cond()
            async with cond:
                cond.notify_all()
