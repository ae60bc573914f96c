"""Ready markers and the create-only quorum of an exchange round.

See docs/architecture.md, "The exchange protocol", step 2.

A replica writes ``ready/rank-<r>.<tag>`` after all of its contribution objects, the tag being the
marker's MAC (:func:`marker_tag`). Every field of a marker but the rank is the same for all the
round's participants, so the quorum's writer computes the tag each peer's marker must carry and
reads a marker only when its name says something else (a mismatch, a marker of an earlier version,
a forgery): the listing that shows the last replica ready is enough to write the quorum. The first replica that
sees all N ready markers, or whose straggler deadline passes with at least ``min_replicas`` ready,
writes ``quorum.json`` with create-only semantics (S3 ``If-None-Match: *``, GCS
``ifGenerationMatch=0``, ``os.link`` locally); everyone then reads the one that won. The quorum
copies the participants' ready markers, so every replica, including late ones, checks that all
participants agree on element count, dtype and codec *before* anything is reduced, and raises the
same :class:`MismatchError` everywhere.

Above 16 replicas (a spread run, :func:`~diloco_serverless.run.layout.spread_count`) N replicas polling
one prefix would exceed the store's per-prefix request rate (S3: 5,500 GET/s; 1,024 replicas listing
the ready markers and reading ``quorum.json`` offered ~100,000/s in the scale model). There only ranks
below :data:`QUORUM_LISTERS` list the ready markers on every poll; the writer, once its create won,
puts :func:`quorum_copies` copies of ``quorum.json`` in the spread prefixes, and every other replica
(a *reader*) polls its copy, listing the ready markers only every :func:`reader_list_s` (rates shared
out so that the readers together stay under :data:`READER_LIST_RATE`). That slow listing is also how a
reader finds a round it must close itself: every lister dead, a straggler deadline, abstentions, a copy
that never came (it then reads ``quorum.json`` itself).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import re
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from typing import Any

from diloco_serverless.exchange._io import CountingStore, json_bytes, markers_in
from diloco_serverless.exchange.errors import (
    AbstainedError,
    CorruptObjectError,
    MismatchError,
    RoundPrunedError,
)
from diloco_serverless.exchange.polling import Backoff
from diloco_serverless.run.integrity import MAC_FIELD, mac_json, verify_json
from diloco_serverless.run.layout import (
    ROUNDS_PREFIX,
    abstain_key,
    control_spread,
    quorum_copy_key,
    quorum_key,
    ready_key,
    ready_prefixes,
    spread_count,
)

logger = logging.getLogger(__name__)

#: In a run of more than 16 replicas, ranks below this list the ready markers on every poll (as every
#: replica of a smaller run does) and read ``quorum.json`` itself; the others read a copy.
QUORUM_LISTERS = 16
#: Listing requests per second that the readers of a round send to its ready prefix, all together
#: (a fifth of S3's 5,500 GET/s per prefix).
READER_LIST_RATE = 1000.0


@dataclass(frozen=True)
class ReadyMarker:
    """What rank ``rank`` contributed to round ``round``: checked by every replica before reducing."""

    run_id: str
    round: int
    rank: int
    world_size: int
    numel: int
    dtype: str
    shape: list[int]
    codec: str
    protocol: str = "flat"  # direct, flat or hierarchical (diloco_serverless.exchange.topology)
    split: int = 1  # pieces per replica share (diloco_serverless.exchange.topology.split_for)
    #: the round's plan when the run decides H at run time (``inner.sync_every = "auto"``): replicas that
    #: trained the round under different plans (one of them deleted and replaced) fail it, never average it
    plan: str | None = None

    def signature(self) -> tuple[Any, ...]:
        return (self.world_size, self.numel, self.dtype, self.codec, self.protocol, self.split, self.plan)

    def describe(self) -> str:
        return (
            f"rank {self.rank}: shape {tuple(self.shape)} ({self.numel} elements, {self.dtype}, codec {self.codec}, "
            f"{self.protocol} exchange{f', {self.split} pieces per share' if self.split != 1 else ''}"
            f"{f', round plan {self.plan}' if self.plan is not None else ''})"
        )

    def to_json(self) -> dict[str, Any]:
        """The marker as stored and signed (``plan`` only when the run has one, so markers of fixed-H runs
        are byte-for-byte what they were before plans existed)."""
        doc = asdict(self)
        if self.plan is None:
            del doc["plan"]
        return doc

    @classmethod
    def parse(cls, data: bytes, *, key: str, run_key: bytes | None = None) -> ReadyMarker:
        """A stored ready marker; CorruptObjectError naming ``key`` if malformed or not signed."""
        try:
            obj = json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptObjectError(f"ready marker {key!r} is not JSON ({e}); refusing it") from e
        check_signature(run_key, "ready", obj, key)
        if not isinstance(obj, dict):
            raise CorruptObjectError(f"ready marker {key!r} is not a JSON object; refusing it")
        return cls.from_json(obj, key=key)

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, key: str) -> ReadyMarker:
        try:
            optional = {"split", "plan"}  # markers of earlier versions / fixed-H runs do not carry them
            marker = cls(**{f: obj[f] for f in cls.__dataclass_fields__ if f in obj or f not in optional})
        except (KeyError, TypeError) as e:
            raise CorruptObjectError(f"ready marker {key!r} is malformed ({e}); refusing it") from e
        if marker.plan is not None and (type(marker.plan) is not str or len(marker.plan) > 200):
            raise CorruptObjectError(f"ready marker {key!r} has plan={marker.plan!r}, not a short string; refusing it")
        if type(marker.split) is not int or marker.split < 1:
            raise CorruptObjectError(f"ready marker {key!r} has split={marker.split!r}, not a count >= 1; refusing it")
        return marker


#: Ready-marker keys of a round by rank, as :func:`~diloco_serverless.exchange._io.markers_in` lists them.
Listed = dict[int, list[tuple[str, str | None]]]
#: Markers the quorum's writer holds or is reading: the marker itself, or its key and the GET under way.
Fetched = dict[int, ReadyMarker | tuple[str, Future[bytes | None]]]


def marker_tag(marker: ReadyMarker, run_key: bytes | None) -> str:
    """The tag in ``marker``'s key (:func:`~diloco_serverless.run.layout.ready_key`): its MAC under the run
    key, i.e. the ``mac`` field of the stored marker, so only a holder of the key can name a marker;
    without a run key the SHA-256 of the marker's canonical JSON (integrity, not authenticity, as for
    everything in a run without a key)."""
    doc = marker.to_json()
    if run_key is not None:  # signed for the marker's place: rank r's marker of its round, wherever it is spread
        return str(mac_json(run_key, "ready", doc, place=ready_key(marker.round, marker.rank))[MAC_FIELD])
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def _named(me: ReadyMarker, rank: int, keys: list[tuple[str, str | None]], run_key: bytes | None) -> ReadyMarker | None:
    """Rank ``rank``'s marker without reading it: ``me`` with that rank, when one of ``keys`` (its listed
    markers) carries that marker's tag; ``None`` when it must be read."""
    twin = replace(me, rank=rank)
    want = marker_tag(twin, run_key)
    return twin if any(tag is not None and hmac.compare_digest(tag, want) for _, tag in keys) else None


def fetch_markers(io: CountingStore, me: ReadyMarker, ranks: set[int], listed: Listed, run_key: bytes | None,
                  fetched: Fetched) -> None:
    """Add to ``fetched`` the markers of ``ranks`` it lacks (not ``me``'s): named after the marker
    ``me`` implies for them (no request), else a GET started of the rank's first listed key."""
    for r in sorted(ranks - set(fetched) - {me.rank}):
        keys = listed.get(r, [])
        known = _named(me, r, keys, run_key)
        if known is not None:
            fetched[r] = known
        else:
            key = keys[0][0] if keys else ready_key(me.round, r, spread=control_spread(me.world_size))
            fetched[r] = (key, io.get_async(key, control=True))


def collect_markers(fetched: Fetched, ranks: list[int], run_key: bytes | None) -> dict[int, ReadyMarker]:
    """The markers of ``ranks`` from ``fetched`` (waiting for their GETs, parsing and checking what was
    read; :class:`CorruptObjectError` for a bad one), removing them from it; a marker whose object was
    gone is left out."""
    out: dict[int, ReadyMarker] = {}
    for r in ranks:
        held = fetched.pop(r)
        if isinstance(held, ReadyMarker):
            out[r] = held
            continue
        key, future = held
        data = future.result()
        if data is not None:
            marker = ReadyMarker.parse(data, key=key, run_key=run_key)
            if marker.rank != r:
                raise CorruptObjectError(f"ready marker {key!r} is rank {marker.rank}'s, found under rank {r}'s "
                                         "key; refusing it")
            out[r] = marker
    return out


@dataclass(frozen=True)
class Quorum:
    """The participants of one round (sorted ranks) and their ready markers."""

    run_id: str
    round: int
    participants: list[int]
    markers: dict[int, ReadyMarker]
    created_by: int

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "round": self.round,
            "participants": self.participants,
            "created_by": self.created_by,
            "created_at": time.time(),
            "markers": {str(r): m.to_json() for r, m in self.markers.items()},
        }

    @classmethod
    def parse(cls, data: bytes, *, key: str, run_id: str, round: int, run_key: bytes | None = None) -> Quorum:
        """Parse ``quorum.json``; raises :class:`CorruptObjectError` naming ``key`` if it is bad, foreign
        or (with ``run_key``) not signed with the run's key."""
        try:
            obj = json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptObjectError(f"quorum object {key!r} is not valid quorum JSON ({e}); refusing it") from e
        check_signature(run_key, "quorum", obj, key)
        try:
            markers = {int(r): ReadyMarker.from_json(m, key=key) for r, m in obj["markers"].items()}
            q = cls(
                obj["run_id"],
                int(obj["round"]),
                sorted(int(r) for r in obj["participants"]),
                markers,
                int(obj["created_by"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptObjectError(f"quorum object {key!r} is not valid quorum JSON ({e}); refusing it") from e
        if q.run_id != run_id or q.round != round:
            raise CorruptObjectError(
                f"quorum object {key!r} belongs to run {q.run_id!r} round {q.round}, "
                f"expected run {run_id!r} round {round}; "
                "is another run using the same store URL and run id?"
            )
        if not q.participants or set(q.participants) != set(markers):
            raise CorruptObjectError(
                f"quorum object {key!r} lists participants {q.participants} without matching markers"
            )
        return q


_ABSTAIN_RE = re.compile(r"/abstain-(\d+)$")


def abstained_in(keys: list[str]) -> set[int]:
    """Ranks with an ``abstain-<r>`` object among ``keys`` (a listing of the round's ready prefix)."""
    return {int(m.group(1)) for m in map(_ABSTAIN_RE.search, keys) if m}


def signed_json(run_key: bytes | None, kind: str, obj: dict[str, Any], key: str) -> bytes:
    """``obj`` as JSON bytes, with its HMAC under the run key when there is one, bound to ``key`` (where it
    is written: :func:`~diloco_serverless.run.integrity.place_of`)."""
    return json_bytes(mac_json(run_key, kind, obj, place=key) if run_key is not None else obj)


def check_signature(run_key: bytes | None, kind: str, obj: object, key: str) -> None:
    """With a run key, refuse (CorruptObjectError naming ``key``) an object not signed with it for ``key``,
    the key it was read from."""
    if run_key is not None and not verify_json(run_key, kind, obj, place=key):
        raise CorruptObjectError(
            f"{kind} object {key!r} does not carry this run's signature for this key (forged, copied from another "
            "key, or written by another launch of the same run id); refusing it. Check who can write the bucket "
            "prefix (docs/security.md)"
        )


def write_abstention(io: CountingStore, me: ReadyMarker, reason: str, run_key: bytes | None = None) -> None:
    """Announce that ``me.rank`` will not contribute to ``me.round`` (why: ``reason``), so the others
    close the round without waiting for it, or fail at once if they cannot."""
    record = {"run_id": me.run_id, "round": me.round, "rank": me.rank, "reason": reason[:500]}
    key = abstain_key(me.round, me.rank, control_spread(me.world_size))
    io.put(key, signed_json(run_key, "abstain", record, key))


def _read_abstention(io: CountingStore, me: ReadyMarker, rank: int, run_key: bytes | None) -> str | None:
    """The reason rank ``rank`` gave for abstaining, or None if its record is missing, foreign or forged."""
    key = abstain_key(me.round, rank, control_spread(me.world_size))
    data = io.get_or_none(key)
    try:
        obj = json.loads(data.decode("utf-8")) if data is not None else None
        check_signature(run_key, "abstain", obj, key)
    except (ValueError, UnicodeDecodeError, CorruptObjectError):
        return None
    if (not isinstance(obj, dict) or obj.get("run_id") != me.run_id or obj.get("round") != me.round
            or obj.get("rank") != rank):
        return None
    return " ".join(str(obj.get("reason", "?")).split())[:200]


def _abstention_error(ready: set[int], me: ReadyMarker, reasons_by_rank: dict[int, str],
                      min_replicas: int) -> AbstainedError:
    reasons = [f"rank {r}: {reason}" for r, reason in sorted(reasons_by_rank.items())]
    return AbstainedError(
        f"round {me.round}: only {len(ready)} of {me.world_size} replicas can contribute and min_replicas="
        f"{min_replicas}; abstained ({'; '.join(reasons)}). Fix the diverging replica (lower inner.lr, raise "
        "inner.warmup_steps) or set exchange min_replicas lower so the run can go on without it"
    )


def read_quorum(io: CountingStore, *, run_id: str, round: int, run_key: bytes | None = None) -> Quorum | None:
    """The round's quorum, or ``None`` when no replica has written it yet."""
    key = quorum_key(round)
    data = io.get_or_none(key)
    return None if data is None else Quorum.parse(data, key=key, run_id=run_id, round=round, run_key=run_key)


def check_agreement(quorum: Quorum, me: ReadyMarker) -> None:
    """Raise :class:`MismatchError` (identically on every replica) unless all participants and ``me``
    agree on world size, element count, dtype and codec. Names both ranks and both shapes."""
    ref = quorum.markers[quorum.participants[0]]
    for r in quorum.participants[1:]:
        other = quorum.markers[r]
        if other.signature() != ref.signature():
            raise MismatchError(
                f"round {quorum.round}: replicas disagree on what they average — "
                f"{ref.describe()} vs {other.describe()}; "
                "every replica must all-reduce the same flat tensor with the same codec, world size and "
                "exchange.topology"
            )
    if me.signature() != ref.signature():
        raise MismatchError(
            f"round {quorum.round}: this replica's tensor does not match the round's participants — "
            f"{me.describe()} vs {ref.describe()}; every replica must all-reduce the same flat tensor"
        )


@dataclass
class QuorumWait:
    """Parameters of :func:`wait_for_quorum` (seconds are monotonic-clock deadlines / intervals)."""

    world_size: int
    min_replicas: int
    straggler_timeout_s: float
    deadline: float
    poll_interval_s: float
    run_key: bytes | None = None  # verify ready markers, abstentions and the quorum with it


def _try_create(
    io: CountingStore, me: ReadyMarker, ready: set[int], run_key: bytes | None, fetched: Fetched, listed: Listed,
) -> Quorum | None:
    """Write quorum.json (create-only) from the markers of ``ready``; the quorum if ours won, else
    ``None`` (losing the race is fine: the caller reads the winner). ``fetched`` holds the markers
    known or being read since polling began (our own marker is ``me``); ``listed`` the last listing."""
    markers: dict[int, ReadyMarker] = {me.rank: me} if me.rank in ready else {}
    others = sorted(ready - set(markers))
    fetch_markers(io, me, set(others), listed, run_key, fetched)  # the rest at once, concurrently
    markers.update(collect_markers(fetched, others, run_key))
    if not markers:
        return None
    q = Quorum(me.run_id, me.round, sorted(markers), markers, me.rank)
    data = signed_json(run_key, "quorum", q.to_json(), quorum_key(me.round))
    if io.put_if_absent(quorum_key(me.round), data):
        put_copies(io, me, data)
        return q
    return None


def quorum_copies(world_size: int) -> int:
    """How many copies of ``quorum.json`` the writer of a round puts for its readers: none up to 16
    replicas (every replica reads ``quorum.json``), else one per 64 replicas, in as many spread prefixes
    (:func:`~diloco_serverless.run.layout.control_spread`, at least 1): 1 at N = 17-64, 4 at 256, 16 at 1,024."""
    return 0 if spread_count(world_size) == 1 else control_spread(world_size)


def list_ready(io: CountingStore, round: int, world_size: int) -> list[str]:
    """The keys under the ready prefixes of ``round`` (one listing, or one per prefix, concurrently, in
    a run above 64 replicas: :func:`~diloco_serverless.run.layout.control_spread`)."""
    return io.list_many(ready_prefixes(round, control_spread(world_size)))


def copy_to_read(me: ReadyMarker) -> str | None:
    """The key of the quorum copy ``me`` polls, or ``None`` for a replica that lists the ready markers
    and reads ``quorum.json`` itself (every replica up to 16, the ranks below :data:`QUORUM_LISTERS` above)."""
    copies = quorum_copies(me.world_size)
    if copies == 0 or me.rank < QUORUM_LISTERS:
        return None
    return quorum_copy_key(me.round, me.rank % copies, spread_count(me.world_size))


def put_copies(io: CountingStore, me: ReadyMarker, data: bytes) -> None:
    """Put the copies of the quorum ``data`` that ``me`` just created, in the background. A copy that
    fails is logged and left: its readers find ``quorum.json`` itself at their next slow listing."""
    spread = spread_count(me.world_size)
    io.put_copies([quorum_copy_key(me.round, c, spread) for c in range(quorum_copies(me.world_size))], data)


def reader_list_s(io: CountingStore, p: QuorumWait) -> float:
    """How often a reader (:func:`copy_to_read`) lists the ready markers: the readers' listing pages
    shared out under :data:`READER_LIST_RATE` per second and ready prefix (1 s at N = 1,024), and never
    more often than the grace a writer gets (:func:`grace_s`)."""
    readers = max(0, p.world_size - QUORUM_LISTERS)
    pages = math.ceil(p.world_size / control_spread(p.world_size) / 1000)  # per ready prefix
    return max(grace_s(io, p), readers * pages / READER_LIST_RATE)


def _read_copy(io: CountingStore, me: ReadyMarker, key: str, run_key: bytes | None) -> Quorum | None:
    """The quorum from the copy at ``key``; ``None`` while it is missing. Raises :class:`CorruptObjectError`
    for a copy that is corrupt, foreign or not signed (the caller ignores that copy from then on:
    ``quorum.json`` stays the authority)."""
    data = io.get_or_none(key)
    return None if data is None else Quorum.parse(data, key=key, run_id=me.run_id, round=me.round, run_key=run_key)


def grace_s(io: CountingStore, p: QuorumWait) -> float:
    """How long an entitled replica that is not the designated writer leaves the writer: four round
    trips (the writer's last marker GET and its create, our read, one spare) and never under half a
    second. On a slow store (seconds per request) a fixed grace had every replica fetch the N markers
    and race the create, three wasted round trips each."""
    return max(4 * p.poll_interval_s, 0.5, 4 * io.round_trip_s)


def check_moved_on(io: CountingStore, me: ReadyMarker, *, voted: bool = False) -> None:
    """One recursive listing of ``rounds/`` by a replica stuck waiting in round ``me.round``.

    Raises :class:`RoundPrunedError` if a later round already has a quorum, or, in a round without a
    quorum object (``voted``, :mod:`~diloco_serverless.exchange.votes`), a contribution or vote: someone
    finished this round without us. Raises :class:`MismatchError` if another replica runs this round
    with the other kind of consensus (ready markers or ``quorum.json`` in a round we vote in, votes in a
    round we wait for a quorum of): it was configured with another ``exchange.topology``.
    """
    later, other = [], []
    for parts in (k.split("/") for k in io.list(ROUNDS_PREFIX)):
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        r, kind = int(parts[1]), parts[2]
        if r > me.round and (kind == "quorum.json" and len(parts) == 3 or voted and kind in ("contrib", "votes")):
            later.append(r)
        elif r == me.round and (kind in ("ready", "quorum.json") if voted else kind == "votes"):
            other.append("/".join(parts))
    if later:
        raise RoundPrunedError(
            f"round {me.round} is not complete but round {min(later)} has begun: the run moved on without this "
            f"replica (rank {me.rank}) and round {me.round} may have been pruned; heal from the latest checkpoint"
        )
    if other:
        mine, theirs = ("votes (no quorum)", "a quorum") if voted else ("a quorum", "votes (no quorum)")
        raise MismatchError(
            f"round {me.round}: this replica (rank {me.rank}, a {me.protocol} round) runs it with {mine} but "
            f"another replica runs it with {theirs} ({sorted(other)[0]!r}); every replica must use the same "
            "exchange.topology and store part size"
        )


def wait_for_quorum(
    io: CountingStore, me: ReadyMarker, p: QuorumWait, on_ready: Callable[[set[int]], None] | None = None
) -> Quorum:
    """Poll ``ready/`` until a quorum exists, writing it ourselves when we are entitled to.

    Entitled = all N ready, or our straggler deadline passed with ``min_replicas`` ready. The
    lowest ready rank writes at once (one replica reads the N markers, not N replicas); any other
    entitled replica writes after a grace of four round trips (at least 0.5 s), so a writer that died
    costs only that grace. A reader of a run above 16 replicas (:func:`copy_to_read`) polls its copy of
    the quorum instead, and lists and reads ``quorum.json`` only every :func:`reader_list_s`.
    ``on_ready`` sees the ready ranks after every listing (the exchange starts prefetching there).
    Raises ``TimeoutError`` naming the ranks that never arrived when ``p.deadline`` passes with
    fewer than ``min_replicas`` ready, and :class:`RoundPrunedError` if the run moved on.
    """
    started = time.monotonic()
    backoff, last_skip_check, last_read = Backoff(p.poll_interval_s), started - 1.0, started
    copy = copy_to_read(me)
    # a reader lists first after one to two periods (spread over ranks), then every period
    every_s = reader_list_s(io, p) if copy is not None else 0.0
    next_list = started + every_s * (1.0 + (me.rank * 0.6180339887) % 1.0)
    entitled_since: float | None = None
    seen: set[int] = set()
    reasons: dict[int, str] = {}  # verified abstentions: rank -> reason
    fetched: Fetched = {}  # ready markers known or being read for the quorum we may write
    ready: set[int] = set()
    listed: Listed = {}
    while True:
        due = copy is None or time.monotonic() >= min(next_list, p.deadline)  # a listing this poll
        if due and copy is not None:
            next_list = time.monotonic() + every_s
        if due and len(ready) < p.world_size:  # once all N are ready, only the quorum is left to read
            listing = list_ready(io, me.round, p.world_size)
            listed = markers_in(listing)
            ready = {r for r in listed if 0 <= r < p.world_size}
            for r in {r for r in abstained_in(listing) if 0 <= r < p.world_size} - ready - set(reasons):
                reason = _read_abstention(io, me, r, p.run_key)
                if reason is not None:
                    reasons[r] = reason
        abstained = set(reasons) - ready
        if due and on_ready is not None:
            on_ready(ready)
        now = time.monotonic()
        accounted = len(ready) + len(abstained) >= p.world_size
        if due and accounted and len(ready) < p.min_replicas and read_quorum(
            io, run_id=me.run_id, round=me.round, run_key=p.run_key
        ) is None:
            raise _abstention_error(ready, me, {r: reasons[r] for r in abstained}, p.min_replicas)
        entitled = (accounted and len(ready) >= p.min_replicas) or (
            now - started >= p.straggler_timeout_s and len(ready) >= p.min_replicas
        )
        if ready and me.rank == min(ready):  # we will write the quorum: fetch what it copies now
            fetch_markers(io, me, ready, listed, p.run_key, fetched)
        if entitled and due:  # a reader acts on its own listings only (the grace fits between two)
            entitled_since = now if entitled_since is None else entitled_since
            if me.rank == min(ready) or now - entitled_since >= grace_s(io, p):
                created = _try_create(io, me, ready, p.run_key, fetched, listed)
                if created is not None:
                    return created  # ours won: no need to read it back
        if copy is not None:
            try:
                q = _read_copy(io, me, copy, p.run_key)
            except CorruptObjectError as e:
                logger.warning("ignoring the quorum copy %s: %s; listing the ready markers and reading "
                               "quorum.json on every poll instead", copy, e)
                copy, q, every_s = None, None, 0.0  # from now on, poll as a lister does
            if q is not None:
                return q
        if (entitled and due) or (due and now - last_read >= max(p.poll_interval_s, 0.5)):
            last_read = now  # others may have formed it without us
            q = read_quorum(io, run_id=me.run_id, round=me.round, run_key=p.run_key)
            if q is not None:
                return q
        if now >= p.deadline:
            missing = sorted(set(range(p.world_size)) - ready)
            raise TimeoutError(
                f"round {me.round}: ranks {missing} never became ready (ready: {sorted(ready)}, "
                f"min_replicas={p.min_replicas}); check those replicas' logs or lower min_replicas"
            )
        if now - started >= p.straggler_timeout_s and now - last_skip_check >= max(1.0, every_s):
            check_moved_on(io, me)
            last_skip_check = now
        if ready != seen:
            seen = ready
            backoff.reset()
        time.sleep(min(backoff.next(), max(0.0, p.deadline - now)))
