"""Rows that cannot be used: skipped, counted and named, until there are too many of them.

One odd row of a real dataset (a wrong type, a chat the template refuses) must not end a run, and a
dataset that is mostly unusable must not train on its remainder unnoticed. :class:`BadRows` counts
the rows read and the rows skipped; each skipped row is named in a warning (the first
:data:`WARN_ROWS`, then every power of two). The run stops with a :class:`DataError` naming example
rows once more than ``data.max_bad_fraction`` of the rows are unusable: judged on all rows read
once a whole pass over the shard is done, and before that as soon as the bad rows alone exceed the
fraction of :func:`min_rows` (so a mostly broken dataset stops within its first rows, and a few bad
rows early in a good one do not). ``data.max_bad_fraction = 0`` stops at the first bad row.
"""

from __future__ import annotations

import logging
import math

from diloco_serverless.data.examples import DataError

__all__ = ["BadRows", "min_rows", "WARN_ROWS"]

logger = logging.getLogger(__name__)
WARN_ROWS = 20
_EXAMPLES = 3


def min_rows(max_fraction: float) -> int:
    """Rows read before the fraction is judged on them alone: enough for ten bad rows to be within
    the limit (1,000 at the default 1%)."""
    return 0 if max_fraction <= 0 else math.ceil(10 / max_fraction)


class BadRows:
    """Counts of one source's rows (train and eval); ``bad`` is what the metrics report."""

    def __init__(self, max_fraction: float, label: str) -> None:
        self.max_fraction, self.label = max_fraction, label
        self.seen = 0
        self.bad = 0
        self.examples: list[str] = []

    def good(self) -> None:
        self.seen += 1

    def skip(self, error: DataError, *, pass_done: bool) -> None:
        """Count a row that ``error`` makes unusable; DataError once there are too many."""
        self.note(error)
        self.check(pass_done=pass_done, cause=error)

    def note(self, error: DataError, *, read: bool = True) -> None:
        """Count a row that ``error`` makes unusable and name it in a warning, without judging the
        fraction (for a source that reads all its rows before it judges them); ``read=False`` for a
        row already counted as read (and as usable) that proved unusable later."""
        self.seen += 1 if read else 0
        self.bad += 1
        if len(self.examples) < _EXAMPLES:
            self.examples.append(str(error))
        if self.bad <= WARN_ROWS or self.bad & (self.bad - 1) == 0:
            logger.warning(
                "skipping an unusable row (%d of %d rows read so far; the run stops past data.max_bad_fraction=%g): %s",
                self.bad, self.seen, self.max_fraction, error,
            )

    def check(self, *, pass_done: bool, cause: DataError | None = None) -> None:
        """DataError naming examples when more than ``max_fraction`` of the rows are unusable (of the
        rows read once ``pass_done``, else of at least :func:`min_rows`)."""
        limit = self.max_fraction * (self.seen if pass_done else max(self.seen, min_rows(self.max_fraction)))
        if self.bad > limit:
            raise DataError(
                f"{self.label}: {self.bad} of {self.seen} rows read are unusable, more than "
                f"data.max_bad_fraction={self.max_fraction:g}; fix the data or raise data.max_bad_fraction. "
                f"Examples: {' | '.join(self.examples)}"
            ) from cause
