"""When an attempt of a replica stops on its own: the platform's deadline and the "continue" rule.

Platforms cap one attempt of a replica (Modal: the function ``timeout``, at most 24 h; HF Jobs: the
Job ``timeout``). A replica killed at the cap loses the work since its last checkpoint and spends
a retry, so the executor tells it the cap (``DILOCO_ATTEMPT_DEADLINE`` / ``DILOCO_ATTEMPT_TIMEOUT_S``,
read by ``entrypoints/replica.py``) and the replica stops first, at an outer-round boundary, with
its state saved; a fresh attempt continues exactly where it stopped (see ``ReplicaTrainer.run``).

The rule (:meth:`AttemptDeadline.should_stop`), checked after every outer round: stop now when

    now + slowest recent round + state save + margin  >  deadline

* *slowest recent round*: the longest wall time of the last :data:`RECENT_ROUNDS` outer rounds of
  this attempt (inner steps, the exchange, metrics, evaluation and any checkpoint: all of it);
* *state save*: the longest save of this replica's state in this attempt (a checkpoint), or, before
  any, the slowest recent round again (a conservative stand-in);
* *margin*: :data:`MARGIN_FRACTION` of the attempt's length (deadline minus the attempt's start), at
  most :data:`MAX_MARGIN_S`: 5 minutes on a 24 h Modal call, 0.5 s on a 5 s rehearsal.

An attempt always trains at least one outer round before it may stop, so a run makes progress even
when the deadline is too close for a single round (it then comes back once per round).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["MARGIN_FRACTION", "MAX_MARGIN_S", "RECENT_ROUNDS", "AttemptDeadline"]

#: outer rounds whose wall time the estimate looks at (the slowest of them counts)
RECENT_ROUNDS = 5
#: the safety margin: this fraction of the attempt's length ...
MARGIN_FRACTION = 0.1
#: ... but never more than this (seconds)
MAX_MARGIN_S = 300.0


@dataclass
class AttemptDeadline:
    """The deadline of this attempt and what the replica measured of its own pace.

    ``deadline`` and ``started_at`` are Unix times (seconds); ``clock`` returns the current one
    (``time.time``; tests pass a fake).
    """

    deadline: float
    started_at: float
    clock: Callable[[], float] = time.time
    rounds: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_ROUNDS))
    save_s: float | None = None

    @property
    def margin_s(self) -> float:
        """:data:`MARGIN_FRACTION` of the attempt's length, at most :data:`MAX_MARGIN_S`."""
        return min(MAX_MARGIN_S, MARGIN_FRACTION * max(0.0, self.deadline - self.started_at))

    def record_round(self, wall_s: float) -> None:
        """One outer round of this attempt took ``wall_s`` seconds."""
        self.rounds.append(max(0.0, float(wall_s)))

    def record_save(self, seconds: float) -> None:
        """Saving this replica's state took ``seconds`` (the longest save counts)."""
        self.save_s = max(float(seconds), self.save_s or 0.0)

    def next_round_s(self) -> float:
        """Seconds the next round needs before the deadline: slowest recent round + save + margin."""
        slowest = max(self.rounds, default=0.0)
        save = self.save_s if self.save_s is not None else slowest
        return slowest + save + self.margin_s

    def remaining_s(self) -> float:
        """Seconds left until the deadline (negative once it has passed)."""
        return self.deadline - self.clock()

    def should_stop(self) -> bool:
        """True when the next round (see :meth:`next_round_s`) would not finish before the deadline.
        Never before this attempt measured a round: an attempt trains at least one."""
        if not self.rounds:
            return False
        return self.next_round_s() > self.remaining_s()

    def describe(self) -> str:
        """The estimate in words, for the log line of a replica that stops."""
        slowest = max(self.rounds, default=0.0)
        save = "as long as a round (no save measured yet)" if self.save_s is None else f"{self.save_s:.1f} s"
        return (f"the next round needs ~{self.next_round_s():.1f} s (slowest of the last {len(self.rounds)} "
                f"round(s) {slowest:.1f} s + state save {save} + margin {self.margin_s:.1f} s) but the attempt's "
                f"deadline is in {self.remaining_s():.1f} s")
