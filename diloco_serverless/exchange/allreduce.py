"""``ObjectStoreAllReduce``: a bandwidth-optimal, fault-tolerant all-reduce (mean) through an object store.

The replicas share nothing but a bucket (S3, GCS, a local folder). One call is one round
(docs/architecture.md, "The exchange protocol"): the flat tensor is cut into S = world_size fixed shards
(times ``split`` when a shard would exceed the store's part size: :func:`.topology.split_for`); each replica
PUTs its S contribution objects (create-only) then a ``ready`` marker; a create-only ``quorum.json`` fixes the
participants Q (all N, or at least ``min_replicas`` after the straggler deadline); shard j is
reduced by ``Q[j mod |Q|]``, which sums the participants' decoded shards in rank order in fp32,
divides by |Q| and PUTs ``reduced/j`` create-only; everyone GETs the reduced shards. Per replica
that is P + P/N bytes up and 2P(N-1)/N down, against the lower bound P + 2P(N-1)/N for a store
that only moves whole objects (the seed's design moved (N-1)P down). This is reduce-scatter +
all-gather (Patarasuk & Yuan 2009) with the bucket as the switch, used as the outer
pseudo-gradient average of DiLoCo (Douillard et al., arXiv 2311.08105).

Fault tolerance: a replica that never becomes ready is left out after the straggler deadline; a
shard whose owner died is reduced by whoever waits past ``takeover_timeout_s`` (the first create
wins and the bytes are identical); a replica that arrives after the quorum adopts the round's
result without contributing. Every replica returns bit-identical values because everyone decodes
the same create-only ``reduced`` objects. Failures raise :class:`ExchangeError` subclasses or
``TimeoutError`` naming the ranks, shards and keys involved.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar

import torch

from diloco_serverless.config import (
    POLL_INTERVAL_S,
    ROUND_TIMEOUT_S,
    STRAGGLER_TIMEOUT_S,
    TAKEOVER_TIMEOUT_S,
)
from diloco_serverless.errors import ExchangeError, StoreError
from diloco_serverless.exchange._io import (
    CountingStore,
    markers_in,
    shard_bounds,
)
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
    payload_bytes,
    reduced_codec,
    residual,
    roundtrip,
    validate_codec,
)
from diloco_serverless.exchange.errors import (
    AbstainedError,
    CorruptObjectError,
    MismatchError,
    ParticipantsChangedError,
    RoundPrunedError,
)
from diloco_serverless.exchange.gather import ReducedShards
from diloco_serverless.exchange.hierarchical import HierarchicalRound
from diloco_serverless.exchange.overlap import EarlyFetch, wait_half, wait_prefetching
from diloco_serverless.exchange.polling import Backoff
from diloco_serverless.exchange.quorum import (
    Quorum,
    QuorumWait,
    ReadyMarker,
    check_agreement,
    copy_to_read,
    list_ready,
    marker_tag,
    read_quorum,
    signed_json,
    wait_for_quorum,
    write_abstention,
)
from diloco_serverless.exchange.robust import guarded_sum
from diloco_serverless.exchange.sparse import is_sparse
from diloco_serverless.exchange.topology import Protocol, resolve, shard_count, split_for
from diloco_serverless.exchange.votes import VotedRound, mean_of, piece_header, quorum_of, quorumless
from diloco_serverless.run.layout import (
    ROUNDS_PREFIX,
    contrib_key,
    control_spread,
    ready_key,
    reduced_key,
    reduced_prefix,
    round_data_prefixes,
    round_prefix,
    spread_count,
)
from diloco_serverless.store import ObjectNotFound, StoreAccessDenied, StoreUnavailable, TransferPolicy
from diloco_serverless.store.objectstore import ObjectStore

__all__ = [
    "CorruptObjectError",
    "ExchangeError",
    "MismatchError",
    "ObjectStoreAllReduce",
    "RoundPrunedError",
    "RoundStats",
]


log = logging.getLogger(__name__)

_GATHER_BATCH_BYTES = 512 << 20  # fp32 bytes of reduced shards downloaded concurrently
_LIST_PAGE_KEYS = 1_000  # keys in one listing request (S3 ListObjectsV2, GCS objects.list)
_EARLY_IDLE_POLLS = 8  # EarlyFetch gives up after this many polls in a row without a new contribution
#: Contribution objects encoded at once: one per core, so that the first ones go up while the rest are
#: encoded (all S at once would finish together and leave the link idle until then).
_ENCODE_AT_ONCE = max(1, os.cpu_count() or 1)


@dataclass
class RoundStats:
    """What one round cost this replica. Bytes are object payloads moved by this replica."""

    round: int
    participants: list[int]
    bytes_up: int = 0
    bytes_down: int = 0
    wait_s: float = 0.0
    total_s: float = 0.0
    late: bool = False
    reduced_shards: list[int] = field(default_factory=list)
    takeovers: list[int] = field(default_factory=list)
    takeover_keys: list[str] = field(default_factory=list)  # hierarchical: partials/reduced shards computed for others
    phases_s: dict[str, float] = field(default_factory=dict)  # publish, quorum, reduce, gather
    abstained: str | None = None  # why this replica did not contribute (its values were not finite)


@dataclass
class _Round:
    """State of the round in progress."""

    r: int
    me: ReadyMarker
    bounds: list[tuple[int, int]]
    deadline: float
    own: Sequence[Summand] | None = None  # our decoded contributions, per shard (a direct sparse round's: as sent)
    stats: RoundStats | None = None
    prefetch: dict[str, Future[bytes | None]] = field(default_factory=dict)  # contrib key -> GET in flight
    prefetch_lock: threading.Lock = field(default_factory=threading.Lock)  # an EarlyFetch thread adds too
    early: EarlyFetch | None = None  # finds the others' contributions before their votes (N <= 16)

    def stop_early(self) -> None:
        """The participants are known (or the round failed): no more early listings."""
        if self.early is not None:
            self.early.stop()


class ObjectStoreAllReduce:
    """Element-wise mean of a tensor over the replicas of a run, through an object store.

    Args:
        url: store URL (``s3://bucket/prefix``, ``gs://...``, ``file:///...``, a path, ``memory://...``)
            or an ``ObjectStore``. Rounds live under ``<url>/<run_id>/rounds/``.
        rank, world_size: this replica and the configured number of replicas (S = world_size shards).
        timeout_s: a round that cannot complete within this raises ``TimeoutError``.
        min_replicas: smallest quorum accepted after ``straggler_timeout_s``; ``None`` = world_size
            (every replica must arrive).
        takeover_timeout_s: how long after the quorum a replica waits for a shard's owner before
            reducing that shard itself.
        codec: ``fp32``, ``bf16`` or ``int8`` for contributions and reduced shards (reduction is fp32).
        error_feedback: add the codec's residual of the previous round (per ``residual_key``) to the input.
        feedback_decay: the residual is scaled by this before it is added (SparseLoCo's ``beta``: the buffer
            ``e = beta * e + delta`` is what is compressed, and what was sent is taken out of it); 1 keeps it whole.
        keep_rounds: rounds kept in the store (older ones are deleted); ``None`` keeps all (use ``prune``).
        run_key: the run's secret key (diloco_serverless.run.integrity): every object this replica writes
            carries an HMAC under it, and objects read without a valid one are refused as corrupt.
        poll_interval_s: longest sleep between polls (polling starts at 20 ms and backs off: :mod:`.polling`).
        topology: ``flat``, ``hierarchical``, ``direct`` or ``auto`` (:func:`.topology.resolve` picks the
            protocol of each round from N and the tensor's size: ``direct``, whole tensors, at N = 2 and for
            small tensors). Every replica must use the same.

    Raises ``ValueError`` in ``__init__`` for an impossible configuration, saying what to change.
    """

    #: Every round has a quorum object (a slice of a multi-device replica's exchange, :mod:`.sliced`, shares
    #: its leader's); otherwise flat and direct rounds at N <= 16 go without one (:mod:`.votes`).
    _QUORUM: ClassVar[bool] = False

    def __init__(
        self,
        url: str | ObjectStore,
        rank: int,
        world_size: int,
        *,
        run_id: str = "default",
        timeout_s: float = ROUND_TIMEOUT_S,
        min_replicas: int | None = None,
        straggler_timeout_s: float = STRAGGLER_TIMEOUT_S,
        takeover_timeout_s: float = TAKEOVER_TIMEOUT_S,
        codec: str = "fp32",
        error_feedback: bool = False,
        feedback_decay: float = 1.0,
        keep_rounds: int | None = 4,
        storage_options: dict[str, Any] | None = None,
        poll_interval_s: float = POLL_INTERVAL_S,
        run_key: bytes | None = None,
        topology: str = "flat",
        transfer: TransferPolicy | None = None,
    ) -> None:
        _validate(
            rank, world_size, min_replicas, timeout_s, straggler_timeout_s, takeover_timeout_s, keep_rounds,
            poll_interval_s,
        )
        self.rank, self.world_size, self.run_id = rank, world_size, run_id
        self.topology = topology
        self.protocol = resolve(topology, world_size) if world_size > 1 else "flat"  # per round: allreduce()
        self._spread = spread_count(world_size)
        self._run_key = run_key
        self.codec = validate_codec(codec)
        self.timeout_s, self.straggler_timeout_s, self.takeover_timeout_s = (
            timeout_s,
            straggler_timeout_s,
            takeover_timeout_s,
        )
        self.min_replicas = world_size if min_replicas is None else min_replicas
        self.error_feedback, self.keep_rounds, self.poll_interval_s = error_feedback, keep_rounds, poll_interval_s
        if not 0.0 <= feedback_decay <= 1.0:
            raise ValueError(f"feedback_decay must be between 0 and 1, got {feedback_decay}")
        self.feedback_decay = feedback_decay
        self.last_stats: RoundStats | None = None
        self._next_round = 0
        self._attempted: int | None = None  # the round of the last allreduce call (finished or not)
        self._residuals: dict[str, torch.Tensor] = {}
        self._plans: dict[int, str] = {}  # round -> the plan it is trained under (bind_plan)
        self._pool: ThreadPoolExecutor | None = None
        self._io: CountingStore | None = None
        if world_size > 1:  # world_size == 1 touches no store, not even to open it
            self._io = CountingStore(_open_store(url, storage_options, timeout_s, transfer).child(run_id))

    # ------------------------------------------------------------------ public API

    def allreduce(
        self,
        tensor: torch.Tensor,
        *,
        round: int | None = None,
        residual_key: str = "default",
        abstain: str | None = None,
    ) -> torch.Tensor:
        """Return the element-wise mean of ``tensor`` over this round's participants.

        Same dtype, shape and device as ``tensor``; bit-identical on every replica. ``round``
        defaults to the round after the last one this object ran (0 first).

        A replica whose ``tensor`` holds NaN or Inf, or that passes ``abstain`` (the reason, e.g. its
        loss diverged), does not contribute: it announces that in the store and receives the mean of
        the others, like a late replica (``last_stats.abstained`` says why). The others close the round
        without waiting for it if ``min_replicas`` allows; otherwise every replica raises
        :class:`~diloco_serverless.exchange.errors.AbstainedError` naming it.
        """
        r = self._next_round if round is None else int(round)
        if r < 0:
            raise ValueError(f"round must be >= 0, got {r}")
        t0 = time.monotonic()
        if self._io is None:
            reason = abstain or _non_finite(tensor.detach().reshape(-1).float())
            if reason is not None:
                raise AbstainedError(f"round {r}: the only replica cannot contribute ({reason})")
            self._next_round = r + 1
            self.last_stats = RoundStats(r, [self.rank], late=False)
            return tensor.detach().clone()
        self._io.reset()
        flat = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        owned = False  # whether flat is ours to overwrite (not the caller's tensor)
        if self.error_feedback and self.codec != "fp32":
            flat, owned = self._add_residual(flat, residual_key)
        self.protocol = self._protocol(flat.numel())
        me = self._marker(r, tensor, self.protocol)
        rs = _Round(r, me, shard_bounds(flat.numel(), shard_count(self.world_size, self.protocol, me.split)),
                    t0 + self.timeout_s)
        rs.stats = RoundStats(r, [], abstained=abstain or _non_finite(flat))
        # A round after one this object finished, tried for the first time, cannot have been published
        # by us before: skip the quorum read that only a restarted or retried replica needs (a late
        # replica still finds the quorum while it waits for it).
        fresh = self.last_stats is not None and self.last_stats.round == r - 1 and self._attempted != r
        self._attempted = r
        try:
            if quorumless(me, quorum=self._QUORUM):
                out = self._quorumless(rs, flat, fresh=fresh)
            else:
                quorum = self._join(rs, flat, fresh=fresh)
                rs.stats.participants, rs.stats.late = list(quorum.participants), self.rank not in quorum.participants
                out = self._gather(rs, quorum)
                self._confirm_quorum(rs, quorum)
        finally:
            rs.stop_early()
        if self.error_feedback and self.codec != "fp32" and not rs.stats.late and rs.stats.abstained is None:
            # A replica re-running a round it took part in before a restart contributed what it stored then:
            # the same bytes its (identical) input encodes to now, so its residual is recomputed from them.
            own = rs.own if rs.own is not None else [roundtrip(flat[a:b], self.codec) for a, b in rs.bounds]
            self._residuals[residual_key] = residual(flat, own, in_place=owned)
        self._next_round = r + 1
        self._finish(rs, t0)
        return out.view(tensor.shape).to(device=tensor.device, dtype=tensor.dtype)

    def read_reduced(
        self, round: int, like: torch.Tensor, *, unless_participant: int | None = None
    ) -> torch.Tensor | None:
        """Replay a stored round's result (healing); ``None`` if the round is absent or pruned, or
        if rank ``unless_participant`` took part in it (a restarted replica that restored its own
        state re-trains such a round instead, so it ends exactly as if it had never crashed).

        Raises :class:`MismatchError` if the stored round averaged a different element count
        than ``like``, :class:`CorruptObjectError` for a bad object.
        """
        if self._io is None:
            return None
        quorum: Quorum | None = read_quorum(self._io, run_id=self.run_id, round=round, run_key=self._run_key)
        if quorum is None:
            voted = self._stored_votes(round, like)
            if not isinstance(voted, tuple):
                quorum = voted
            elif unless_participant is not None and unless_participant in voted[0]:
                return None
            else:
                return voted[1].view(like.shape).to(device=like.device, dtype=like.dtype)
        if quorum is None:
            return None
        if unless_participant is not None and unless_participant in quorum.participants:
            return None
        ref = quorum.markers[quorum.participants[0]]
        if ref.numel != like.numel():
            raise MismatchError(
                f"round {round} averaged {ref.numel} elements (shape {tuple(ref.shape)}) but the tensor to replay into "
                f"has {like.numel()} (shape {tuple(like.shape)})"
            )
        bounds = shard_bounds(ref.numel, shard_count(ref.world_size, ref.protocol, ref.split))
        if ref.protocol == "direct":
            rs = _Round(round, ref, bounds, time.monotonic() + self.timeout_s)
            try:
                out = self._reduce_direct(rs, quorum, ref)
            except ExchangeError:
                return None  # a contribution is gone: the round was pruned
            return out.view(like.shape).to(device=like.device, dtype=like.dtype)
        spread = spread_count(ref.world_size)
        keys = [reduced_key(round, j, spread) for j in range(len(bounds))]
        blobs = self._io.get_many(keys, missing_ok=True)
        if len(blobs) != len(keys):
            return None
        parts = [
            decode_shard(blobs[k], key=k, expect=self._reduced_header(round, j, b, ref, quorum), run_key=self._run_key)
            for j, (k, b) in enumerate(zip(keys, bounds))
        ]
        return torch.cat(parts).view(like.shape).to(device=like.device, dtype=like.dtype)

    def holds_round(self, round: int, like: torch.Tensor) -> bool:
        """Whether the store still holds round ``round``'s outcome (its quorum, or every rank's vote in a
        round without one), found without reading the averaged data: what a replica checks before it
        re-trains the run from its start (one GET, and one listing for a round without a quorum)."""
        if self._io is None:
            return False
        if read_quorum(self._io, run_id=self.run_id, round=round, run_key=self._run_key) is not None:
            return True
        me = self._marker(round, like, self._protocol(like.numel()))
        if not quorumless(me, quorum=self._QUORUM):
            return False
        return VotedRound(self._io, me, self._wait(time.monotonic() + self.timeout_s)).complete()

    def prune(self, before_round: int) -> None:
        """Delete every stored round numbered below ``before_round`` (missing rounds are fine)."""
        if self._io is None:
            return
        rounds = {
            int(k.split("/")[1])
            for k in self._io.list(ROUNDS_PREFIX)
            if k.count("/") >= 2 and k.split("/")[1].isdigit()
        }
        for r in sorted(x for x in rounds if x < before_round):
            self._delete_round(r, range(len(round_data_prefixes(r, self.world_size))))

    def close(self) -> None:
        """Release the upload threads. The object can still be used afterwards (threads restart)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._io is not None:
            self._io.close()

    def __enter__(self) -> ObjectStoreAllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ round phases

    def _join(self, rs: _Round, flat: torch.Tensor, *, fresh: bool = False) -> Quorum:
        """Publish our contribution unless the round already has a quorum (not read when ``fresh``:
        see :meth:`allreduce`); return the quorum."""
        io = self._io
        assert io is not None and rs.stats is not None
        quorum = None if fresh else read_quorum(io, run_id=self.run_id, round=rs.r, run_key=self._run_key)
        if quorum is None:
            t = time.monotonic()
            if rs.stats.abstained is None:
                rs.own = self._publish(rs, flat)
            else:
                write_abstention(io, rs.me, rs.stats.abstained, self._run_key)
            waited = time.monotonic()
            rs.stats.phases_s["publish"] = waited - t
            quorum = wait_for_quorum(io, rs.me, self._wait(rs.deadline),
                                     on_ready=lambda ready: self._prefetch(rs, ready))
            rs.stop_early()
            rs.stats.wait_s += time.monotonic() - waited
            rs.stats.phases_s["quorum"] = time.monotonic() - waited
        check_agreement(quorum, rs.me)
        return quorum

    def _confirm_quorum(self, rs: _Round, quorum: Quorum) -> None:
        """Before the round's result is applied: re-read the round's ``quorum.json`` and check it still names
        the participants this replica used. A deleted quorum (a late replica may then create another) or a
        different one raises :class:`ParticipantsChangedError`: deletions fail a round, never change its
        result (docs/security.md)."""
        io = self._io
        assert io is not None
        try:
            copy = copy_to_read(rs.me)  # above 16 replicas, the copy it reads (not everyone at one key)
            data = None if copy is None else io.get_or_none(copy)
            now = (read_quorum(io, run_id=self.run_id, round=rs.r, run_key=self._run_key) if data is None
                   else Quorum.parse(data, key=str(copy), run_id=self.run_id, round=rs.r, run_key=self._run_key))
        except CorruptObjectError as e:
            raise ParticipantsChangedError(f"round {rs.r}: its quorum.json was replaced while it closed ({e})") from e
        if now is None or now.participants != quorum.participants:
            what = "deleted" if now is None else f"replaced by one naming {now.participants}"
            raise ParticipantsChangedError(
                f"round {rs.r}: its quorum.json (participants {quorum.participants}) was {what} while the round "
                "closed; failing the round rather than applying a participant set the other replicas may not "
                "share. Restart the replica; check who can delete under the run's prefix (docs/security.md)"
            )

    def _wait(self, deadline: float) -> QuorumWait:
        """How this replica waits for the others in a round that must end by ``deadline`` (monotonic)."""
        return QuorumWait(self.world_size, self.min_replicas, self.straggler_timeout_s, deadline,
                          self.poll_interval_s, self._run_key)

    def _quorumless(self, rs: _Round, flat: torch.Tensor, *, fresh: bool = False) -> torch.Tensor:
        """A round without a quorum object (:mod:`~diloco_serverless.exchange.votes`): create our vote
        (after our shards in a flat round), read everyone's as they appear; then a direct round sums the
        contributors' in rank order, and a flat round reduces and gathers over them."""
        io = self._io
        assert io is not None and rs.stats is not None
        t = time.monotonic()
        direct = rs.me.protocol == "direct"

        def put_share(values: torch.Tensor) -> None:
            rs.own = self._put_contributions(rs, values)  # a round without a quorum has N <= 16: EarlyFetch

        round_ = VotedRound(io, rs.me, self._wait(rs.deadline), None if direct else put_share)
        mine = round_.publish(flat, rs.stats.abstained, fresh=fresh)
        waited = time.monotonic()
        rs.stats.phases_s["publish"] = waited - t
        entries = round_.collect(None if direct else lambda listed: self._prefetch(rs, listed))
        rs.stop_early()
        rs.stats.wait_s += round_.wait_s
        t = time.monotonic()
        rs.stats.phases_s["quorum"] = t - waited
        if mine.contributed:  # ours, or the vote we cast before a restart: what everyone counts
            rs.stats.abstained = None
        if direct:
            # the votes that decided the participants are still there, unchanged: checked (one listing)
            # while we sum, and before the mean is returned
            confirming = self._executor().submit(round_.confirm)
            participants, out = mean_of(entries, rs.me)
            rs.stats.phases_s["reduce"] = time.monotonic() - t
            rs.stats.participants, rs.stats.late = participants, self.rank not in participants
            rs.own = [mine.values] if mine.values is not None else None  # sparse as sent: no dense copy
            confirming.result()
            return out
        quorum = quorum_of(entries, rs.me)
        rs.stats.participants, rs.stats.late = list(quorum.participants), self.rank not in quorum.participants
        out = self._gather(rs, quorum)  # rs.own: our shards if we wrote them in this call, else read back
        round_.confirm()
        return out

    def _stored_votes(self, round: int, like: torch.Tensor) -> Quorum | tuple[list[int], torch.Tensor] | None:
        """What :meth:`read_reduced` needs of a round without a quorum object: a flat round's participants
        (as a quorum), a direct round's participants and mean; ``None`` unless every rank's vote key holds
        something."""
        io = self._io
        assert io is not None
        me = self._marker(round, like, self._protocol(like.numel()))
        if not quorumless(me, quorum=self._QUORUM):
            return None
        entries = VotedRound(io, me, self._wait(time.monotonic() + self.timeout_s)).stored()
        if entries is None:
            return None
        ref = next((e.marker for e in entries.values() if e.marker is not None), None)
        if ref is None:
            return None
        if ref.numel != like.numel():
            raise MismatchError(
                f"round {round} averaged {ref.numel} elements (shape {tuple(ref.shape)}) but the tensor to replay into "
                f"has {like.numel()} (shape {tuple(like.shape)})"
            )
        return mean_of(entries, ref) if ref.protocol == "direct" else quorum_of(entries, ref)

    def _publish(self, rs: _Round, flat: torch.Tensor) -> list[torch.Tensor]:
        """PUT our S contribution objects concurrently, then our ready marker; return what others will decode."""
        io = self._io
        assert io is not None
        own = self._put_contributions(rs, flat, self._ready_lister(rs))
        self._before_ready(rs)
        key = ready_key(rs.r, self.rank, marker_tag(rs.me, self._run_key), control_spread(self.world_size))
        io.put(key, signed_json(self._run_key, "ready", rs.me.to_json(), key))
        return own

    def _ready_lister(self, rs: _Round) -> Callable[[], set[int]] | None:
        """One listing of the ranks whose ready markers exist, for a replica above 16 that lists them anyway
        (ranks 0-15: :func:`~diloco_serverless.exchange.quorum.copy_to_read`); else ``None`` (up to 16,
        :class:`~diloco_serverless.exchange.overlap.EarlyFetch` finds the contributions themselves)."""
        io = self._io
        if io is None or self._spread == 1 or copy_to_read(rs.me) is not None:
            return None
        return lambda: set(markers_in(list_ready(io, rs.r, self.world_size)))

    def _put_contributions(
        self, rs: _Round, flat: torch.Tensor, look: Callable[[], set[int]] | None = None
    ) -> list[torch.Tensor]:
        """PUT our S contribution objects concurrently, each as soon as it is encoded (``_ENCODE_AT_ONCE``
        encodings at a time); return what others will decode. With ``look``
        (one listing: the ranks whose contributions are complete), start prefetching theirs once half
        of ours are answered (:func:`~diloco_serverless.exchange.overlap.wait_prefetching`)."""
        io = self._io
        assert io is not None

        encoding = threading.BoundedSemaphore(_ENCODE_AT_ONCE)

        def one(j: int) -> torch.Tensor:
            a, b = rs.bounds[j]
            header = piece_header(rs.me, j, (a, b))
            key = contrib_key(rs.r, j, self.rank, self._spread)
            with encoding:
                enc = encode_values(flat[a:b], self.codec)
                data = pack(enc, asdict(header), self._run_key, place=key)
            stored = self._write_piece(key, data, header)
            return decode_values(enc, self.codec, b - a) if stored is None else stored

        futures = [self._executor().submit(one, j) for j in range(len(rs.bounds))]
        if self.protocol == "hierarchical":  # nothing safe to prefetch there (see _prefetch)
            return [fut.result() for fut in futures]
        if self._spread == 1 and self.protocol == "flat":
            wait_half(futures)
            rs.early = self._early_fetch(rs).start()
            return [fut.result() for fut in futures]
        if look is None:
            return [fut.result() for fut in futures]
        return wait_prefetching(futures, lambda: look() - {self.rank}, lambda ready: self._prefetch(rs, ready),
                                others=self.world_size - 1, poll_interval_s=self.poll_interval_s)

    def _write_piece(self, key: str, data: bytes, header: ShardHeader) -> torch.Tensor | None:
        """Create our contribution object ``key`` (create-only): ``None`` once ``data`` is stored there, or
        the values of the object already there, ours from before a restart, which count (others may have
        read it before our vote: :class:`EarlyFetch` does not wait for votes). One the store cannot give
        back whole, or that does not decode, is replaced: nobody can have summed it. A store that cannot be
        reached, or refuses us, raises."""
        io = self._io
        assert io is not None
        try:
            if io.put_if_absent(key, data):
                return None
            return decode_shard(io.get(key), key=key, expect=header, run_key=self._run_key)
        except (StoreUnavailable, StoreAccessDenied, ObjectNotFound):
            raise
        except (CorruptObjectError, StoreError) as e:
            log.warning("round %d: our contribution %r from before a restart is unreadable (%s); writing it again",
                        header.round, key, e)
        io.put(key, data)
        return None

    def _early_fetch(self, rs: _Round) -> EarlyFetch:
        """An :class:`~diloco_serverless.exchange.overlap.EarlyFetch` of the others' contributions to the
        shards we reduce if everyone takes part. A poll is one listing of the round's ``contrib/`` folder
        while that is one page (N x S <= 1,000 keys), else one listing per shard we reduce; it gives up
        after eight polls in a row without a new contribution."""
        io = self._io
        assert io is not None
        mine = range(self.rank, len(rs.bounds), self.world_size)
        expected = {contrib_key(rs.r, j, q) for j in mine for q in range(self.world_size) if q != self.rank}
        if self.world_size * len(rs.bounds) <= _LIST_PAGE_KEYS:
            folders = [contrib_key(rs.r, 0, 0).rsplit("/", 2)[0]]
        else:
            folders = sorted({contrib_key(rs.r, j, self.rank).rsplit("/", 1)[0] for j in mine})
        return EarlyFetch(lambda: set(io.list_many(folders)), lambda keys: self._prefetch_keys(rs, keys),
                          expected=expected, poll_interval_s=self.poll_interval_s, idle_polls=_EARLY_IDLE_POLLS)

    def _before_ready(self, rs: _Round) -> None:
        """Hook between our contributions and our ready marker (a sliced exchange's leader waits
        there for its sibling slices, see :mod:`diloco_serverless.exchange.sliced`)."""

    def _gather(self, rs: _Round, quorum: Quorum) -> torch.Tensor:
        """Reduce our shards, then collect every reduced shard (taking over dead owners' shards)."""
        io = self._io
        assert io is not None and rs.stats is not None
        ref = quorum.markers[quorum.participants[0]]
        if self.protocol == "direct":
            t = time.monotonic()
            out = self._reduce_direct(rs, quorum, ref)
            rs.stats.phases_s["reduce"] = time.monotonic() - t
            return out
        if self.protocol == "hierarchical":
            return self._gather_hierarchical(rs, quorum)
        out = torch.empty(ref.numel, dtype=torch.float32)
        done: set[int] = set()
        t_reduce = time.monotonic()

        def place(j: int, values: torch.Tensor) -> None:
            out[rs.bounds[j][0] : rs.bounds[j][1]].copy_(values)
            done.add(j)

        shards = len(rs.bounds)
        mine = [j for j in range(shards) if quorum.participants[j % len(quorum.participants)] == self.rank]
        keys = {j: reduced_key(rs.r, j, self._spread) for j in range(shards)}
        fetch = ReducedShards(io, keys, {j: 4 * (b - a) for j, (a, b) in enumerate(rs.bounds)},
                              reduced_prefix(rs.r) if self._spread == 1 else None, _GATHER_BATCH_BYTES)
        # Where a gather poll is one listing (N <= 16), the gather runs while we reduce our own shards: the
        # others' reduced shards come down while our sums and PUTs are under way (docs/exchange.md, "Round
        # trips"). A spread round polls by GETs of every missing shard, so it gathers after its reduce.
        reducing = {j: self._executor().submit(self._reduce, rs, quorum, j, ref) for j in mine}
        if self._spread != 1:
            wait(list(reducing.values()))
        started: float | None = None  # when our own shards were done: the takeover clock starts there
        backoff = Backoff(self.poll_interval_s)

        def arrived(j: int, data: bytes) -> None:
            expect = self._reduced_header(rs.r, j, rs.bounds[j], ref, quorum)
            place(j, decode_shard(data, key=keys[j], expect=expect, run_key=self._run_key))

        while len(done) < shards:
            for j in [j for j, fut in reducing.items() if fut.done()]:
                place(j, reducing.pop(j).result())
                rs.stats.reduced_shards.append(j)
            if started is None and not reducing:
                started = time.monotonic()
                rs.stats.phases_s["reduce"] = started - t_reduce
            if len(done) == shards:
                break
            if fetch.poll({j for j in range(shards) if j not in done and j not in reducing}, arrived):
                backoff.reset()
                continue
            now = time.monotonic()
            flying = fetch.in_flight()
            missing = [j for j in range(shards) if j not in done and j not in flying and j not in reducing]
            if missing and started is not None and now - started >= self.takeover_timeout_s:
                for j, values in self._reduce_all(rs, quorum, missing, ref).items():
                    place(j, values)
                    rs.stats.takeovers.append(j)
                continue
            if now >= rs.deadline:
                owners = {j: quorum.participants[j % len(quorum.participants)] for j in range(shards) if j not in done}
                raise TimeoutError(
                    f"round {rs.r}: reduced shards never appeared (shard: owner rank) {owners}; check those replicas"
                )
            pause = min(backoff.next(), max(0.0, rs.deadline - now))
            fetch.wait(pause, also=list(reducing.values()))
            rs.stats.wait_s += time.monotonic() - now
        assert started is not None  # every own shard is placed before the last one is
        rs.stats.phases_s["gather"] = time.monotonic() - started
        return out

    def _prefetch(self, rs: _Round, ready: set[int]) -> None:
        """While waiting for the quorum, start downloading the contributions of ready ranks to the
        shard we will own if everyone arrives (shard ``rank``): the reduce then overlaps the wait.
        If the quorum turns out smaller, those bytes are simply not used."""
        io = self._io
        assert io is not None
        if self.protocol == "hierarchical":
            return  # the shard we sum depends on who is in our group: nothing safe to prefetch
        shards = len(rs.bounds)
        mine = range(self.rank, shards, self.world_size) if self.protocol == "flat" else range(shards)
        self._prefetch_keys(rs, {contrib_key(rs.r, j, q, self._spread) for q in ready - {self.rank} for j in mine})

    def _prefetch_keys(self, rs: _Round, keys: set[str]) -> None:
        """Start a GET of each of ``keys`` (contribution objects) not fetched or fetching yet."""
        io = self._io
        assert io is not None
        with rs.prefetch_lock:
            for key in sorted(keys - rs.prefetch.keys()):
                rs.prefetch[key] = io.get_async(key)

    def _reduce_all(self, rs: _Round, quorum: Quorum, shards: list[int], ref: ReadyMarker) -> dict[int, torch.Tensor]:
        """:meth:`_reduce` of each of ``shards``, concurrently: a split round gives a replica several
        shards, and each one's sum waits for its own contributions and its PUT is a round trip of its own."""
        if len(shards) <= 1:
            return {j: self._reduce(rs, quorum, j, ref) for j in shards}
        futures = {j: self._executor().submit(self._reduce, rs, quorum, j, ref) for j in shards}
        return {j: fut.result() for j, fut in futures.items()}

    def _reduce(self, rs: _Round, quorum: Quorum, j: int, ref: ReadyMarker) -> torch.Tensor:
        """Mean of shard j over the quorum (rank order, fp32), stored create-only; returns the stored values."""
        io = self._io
        assert io is not None
        a, b = rs.bounds[j]
        if rs.own is None and self.rank in quorum.participants:
            # A participant that did not publish in this call is re-running a round it took part in
            # before it restarted: its shard may be reduced already.
            stored = io.get_or_none(reduced_key(rs.r, j, self._spread))
            if stored is not None:
                expect = self._reduced_header(rs.r, j, (a, b), ref, quorum)
                key = reduced_key(rs.r, j, self._spread)
                return decode_shard(stored, key=key, expect=expect, run_key=self._run_key)
        acc = self._sum_contributions(rs, quorum, j, ref)
        acc /= len(quorum.participants)
        enc = encode_values(acc, reduced_codec(self.codec))
        key = reduced_key(rs.r, j, self._spread)
        expect = self._reduced_header(rs.r, j, (a, b), ref, quorum)
        if io.put_if_absent(key, pack(enc, asdict(expect), self._run_key, place=key)):
            return decode_values(enc, expect.codec, b - a)
        return decode_shard(io.get(key), key=key, expect=expect, run_key=self._run_key)

    def _reduce_direct(self, rs: _Round, quorum: Quorum, ref: ReadyMarker) -> torch.Tensor:
        """Direct protocol: the mean of the participants' whole contributions, summed here in rank order
        (fp32, the same operations on every replica) and passed through the codec, as a stored reduced
        shard would be; nothing is written."""
        pieces = []
        for j in range(len(rs.bounds)):
            acc = self._sum_contributions(rs, quorum, j, ref)
            acc /= len(quorum.participants)
            codec = reduced_codec(ref.codec, stored=False)
            pieces.append(decode_values(encode_values(acc, codec), codec, acc.numel()))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _gather_hierarchical(self, rs: _Round, quorum: Quorum) -> torch.Tensor:
        io = self._io
        assert io is not None and rs.stats is not None
        t = time.monotonic()
        own = [dense(v) for v in rs.own] if rs.own is not None and self.rank in quorum.participants else None
        h = HierarchicalRound(
            io, self.run_id, self._run_key, self.rank, rs.r, quorum, rs.bounds, own,
            self.takeover_timeout_s, self.poll_interval_s, rs.deadline,
        )
        out = h.run()
        rs.stats.reduced_shards.extend(h.reduced_shards)
        rs.stats.takeover_keys.extend(h.takeovers)
        rs.stats.wait_s += h.wait_s
        rs.stats.phases_s["reduce"] = time.monotonic() - t
        return out

    def _sum_contributions(self, rs: _Round, quorum: Quorum, j: int, ref: ReadyMarker) -> torch.Tensor:
        """fp32 sum of shard j over the quorum in rank order (our own decoded values where we have them)."""
        io = self._io
        assert io is not None
        a, b = rs.bounds[j]
        use_own = rs.own is not None and self.rank in quorum.participants
        keys = {
            q: contrib_key(rs.r, j, q, self._spread) for q in quorum.participants if not (use_own and q == self.rank)
        }
        pending = {k: rs.prefetch.pop(k) for k in keys.values() if k in rs.prefetch}
        blobs = io.get_many([k for k in keys.values() if k not in pending], missing_ok=True)
        early: set[str] = set()  # read before the participants were known: a damaged one is read again
        for k, fut in pending.items():
            try:
                data = fut.result()
            except (StoreUnavailable, StoreAccessDenied):
                raise
            except StoreError:  # e.g. a checksum failure: its writer replaces a damaged piece when it votes
                data = None
            if data is None:
                blobs.update(io.get_many([k], missing_ok=True))
            else:
                blobs[k] = data
                early.add(k)
        acc = torch.zeros(b - a, dtype=torch.float32)
        guarded: list[tuple[int, Summand]] = []  # a sparse round sums through the guard (exchange/robust.py)

        def add(q: int, values: Summand) -> None:
            if is_sparse(ref.codec):
                guarded.append((q, values))
            else:
                acc.add_(dense(values))

        for q in quorum.participants:
            if use_own and q == self.rank:
                assert rs.own is not None
                add(q, rs.own[j])
                continue
            if keys[q] not in blobs:
                raise ExchangeError(
                    f"round {rs.r}: contribution {keys[q]!r} of participant {q} is missing although its ready marker "
                    "exists; the round was pruned or the store lost it — restart the round"
                )
            head = piece_header(replace(ref, rank=q), j, rs.bounds[j])
            try:
                add(q, decode_summand(blobs.pop(keys[q]), key=keys[q], expect=head, run_key=self._run_key))
            except CorruptObjectError:
                if keys[q] not in early:
                    raise
                add(q, decode_summand(io.get(keys[q]), key=keys[q], expect=head, run_key=self._run_key))
        if guarded:
            acc = guarded_sum(guarded, what=f"round {rs.r} shard {j}")
        return acc

    def _finish(self, rs: _Round, t0: float) -> None:
        """Record stats and delete the round that fell out of ``keep_rounds``."""
        io = self._io
        assert io is not None and rs.stats is not None
        q = rs.stats.participants
        if self.keep_rounds is not None and rs.r >= self.keep_rounds and self.rank in q:
            # the data prefixes are split among the participants (at N = 1,024: one each); the round's
            # control folder goes last, with the data prefixes of the participant who owns it
            i, old = q.index(self.rank), rs.r - self.keep_rounds
            mine = range((i - rs.r) % len(q), len(round_data_prefixes(old, self.world_size)), len(q))
            self._delete_round(old, mine, control=q[rs.r % len(q)] == self.rank)
        rs.stats.bytes_up, rs.stats.bytes_down = io.bytes_up, io.bytes_down
        rs.stats.total_s = time.monotonic() - t0
        self.last_stats = rs.stats

    # ------------------------------------------------------------------ helpers

    def _delete_round(self, r: int, data: range, *, control: bool = True) -> None:
        """Delete round r's data prefixes numbered ``data`` and, with ``control``, its ``rounds/`` folder."""
        io = self._io
        assert io is not None
        prefixes = round_data_prefixes(r, self.world_size)
        for i in data:
            if prefixes[i] != round_prefix(r):
                io.delete(prefixes[i], recursive=True)
        if control:
            io.delete(round_prefix(r), recursive=True)

    def _marker(self, r: int, tensor: torch.Tensor, protocol: str) -> ReadyMarker:
        assert self._io is not None
        split = split_for(
            tensor.numel(), self.world_size, protocol, lambda n: max_object_bytes(self.codec, n),
            self._io.store.whole_object_max,
        )
        return ReadyMarker(
            self.run_id,
            r,
            self.rank,
            self.world_size,
            tensor.numel(),
            str(tensor.dtype),
            list(tensor.shape),
            self.codec,
            protocol,
            split,
            self._plans.get(r),
        )

    def bind_plan(self, round: int, plan: str) -> None:
        """Tie round ``round`` to the plan this replica trains it under (``inner.sync_every = "auto"``: its H
        and first inner step). The plan goes into the round's signed ready marker, so replicas that trained
        the round under different plans (a stored plan deleted and replaced by another) fail the round
        with a :class:`MismatchError` on every replica instead of averaging rounds of different lengths."""
        self._plans[round] = plan
        for old in [k for k in self._plans if k < round - 8]:
            del self._plans[old]

    def _reduced_header(self, r: int, j: int, bounds: tuple[int, int], ref: ReadyMarker,
                        quorum: Quorum) -> ShardHeader:
        return ShardHeader(self.run_id, r, j, "reduced", reduced_codec(ref.codec), bounds[1] - bounds[0], None,
                           ref.dtype, ref.shape, list(quorum.participants))

    def residuals(self) -> dict[str, torch.Tensor]:
        """The error-feedback residuals carried to the next round, by key (for exact resume)."""
        return {k: v.clone() for k, v in self._residuals.items()}

    def load_residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`residuals` returned."""
        self._residuals = {k: v.to(torch.float32).clone() for k, v in residuals.items()}

    def _add_residual(self, flat: torch.Tensor, key: str) -> tuple[torch.Tensor, bool]:
        """``flat`` plus the decayed residual, and whether that is a new tensor (not the caller's)."""
        res = self._residuals.get(key)
        if res is None or res.numel() != flat.numel():
            return flat, False
        return (flat + res if self.feedback_decay == 1.0 else torch.add(flat, res, alpha=self.feedback_decay)), True

    def _protocol(self, numel: int) -> Protocol:
        """This round's protocol (:func:`.topology.resolve`); a sparse codec's ``auto`` weighs its payload
        against the same tensor's int8 one (:func:`.topology.compressed_direct`)."""
        compressed = ((payload_bytes(self.codec, numel), payload_bytes("int8", numel))
                      if reduced_codec(self.codec) != self.codec else None)
        return resolve(self.topology, self.world_size, max_object_bytes(self.codec, numel), compressed=compressed)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=64, thread_name_prefix=f"exchange-{self.rank}"
            )
        return self._pool


def _non_finite(flat: torch.Tensor) -> str | None:
    """Why ``flat`` must not be averaged in (it holds NaN or Inf), or None."""
    if flat.numel() == 0 or (math.isfinite(float(flat.amax())) and math.isfinite(float(flat.amin()))):
        return None  # max and min propagate NaN and show an infinity: both finite is all finite (10x faster)
    bad = int((~torch.isfinite(flat)).sum())
    return None if bad == 0 else f"pseudo-gradient has {bad} non-finite values (NaN/Inf) of {flat.numel()}"


def _open_store(url: str | ObjectStore, storage_options: dict[str, Any] | None, timeout_s: float,
                transfer: TransferPolicy | None = None) -> ObjectStore:
    """Open the store; no single store operation (retries included) may outlive the round's timeout.
    ``transfer`` (the run's ``store_part_size_mb`` / ``store_part_concurrency``) replaces the store's
    default part size and concurrency for large objects."""

    # No s3fs options to add: ObjectStore reads S3 objects with its own ranged GETs (no HEAD).
    store = url if isinstance(url, ObjectStore) else ObjectStore(url, storage_options)
    if store.retry.timeout_s > timeout_s:
        store = store.with_retry(replace(store.retry, timeout_s=timeout_s))
    return store if transfer is None else store.with_transfer(transfer)


def _validate(
    rank: int,
    world_size: int,
    min_replicas: int | None,
    timeout_s: float,
    straggler_timeout_s: float,
    takeover_timeout_s: float,
    keep_rounds: int | None,
    poll_interval_s: float,
) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must satisfy 0 <= rank < world_size={world_size}, got rank={rank}; check REPLICA_RANK")
    if min_replicas is not None and not 1 <= min_replicas <= world_size:
        raise ValueError(f"min_replicas must be between 1 and world_size={world_size}, got {min_replicas}")
    for name, v in (
        ("timeout_s", timeout_s),
        ("straggler_timeout_s", straggler_timeout_s),
        ("takeover_timeout_s", takeover_timeout_s),
        ("poll_interval_s", poll_interval_s),
    ):
        if not v > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {v}")
    if keep_rounds is not None and keep_rounds < 1:
        raise ValueError(f"keep_rounds must be >= 1 or None (keep all), got {keep_rounds}")
