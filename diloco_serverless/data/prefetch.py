"""A background thread that runs a producer of batches ahead of the training loop.

:class:`Prefetcher` pulls items from a generator in a daemon thread into a bounded queue (``depth``
items: memory stays bounded and the producer never runs far ahead of the consumer). An exception
in the producer (a :class:`DataError` on a bad record) is handed to the consumer and raised by
:meth:`Prefetcher.get`, then by every later call. :meth:`Prefetcher.close` stops the thread; the
generator is closed in the thread that ran it.

The producer must be deterministic in what it yields (the items do not depend on timing), so a
builder with a prefetcher yields exactly the batches of one without.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

__all__ = ["Prefetcher"]

T = TypeVar("T")
_POLL_S = 0.05


class Prefetcher(Generic[T]):
    """Run ``producer`` in a daemon thread; :meth:`get` returns its items in order."""

    def __init__(self, producer: Iterator[T], depth: int, name: str = "diloco-data") -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._producer = producer
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: tuple[str, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._producer:
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(("error", exc))
        finally:
            close = getattr(self._producer, "close", None)
            if callable(close):
                close()

    def get(self) -> T:
        """The next item; blocks until the producer made it. Raises what the producer raised."""
        if self._error is not None:
            raise self._error
        kind, value = self._queue.get()
        if kind == "item":
            return value  # type: ignore[no-any-return]
        self._error = value if kind == "error" else RuntimeError("the batch producer ended")
        assert self._error is not None
        raise self._error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (it finishes the item it is making); safe to call twice."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
