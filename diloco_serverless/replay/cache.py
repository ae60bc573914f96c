"""A content-addressed cache of teacher answers, so a re-run pays for nothing twice.

The address of an answer is the SHA-256 of the request that produced it, as canonical JSON: the
endpoint (``base_url``), model, messages, tools, ``max_tokens``, temperature and extra body fields.
Never the API key, nor any header: a cache folder can be shared or kept with the data. It lives in a
local folder or any store URL the package reads (``s3://bucket/replay-cache``, ``gs://...``), written
create-only at ``answers/<2 hex>/<sha256>.json``. An entry holds the answer (content and tool calls),
the usage and cost the original call reported and its latency; a cached answer costs nothing.

The cache is data, like a ``data.source``: it is trusted as the user's own. Each entry carries its
request digest, and an entry whose digest does not match its address is ignored (and re-asked).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diloco_serverless.store.errors import ObjectNotFound
from diloco_serverless.store.objectstore import ObjectStore

__all__ = ["AnswerCache", "request_digest"]

_MAX_ENTRY = 64 * 1024 * 1024


def request_digest(request: Mapping[str, Any]) -> str:
    """SHA-256 hex of the request's canonical JSON (sorted keys, compact)."""
    body = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


class AnswerCache:
    """Answers by request digest in a folder or store URL."""

    def __init__(self, url: str | Path) -> None:
        self.url = str(url)
        if "://" not in self.url:
            Path(self.url).mkdir(parents=True, exist_ok=True)
        self.store = ObjectStore(self.url)

    def __repr__(self) -> str:
        return f"AnswerCache({self.url!r})"

    @staticmethod
    def key(digest: str) -> str:
        return f"answers/{digest[:2]}/{digest}.json"

    def get(self, digest: str) -> dict[str, Any] | None:
        """The entry for ``digest``, or None (absent, unreadable or not its own)."""
        try:
            raw = self.store.get(self.key(digest), max_bytes=_MAX_ENTRY)
        except ObjectNotFound:
            return None
        return self._decode(raw, digest)

    def get_many(self, digests: list[str]) -> dict[str, dict[str, Any]]:
        """The entries present for ``digests`` ({digest: entry}): one listing of the cache, then the
        present entries read concurrently."""
        present = set(self.store.list("answers/"))
        keys = {self.key(d): d for d in digests if self.key(d) in present}
        out: dict[str, dict[str, Any]] = {}
        for key, raw in self.store.get_many(list(keys), missing_ok=True, max_bytes=_MAX_ENTRY).items():
            entry = self._decode(raw, keys[key])
            if entry is not None:
                out[keys[key]] = entry
        return out

    @staticmethod
    def _decode(raw: bytes, digest: str) -> dict[str, Any] | None:
        try:
            entry = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(entry, dict) or entry.get("request_sha256") != digest:
            return None
        return entry

    def put(self, digest: str, entry: Mapping[str, Any]) -> None:
        """Store ``entry`` for ``digest`` (create-only: the first answer stays)."""
        body = dict(entry, request_sha256=digest)
        self.store.put_if_absent(self.key(digest), json.dumps(body, ensure_ascii=False, sort_keys=True).encode())

    async def aget(self, digest: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.get, digest)

    async def aput(self, digest: str, entry: Mapping[str, Any]) -> None:
        await asyncio.to_thread(self.put, digest, entry)
