"""A replica's heartbeats and per-round metrics, written by one background thread off the training path.

Every round a replica reports its state (``members/rank-<r>.json``) at the round's start, before an
evaluation and after the round, and its metrics (``metrics/rank-<r>/<round>.json``). Written in line,
each is a PUT the training waits for: three to four sequential first bytes per round (60 ms median, a
250 ms p99 on S3), all of them on every replica, since the replicas meet again at the next exchange.
Here the caller builds the object (so its time stamp and content are those of the moment it is
reported, and a record that is not JSON fails in the caller) and hands it over; one thread writes them
in order. A heartbeat not yet written is replaced by a newer one (only the latest state matters);
metrics are never dropped.

:meth:`ReportWriter.flush` waits until everything handed over is written. The trainer closes the writer
right after queueing a heartbeat that ends an attempt (``done``, ``failed``, ``continuing``): that
heartbeat is the last object written, so a reader that sees it also sees every metrics record before
it, and no older state can overwrite it. A close that times out leaves the thread writing, in order.
A failed write (after the store's own retries) is logged and counted, never raised: reports are not
worth a replica.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from diloco_serverless.store.objectstore import ObjectStore

__all__ = ["ReportWriter"]

logger = logging.getLogger(__name__)


class ReportWriter:
    """Writes ``(key, bytes)`` reports of one replica to ``store`` from a daemon thread, in order.

    ``heartbeat_key`` names the one key whose pending write a newer one replaces.
    """

    def __init__(self, store: ObjectStore, heartbeat_key: str, *, name: str = "reports") -> None:
        self.store, self.heartbeat_key = store, heartbeat_key
        self.failures = 0  # writes that failed after the store's retries
        self.written = 0
        self._queue: deque[tuple[str, bytes]] = deque()
        self._busy = False  # a write taken off the queue is in flight
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, key: str, data: bytes) -> None:
        """Queue ``data`` for ``key``; a queued, unwritten heartbeat is replaced by a newer one."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the report writer is closed")
            if key == self.heartbeat_key:
                for i, (queued, _) in enumerate(self._queue):
                    if queued == key:
                        del self._queue[i]
                        break
            self._queue.append((key, data))
            self._cond.notify_all()

    def pending(self) -> int:
        """Reports handed over and not yet written (or given up on)."""
        with self._cond:
            return len(self._queue) + int(self._busy)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every report handed over so far is written or given up on; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float | None = None) -> bool:
        """Refuse new reports, flush, and let the thread end once the queue is empty; False if the flush
        timed out (the thread then goes on writing what is left, in order)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        done = self.flush(timeout_s)
        if done:
            self._thread.join(timeout_s)
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                key, data = self._queue.popleft()
                self._busy = True
            try:
                self.store.put(key, data)
                self.written += 1
            except Exception as exc:  # the store's retries are spent; the next report may get through
                self.failures += 1
                logger.warning("writing %s failed: %s", key, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
