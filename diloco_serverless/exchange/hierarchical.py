"""The hierarchical round: groups of ~sqrt(N) replicas sum first, then the group sums are summed.

Used by :class:`~diloco_serverless.exchange.allreduce.ObjectStoreAllReduce` when its protocol is
``hierarchical`` (:mod:`.topology`); publishing, the quorum and the ready markers are the flat
protocol's. With ``g = ceil(sqrt(N))`` and S = g shards, after the quorum Q (docs/exchange.md,
"Hierarchical exchange"):

1. **Group partials.** Group k holds ranks ``[k*g, (k+1)*g)``; its participants, in rank order,
   are its members. Shard j's partial of group k, ``partial/<k>/<j>``, is the fp32 sum of the
   members' decoded contributions to shard j in rank order, written create-only by member
   ``members[j mod |members|]``.
2. **Reduce.** ``reduced/<j>`` is the sum of the group partials of shard j in group order, divided by
   |Q|, encoded with the round's codec and written create-only by ``Q[(|Q| - 1 - j) mod |Q|]``.
3. **Gather.** Everyone GETs the S reduced shards.

Per replica that is S + 1 PUTs up front, S GETs for a partial, |groups| GETs for a reduced shard
(only S replicas do it), S GETs at the end: O(sqrt N) requests against flat's O(N). Every object is
create-only and deterministic, so whoever writes it first, the bytes are the same; a replica that
waits past ``takeover_timeout_s`` for a partial or reduced shard computes it itself (from the stored
contributions, or partials), exactly as the flat protocol takes over a dead owner's shard. Everyone
decodes the same ``reduced`` objects, so results are bit-identical on every replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from diloco_serverless.errors import ExchangeError
from diloco_serverless.exchange._io import FIRST_POLL_S, CountingStore
from diloco_serverless.exchange.codec import ShardHeader, decode_shard, decode_values, encode_values, pack
from diloco_serverless.exchange.quorum import Quorum, ReadyMarker
from diloco_serverless.exchange.topology import group_count, group_size
from diloco_serverless.run.layout import contrib_key, partial_key, reduced_key, spread_count


@dataclass
class HierarchicalRound:
    """One replica's view of one hierarchical round after its quorum (see the module docstring)."""

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
        size = group_size(n)
        self.members = {k: [q for q in self.quorum.participants if q // size == k] for k in range(group_count(n))}
        self.groups = [k for k, m in self.members.items() if m]  # groups with at least one participant
        self.reduced_shards: list[int] = []
        self.takeovers: list[str] = []
        self.wait_s = 0.0

    # ------------------------------------------------------------------ ownership

    def partial_owner(self, k: int, j: int) -> int:
        m = self.members[k]
        return m[j % len(m)]

    def reduced_owner(self, j: int) -> int:
        q = self.quorum.participants
        return q[(len(q) - 1 - j) % len(q)]

    # ------------------------------------------------------------------ headers

    def _header(self, kind: str, j: int, who: int | None, codec: str) -> ShardHeader:
        a, b = self.bounds[j]
        return ShardHeader(self.run_id, self.r, j, kind, codec, b - a, who, self.ref.dtype, self.ref.shape)  # type: ignore[arg-type]

    def _decode(self, data: bytes, key: str, expect: ShardHeader) -> torch.Tensor:
        return decode_shard(data, key=key, expect=expect, run_key=self.run_key)

    def _store(self, key: str, values: torch.Tensor, header: ShardHeader) -> torch.Tensor:
        """Write ``values`` create-only at ``key``; return what the stored object decodes to (ours or
        the identical one another replica wrote first)."""
        enc = encode_values(values, header.codec)
        if self.io.put_if_absent(key, pack(enc, asdict(header), self.run_key)):
            return decode_values(enc, header.codec, header.numel)
        return self._decode(self.io.get(key), key, header)

    # ------------------------------------------------------------------ objects

    def compute_partial(self, k: int, j: int) -> torch.Tensor:
        """Group k's fp32 sum of shard j in rank order, from the stored contributions; stored create-only."""
        members = self.members[k]
        mine = self.own is not None and self.rank in members
        keys = {q: contrib_key(self.r, j, q, self.spread) for q in members if not (mine and q == self.rank)}
        blobs = self.io.get_many(list(keys.values()), missing_ok=True)
        a, b = self.bounds[j]
        acc = torch.zeros(b - a, dtype=torch.float32)
        for q in members:
            if mine and q == self.rank:
                assert self.own is not None
                acc += self.own[j]
                continue
            if keys[q] not in blobs:
                raise ExchangeError(
                    f"round {self.r}: contribution {keys[q]!r} of participant {q} is missing although its ready "
                    "marker exists; the round was pruned or the store lost it — restart the round"
                )
            acc += self._decode(blobs.pop(keys[q]), keys[q], self._header("contrib", j, q, self.ref.codec))
        return self._store(partial_key(self.r, k, j, self.spread), acc, self._header("partial", j, k, "fp32"))

    def compute_reduced(self, j: int, partials: dict[int, torch.Tensor]) -> torch.Tensor:
        """Shard j's mean from the group partials (those missing from ``partials`` are read or,
        past the takeover timeout, computed); stored create-only."""
        got = dict(partials)
        self._await(
            {k: partial_key(self.r, k, j, self.spread) for k in self.groups if k not in got},
            lambda k, key: self._decode_partial(k, j, key),
            lambda k: self.compute_partial(k, j),
            got,
            what=f"partials of shard {j} (group: owner rank)",
            owners={k: self.partial_owner(k, j) for k in self.groups},
        )
        acc = torch.zeros(self.bounds[j][1] - self.bounds[j][0], dtype=torch.float32)
        for k in self.groups:
            acc += got[k]
        acc /= len(self.quorum.participants)
        return self._store(reduced_key(self.r, j, self.spread), acc, self._header("reduced", j, None, self.ref.codec))

    def _decode_partial(self, k: int, j: int, key: str) -> Callable[[bytes], torch.Tensor]:
        return lambda data: self._decode(data, key, self._header("partial", j, k, "fp32"))

    # ------------------------------------------------------------------ the round

    def run(self) -> torch.Tensor:
        """Do this replica's share of the round and return the reduced tensor (flat fp32)."""
        out = torch.empty(self.ref.numel, dtype=torch.float32)
        shards = range(len(self.bounds))
        partials: dict[int, dict[int, torch.Tensor]] = {j: {} for j in shards}
        for k in self.groups:
            for j in shards:
                if self.partial_owner(k, j) == self.rank:
                    partials[j][k] = self.compute_partial(k, j)
        done: dict[int, torch.Tensor] = {}
        for j in shards:
            if self.reduced_owner(j) == self.rank:
                done[j] = self.compute_reduced(j, partials[j])
                self.reduced_shards.append(j)
        self._await(
            {j: reduced_key(self.r, j, self.spread) for j in shards if j not in done},
            lambda j, key: lambda data: self._decode(data, key, self._header("reduced", j, None, self.ref.codec)),
            lambda j: self.compute_reduced(j, partials[j]),
            done,
            what="reduced shards (shard: owner rank)",
            owners={j: self.reduced_owner(j) for j in shards},
        )
        for j, values in done.items():
            out[self.bounds[j][0] : self.bounds[j][1]].copy_(values)
        return out

    def _await(
        self,
        keys: dict[int, str],
        decoder: Callable[[int, str], Callable[[bytes], torch.Tensor]],
        take_over: Callable[[int], torch.Tensor],
        into: dict[int, torch.Tensor],
        *,
        what: str,
        owners: dict[int, int],
    ) -> None:
        """Poll ``keys`` (GETs of the missing ones, backing off) into ``into``; past the takeover
        timeout compute what is still missing with ``take_over``; TimeoutError at the round deadline."""
        started, sleep_s = time.monotonic(), min(FIRST_POLL_S, self.poll_interval_s)
        missing = dict(keys)
        while missing:
            blobs = self.io.get_many(list(missing.values()), missing_ok=True)
            for i, key in list(missing.items()):
                if key in blobs:
                    into[i] = decoder(i, key)(blobs.pop(key))
                    del missing[i]
            if not missing:
                return
            now = time.monotonic()
            if now - started >= self.takeover_timeout_s:
                for i, key in list(missing.items()):
                    into[i] = take_over(i)
                    self.takeovers.append(key)
                    del missing[i]
                return
            if now >= self.deadline:
                raise TimeoutError(
                    f"round {self.r}: {what} never appeared: {({i: owners[i] for i in missing})}; check those replicas"
                )
            pause = min(sleep_s, max(0.0, self.deadline - now))
            time.sleep(pause)
            self.wait_s += pause
            sleep_s = min(sleep_s * 1.5, self.poll_interval_s)
