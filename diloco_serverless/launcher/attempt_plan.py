"""The plan for a run longer than its platform's cap on one attempt of a replica.

Modal ends a function call after its ``timeout`` (24 h at most), an HF Job after its ``timeout``; the
local executor can rehearse a cap (``-x attempt_timeout_s=S``). A replica stops on its own before the
cap, at a round boundary, with its state saved, and a fresh attempt takes over (not a retry; see
docs/replica.md, "Runs longer than the platform's cap"). This module says, from the rounds done so far,
whether the run is expected to cross the cap and how the attempts will go, so ``diloco launch`` can print
it once the round time is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: Who starts the next attempt at the cap, by executor kind.
_RELAUNCHED_BY = {
    "local": "the local supervisor starts the next attempt at once",
    "modal": "each Modal call spawns the next one itself, so a detached run needs nothing from you",
    "hf-jobs": "the launcher starts the next Job while it follows the run; a detached run needs "
               "`diloco resume RUN_URL` after each cap",
}


@dataclass(frozen=True)
class AttemptCap:
    """One attempt's time cap on an executor: seconds, and the setting that sets it."""

    seconds: float
    setting: str


#: The setting that sets the cap, by executor kind.
_CAP_SETTING = {
    "modal": "Modal's function timeout (-x timeout_s=S, <= 24 h)",
    "hf-jobs": "the HF Job timeout (-x timeout=...)",
    "local": "-x attempt_timeout_s",
}


def attempt_cap(executor: Any) -> AttemptCap | None:
    """The per-attempt cap of ``executor`` (its ``attempt_cap_s``), or None when it has none (or is of a
    kind without one, or an object without ``attempt_cap_s``, such as a test fake)."""
    setting = _CAP_SETTING.get(getattr(executor, "kind", None) or "")
    if setting is None:
        return None
    value = getattr(executor, "attempt_cap_s", None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        return None
    return AttemptCap(float(value), setting)


def cap_plan(cap: AttemptCap | None, kind: str | None, *, rounds_total: int, rounds_done: int,
             elapsed_s: float) -> str | None:
    """One line of plan when ``rounds_total`` rounds at the pace so far take longer than one attempt,
    else None. ``elapsed_s`` is the run's wall time for ``rounds_done`` rounds (at least 1 needed)."""
    if cap is None or rounds_done < 1 or elapsed_s <= 0:
        return None
    per_round = elapsed_s / rounds_done
    total = per_round * rounds_total
    if total <= cap.seconds:
        return None
    attempts = math.ceil(total / cap.seconds)
    who = _RELAUNCHED_BY.get(kind or "", "the executor starts the next attempt")
    return (f"at {_duration(per_round)} per round, {rounds_total} rounds take about {_duration(total)}, longer than "
            f"one attempt ({_duration(cap.seconds)}, {cap.setting}): each replica will run about {attempts} attempts, "
            f"stopping before each cap with its state saved; {who}. Fresh attempts are not retries.")


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"
