"""``SlicedManager``: the torchft ``Manager`` slot of one local process of a multi-device replica.

Every local process of a replica holds the same model (the inner steps sum their gradients over the
local group), so each hands DiLoCo's flat pseudo-gradient of a fragment to its manager. Local rank g
exchanges only slice g of it (:class:`~diloco_serverless.exchange.sliced.SlicedAllReduce`, 1/G of
the bytes). Either the G reduced slices are then all-gathered inside the replica, so every local
process applies the same outer step to the same averaged pseudo-gradient, or (``gather_result=False``,
what the trainer uses) each process keeps its slice of the mean, steps its slice of the global
parameters (:mod:`diloco_serverless.trainer.sliced_outer`) and the updated slices are all-gathered.
Either way the global parameters stay identical on every process of every replica. With FSDP
(``presliced=True``) each process hands over only its shards, which are its slice as they are.

The replica decides as one: it abstains when any of its slices cannot contribute (one non-finite
slice, or the loop's abstain reason), a round fails on all its processes when it fails on one, and a
stored round is replayed only when every slice of it is stored.
"""

from __future__ import annotations

from typing import Any

import torch

from diloco_serverless.config import ROUND_TIMEOUT_S, STRAGGLER_TIMEOUT_S
from diloco_serverless.errors import ExchangeError
from diloco_serverless.exchange.sliced import SlicedAllReduce
from diloco_serverless.trainer.local_group import LocalGroup
from diloco_serverless.trainer.manager import ExchangeRecord, ObjectStoreManager

__all__ = ["SlicedManager"]


class SlicedManager(ObjectStoreManager):
    """:class:`ObjectStoreManager` for local rank ``local.rank`` of a replica of ``local.size`` processes.

    Takes the arguments of :class:`ObjectStoreManager` (``allreduce`` excepted) plus ``local`` and
    ``gather_result``: with ``False`` the returned mean holds only this process's slice (zeros
    elsewhere) and no all-gather is made, for an outer optimizer that steps only that slice
    (:class:`~diloco_serverless.trainer.sliced_outer.SlicedOuterSGD`, which all-gathers the updated
    parameters instead). ``presliced=True`` (FSDP, ``parallel.strategy = "fsdp"``): the tensor handed
    over is already this process's slice (its shards of the fragment's parameters; the slices of the
    local ranks may differ in size) and the mean returned is that slice, never gathered.
    ``ExchangeRecord`` bytes are this process's (one device's) bytes.
    """

    def __init__(
        self,
        url: str,
        rank: int,
        world_size: int,
        *,
        local: LocalGroup,
        gather_result: bool = True,
        presliced: bool = False,
        run_id: str,
        min_replicas: int | None = None,
        fragments: int = 1,
        codec: str = "fp32",
        error_feedback: bool = False,
        timeout_s: float = ROUND_TIMEOUT_S,
        straggler_timeout_s: float = STRAGGLER_TIMEOUT_S,
        storage_options: dict[str, Any] | None = None,
        max_retries: int | None = None,
        **exchange_options: Any,
    ) -> None:
        exchange_options.setdefault("keep_rounds", None)
        exchange = SlicedAllReduce(
            url, rank, world_size, slice_index=local.rank, slices=local.size, run_id=run_id, timeout_s=timeout_s,
            min_replicas=min_replicas, straggler_timeout_s=straggler_timeout_s, codec=codec,
            error_feedback=error_feedback, storage_options=storage_options, **exchange_options,
        )
        super().__init__(url, rank, world_size, run_id=run_id, min_replicas=min_replicas, fragments=fragments,
                         max_retries=max_retries, allreduce=exchange)
        self.local, self.gather_result, self.presliced = local, gather_result, presliced

    def _part(self, tensor: torch.Tensor) -> torch.Tensor:
        """This process's slice of a fragment's flat tensor (the whole tensor when presliced)."""
        return tensor.reshape(-1) if self.presliced else self.local.slice_of(tensor)

    def _exchange(self, tensor: torch.Tensor, round_: int, residual_key: str, record: ExchangeRecord) -> torch.Tensor:
        part = self._part(tensor)
        own_reason = record.abstained
        if own_reason is None and not bool(torch.isfinite(part).all()):
            own_reason = f"slice {self.local.rank} of the pseudo-gradient has non-finite values (NaN/Inf)"
        abstaining = self.local.flags(own_reason is not None)
        if any(abstaining) and own_reason is None:
            own_reason = f"local process {abstaining.index(True)} of this replica cannot contribute"
        record.abstained = own_reason
        failure: Exception | None = None
        try:
            reduced = super()._exchange(part.contiguous(), round_, residual_key, record)
        except Exception as exc:  # the whole replica fails the round together (below)
            failure, reduced = exc, torch.zeros_like(part)
        failed = self.local.flags(failure is not None)
        up, down = self.local.sums([record.bytes_up, record.bytes_down])
        record.replica_bytes = (up, down)
        if failure is not None:
            raise failure
        if any(failed):
            raise ExchangeError(
                f"round {round_}: local process {failed.index(True)} of replica {self.rank} failed its slice of the "
                "exchange (see its log); the replica drops the round as a whole"
            )
        return self._whole(reduced, tensor)

    def _read_round(self, round_: int, like: torch.Tensor) -> torch.Tensor | None:
        part_like = self._part(like)
        failure: Exception | None = None
        got: torch.Tensor | None = None
        try:
            got = super()._read_round(round_, part_like)
        except Exception as exc:
            failure = exc
        failed = self.local.flags(failure is not None)
        if failure is not None:
            raise failure
        if any(failed):
            raise ExchangeError(f"round {round_}: local process {failed.index(True)} of replica {self.rank} could "
                                "not read its slice of the stored round (see its log)")
        present = self.local.flags(got is not None)
        if not all(present):
            return None
        assert got is not None
        return self._whole(got, like)

    def _whole(self, part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``like``-shaped: every slice gathered, or (``gather_result=False``) only ours, zeros elsewhere;
        presliced: ours, which is all of ``like``."""
        if self.presliced:
            return part.reshape(like.shape).to(like.dtype)
        if self.gather_result:
            return self.local.gather_slices(part, like.numel()).view(like.shape).to(like.dtype)
        out = torch.zeros(like.numel(), dtype=like.dtype)
        self.local.slice_of(out).copy_(part.reshape(-1))
        return out.view(like.shape)
