"""A byte-counting view of the store for the exchange, plus the helpers that parse its keys.

The keys themselves are built in :mod:`diloco_serverless.run.layout`; under ``<store_url>/<run_id>/``
a round is (docs/architecture.md, "The exchange protocol")::

    rounds/<round:08d>/ready/rank-<r>.<mac>       JSON ReadyMarker, written after all of r's contributions
    rounds/<round:08d>/quorum.json                create-only: participants + their markers
    x<hh>/<round:08d>/quorum.json                 above 16 replicas: copies of it, one per 64 replicas
    x<hh>/<round:08d>/ready/rank-<r>.<mac>        above 64 replicas: the ready markers, hh = r mod N/64
    rounds/<round:08d>/contrib/<shard:04d>/rank-<r>
    rounds/<round:08d>/reduced/<shard:04d>        create-only: the averaged shard

A round without a quorum (:mod:`~diloco_serverless.exchange.votes`, N <= 16, flat or direct) has no ready
marker and no ``quorum.json``: ``votes/rank-<r>`` is r's create-only vote (or a tombstone that leaves r
out), created after r's contributions ``contrib/<j>/rank-<r>``; a direct round whose share is one object
votes with ``contrib/0000/rank-<r>`` itself.

Size limits: :class:`CountingStore` refuses a contribution or reduced shard larger than a valid
object of its shard can be (:func:`~diloco_serverless.exchange.codec.max_object_bytes`) without
reading it in full, raising :class:`CorruptObjectError` naming the key. The expected size comes
from the round's layout (element count, world size, codec): the replica's own ready marker when
it writes it, else the round's quorum when it reads it (:meth:`CountingStore.expect_round`).
"""

from __future__ import annotations

import builtins
import json
import logging
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

from diloco_serverless.exchange.codec import max_object_bytes, reduced_codec, validate_codec
from diloco_serverless.exchange.errors import CorruptObjectError
from diloco_serverless.exchange.topology import PROTOCOLS, shard_count
from diloco_serverless.run.layout import ROUNDS_PREFIX, SPREAD_PREFIX
from diloco_serverless.store.errors import ObjectNotFound
from diloco_serverless.store.objectstore import ObjectStore, ObjectTooLarge

logger = logging.getLogger(__name__)
T = TypeVar("T")

_RANK_RE = re.compile(r"rank-(\d+)(?:\.([0-9a-f]+))?$")
_SHARD_RE = re.compile(r"/(\d{4,})$")
_ROUND = rf"{re.escape(ROUNDS_PREFIX)}/(\d{{8,}})"
_DATA_ROUND = rf"(?:{re.escape(ROUNDS_PREFIX)}|{re.escape(SPREAD_PREFIX)}[0-9a-f]{{2}})/(\d{{8,}})"
_OWN_MARKER_RE = re.compile(rf"{_DATA_ROUND}/ready/rank-\d+(?:\.[0-9a-f]+)?")
_QUORUM_RE = re.compile(rf"{_DATA_ROUND}/quorum\.json")  # quorum.json, or a copy of it in a spread run
_SHARD_OBJECT_RE = re.compile(
    rf"{_DATA_ROUND}/(?:contrib/(\d{{4,}})/rank-\d+|reduced/(\d{{4,}})(?:\.copy-\d+)?|partial/(?:l\d/)?\d{{4,}}/(\d{{4,}}))"
)
_ROUND_RE = re.compile(_DATA_ROUND)
_CONTROL_RE = re.compile(rf"{_DATA_ROUND}/(?:ready|votes)/[^/]+")  # ready markers, abstentions, votes, tombstones
#: Largest control object of a round a replica reads (a ready marker, an abstention, a vote or tombstone
#: without values: well under 1 KiB honestly); a planted larger one is refused without being read in full.
CONTROL_MAX_BYTES = 1 << 20
#: Largest ``quorum.json`` (or copy) read: it holds every participant's ready marker (~0.3 KiB each).
QUORUM_MAX_BYTES = 4 << 20
_KEEP_LAYOUTS = 8  # rounds whose layout a CountingStore remembers (the newest)
#: Concurrent GETs of one replica: a round splits large tensors into part-sized shards (topology.split_for),
#: so a gather is many single-part objects; the store's connection pool (64) is the real bound.
_GET_THREADS = 64
_ROUND_TRIP_SAMPLES = 9  # listings whose duration :attr:`CountingStore.round_trip_s` is the median of


def ranks_in(keys: Sequence[str]) -> set[int]:
    """Ranks named by ``.../rank-<r>`` keys (others are ignored)."""
    out: set[int] = set()
    for k in keys:
        m = _RANK_RE.search(k)
        if m:
            out.add(int(m.group(1)))
    return out


def markers_in(keys: Sequence[str]) -> dict[int, list[tuple[str, str | None]]]:
    """Ready-marker keys among ``keys`` (a listing of a round's ready prefix), by rank: each as
    ``(key, tag)``, the tag being the MAC in the name (``None`` for a marker named without one), sorted."""
    out: dict[int, list[tuple[str, str | None]]] = {}
    for k in sorted(keys):
        m = _RANK_RE.search(k)
        if m:
            out.setdefault(int(m.group(1)), []).append((k, m.group(2)))
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


class RoundLayout(NamedTuple):
    """What a round averages, as far as object sizes go (from a ready marker or the quorum)."""

    numel: int
    world_size: int
    codec: str
    protocol: str = "flat"  # exchange.topology's protocol (with ``split``, it fixes the shard count)
    split: int = 1

    @property
    def shards(self) -> int:
        return shard_count(self.world_size, self.protocol, self.split)

    def shard_numel(self, shard: int) -> int:
        """Elements of ``shard`` (as :func:`shard_bounds` cuts them); 0 for a shard that cannot exist."""
        if shard >= self.shards:
            return 0
        base, extra = divmod(self.numel, self.shards)
        return base + (1 if shard < extra else 0)

    @classmethod
    def from_marker(cls, marker: object) -> RoundLayout | None:
        """The layout a ready marker (JSON object) describes; ``None`` if it is not well formed
        (the exchange's own parsing then reports it)."""
        if not isinstance(marker, dict):
            return None
        numel, world_size, codec = marker.get("numel"), marker.get("world_size"), marker.get("codec")
        if type(numel) is not int or type(world_size) is not int or numel < 0 or world_size < 1:
            return None
        if not isinstance(codec, str):
            return None
        try:
            validate_codec(codec)
        except ValueError:
            return None
        protocol, split = marker.get("protocol", "flat"), marker.get("split", 1)
        if protocol not in PROTOCOLS or type(split) is not int or split < 1:
            return None
        return cls(numel, world_size, codec, protocol, split)


class CountingStore:
    """Thin view of an :class:`ObjectStore` that counts payload bytes moved (for ``RoundStats``)
    and bounds the size of the exchange objects it reads (see the module docstring).

    Counts object bodies only (PUT and GET); listings and existence checks are not counted.
    Thread-safe. Errors from the store propagate unchanged, except that an object over its size
    limit raises :class:`CorruptObjectError` naming the key.
    """

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self.bytes_up = 0
        self.bytes_down = 0
        self._pool: ThreadPoolExecutor | None = None
        self._control: ThreadPoolExecutor | None = None
        self._layouts: dict[int, tuple[RoundLayout, bool]] = {}  # round -> (layout, from our own marker)
        self._round_trips: deque[float] = deque(maxlen=_ROUND_TRIP_SAMPLES)

    @property
    def round_trip_s(self) -> float:
        """This store's round trip as this replica sees it: the median duration of its recent listings
        (a listing moves almost no bytes, so it is one request's latency); 0.0 before the first."""
        with self._lock:
            samples = list(self._round_trips)
        return statistics.median(samples) if samples else 0.0

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
        if _OWN_MARKER_RE.fullmatch(key):  # our own ready marker: the round's layout as we know it
            self._learn(key, data, own=True)

    def put_copies(self, keys: Sequence[str], data: bytes) -> None:
        """PUT ``data`` at each of ``keys`` in the background, on the control pool: copies that other
        replicas read instead of one hot object (of a quorum, of a small reduced shard), which nobody in
        this replica waits for. A copy that fails is logged and left: its readers fall back to the
        original."""

        def put(key: str) -> None:
            try:
                self.put(key, data)
            except Exception as e:  # noqa: BLE001 - a copy is an optimisation: never fail the caller
                logger.warning("could not put the copy %s (%s); its readers will read the original", key, e)

        for key in keys:
            self._control_executor().submit(put, key)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        created = self.store.put_if_absent(key, data)
        self._add(up=len(data))
        return created

    # ----------------------------------------------------------------- size limits

    def expect_round(self, round: int, layout: RoundLayout, *, own: bool = True) -> None:
        """Bound the objects of ``round`` by ``layout`` from now on. A layout from this replica's
        own marker (``own``) is kept over one read from the store (a quorum)."""
        with self._lock:
            known = self._layouts.get(round)
            if known is not None and known[1] and not own:
                return
            self._layouts[round] = (layout, own)
            while len(self._layouts) > _KEEP_LAYOUTS:
                del self._layouts[min(self._layouts)]

    def max_bytes(self, key: str) -> int | None:
        """Largest valid size of the object at ``key``: bounded for a contribution or reduced shard
        of a round whose layout is known, for ``quorum.json`` (:data:`QUORUM_MAX_BYTES`) and the round's
        other control objects (:data:`CONTROL_MAX_BYTES`), else ``None`` (no limit)."""
        m = _SHARD_OBJECT_RE.fullmatch(key)
        if m is None:
            if _QUORUM_RE.fullmatch(key):
                return QUORUM_MAX_BYTES
            return CONTROL_MAX_BYTES if _CONTROL_RE.fullmatch(key) else None
        with self._lock:
            known = self._layouts.get(int(m.group(1)))
        if known is None:
            return None
        layout = known[0]
        if m.group(4) is not None:  # a hierarchical group partial: always fp32
            return max_object_bytes("fp32", layout.shard_numel(int(m.group(4))))
        if m.group(2) is not None:  # a contribution: the round's codec (a sparse one's is ~36x below int8's,
            # and a bound under the transfer part size is read with one GET, not a ranged GET per part)
            return max_object_bytes(layout.codec, layout.shard_numel(int(m.group(2))))
        return max_object_bytes(reduced_codec(layout.codec), layout.shard_numel(int(m.group(3))))

    def _learn(self, key: str, data: bytes, *, own: bool) -> None:
        """Record the round layout in a ready marker or ``quorum.json`` we wrote or read; anything
        malformed is ignored here (the exchange's own parsing reports it)."""
        try:
            obj = json.loads(data)
            if not own:  # quorum.json: the first participant's marker, as the exchange uses it
                first = min(obj["participants"])
                obj = obj["markers"][str(first)]
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            return
        layout = RoundLayout.from_marker(obj)
        m = _ROUND_RE.match(key)
        if layout is not None and m is not None:
            self.expect_round(int(m.group(1)), layout, own=own)

    def _fetch(self, key: str, max_bytes: int | None) -> bytes:
        """One GET, refused as :class:`CorruptObjectError` if over ``max_bytes`` (default: :meth:`max_bytes`)."""
        limit = self.max_bytes(key) if max_bytes is None else max_bytes
        try:
            data = self.store.get(key, max_bytes=limit)
        except ObjectTooLarge as e:
            raise CorruptObjectError(
                f"exchange object {key!r} is larger than the {e.max_bytes} bytes a valid object there can have; "
                "refusing it without reading it in full (no replica of this round writes one that large)"
            ) from e
        if _QUORUM_RE.fullmatch(key):
            self._learn(key, data, own=False)
        return data

    # ----------------------------------------------------------------- reads

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """One GET (see :meth:`get_many` for ``max_bytes``)."""
        data = self._fetch(key, max_bytes)
        self._add(down=len(data))
        return data

    def get_many(
        self, keys: Sequence[str], *, missing_ok: bool = False, max_bytes: int | None = None
    ) -> dict[str, bytes]:
        """Concurrent single GETs (one request per key: no existence probe before each GET).

        Missing keys are omitted if ``missing_ok``, else the store's ``ObjectNotFound`` propagates.
        Each object is bounded by ``max_bytes`` if given, else by :meth:`max_bytes` of its key; one
        over its bound raises :class:`CorruptObjectError` naming it.
        """

        def one(key: str) -> bytes | None:
            try:
                return self._fetch(key, max_bytes)
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

    def get_async(self, key: str, *, control: bool = False) -> Future[bytes | None]:
        """Start one GET in the background; the future yields ``None`` if the object is missing.
        ``control`` objects (ready markers, the votes of a flat round: up to 16 at once) use a pool of
        their own, so they never queue behind contribution downloads."""
        pool = self._control_executor() if control else self._executor()
        return pool.submit(lambda: self.get_many([key], missing_ok=True).get(key))

    def get_or_none(self, key: str) -> bytes | None:
        """One GET; ``None`` if the object does not exist."""
        return self.get_many([key], missing_ok=True).get(key)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=_GET_THREADS, thread_name_prefix="exchange-get")
            return self._pool

    def _control_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._control is None:
                self._control = ThreadPoolExecutor(max_workers=16, thread_name_prefix="exchange-control")
            return self._control

    def close(self) -> None:
        with self._lock:
            pools, self._pool, self._control = (self._pool, self._control), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)

    def get_json(self, key: str) -> Any:
        return json.loads(self.get(key).decode("utf-8"))

    def put_json(self, key: str, obj: Any) -> None:
        self.put(key, json_bytes(obj))

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self._timed(self.store.list, prefix)

    def list_md5(self, prefix: str = "") -> dict[str, str | None]:
        """The keys under ``prefix`` with each object's MD5 where the listing tells it
        (:meth:`ObjectStore.list_md5`), in one listing."""
        return self._timed(self.store.list_md5, prefix)

    def _timed(self, lister: Callable[[str], T], prefix: str) -> T:
        """One listing, timed as one of the store's round trips (it moves almost no bytes)."""
        t = time.monotonic()
        out = lister(prefix)
        with self._lock:
            self._round_trips.append(time.monotonic() - t)
        return out

    def list_many(self, prefixes: Sequence[str]) -> builtins.list[str]:
        """The keys under each of ``prefixes``, listed concurrently (on the control pool) when several."""
        if len(prefixes) == 1:
            return self.list(prefixes[0])
        return [k for keys in self._control_executor().map(self.list, prefixes) for k in keys]

    def delete(self, key: str, *, recursive: bool = False) -> None:
        self.store.delete(key, recursive=recursive)


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")
