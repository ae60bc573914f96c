"""A byte-counting view of the store for the exchange, plus the helpers that parse its keys.

The keys themselves are built in :mod:`diloco_serverless.run.layout`; under ``<store_url>/<run_id>/``
a round is (docs/architecture.md, "The exchange protocol")::

    rounds/<round:08d>/ready/rank-<r>             JSON ReadyMarker, written after all of r's contributions
    rounds/<round:08d>/quorum.json                create-only: participants + their markers
    rounds/<round:08d>/contrib/<shard:04d>/rank-<r>
    rounds/<round:08d>/reduced/<shard:04d>        create-only: the averaged shard
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from diloco_serverless.store.errors import ObjectNotFound

if TYPE_CHECKING:  # pragma: no cover
    from diloco_serverless.store.objectstore import ObjectStore

FIRST_POLL_S = 0.02  # first sleep of a polling loop; it then grows 1.5x per empty poll up to poll_interval_s
_RANK_RE = re.compile(r"rank-(\d+)$")
_SHARD_RE = re.compile(r"/(\d{4,})$")


def ranks_in(keys: Sequence[str]) -> set[int]:
    """Ranks named by ``.../rank-<r>`` keys (others are ignored)."""
    out: set[int] = set()
    for k in keys:
        m = _RANK_RE.search(k)
        if m:
            out.add(int(m.group(1)))
    return out


def shards_in(keys: Sequence[str]) -> set[int]:
    """Shard numbers named by ``.../reduced/<shard>`` keys (others are ignored)."""
    out: set[int] = set()
    for k in keys:
        m = _SHARD_RE.search(k)
        if m:
            out.add(int(m.group(1)))
    return out


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``shards`` contiguous ranges whose sizes differ by at most one."""
    base, extra = divmod(numel, shards)
    out, start = [], 0
    for j in range(shards):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return out


class CountingStore:
    """Thin view of an :class:`ObjectStore` that counts payload bytes moved (for ``RoundStats``).

    Counts object bodies only (PUT and GET); listings and existence checks are not counted.
    Thread-safe. Errors from the store propagate unchanged.
    """

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self.bytes_up = 0
        self.bytes_down = 0
        self._pool: ThreadPoolExecutor | None = None

    def reset(self) -> None:
        with self._lock:
            self.bytes_up = self.bytes_down = 0

    def _add(self, up: int = 0, down: int = 0) -> None:
        with self._lock:
            self.bytes_up += up
            self.bytes_down += down

    def put(self, key: str, data: bytes) -> None:
        self.store.put(key, data)
        self._add(up=len(data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        created = self.store.put_if_absent(key, data)
        self._add(up=len(data))
        return created

    def get(self, key: str) -> bytes:
        data = self.store.get(key)
        self._add(down=len(data))
        return data

    def get_many(self, keys: Sequence[str], *, missing_ok: bool = False) -> dict[str, bytes]:
        """Concurrent single GETs (one request per key: no existence probe before each GET).

        Missing keys are omitted if ``missing_ok``, else the store's ``ObjectNotFound`` propagates.
        """

        def one(key: str) -> bytes | None:
            try:
                return self.store.get(key)
            except ObjectNotFound:
                if missing_ok:
                    return None
                raise

        keys = list(dict.fromkeys(keys))
        if len(keys) <= 1:
            values = [one(k) for k in keys]
        else:
            values = list(self._executor().map(one, keys))
        out = {k: v for k, v in zip(keys, values) if v is not None}
        self._add(down=sum(len(v) for v in out.values()))
        return out

    def get_async(self, key: str) -> Future[bytes | None]:
        """Start one GET in the background; the future yields ``None`` if the object is missing."""
        return self._executor().submit(lambda: self.get_many([key], missing_ok=True).get(key))

    def get_or_none(self, key: str) -> bytes | None:
        """One GET; ``None`` if the object does not exist."""
        return self.get_many([key], missing_ok=True).get(key)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="exchange-get")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def get_json(self, key: str) -> Any:
        return json.loads(self.get(key).decode("utf-8"))

    def put_json(self, key: str, obj: Any) -> None:
        self.put(key, json_bytes(obj))

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.store.list(prefix)

    def delete(self, key: str, *, recursive: bool = False) -> None:
        self.store.delete(key, recursive=recursive)


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")
