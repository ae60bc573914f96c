"""Which exchange protocol a round uses, and how it cuts the tensor: picked from N (and the part size).

Every replica derives the same answer from the configured world size and the ``exchange.topology``
setting, and writes it in its ready marker, so replicas that disagree fail with a ``MismatchError``
before anything is reduced (docs/exchange.md, "Hierarchical exchange").

- ``direct`` (under ``auto``: N = 2, and small tensors below 64 replicas, :func:`direct_extra_bytes`):
  one contribution object per replica; each replica reads the others' and sums locally in rank order.
  1 PUT + (N-1) GETs of P bytes: at N = 2 exactly what a naive exchange moves, and a dead peer's stored
  contribution is all a survivor needs. No reduce and no gather: two to three fewer sequential round
  trips than flat, for ((N-1)(N-2) - 1) P / N more bytes per replica.
- ``flat``: S = N shards, reduce-scatter + all-gather (O(N) requests per replica, ~the byte bound).
  Direct and flat cut each replica's share into :func:`split_for` pieces when one object would
  exceed the store's part size (S3: one round trip instead of a multipart upload's three; GCS: many
  connections instead of one upload's single stream).
- a compressed codec (``sparse``, docs/exchange.md "Sparse pseudo-gradients"): under ``auto``, ``direct`` (an
  all-gather of the N small payloads) while its N objects per replica weigh no more than an ``int8`` flat
  round's bytes (:func:`compressed_direct`), else the protocol an int8 round would use.
- ``hierarchical``: a tree of L levels (:func:`levels`: 2 below :data:`THREE_LEVELS_FROM` replicas,
  3 from there) with branching ``c = ceil(N^(1/L))`` (:func:`branching`); S = c shards. Groups of c
  consecutive ranks sum each shard (a ``partial``); with 3 levels, groups of c groups sum those
  (a level-2 partial); one replica per shard sums the top level's partials; everyone fetches the c
  reduced shards: O(L * N^(1/L)) requests per replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, cast

Topology = Literal["flat", "hierarchical", "direct", "auto"]
Protocol = Literal["direct", "flat", "hierarchical"]

TOPOLOGIES: tuple[str, ...] = ("flat", "hierarchical", "direct", "auto")
PROTOCOLS: tuple[str, ...] = ("direct", "flat", "hierarchical")

#: ``auto`` switches from flat to hierarchical at this many replicas (benchmarks/scale.py, docs/exchange.md).
AUTO_HIERARCHICAL_FROM = 64
#: A hierarchical round uses three levels (groups of groups) from this many replicas, two below
#: (benchmarks/scale.py: fewer requests per replica from here at a similar round time).
THREE_LEVELS_FROM = 128
#: ``auto`` uses ``direct`` below :data:`AUTO_HIERARCHICAL_FROM` replicas while the bytes it moves beyond
#: flat (:func:`direct_extra_bytes`) stay under this: 32 MiB is 0.27 s at 1 Gbit/s, less than the two to
#: three sequential round trips (reduce, gather) direct saves on S3 or GCS at their tail latency.
AUTO_DIRECT_EXTRA_BYTES = 32 << 20


def resolve(topology: str, world_size: int, payload_bytes: int | None = None, *,
            compressed: tuple[int, int] | None = None) -> Protocol:
    """The protocol a round of ``world_size`` replicas uses under ``topology`` (flat, hierarchical,
    direct, auto), for a tensor of ``payload_bytes`` encoded bytes (``None``: not known yet).

    ``flat``, ``hierarchical`` and ``direct`` are honoured at any N >= 2 (hierarchical with N < 4 has
    one group). ``auto`` (the config default) uses ``direct`` at N = 2, where no sharded protocol beats
    it, and below :data:`AUTO_HIERARCHICAL_FROM` replicas for tensors small enough that direct's extra
    bytes cost less than the round trips it saves (:data:`AUTO_DIRECT_EXTRA_BYTES`); flat for larger
    tensors there; hierarchical from :data:`AUTO_HIERARCHICAL_FROM` replicas on. Every replica derives
    the same answer from the same config and tensor size.

    ``compressed`` (a sparse codec's payload bytes, and the same tensor's ``int8`` payload bytes): ``auto``
    picks ``direct`` whenever :func:`compressed_direct` says it moves no more bytes than an int8 flat round,
    at any N; otherwise it picks as above.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"exchange topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
    if topology != "auto":
        return cast(Protocol, topology)  # flat, hierarchical, direct: the protocol of the same name
    if world_size == 2:
        return "direct"
    if compressed is not None and compressed_direct(*compressed, world_size):
        return "direct"
    if world_size >= AUTO_HIERARCHICAL_FROM:
        return "hierarchical"
    if payload_bytes is not None and direct_extra_bytes(payload_bytes, world_size) <= AUTO_DIRECT_EXTRA_BYTES:
        return "direct"
    return "flat"


def direct_extra_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes a direct round moves per replica beyond a flat one, for ``payload_bytes`` per replica:
    direct sends P up and (N-1)P down, flat P + P/N up and 2P(N-1)/N down; the difference is
    ((N-1)(N-2) - 1) P / N (negative at N = 2, where direct is the lighter one)."""
    n = world_size
    return ((n - 1) * (n - 2) - 1) * payload_bytes // n


def sharded_round_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes a flat (sharded) round moves per replica for ``payload_bytes`` per replica: P + P/N up,
    2P(N-1)/N down (the byte bound, which a hierarchical round's fp32 partials only exceed)."""
    n = world_size
    return payload_bytes + payload_bytes // n + 2 * payload_bytes * (n - 1) // n


def compressed_direct(payload_bytes: int, dense_bytes: int, world_size: int) -> bool:
    """Whether a direct round of a compressed codec (``payload_bytes`` per replica: P_s up, (N-1) P_s down)
    moves no more bytes per replica than a flat round of ``dense_bytes`` (the same tensor in int8) would:
    ``N * P_s <= P8 (1 + 1/N + 2 (N-1)/N)``. At the sparse defaults (P8 / P_s = 36) that holds to N = 107."""
    return world_size * payload_bytes <= sharded_round_bytes(dense_bytes, world_size)


def levels(world_size: int) -> int:
    """Levels of a hierarchical round of ``world_size`` replicas: 2 (groups, then their sums), or 3
    (groups, groups of groups, then their sums) from :data:`THREE_LEVELS_FROM` replicas."""
    return 3 if world_size >= THREE_LEVELS_FROM else 2


def branching(world_size: int) -> int:
    """Children per node of the hierarchical tree: the smallest ``c`` with ``c ** levels(N) >= N``
    (``ceil(sqrt(N))`` with two levels, ``ceil(cbrt(N))`` with three; at least 1)."""
    depth, c = levels(world_size), 1
    while c**depth < world_size:
        c += 1
    return c


def group_size(world_size: int) -> int:
    """Ranks per level-1 hierarchical group: :func:`branching` (the last group may be smaller)."""
    return branching(world_size)


def group_of(rank: int, world_size: int, level: int = 1) -> int:
    """The hierarchical group of ``rank`` at ``level`` (1: consecutive blocks of :func:`branching` ranks;
    2: blocks of ``branching ** 2`` ranks, i.e. groups of level-1 groups)."""
    return rank // int(branching(world_size) ** level)


def group_count(world_size: int, level: int = 1) -> int:
    """Groups at ``level`` of a hierarchical round (the groups that hold at least one rank)."""
    return -(-world_size // int(branching(world_size) ** level))


def shard_count(world_size: int, protocol: str, split: int = 1) -> int:
    """Shards the tensor is cut into: ``split`` (direct), ``N * split`` (flat), :func:`branching`
    (hierarchical, which never splits). ``split`` is :func:`split_for`'s answer."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"exchange protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if split < 1:
        raise ValueError(f"split must be >= 1, got {split}")
    if protocol == "direct":
        return split
    if protocol == "flat":
        return world_size * split
    return branching(world_size)


def split_for(numel: int, world_size: int, protocol: str, object_bytes: Callable[[int], int],
              part_size: int | None) -> int:
    """Pieces each replica's share of ``numel`` values is cut into so that no exchange object exceeds
    ``part_size``.

    A store that uploads a large object in parts (S3 multipart) pays two extra round trips for it
    (create, then complete) on top of the parts, and one that uploads it whole (GCS) sends it over one
    connection; the exchange already sends its objects concurrently, so cutting the tensor into more,
    part-sized shards reaches the NIC's bandwidth in one round trip (docs/exchange.md, "Round trips").
    ``object_bytes(n)`` is the stored size of a shard of ``n`` values; ``part_size`` ``None`` (a store
    with no per-request limit: local, memory) means no split.
    Hierarchical rounds never split (their shards are the tree's). Every replica computes the same
    answer from the same run config and tensor size, and writes it in its ready marker.
    """
    if part_size is None or protocol == "hierarchical" or numel <= 0:
        return 1
    per = world_size if protocol == "flat" else 1
    split = max(1, -(-object_bytes(-(-numel // per)) // part_size))
    while object_bytes(-(-numel // (per * split))) > part_size and per * split < numel:
        split += 1
    return split
