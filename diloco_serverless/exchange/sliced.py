"""``SlicedAllReduce``: one slice of a multi-device replica's exchange, under one quorum per round.

A replica with G local processes (``parallel.devices = G``) cuts each flat pseudo-gradient into G
contiguous slices (:func:`~diloco_serverless.exchange._io.shard_bounds`); local rank g exchanges
slice g with local rank g of every other replica, in parallel with the other slices, under
``<run>/slices/<g:02d>/rounds/...`` (:func:`~diloco_serverless.run.layout.slice_prefix`). Each slice
is an ordinary :class:`~diloco_serverless.exchange.allreduce.ObjectStoreAllReduce` round (shards,
reducers, takeover, late replicas) over P/G elements, so every device moves 1/G of the bytes a G=1
replica moves.

**One quorum per round for all slices**: a replica takes part in a round with all its slices or
with none.

* Slice 0 (local rank 0, the *leader*) forms the round's quorum as usual, but writes its ready
  marker only after the ready markers of all its sibling slices exist (or the round's quorum was
  formed without it meanwhile): a replica that is in the quorum has published every slice.
* Slice g > 0 (a *follower*) publishes, then waits for slice 0's ``quorum.json`` and copies its
  participants into its own slice's ``quorum.json`` (create-only; every follower of the slice writes
  the same participants, the first create wins), with the participants' ready markers of slice g.
  A follower whose leader arrived after the quorum is late in its slice too.

Reduced slices are reassembled inside the replica by the trainer (an all-gather over the local
process group), not here: this module only touches the store.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from diloco_serverless.exchange._io import CountingStore, markers_in, ranks_in
from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce, _Round
from diloco_serverless.exchange.polling import Backoff
from diloco_serverless.exchange.quorum import (
    Fetched,
    Quorum,
    ReadyMarker,
    check_agreement,
    check_moved_on,
    collect_markers,
    fetch_markers,
    list_ready,
    read_quorum,
    signed_json,
    write_abstention,
)
from diloco_serverless.run.integrity import scoped_key
from diloco_serverless.run.layout import control_spread, quorum_key, ready_prefix, slice_prefix
from diloco_serverless.store.objectstore import ObjectStore

__all__ = ["SlicedAllReduce"]


class SlicedAllReduce(ObjectStoreAllReduce):
    """Slice ``slice_index`` of ``slices`` of replica ``rank``'s exchange (see the module docstring).

    Takes the arguments of :class:`ObjectStoreAllReduce` plus ``slice_index`` (this process's local
    rank) and ``slices`` (G, the replica's local processes). ``allreduce`` gets this slice's part of
    the flat tensor and returns its mean over the round's participants. Raises ``ValueError`` for a
    slice outside ``0..slices-1``.
    """

    _QUORUM = True  # flat and direct rounds too go through the leader's quorum (one quorum for all slices)

    def __init__(
        self,
        url: str | ObjectStore,
        rank: int,
        world_size: int,
        *,
        slice_index: int,
        slices: int,
        **options: Any,
    ) -> None:
        if slices < 1 or not 0 <= slice_index < slices:
            raise ValueError(
                f"slice_index must satisfy 0 <= slice_index < slices={slices}, got {slice_index}; "
                "it is the process's local rank (LOCAL_RANK) inside its replica"
            )
        super().__init__(url, rank, world_size, **options)
        self.slice_index, self.slices = slice_index, slices
        # Each slice's objects are signed with the run key scoped to its prefix (slices/<g>): its keys are
        # relative to that prefix, so the scope is what binds an object to its slice (a slice-0 object
        # copied to the same key under slices/01 is refused). Slice 0's key reads the leader's quorum.
        run_key = self._run_key
        self._slice_keys: list[bytes | None] = [
            None if run_key is None else scoped_key(run_key, slice_prefix(h)) for h in range(slices)
        ]
        self._run_key = self._slice_keys[slice_index]
        self._slice_io: list[CountingStore] = []
        if self._io is not None:
            run_store = self._io.store
            self._io.close()
            self._slice_io = [CountingStore(run_store.child(slice_prefix(h))) for h in range(slices)]
            self._io = self._slice_io[slice_index]

    def close(self) -> None:
        super().close()
        for io in self._slice_io:
            io.close()

    # ------------------------------------------------------------------ the leader (slice 0)
    def _before_ready(self, rs: _Round) -> None:
        """Slice 0: wait until every sibling slice of this replica is published (its ready marker)."""
        if self.slice_index != 0:
            return
        waiting = set(range(1, self.slices))
        backoff = Backoff(self.poll_interval_s)
        spread = control_spread(self.world_size)
        mine = ready_prefix(rs.r, self.rank % spread, spread)  # where this rank's markers are, in every slice
        io = self._io
        assert io is not None
        while waiting:  # a sibling's marker is named by its own tag (its slice's size): look for the rank
            waiting = {h for h in waiting
                       if self.rank not in ranks_in(self._slice_io[h].store.list(mine))}
            if not waiting:
                return
            if io.store.exists(quorum_key(rs.r)):  # the round closed without us: we are late in every slice
                return
            if time.monotonic() >= rs.deadline:
                raise TimeoutError(
                    f"round {rs.r}: slices {sorted(waiting)} of replica {self.rank} never published (no ready "
                    f"marker under {', '.join(slice_prefix(h) for h in sorted(waiting))}); check the replica's "
                    "other local processes"
                )
            time.sleep(backoff.next())

    # ------------------------------------------------------------------ followers (slice > 0)
    def _join(self, rs: _Round, flat: torch.Tensor, *, fresh: bool = False) -> Quorum:
        if self.slice_index == 0:
            return super()._join(rs, flat, fresh=fresh)
        io = self._io
        assert io is not None and rs.stats is not None
        lead = self._slice_io[0]
        t = time.monotonic()
        if read_quorum(lead, run_id=self.run_id, round=rs.r, run_key=self._slice_keys[0]) is None:
            if rs.stats.abstained is None:
                rs.own = self._publish(rs, flat)
            else:
                write_abstention(io, rs.me, rs.stats.abstained, self._run_key)
        waited = time.monotonic()
        rs.stats.phases_s["publish"] = waited - t
        quorum = read_quorum(io, run_id=self.run_id, round=rs.r, run_key=self._run_key)
        if quorum is None:
            leader = self._wait_leader_quorum(rs)
            markers = self._wait_markers(rs, leader.participants)
            mine = Quorum(self.run_id, rs.r, list(leader.participants), markers, self.rank)
            io.put_if_absent(quorum_key(rs.r), signed_json(self._run_key, "quorum", mine.to_json(), quorum_key(rs.r)))
            quorum = read_quorum(io, run_id=self.run_id, round=rs.r, run_key=self._run_key)
            assert quorum is not None  # we or another follower just created it
        rs.stats.wait_s += time.monotonic() - waited
        rs.stats.phases_s["quorum"] = time.monotonic() - waited
        check_agreement(quorum, rs.me)
        return quorum

    def _wait_leader_quorum(self, rs: _Round) -> Quorum:
        """Slice 0's quorum of round ``rs.r`` once some leader wrote it; TimeoutError at the deadline,
        RoundPrunedError if the run moved past the round."""
        lead = self._slice_io[0]
        started, last_skip_check = time.monotonic(), 0.0
        backoff = Backoff(self.poll_interval_s)
        while True:
            q = read_quorum(lead, run_id=self.run_id, round=rs.r, run_key=self._slice_keys[0])
            if q is not None:
                return q
            now = time.monotonic()
            if now >= rs.deadline:
                raise TimeoutError(
                    f"round {rs.r}: slice 0 never formed a quorum ({slice_prefix(0)}/{quorum_key(rs.r)} missing); "
                    "check the replicas' local rank 0 logs"
                )
            if now - started >= self.straggler_timeout_s and now - last_skip_check >= 1.0:
                check_moved_on(lead, rs.me)
                last_skip_check = now
            time.sleep(min(backoff.next(), max(0.0, rs.deadline - now)))

    def _wait_markers(self, rs: _Round, participants: list[int]) -> dict[int, ReadyMarker]:
        """This slice's ready markers of ``participants`` (each leader waited for them before its own)."""
        io = self._io
        assert io is not None
        markers: dict[int, ReadyMarker] = {}
        backoff = Backoff(self.poll_interval_s)
        while True:
            listed = markers_in(list_ready(io, rs.r, self.world_size))
            here = {r for r in participants if r not in markers and r in listed}
            fetched: Fetched = {}
            fetch_markers(io, rs.me, here, listed, self._run_key, fetched)  # named like ours: no GET
            markers.update(collect_markers(fetched, sorted(fetched), self._run_key))
            if self.rank in here:
                markers[self.rank] = rs.me
            if len(markers) == len(participants):
                return markers
            if time.monotonic() >= rs.deadline:
                missing = sorted(set(participants) - set(markers))
                raise TimeoutError(
                    f"round {rs.r}: slice {self.slice_index} of ranks {missing} has no ready marker although "
                    "they are in the round's quorum; the store lost it or those replicas died — the round fails"
                )
            time.sleep(backoff.next())
