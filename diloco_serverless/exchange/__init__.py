"""The all-reduce through the object store: sharded, create-only, verified (torch, no torchft).

:class:`ObjectStoreAllReduce` averages one flat tensor per round across N replicas that never talk
to each other: each writes its contribution in shards, a create-only quorum fixes who takes part,
each shard's owner reduces it in rank order, and everyone downloads the reduced shards
(:mod:`.allreduce`, :mod:`.quorum`). Every object is a verified safetensors file (:mod:`.codec`).
See docs/architecture.md, "The exchange protocol".
"""

from __future__ import annotations

from diloco_serverless.errors import ExchangeError
from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce, RoundStats
from diloco_serverless.exchange.codec import (
    CODECS,
    ShardHeader,
    decode_shard,
    encode_shard,
)
from diloco_serverless.exchange.errors import (
    CorruptObjectError,
    MismatchError,
    RoundPrunedError,
)

__all__ = [
    "CODECS",
    "CorruptObjectError",
    "ExchangeError",
    "MismatchError",
    "ObjectStoreAllReduce",
    "RoundPrunedError",
    "RoundStats",
    "ShardHeader",
    "decode_shard",
    "encode_shard",
]
