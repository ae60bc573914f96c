"""The hierarchical round: a tree of groups sums each shard, level by level, instead of everyone reading everyone.

Used by :class:`~diloco_serverless.exchange.allreduce.ObjectStoreAllReduce` when its protocol is
``hierarchical`` (:mod:`.topology`); publishing, the quorum and the ready markers are the flat
protocol's. With L levels (:func:`~.topology.levels`: 2, or 3 from 128 replicas), branching
``c = ceil(N^(1/L))`` and S = c shards, after the quorum Q (docs/exchange.md, "Hierarchical exchange"):

1. **Level-1 partials.** Group k holds ranks ``[k*c, (k+1)*c)``; its participants, in rank order,
   are its members. ``partial/<k>/<j>`` is the fp32 sum of the members' decoded contributions to
   shard j in rank order, written create-only by member ``members[j mod |members|]``. In a sparse round
   each contribution passes the robust-aggregation guard first (:mod:`.robust`), against the median of
   the group's norms of that shard: nobody below the root sees every contribution, and a group
   with three or more participants has a median of its own (``c >= 3`` from N = 5).
2. **Level-2 partials** (three levels only). Group k of level 2 holds level-1 groups
   ``[k*c, (k+1)*c)`` (ranks ``[k*c^2, (k+1)*c^2)``); ``partial/l2/<k>/<j>`` is the sum of their
   partials of shard j in group order, written create-only by member ``members[(|members| - 1 - j)
   mod |members|]`` of the level-2 group.
3. **Reduce.** ``reduced/<j>`` is the sum of the top level's partials of shard j in group order,
   divided by |Q|, encoded with the round's codec and written create-only by ``Q[(|Q| - 1 - j) mod |Q|]``.
4. **Gather.** Everyone GETs the S reduced shards. Above 64 replicas, when a reduced shard is at most
   :data:`COPY_MAX_BYTES`, the replica whose create of it won also puts :func:`reduced_copies` copies
   of it in other prefixes (in the background) and every other replica reads copy ``rank mod copies``:
   N replicas reading S small objects within two round trips would send each object's prefix ~N GETs
   at once (17,000/s at N = 1,024 for a 4 MB tensor in the scale model, against S3's 5,500). A
   replica whose copy has not appeared after half the takeover timeout reads the original.

Per replica that is S + 1 PUTs up front, ~S requests for its level-1 partial, S at the end (the
few owners of deeper objects read c objects each): O(L * N^(1/L)) requests against flat's O(N).
Waiting for objects polls one of them (a GET, rotated by rank over the missing ones) and fetches the
rest once it appears, so a replica that waits costs one request per poll, not one per missing object.

Every object is create-only and deterministic, so whoever writes it first, the bytes are the same; a
replica that waits past ``takeover_timeout_s`` for a partial or reduced shard computes it itself
(recursively, from the stored partials or contributions below it), exactly as the flat protocol
takes over a dead owner's shard. Everyone decodes the same ``reduced`` objects, so results are
bit-identical on every replica.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import torch

from diloco_serverless.errors import ExchangeError
from diloco_serverless.exchange._io import CountingStore
from diloco_serverless.exchange.codec import (
    ShardHeader,
    Summand,
    decode_shard,
    decode_summand,
    decode_values,
    dense,
    encode_values,
    max_object_bytes,
    pack,
    reduced_codec,
)
from diloco_serverless.exchange.polling import Backoff
from diloco_serverless.exchange.quorum import Quorum, ReadyMarker
from diloco_serverless.exchange.robust import guarded_sum
from diloco_serverless.exchange.sparse import is_sparse
from diloco_serverless.exchange.topology import branching, levels
from diloco_serverless.exchange.votes import piece_header
from diloco_serverless.run.layout import (
    contrib_key,
    control_spread,
    partial_key,
    reduced_copy_key,
    reduced_key,
    spread_count,
)

#: Largest reduced shard object that gets copies (above it, reading it takes long enough that the
#: N replicas' GETs of it spread out on their own: 36 MB shards at 400 MB and N = 1,024 peak at
#: 2,939 GET/s per prefix in the scale model). Each copy costs its writer one more upload of the shard.
COPY_MAX_BYTES = 16 << 20


def reduced_copies(world_size: int, shard_object_bytes: int) -> int:
    """Copies of each reduced shard of a hierarchical round: one per 64 replicas above 64
    (:func:`~diloco_serverless.run.layout.control_spread`) when the shard is at most
    :data:`COPY_MAX_BYTES`, else none."""
    k = control_spread(world_size)
    return k if k > 1 and shard_object_bytes <= COPY_MAX_BYTES else 0


@dataclass
class HierarchicalRound:
    """One replica's view of one hierarchical round after its quorum (see the module docstring).

    Tree nodes are ``(level, group)``: level 0 are the ranks, level ``L`` the single root (the
    reduced shards); ``(l, k)`` holds the ranks ``q`` with ``q // c**l == k``.
    """

    io: CountingStore
    run_id: str
    run_key: bytes | None
    rank: int
    r: int
    quorum: Quorum
    bounds: list[tuple[int, int]]
    own: list[torch.Tensor] | None  # our decoded contributions, per shard (None if we did not publish)
    takeover_timeout_s: float
    poll_interval_s: float
    deadline: float

    def __post_init__(self) -> None:
        self.ref: ReadyMarker = self.quorum.markers[self.quorum.participants[0]]
        n = self.ref.world_size
        self.spread = spread_count(n)
        self.depth, self.c = levels(n), branching(n)
        self.members: dict[tuple[int, int], list[int]] = {}
        for q in self.quorum.participants:  # in rank order
            for level in range(1, self.depth + 1):
                self.members.setdefault((level, q // self.c**level), []).append(q)
        self.have: dict[tuple[int, int, int], torch.Tensor] = {}  # (level, group, shard) -> values
        self.reduced_shards: list[int] = []
        largest = max((b - a for a, b in self.bounds), default=0)
        self.top_codec = reduced_codec(self.ref.codec)  # the reduced shards' (int8 in a sparse round)
        self.copies = reduced_copies(n, max_object_bytes(self.top_codec, largest))
        self.takeovers: list[str] = []
        self.wait_s = 0.0

    # ------------------------------------------------------------------ tree

    def children(self, level: int, k: int) -> list[int]:
        """The groups of ``level - 1`` (ranks for level 1) inside group k of ``level`` that hold a participant."""
        if level == 1:
            return self.members[(1, k)]
        return sorted({q // self.c ** (level - 1) for q in self.members[(level, k)]})

    def owner(self, level: int, k: int, j: int) -> int:
        """Who writes group k's object of shard j at ``level`` (the reduced shard at the top)."""
        m = self.members[(level, k)]
        return m[j % len(m)] if level == 1 else m[(len(m) - 1 - j) % len(m)]

    def key(self, level: int, k: int, j: int) -> str:
        if level == self.depth:
            return reduced_key(self.r, j, self.spread)
        return partial_key(self.r, k, j, self.spread, level=level)

    def read_key(self, level: int, k: int, j: int, *, original: bool = False) -> str:
        """Where this replica reads the object: a reduced shard's copy ``rank mod copies`` when it has
        copies (unless ``original``), else :meth:`key`."""
        if level == self.depth and self.copies and not original:
            return reduced_copy_key(self.r, j, self.rank % self.copies, self.spread)
        return self.key(level, k, j)

    def _put_copies(self, j: int, data: bytes) -> None:
        """Put the copies of reduced shard j (``data``: the stored original's bytes), in the background."""
        self.io.put_copies([reduced_copy_key(self.r, j, c, self.spread) for c in range(self.copies)], data)

    def _header(self, level: int, k: int, j: int) -> ShardHeader:
        a, b = self.bounds[j]
        kind, who, codec = ("reduced", None, self.top_codec) if level == self.depth else ("partial", k, "fp32")
        return ShardHeader(self.run_id, self.r, j, kind, codec, b - a, who, self.ref.dtype, self.ref.shape,  # type: ignore[arg-type]
                           list(self.quorum.participants) if kind == "reduced" else None)

    # ------------------------------------------------------------------ objects

    def compute(self, level: int, k: int, j: int) -> torch.Tensor:
        """Group k's object of shard j at ``level`` (>= 1): the fp32 sum of its children's in order
        (divided by |Q| and encoded with the round's codec at the top), stored create-only; returns
        what the stored object decodes to (ours, or the identical one another replica wrote first)."""
        a, b = self.bounds[j]
        acc = torch.zeros(b - a, dtype=torch.float32)
        if level == 1 and is_sparse(self.ref.codec):  # the guard, against the median of the group's norms
            acc = guarded_sum(list(zip(self.members[(1, k)], self._contributions(k, j))),
                              what=f"round {self.r} group {k} shard {j}")
        elif level == 1:
            for values in self._contributions(k, j):
                acc += dense(values)
        else:
            kids = self.children(level, k)
            self._await(
                {i: (level - 1, i, j) for i in kids},
                what=f"level-{level - 1} partials of shard {j} (group: owner rank)",
            )
            for i in kids:
                acc += self.have[(level - 1, i, j)]
        if level == self.depth:
            acc /= len(self.quorum.participants)
        header = self._header(level, k, j)
        key = self.key(level, k, j)
        enc = encode_values(acc, header.codec)
        data = pack(enc, asdict(header), self.run_key, place=key)
        if self.io.put_if_absent(key, data):
            out = decode_values(enc, header.codec, header.numel)
            if level == self.depth:  # the copies of our original (a writer that lost leaves them to the winner)
                self._put_copies(j, data)
        else:
            out = decode_shard(self.io.get(key), key=key, expect=header, run_key=self.run_key)
        self.have[(level, k, j)] = out
        return out

    def _contributions(self, k: int, j: int) -> list[Summand]:
        """Shard j of group k's members' contributions, decoded (a sparse codec's as sent), in rank order
        (ours from memory)."""
        members = self.members[(1, k)]
        mine = self.own is not None and self.rank in members
        keys = {q: contrib_key(self.r, j, q, self.spread) for q in members if not (mine and q == self.rank)}
        blobs = self.io.get_many(list(keys.values()), missing_ok=True)
        out: list[Summand] = []
        for q in members:
            if mine and q == self.rank:
                assert self.own is not None
                out.append(self.own[j])
                continue
            if keys[q] not in blobs:
                raise ExchangeError(
                    f"round {self.r}: contribution {keys[q]!r} of participant {q} is missing although its ready "
                    "marker exists; the round was pruned or the store lost it — restart the round"
                )
            head = piece_header(replace(self.ref, rank=q), j, self.bounds[j])
            out.append(decode_summand(blobs.pop(keys[q]), key=keys[q], expect=head, run_key=self.run_key))
        return out

    # ------------------------------------------------------------------ the round

    def run(self) -> torch.Tensor:
        """Do this replica's share of the round and return the reduced tensor (flat fp32)."""
        shards = range(len(self.bounds))
        if self.rank in self.quorum.participants:
            for level in range(1, self.depth + 1):
                k = self.rank // self.c**level
                for j in shards:
                    if self.owner(level, k, j) == self.rank:
                        self.compute(level, k, j)
                        if level == self.depth:
                            self.reduced_shards.append(j)
        self._await({j: (self.depth, 0, j) for j in shards}, what="reduced shards (shard: owner rank)")
        out = torch.empty(self.ref.numel, dtype=torch.float32)
        for j in shards:
            out[self.bounds[j][0] : self.bounds[j][1]].copy_(self.have[(self.depth, 0, j)])
        return out

    def _await(self, nodes: dict[int, tuple[int, int, int]], *, what: str) -> None:
        """Make every ``(level, group, shard)`` of ``nodes`` available in ``self.have``: read the stored
        objects (polling ONE missing object per poll, rotated by rank, and fetching all missing ones as
        soon as it appears; backing off); past the takeover timeout compute what is still missing;
        TimeoutError at the round deadline, naming the owners waited for."""
        started, backoff = time.monotonic(), Backoff(self.poll_interval_s)
        missing = {i: node for i, node in nodes.items() if node not in self.have}
        probe = True  # the objects are usually being written right now: ask for one, not all
        original = False  # read copies of reduced shards until half the takeover timeout has passed
        while missing:
            order = sorted(missing)
            batch = [order[self.rank % len(order)]] if probe else order
            keys = {i: self.read_key(*missing[i], original=original) for i in batch}
            blobs = self.io.get_many(list(keys.values()), missing_ok=True)
            found = False
            for i, key in keys.items():
                if key in blobs:
                    node, found = missing.pop(i), True
                    self.have[node] = decode_shard(
                        blobs.pop(key), key=key, expect=self._header(*node), run_key=self.run_key
                    )
            if not missing:
                return
            if found and probe:
                probe = False  # the probed object appeared: fetch all the others at once
                continue
            probe = True
            now = time.monotonic()
            original = original or now - started >= self.takeover_timeout_s / 2
            if now - started >= self.takeover_timeout_s:
                for _, node in sorted(missing.items()):
                    if node not in self.have:  # a takeover below may have computed it already
                        self.compute(*node)
                        self.takeovers.append(self.key(*node))
                return
            if now >= self.deadline:
                owners = {i: self.owner(*node) for i, node in missing.items()}
                raise TimeoutError(f"round {self.r}: {what} never appeared: {owners}; check those replicas")
            pause = min(backoff.next(), max(0.0, self.deadline - now))
            time.sleep(pause)
            self.wait_s += pause
