"""An ObjectStore that records every request made through it (and through its children)."""

from __future__ import annotations

import math
import threading
from collections import Counter
from typing import Any

from diloco_serverless.store.objectstore import ObjectStore


class RecordingStore(ObjectStore):
    """Records ``(op, key)`` for each GET, PUT (plain or create-only), LIST page, existence check and
    DELETE, keys relative to the store they went through (an exchange's run child: ``rounds/...``).

    ``child()``, ``with_retry()`` and ``with_transfer()`` build a plain :class:`ObjectStore` sharing this
    one's ``__dict__``; they are turned back into recorders that share the one log."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, **kw: Any) -> None:
        super().__init__(url, storage_options, **kw)
        self.requests: list[tuple[str, str]] = []
        self._log_lock = threading.Lock()

    def _record(self, op: str, key: str, times: int = 1) -> None:
        with self._log_lock:
            self.requests.extend([(op, key)] * times)

    @property
    def counts(self) -> Counter[str]:
        with self._log_lock:
            return Counter(op for op, _ in self.requests)

    def keys(self, op: str, *, contains: str = "") -> list[str]:
        """The keys of the ``op`` requests that contain ``contains``, in order."""
        with self._log_lock:
            return [k for o, k in self.requests if o == op and contains in k]

    def _same(self, other: ObjectStore) -> ObjectStore:
        other.__class__ = type(self)
        return other

    def child(self, prefix: str) -> ObjectStore:
        return self._same(super().child(prefix))

    def with_retry(self, retry: Any) -> ObjectStore:
        return self._same(super().with_retry(retry))

    def with_transfer(self, transfer: Any) -> ObjectStore:
        return self._same(super().with_transfer(transfer))

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        self._record("GET", key)
        return super().get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes) -> None:
        self._record("PUT", key)
        super().put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._record("PUT", key)
        return super().put_if_absent(key, data)

    def list(self, prefix: str = "") -> list[str]:
        out = super().list(prefix)
        self._record("LIST", prefix, max(1, math.ceil(len(out) / 1000)))  # one request per 1,000-key page
        return out

    def list_md5(self, prefix: str = "") -> dict[str, str | None]:
        out = super().list_md5(prefix)
        self._record("LIST", prefix, max(1, math.ceil(len(out) / 1000)))
        return out

    def exists(self, key: str) -> bool:
        self._record("HEAD", key)
        return super().exists(key)

    def delete(self, key: str, *, recursive: bool = False) -> None:
        self._record("DELETE", key)
        super().delete(key, recursive=recursive)
