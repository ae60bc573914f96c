"""Rounds without a quorum object: each replica's create-only vote says it contributed.

A direct round (:mod:`~diloco_serverless.exchange.topology`: whole tensors, everyone sums everyone's) or a
flat one (shards reduced by their owners, then gathered) with its data under ``rounds/`` (N <= 16) needs no
ready marker and no ``quorum.json``. Each rank q has a vote key, written create-only: in a direct round
whose share is one object, its contribution key ``rounds/<r>/contrib/0000/rank-<q>``; otherwise
``rounds/<r>/votes/rank-<q>``, written after every contribution object of q (the ``split`` pieces of its
share in a direct round, its N x ``split`` shards in a flat one). The vote key ends up holding exactly
one of:

* rank q's **vote**: its ready marker (world size, element count, dtype, codec, protocol, split) in the
  header, for the agreement check, with its values when it is a direct round's whole share; or
* a **tombstone**: an exchange object without values whose header says why rank q is left out: it
  abstained (written by q itself: its values were not finite), or it had not contributed when another
  replica's straggler deadline passed with at least ``min_replicas`` contributions (written by that replica).

Whichever create comes first wins, so every replica that lists N keys sees the same N objects (it reads
each, or checks it from the MD5 the listing shows: ``VotedRound._as_expected``), and the
participants are the ranks holding a vote: the same participant list everywhere, as a quorum gives,
without waiting for a quorum to be written and read (two to three sequential round trips fewer;
docs/exchange.md, "Rounds without a quorum"). A direct round then sums the participants' contributions
in rank order on every replica; a flat round hands the participants to the usual reduce and gather
(create-only reduced shards, takeover of a dead owner's shard). A replica that finds a tombstone where
its vote should go is late: it receives the mean of the others. A restarted replica that finds its own
earlier vote there takes part with what it stored then (with contributions in several objects, it checks
for its vote before rewriting any; a flat round's shards are create-only, so it keeps those it wrote).
A dead replica's stored contribution is all anyone needs of it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace

import torch

from diloco_serverless.errors import ExchangeError
from diloco_serverless.exchange._io import CountingStore, RoundLayout, ranks_in, shard_bounds
from diloco_serverless.exchange.codec import (
    ShardHeader,
    Summand,
    check_fields,
    decode_as_sent,
    decode_summand,
    decode_summand_checked,
    encode_values,
    pack,
    reduced_codec,
    roundtrip,
    unpack,
)
from diloco_serverless.exchange.errors import (
    AbstainedError,
    CorruptObjectError,
    MismatchError,
    ParticipantsChangedError,
    RoundPrunedError,
)
from diloco_serverless.exchange.polling import Backoff
from diloco_serverless.exchange.quorum import (
    Quorum,
    QuorumWait,
    ReadyMarker,
    check_agreement,
    check_moved_on,
    grace_s,
)
from diloco_serverless.exchange.robust import guarded_sum
from diloco_serverless.exchange.sparse import SparseValues, concat, is_sparse
from diloco_serverless.run.layout import contrib_key, spread_count, vote_key
from diloco_serverless.store.errors import ObjectNotFound

__all__ = ["Entry", "VotedRound", "mean_of", "quorum_of", "quorumless", "read_entry"]

#: The header field that makes an exchange object a tombstone (its value: why the rank is left out).
EXCLUDED = "excluded"


def _md5(data: bytes) -> str:
    """The MD5 of an object's bytes, as a store listing shows it (S3's ETag, GCS's md5Hash)."""
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def quorumless(marker: ReadyMarker, *, quorum: bool = False) -> bool:
    """Whether a round described by ``marker`` runs without a quorum object: a direct or flat round whose
    data lives under ``rounds/`` (N <= 16), unless the exchange gives every round a quorum (``quorum``: a
    sliced, multi-device exchange, whose slices share the leader's). Hierarchical rounds keep theirs: a
    group's partial sums need the participants before anyone reduces. Every replica derives the same
    answer."""
    return not quorum and marker.protocol in ("direct", "flat") and spread_count(marker.world_size) == 1


def whole_vote(marker: ReadyMarker) -> bool:
    """Whether the votes of the round ``marker`` describes are the contributions themselves: a direct
    round whose share is one object."""
    return marker.protocol == "direct" and marker.split == 1


def vote_keys(marker: ReadyMarker) -> dict[int, str]:
    """Each rank's vote key in the round ``marker`` describes: its contribution when that is one object
    (:func:`whole_vote`), else ``votes/rank-<q>``."""
    r, n = marker.round, marker.world_size
    return {q: contrib_key(r, 0, q) if whole_vote(marker) else vote_key(r, q) for q in range(n)}


@dataclass(frozen=True)
class Entry:
    """What rank ``rank``'s vote key holds: its vote (``marker``; ``values`` once its pieces are read) or
    a tombstone (``reason`` it is left out, written by rank ``by``). A sparse round's ``values`` read from the
    store stay sparse (:data:`~diloco_serverless.exchange.codec.Summand`) until they are summed."""

    rank: int
    marker: ReadyMarker | None = None
    values: Summand | None = None
    reason: str | None = None
    by: int | None = None

    @property
    def contributed(self) -> bool:
        return self.marker is not None


def contribution(values: torch.Tensor, me: ReadyMarker, run_key: bytes | None) -> tuple[bytes, Summand]:
    """Rank ``me.rank``'s contribution object (its marker in the header) and the values others will decode
    (a sparse codec's as they were sent, :func:`~diloco_serverless.exchange.codec.decode_as_sent`)."""
    enc = encode_values(values, me.codec)
    header = {**asdict(piece_header(me, 0, (0, me.numel))), "marker": me.to_json()}
    return pack(enc, header, run_key, place=vote_keys(me)[me.rank]), decode_as_sent(enc, me.codec, me.numel)


def vote(me: ReadyMarker, run_key: bytes | None) -> bytes:
    """Rank ``me.rank``'s vote when its contribution is several objects: its marker, no values."""
    header = {"run_id": me.run_id, "round": me.round, "shard": 0, "rank": me.rank, "marker": me.to_json()}
    return pack({}, header, run_key, place=vote_keys(me)[me.rank])


def piece_header(marker: ReadyMarker, j: int, bounds: tuple[int, int]) -> ShardHeader:
    """The header of contribution object ``j`` (values ``bounds``) of ``marker.rank``: a piece of its
    share, or, with ``bounds`` the whole tensor, its whole share."""
    return ShardHeader(marker.run_id, marker.round, j, "contrib", marker.codec, bounds[1] - bounds[0], marker.rank,
                       marker.dtype, marker.shape)


def tombstone(me: ReadyMarker, rank: int, reason: str, run_key: bytes | None) -> bytes:
    """The tombstone ``me.rank`` writes at rank ``rank``'s contribution key: why ``rank`` is left out."""
    header = {"run_id": me.run_id, "round": me.round, "shard": 0, "rank": rank, EXCLUDED: reason[:500],
              "by": me.rank}
    return pack({}, header, run_key, place=vote_keys(me)[rank])


def read_entry(data: bytes, *, key: str, run_id: str, round: int, rank: int, run_key: bytes | None) -> Entry:
    """Parse what a vote key of a quorum-less round holds (a vote separate from its contribution has no
    values: ``values`` is ``None``; a direct round reads them from the pieces).
    :class:`CorruptObjectError` naming ``key`` for bad bytes,
    a foreign run or round, a wrong rank or a missing signature; :class:`MismatchError` for a
    contribution of another exchange protocol (a replica configured differently: it carries no ready
    marker)."""
    tensors, header = unpack(data, key=key, run_key=run_key)
    if header.get("run_id") != run_id or header.get("round") != round or header.get("rank") != rank:
        raise CorruptObjectError(
            f"exchange object {key!r} belongs to run {header.get('run_id')!r} round {header.get('round')!r} rank "
            f"{header.get('rank')!r}, expected run {run_id!r} round {round} rank {rank}; refusing it "
            "(is another run using the same store URL and run id?)"
        )
    if EXCLUDED in header:
        by = header.get("by")
        if tensors or type(by) is not int:
            raise CorruptObjectError(f"tombstone {key!r} holds values or names no writer; refusing it")
        return Entry(rank, reason=" ".join(str(header[EXCLUDED]).split())[:200], by=by)
    if not isinstance(header.get("marker"), dict):
        raise MismatchError(
            f"round {round}: rank {rank} published a contribution of another exchange protocol at {key!r} (no "
            "ready marker in it) while this replica runs a direct round without a quorum; every replica must "
            "use the same exchange.topology and store part size"
        )
    marker = ReadyMarker.from_json(header["marker"], key=key)
    if marker.run_id != run_id or marker.round != round or marker.rank != rank:
        raise CorruptObjectError(f"exchange object {key!r} carries the marker of {marker.describe()}; refusing it")
    if not whole_vote(marker):
        if tensors:
            raise CorruptObjectError(f"vote {key!r} of a {marker.protocol} round (split {marker.split}) holds "
                                     "values; refusing it")
        return Entry(rank, marker=marker)
    expect = piece_header(marker, 0, (0, marker.numel))
    check_fields(header, key=key, expect=expect)
    return Entry(rank, marker=marker, values=decode_summand_checked(tensors, key=key, expect=expect))


def quorum_of(entries: dict[int, Entry], me: ReadyMarker) -> Quorum:
    """The round's participants (ranks holding a vote) and their markers, as a quorum object would hold
    them (``created_by`` -1: nobody wrote one). :class:`MismatchError` (the same on every replica) if
    they disagree on what they average, :class:`AbstainedError` if nobody contributed."""
    participants = sorted(q for q, e in entries.items() if e.contributed)
    if not participants:
        raise AbstainedError(f"round {me.round}: no replica contributed (every one is tombstoned); nothing to average")
    markers = {q: m for q in participants if (m := entries[q].marker) is not None}
    quorum = Quorum(me.run_id, me.round, participants, markers, -1)
    check_agreement(quorum, me)
    return quorum


def mean_of(entries: dict[int, Entry], me: ReadyMarker) -> tuple[list[int], torch.Tensor]:
    """The participants of a direct round and their mean: summed in rank order in fp32, divided by their
    count and passed through the codec, the same operations on every replica. Errors of
    :func:`quorum_of`."""
    quorum = quorum_of(entries, me)
    participants, ref = quorum.participants, quorum.markers[quorum.participants[0]]
    acc = torch.zeros(ref.numel, dtype=torch.float32)
    for q in participants:
        values = entries[q].values
        assert values is not None
        if not is_sparse(ref.codec):
            assert not isinstance(values, SparseValues)
            acc += values
    if is_sparse(ref.codec):  # through the robust-aggregation guard (exchange/robust.py), sparse as sent
        acc = guarded_sum([(q, v) for q in participants if (v := entries[q].values) is not None],
                          what=f"round {me.round}")
    acc /= len(participants)
    # through the codec piece by piece, as the pieces were encoded (and as a quorum's direct round does);
    # fp32 (a sparse round's mean) passes through unchanged: no copy
    codec = reduced_codec(ref.codec, stored=False)
    if codec == "fp32":
        return participants, acc
    return participants, torch.cat([roundtrip(acc[a:b], codec) for a, b in shard_bounds(ref.numel, ref.split)])


def _joined(pieces: list[Summand]) -> Summand:
    """A share's decoded pieces, in order, as one vector (sparse if they are)."""
    sparse_pieces = [p for p in pieces if isinstance(p, SparseValues)]
    if len(sparse_pieces) == len(pieces):
        return concat(sparse_pieces)
    return torch.cat([p.to_dense() if isinstance(p, SparseValues) else p for p in pieces])


class VotedRound:
    """One quorum-less round of replica ``me.rank`` (see the module docstring).

    ``publish`` writes our contribution (or our abstention), ``collect`` waits until every rank's key
    holds something, writing tombstones for the missing ones once the straggler deadline allows;
    :func:`mean_of` turns a direct round's result into its mean, :func:`quorum_of` a flat round's into
    its participants. ``put_share`` writes a flat round's contribution objects (the exchange's own
    shard layout) before the vote; a direct round writes its own.
    """

    def __init__(self, io: CountingStore, me: ReadyMarker, wait: QuorumWait,
                 put_share: Callable[[torch.Tensor], None] | None = None) -> None:
        self.io, self.me, self.p = io, me, wait
        self.direct = me.protocol == "direct"
        self.put_share = put_share
        self.keys = vote_keys(me)
        self._expected_md5: dict[int, str] = {}  # rank -> MD5 of the vote we expect of it (_as_expected)
        self._decided_by: dict[int, str] = {}  # rank -> MD5 of the object that decided its entry (confirm)
        self.prefix = self.keys[0].rsplit("/", 1)[0]
        self.entries: dict[int, Entry] = {}
        self.pieces: dict[int, list[Future[bytes | None]]] = {}  # rank -> GETs of its pieces under way
        self.wait_s = 0.0
        io.expect_round(me.round, RoundLayout(me.numel, me.world_size, me.codec, me.protocol, me.split))

    def publish(self, flat: torch.Tensor, abstain: str | None, *, fresh: bool = False) -> Entry:
        """Create our vote (our contribution, its pieces first when it is cut; with ``abstain``, our
        tombstone saying why); if the key already holds something (we are late, or restarted after
        voting), that is what counts. Unless ``fresh`` (a first try, see ``ObjectStoreAllReduce``), a
        share in pieces checks for our vote before rewriting any piece. Returns our entry."""
        key, run_key, me = self.keys[self.me.rank], self.p.run_key, self.me
        if not whole_vote(me) and not fresh:
            stored = self.io.get_or_none(key)
            if stored is not None:
                return self._settle(self._read_own(stored))
        if abstain is not None:
            blob, mine = tombstone(me, me.rank, abstain, run_key), Entry(me.rank, reason=abstain, by=me.rank)
        elif whole_vote(me):
            blob, values = contribution(flat, me, run_key)
            mine = Entry(me.rank, marker=me, values=values)
        elif self.direct:
            blob, mine = vote(me, run_key), Entry(me.rank, marker=me, values=self._put_pieces(flat))
        else:
            if self.put_share is None:
                raise ValueError(f"a {me.protocol} round without a quorum needs put_share to write its shards")
            self.put_share(flat)
            blob, mine = vote(me, run_key), Entry(me.rank, marker=me)
        if not self.io.put_if_absent(key, blob):
            return self._settle(self._read_own(self.io.get(key)))
        self._decided_by[me.rank] = _md5(blob)
        self.entries[me.rank] = mine
        return mine

    def confirm(self) -> None:
        """Check, before the round's result is applied, that every vote key still holds the object that
        decided its rank's entry here (our own vote included): one listing, plus a GET of each key whose
        MD5 the listing does not show (local stores). A key deleted or replaced since (someone deleted a
        vote, and another replica then tombstoned it) raises :class:`ParticipantsChangedError`: this
        replica could otherwise apply another participant set than the others. Deletions fail a round,
        never change its result. On S3 and GCS the listing shows every MD5: no object is read again."""
        listed = self.io.list_md5(self.prefix)
        changed = []
        for q, key in sorted(self.keys.items()):
            want = self._decided_by.get(q)
            if want is None or key not in listed:
                changed.append((q, "gone" if key not in listed else "not read"))
                continue
            got = listed[key]
            if got is None:  # a local or memory store (its listing shows no MD5): read it there, off the byte count
                try:
                    got = _md5(self.io.store.get(key))
                except ObjectNotFound:
                    got = None
            if got != want:
                changed.append((q, "gone" if got is None else "replaced"))
        if changed:
            what = ", ".join(f"rank {q}'s vote key {how}" for q, how in changed)
            raise ParticipantsChangedError(
                f"round {self.me.round}: what decided its participants changed while it closed ({what}; keys under "
                f"{self.prefix}/). Someone deleted objects of the round: failing it rather than applying a "
                "participant set the other replicas may not share. Restart the replica; check who can delete "
                "under the run's prefix (docs/security.md)"
            )

    def complete(self) -> bool:
        """Whether every rank's vote key holds something (one listing; nothing is read)."""
        return set(self.keys.values()) <= set(self.io.list(self.prefix))

    def stored(self) -> dict[int, Entry] | None:
        """Every rank's entry of a round that is over (for replay), or ``None`` unless all N vote keys
        hold something."""
        if not self.complete():
            return None
        blobs = self.io.get_many(list(self.keys.values()), missing_ok=True)
        if len(blobs) != len(self.keys):
            return None  # pruned meanwhile
        for q, k in self.keys.items():
            self._decided_by[q] = _md5(blobs[k])
            self._add(self._read(q, blobs[k]))
        self._read_pieces()
        return dict(sorted(self.entries.items()))

    def collect(self, on_listed: Callable[[set[int]], None] | None = None) -> dict[int, Entry]:
        """Poll the round's vote prefix, reading each object as it appears, until all N keys hold
        something; returns them by rank. Where the votes are the contributions themselves (a direct round
        whose share is one object), a poll is instead a GET of each vote still missing, all at once: a vote
        is read in the round trip that finds it, not in one after the listing that shows it (a GET costs
        a twelfth of a listing on S3, and N <= 16 here). ``on_listed`` sees the ranks whose vote key holds something
        each time a listing shows new ones: a vote is written after every contribution object of its
        rank, so a flat round starts fetching their shards there, while the votes are being read (a
        tombstone's rank is simply never summed). Past our straggler deadline, with
        ``min_replicas``
        contributions, tombstones the missing ranks (the lowest contributor at once, anyone else after a
        grace of four round trips). Raises :class:`AbstainedError` (everywhere alike) when too few can
        contribute, ``TimeoutError`` naming the missing ranks at the round deadline, and
        :class:`~diloco_serverless.exchange.errors.RoundPrunedError` if the run moved on."""
        io, p, n = self.io, self.p, self.me.world_size
        started = time.monotonic()
        backoff, last_skip_check = Backoff(p.poll_interval_s), started - 1.0
        reading: dict[int, Future[bytes | None]] = {}
        entitled_since: float | None = None
        seen, announced = 0, set[int]()
        by_get = whole_vote(self.me)
        while True:
            if by_get:  # poll by GETs of the missing votes: one round trip per vote, not a listing and a GET
                for q in sorted(set(range(n)) - set(self.entries) - set(reading)):
                    reading[q] = io.get_async(self.keys[q])
                self._take(reading, wait=False)
                present = set(self.entries)
            else:
                listed = io.list_md5(self.prefix)
                present = {q for q in ranks_in(list(listed)) if 0 <= q < n} | set(self.entries)
                for q in sorted(present - set(self.entries) - set(reading)):
                    if self._as_expected(q, listed.get(self.keys[q])):
                        self._decided_by[q] = self._expected_md5[q]
                        self._add(Entry(q, marker=replace(self.me, rank=q)))
                    else:  # a vote without values is a control object: own pool
                        reading[q] = io.get_async(self.keys[q], control=True)
                if on_listed is not None and present - announced:
                    on_listed(present)
                    announced = present
                self._take(reading, wait=len(present) == n)
            if len(self.entries) == n:
                self._check_enough()
                self._read_pieces()
                return dict(sorted(self.entries.items()))
            self._check_enough()
            now = time.monotonic()
            if now - started >= p.straggler_timeout_s:
                if now - last_skip_check >= 1.0:  # first: a round the run left behind is never closed by us
                    last_skip_check = now
                    if self._moved_on(reading):
                        continue  # the votes that let the others finish were there: the round is complete
                self._take(reading, wait=True)
                contributors = [q for q, e in self.entries.items() if e.contributed]
                if len(contributors) >= p.min_replicas:
                    entitled_since = now if entitled_since is None else entitled_since
                    if self.me.rank == min(contributors) or now - entitled_since >= grace_s(io, p):
                        self._exclude(sorted(set(range(n)) - set(self.entries)))
                        continue
            if now >= p.deadline:
                missing = sorted(set(range(n)) - set(self.entries))
                raise TimeoutError(
                    f"round {self.me.round}: ranks {missing} never contributed (contributed: "
                    f"{sorted(q for q, e in self.entries.items() if e.contributed)}, min_replicas={p.min_replicas}); "
                    "check those replicas' logs or lower min_replicas"
                )
            pause = min(backoff.next(), max(0.0, p.deadline - now))
            if by_get:
                self._sleep_reading(reading, until=now + pause)
            else:
                time.sleep(pause)
            self.wait_s += time.monotonic() - now
            if len(set(self.entries) | present) > seen:  # progress: poll soon again
                seen = len(set(self.entries) | present)
                backoff.reset()

    # ------------------------------------------------------------------ helpers

    def _moved_on(self, reading: dict[int, Future[bytes | None]]) -> bool:
        """:func:`check_moved_on`, for a replica still missing votes. A later round means the others finished
        this one, with every rank's vote or tombstone stored, unless it was pruned: read the missing ones
        once more (what a poll in flight missed, e.g. a tombstone written just after our GET) and return
        True if they complete the round; re-raise the :class:`RoundPrunedError` if they do not."""
        try:
            check_moved_on(self.io, self.me, voted=True)
        except RoundPrunedError:
            self._take(reading, wait=True)
            for q in sorted(set(range(self.me.world_size)) - set(self.entries)):
                reading[q] = self.io.get_async(self.keys[q], control=not whole_vote(self.me))
            self._take(reading, wait=True)
            if len(self.entries) < self.me.world_size:
                raise
            return True
        return False

    def _sleep_reading(self, reading: dict[int, Future[bytes | None]], *, until: float) -> None:
        """Sleep until ``until`` (monotonic), taking each vote whose GET answers meanwhile; stop early once
        every rank's entry is in. A GET that found nothing is simply done: the next poll asks again."""
        while len(self.entries) < self.me.world_size and (left := until - time.monotonic()) > 0:
            if not reading:
                time.sleep(left)
                return
            done, _ = wait(list(reading.values()), timeout=left, return_when=FIRST_COMPLETED)
            if not done:
                return
            self._take(reading, wait=False)

    def _as_expected(self, rank: int, md5: str | None) -> bool:
        """Whether the listing shows that ``rank``'s vote key holds exactly the vote we expect of it (our
        own but for the rank; MAC'd with the run key): then it need not be read. The MD5 comes from the
        listing (S3's ETag, GCS's md5Hash; see ``ObjectStore.list_md5``); anything else (a tombstone, a
        vote that disagrees, a foreign object, a store that shows no MD5) is read and checked as always.
        Matching a given MD5 with other bytes needs a second preimage, which nobody can compute."""
        if md5 is None or whole_vote(self.me):
            return False
        expected = self._expected_md5.get(rank)
        if expected is None:
            blob = vote(replace(self.me, rank=rank), self.p.run_key)
            expected = self._expected_md5[rank] = hashlib.md5(blob, usedforsecurity=False).hexdigest()
        return md5 == expected

    def _take(self, reading: dict[int, Future[bytes | None]], *, wait: bool) -> None:
        """Move the finished reads (all of them with ``wait``) from ``reading`` into ``entries``."""
        for q in sorted(reading):
            fut = reading[q]
            if not wait and not fut.done():
                continue
            del reading[q]
            data = fut.result()
            if data is not None:  # gone again: the round is being pruned; the listing will tell
                self._decided_by[q] = _md5(data)
                self._add(self._read(q, data))

    def _add(self, entry: Entry) -> None:
        """Record ``entry``; in a direct round, a vote of a share in pieces starts the GETs of its pieces."""
        self.entries[entry.rank] = entry
        if self.direct and entry.marker is not None and entry.values is None:
            keys = [contrib_key(self.me.round, j, entry.rank) for j in range(entry.marker.split)]
            self.pieces[entry.rank] = [self.io.get_async(k) for k in keys]

    def _read_pieces(self) -> None:
        """Wait for the pieces of every vote read and decode them into its entry. A missing piece of a
        rank that voted is an error: pieces are written before the vote."""
        for q in sorted(self.pieces):
            marker = self.entries[q].marker
            assert marker is not None
            values: list[Summand] = []
            for j, (fut, b) in enumerate(zip(self.pieces.pop(q), shard_bounds(marker.numel, marker.split))):
                key, data = contrib_key(self.me.round, j, q), fut.result()
                if data is None:
                    raise ExchangeError(
                        f"round {self.me.round}: piece {key!r} of rank {q} is missing although its vote exists; the "
                        "round was pruned or the store lost it — restart the round"
                    )
                values.append(decode_summand(data, key=key, expect=piece_header(marker, j, b), run_key=self.p.run_key))
            self.entries[q] = replace(self.entries[q], values=_joined(values))

    def _settle(self, entry: Entry) -> Entry:
        """Our entry as the store holds it (we were late, or restarted after voting), with its values."""
        self._add(entry)
        self._read_pieces()
        return self.entries[entry.rank]

    def _read_own(self, data: bytes) -> Entry:
        self._decided_by[self.me.rank] = _md5(data)
        return self._read(self.me.rank, data)

    def _put_pieces(self, flat: torch.Tensor) -> Summand:
        """PUT our share's pieces concurrently; returns the values others will decode (sparse as sent)."""
        me, bounds = self.me, shard_bounds(self.me.numel, self.me.split)

        def one(j: int) -> Summand:
            a, b = bounds[j]
            enc = encode_values(flat[a:b], me.codec)
            header = asdict(piece_header(me, j, (a, b)))
            key = contrib_key(me.round, j, me.rank)
            self.io.put(key, pack(enc, header, self.p.run_key, place=key))
            return decode_as_sent(enc, me.codec, b - a)

        with ThreadPoolExecutor(max_workers=min(len(bounds), 32), thread_name_prefix=f"pieces-{me.rank}") as pool:
            return _joined(list(pool.map(one, range(len(bounds)))))

    def _read(self, rank: int, data: bytes) -> Entry:
        return read_entry(data, key=self.keys[rank], run_id=self.me.run_id, round=self.me.round, rank=rank,
                          run_key=self.p.run_key)

    def _exclude(self, ranks: list[int]) -> None:
        """Tombstone ``ranks`` (create-only, concurrently); a rank whose contribution won is read instead."""
        reason = (f"no contribution within rank {self.me.rank}'s straggler deadline "
                  f"({self.p.straggler_timeout_s:g} s)")
        if not ranks:
            return
        blobs = {q: tombstone(self.me, q, reason, self.p.run_key) for q in ranks}
        with ThreadPoolExecutor(max_workers=len(ranks), thread_name_prefix=f"exclude-{self.me.rank}") as pool:
            created = dict(zip(ranks, pool.map(lambda q: self.io.put_if_absent(self.keys[q], blobs[q]), ranks)))
        for q in ranks:
            if created[q]:
                self._decided_by[q] = _md5(blobs[q])
                self._add(Entry(q, reason=reason, by=self.me.rank))

    def _check_enough(self) -> None:
        """:class:`AbstainedError` once so many ranks abstained (tombstoned themselves) that ``min_replicas``
        cannot be met. Ranks tombstoned by another replica do not count: that replica closed the round with
        enough contributions (under its ``min_replicas``)."""
        out = {q: e for q, e in self.entries.items() if not e.contributed and e.by == q}
        if self.me.world_size - len(out) >= self.p.min_replicas:
            return
        reasons = "; ".join(f"rank {q}: {e.reason}" for q, e in sorted(out.items()))
        raise AbstainedError(
            f"round {self.me.round}: only {self.me.world_size - len(out)} of {self.me.world_size} replicas can "
            f"contribute and min_replicas={self.p.min_replicas}; left out ({reasons}). Fix the diverging replica "
            "(lower inner.lr, raise inner.warmup_steps) or set exchange min_replicas lower so the run can go on "
            "without it"
        )
