"""Which exchange protocol a round uses, and how it cuts the tensor: picked from N alone.

Every replica derives the same answer from the configured world size and the ``exchange.topology``
setting, and writes it in its ready marker, so replicas that disagree fail with a ``MismatchError``
before anything is reduced (docs/exchange.md, "Hierarchical exchange").

- ``direct`` (N = 2 under ``auto``): one contribution object per replica; each replica
  reads the others' and sums locally in rank order. 1 PUT + (N-1) GETs of P bytes: at N = 2 exactly
  what a naive exchange moves, and a dead peer's stored contribution is all a survivor needs.
- ``flat``: S = N shards, reduce-scatter + all-gather (O(N) requests per replica, ~the byte bound).
- ``hierarchical``: groups of ``g = ceil(sqrt(N))`` consecutive ranks; S = g shards. Member i of a
  group sums shard i over its group (a ``partial``), one replica per shard sums the group partials,
  everyone fetches the g reduced shards: O(sqrt N) requests per replica.
"""

from __future__ import annotations

import math
from typing import Literal

Topology = Literal["flat", "hierarchical", "auto"]
Protocol = Literal["direct", "flat", "hierarchical"]

TOPOLOGIES: tuple[str, ...] = ("flat", "hierarchical", "auto")
PROTOCOLS: tuple[str, ...] = ("direct", "flat", "hierarchical")

#: ``auto`` switches from flat to hierarchical at this many replicas (benchmarks/scale.py, docs/exchange.md).
AUTO_HIERARCHICAL_FROM = 64


def resolve(topology: str, world_size: int) -> Protocol:
    """The protocol a run of ``world_size`` replicas uses under ``topology`` (flat, hierarchical, auto).

    ``flat`` and ``hierarchical`` are honoured at any N >= 2 (hierarchical with N < 4 has one group).
    ``auto`` (the config default) uses ``direct`` at N = 2, where no sharded protocol beats it, flat
    below :data:`AUTO_HIERARCHICAL_FROM` replicas and hierarchical from there on.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"exchange topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
    if topology != "auto":
        return "hierarchical" if topology == "hierarchical" else "flat"
    if world_size == 2:
        return "direct"
    return "hierarchical" if world_size >= AUTO_HIERARCHICAL_FROM else "flat"


def group_size(world_size: int) -> int:
    """Ranks per hierarchical group: ``ceil(sqrt(N))`` (the last group may be smaller)."""
    return max(1, math.isqrt(world_size - 1) + 1) if world_size > 1 else 1


def group_of(rank: int, world_size: int) -> int:
    """The hierarchical group of ``rank``: consecutive blocks of :func:`group_size` ranks."""
    return rank // group_size(world_size)


def group_count(world_size: int) -> int:
    return -(-world_size // group_size(world_size))


def shard_count(world_size: int, protocol: str) -> int:
    """Shards the tensor is cut into: 1 (direct), N (flat), ``group_size(N)`` (hierarchical)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"exchange protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if protocol == "direct":
        return 1
    if protocol == "flat":
        return world_size
    return group_size(world_size)
