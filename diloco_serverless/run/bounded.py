"""Bounded reads of the run's control objects: no JSON record is read in full past its kind's limit.

Anyone who can write the bucket can plant a huge object where a small record belongs (a 96 MiB
heartbeat). Every control object the launcher or a replica reads goes through :func:`get_bounded`
or :func:`get_many_bounded` with its kind's limit (:data:`LIMITS`): at most ``limit + 1`` bytes are
read (a ranged GET on remote stores), and a larger object is refused naming its key, or skipped with
a warning where the reader goes on without it (a heartbeat, a metrics record, a start record). The
exchange bounds its own objects (``exchange/_io.py``: ready markers, abstentions, votes, ``quorum.json``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from diloco_serverless.store.errors import ObjectTooLarge
from diloco_serverless.store.objectstore import ObjectStore

__all__ = ["LIMITS", "get_bounded", "get_many_bounded"]

#: Largest object of each kind of control record (bytes). run.json holds the config and one handle per
#: replica (about 0.5 KiB each); the others are one small JSON object.
LIMITS: dict[str, int] = {
    "run.json": 4 << 20,
    "heartbeat": 1 << 20,
    "metrics": 1 << 20,
    "start": 64 << 10,
    "final-done": 1 << 20,
}


def get_bounded(store: ObjectStore, key: str, kind: str) -> bytes:
    """The object at ``key``, read only up to the limit of ``kind``; :class:`ObjectTooLarge` naming the
    key when it is larger, :class:`~diloco_serverless.store.errors.ObjectNotFound` when absent."""
    return store.get(key, max_bytes=LIMITS[kind])


def get_many_bounded(store: ObjectStore, keys: Sequence[str], kind: str) -> dict[str, bytes]:
    """:meth:`ObjectStore.get_many` (missing keys left out) with each object bounded by the limit of
    ``kind``; an object over it is skipped with a warning naming it, the others are returned."""
    limit = LIMITS[kind]
    try:
        return store.get_many(keys, missing_ok=True, max_bytes=limit)
    except ObjectTooLarge:
        pass
    out: dict[str, bytes] = {}
    for key in keys:  # one by one, to leave out only the oversized ones
        try:
            out.update(store.get_many([key], missing_ok=True, max_bytes=limit))
        except ObjectTooLarge:
            warnings.warn(f"skipping {store.url}/{key}: larger than the {limit} bytes a {kind} record may have",
                          stacklevel=2)
    return out
