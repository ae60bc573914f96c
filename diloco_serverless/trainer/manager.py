"""The torchft ``Manager`` slot: :class:`ObjectStoreManager` (production) and :class:`MockManager` (tests).

``torchft.local_sgd.DiLoCo`` (DiLoCo, arXiv 2311.08105; Streaming DiLoCo, arXiv 2501.18512) drives
its outer loop through a small part of ``torchft.Manager``: ``start_quorum()``, ``allreduce(tensor,
should_quantize=...) -> Work``, ``should_commit()``, ``current_step()``, ``register_state_dict_fn()``,
``allow_state_dict_read()`` / ``disallow_state_dict_read()``, ``_use_async_quorum`` and, through its
callers, ``errored()``, ``report_error()`` and ``num_participants()``. The managers here implement
exactly that surface with torchft's semantics, but the transport is an object store instead of a
lighthouse and a process group:

* one ``allreduce`` call is one exchange **round** (round id = ``current_step()``), run on a background
  thread so that ``fragment_sync_delay > 0`` overlaps it with inner steps. DiLoCo must therefore hand
  over one flat buffer per fragment (bucketization with a bucket as large as the fragment, see
  :mod:`diloco_serverless.trainer.diloco`); a second ``allreduce`` in the same round raises, because per-parameter
  calls would create one store object per parameter;
* like torchft, an exchange error never raises out of ``allreduce`` or ``Work.wait``: it is recorded
  with :meth:`report_error`, the buffer is zeroed, and the next :meth:`should_commit` returns ``False``
  so DiLoCo restores the last global parameters and discards the round;
* a replica that arrives after the round's quorum was fixed is *late*: it still receives the reduced
  mean (everyone applies the same outer step) but ``is_participating()`` is ``False`` for that round;
* :meth:`replaying` turns ``allreduce`` into a read of an already reduced round (healing by replay).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future as _CFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from diloco_serverless.config import ROUND_TIMEOUT_S, STRAGGLER_TIMEOUT_S
from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce

logger = logging.getLogger(__name__)

__all__ = ["ExchangeRecord", "ExchangeWork", "ManagerBase", "ObjectStoreManager"]


@dataclass
class ExchangeRecord:
    """What one exchange round cost and who took part (read by the train loop for metrics)."""

    round: int
    numel: int
    participants: list[int] = field(default_factory=list)
    late: bool = False
    replayed: bool = False
    bytes_up: int = 0
    bytes_down: int = 0
    exchange_s: float = 0.0  # wall time of the exchange on the background thread
    blocked_s: float = 0.0  # time the training thread spent blocked in Work.wait()
    error: str | None = None
    failure: Exception | None = field(default=None, repr=False, compare=False)  # what ``error`` describes
    abstained: str | None = None  # why this replica did not contribute (non-finite loss or values)
    #: a multi-device replica's bytes over all its local processes (bytes_up/down are this process's)
    replica_bytes: tuple[int, int] | None = None


class _TrackingFuture(torch.futures.Future):  # type: ignore[type-arg]
    """A future that remembers the futures chained on it with ``then``.

    ``torch.futures.Future.wait()`` returns as soon as the value is set, before ``then`` callbacks
    have run; DiLoCo's bucketized path copies the reduced buffer back into the pseudo-gradients in
    such a callback, so :class:`ExchangeWork` waits for the chained futures too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.children: list[torch.futures.Future[Any]] = []

    def then(self, callback: Callable[[Any], Any]) -> torch.futures.Future[Any]:
        child = super().then(callback)
        self.children.append(child)
        return child


class ExchangeWork(dist._Work):  # type: ignore[name-defined,misc]  # torch ships no stub for _Work
    """torchft-style ``Work`` for one background exchange.

    ``wait()`` blocks until the reduced buffer is in place (and callbacks chained on
    :meth:`get_future` ran) and returns ``True``; errors were already reported to the manager,
    exactly like ``torchft.Manager``'s managed work, so it never raises.
    """

    def __init__(self, future: _TrackingFuture, record: ExchangeRecord | None,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self._future = future
        self._record = record
        self._device = device

    def wait(self, timeout: timedelta | None = None) -> bool:
        start = time.monotonic()
        pending: list[Any] = [self._future]
        while pending:
            fut = pending.pop(0)
            try:
                fut.wait()
            except Exception:
                logger.debug("exchange future completed with an error", exc_info=True)
            pending.extend(getattr(fut, "children", []))
        if self._device is not None and self._device.type == "cuda":
            # the result and chained copies were enqueued from the exchange thread's stream
            torch.cuda.synchronize(self._device)
        if self._record is not None:
            self._record.blocked_s += time.monotonic() - start
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return bool(self._future.done())


class ManagerBase(abc.ABC):
    """torchft ``Manager`` surface shared by the object-store and mock managers.

    Subclasses implement :meth:`_exchange` (one round, blocking, called on the exchange thread) and
    :meth:`_read_round` (an already reduced round, for replay).
    """

    _use_async_quorum: bool = False

    def __init__(self, rank: int, world_size: int, *, min_replicas: int | None = None,
                 fragments: int = 1, max_retries: int | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the run (world_size={world_size}); use 0..{world_size - 1}")
        if min_replicas is not None and not 1 <= min_replicas <= world_size:
            raise ValueError(f"min_replicas must be in 1..{world_size}, got {min_replicas}")
        if fragments < 1:
            raise ValueError(f"fragments must be >= 1, got {fragments}")
        self.rank, self.world_size, self.fragments = rank, world_size, fragments
        self.min_replicas = min_replicas or 1
        self._max_retries = max_retries
        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._errored: Exception | None = None
        self._participants: list[int] = list(range(world_size))
        self._late = False
        self._calls_this_quorum = 0
        self._replay = False
        self._inflight: _CFuture[None] | None = None
        self._load_fns: dict[str, Callable[[Any], None]] = {}
        self._save_fns: dict[str, Callable[[], Any]] = {}
        self._readable = threading.Event()
        self._readable.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"diloco-exchange-r{rank}")
        self.history: list[ExchangeRecord] = []
        self._warned_quantize = False
        #: Set by the train loop when this replica must not contribute to the next round (its loss
        #: was not finite); the exchange then only receives the others' mean. Cleared per round.
        self.abstain_reason: str | None = None
        #: Set by the train loop once it restored this replica's own state from a checkpoint: stored
        #: rounds this rank took part in are then re-trained (same data, same state, same bytes
        #: contributed) instead of replayed, so a crash changes nothing in the final model.
        self.retrain_own_rounds = False

    # -- subclass hooks -------------------------------------------------------------------------
    @abc.abstractmethod
    def _exchange(self, tensor: torch.Tensor, round_: int, residual_key: str,
                  record: ExchangeRecord) -> torch.Tensor:
        """Average ``tensor`` for ``round_`` (blocking, on the exchange thread) and fill ``record``."""

    @abc.abstractmethod
    def _read_round(self, round_: int, like: torch.Tensor) -> torch.Tensor | None:
        """The stored result of ``round_`` shaped like ``like``, or ``None`` if it is not there."""

    @abc.abstractmethod
    def prune(self, before_round: int) -> None:
        """Forget rounds older than ``before_round`` (after a complete checkpoint)."""

    def read_reduced(self, round_: int, like: torch.Tensor) -> torch.Tensor | None:
        """The stored reduced result of ``round_`` or ``None`` (not finished, pruned or absent)."""
        return self._read_round(round_, like)

    def holds_round(self, round_: int, like: torch.Tensor) -> bool:
        """Whether the store still holds the outcome of ``round_`` (False here: no store; the object-store
        manager asks its exchange)."""
        return False

    # -- torchft Manager API --------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False,
                  reduce_op: ReduceOp.RedOpType = ReduceOp.AVG) -> ExchangeWork:
        """Average ``tensor`` across the round's participants in place; returns a torchft-style Work.

        The exchange runs on a background thread. On failure the tensor is zeroed, the error is
        reported (:meth:`errored`) and the next :meth:`should_commit` returns ``False``.
        Raises ``RuntimeError`` (a wiring bug, not a fault) on a second call in the same round.
        """
        if reduce_op not in (ReduceOp.AVG, ReduceOp.SUM):
            raise ValueError(f"reduce_op {reduce_op} is not supported by {type(self).__name__}; use AVG or SUM")
        if not torch.is_floating_point(tensor):
            raise ValueError(f"allreduce needs a floating point tensor, got {tensor.dtype}")
        future = _TrackingFuture()
        if self._errored is not None:
            future.set_result(tensor)
            return ExchangeWork(future, None)
        if self._calls_this_quorum:
            raise RuntimeError(
                f"{type(self).__name__} rank {self.rank}: second allreduce in round {self._step} "
                f"({tensor.numel()} elements). One round exchanges ONE flat buffer per fragment; build DiLoCo "
                "with diloco_serverless.trainer.diloco.build_diloco "
                "(bucketization with a bucket as large as the fragment)."
            )
        self._calls_this_quorum += 1
        if should_quantize and not self._warned_quantize:
            logger.info("should_quantize is ignored: the codec is the exchange's setting (exchange.codec)")
            self._warned_quantize = True
        record = ExchangeRecord(
            round=self._step, numel=tensor.numel(), replayed=self._replay, abstained=self.abstain_reason
        )
        self.abstain_reason = None
        self.history.append(record)
        host = tensor.detach().to("cpu", copy=True)
        self._inflight = self._executor.submit(self._run, tensor, host, record, future, reduce_op, self._replay)
        return ExchangeWork(future, record, tensor.device)

    def _run(
        self,
        tensor: torch.Tensor,
        host: torch.Tensor,
        record: ExchangeRecord,
        future: _TrackingFuture,
        reduce_op: ReduceOp.RedOpType,
        replay: bool,
    ) -> None:
        start = time.monotonic()
        try:
            if replay:
                result = self._read_round(record.round, host)
                if result is None:
                    raise LookupError(f"round {record.round} has no stored reduced result to replay")
                record.participants = []
            else:
                key = f"fragment-{record.round % self.fragments}"
                result = self._exchange(host, record.round, key, record)
            if reduce_op == ReduceOp.SUM:
                result = result * max(1, len(record.participants) or self.world_size)
            with torch.no_grad():
                tensor.copy_(result)
            self._participants, self._late = list(record.participants), record.late
        except Exception as exc:
            logger.warning("rank %d: exchange of round %d failed: %s", self.rank, record.round, exc)
            record.error = f"{type(exc).__name__}: {exc}"
            record.failure = exc
            self.report_error(exc)
            with torch.no_grad():
                tensor.zero_()
        finally:
            record.exchange_s = time.monotonic() - start
            future.set_result(tensor)

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Ready the manager for a new round: wait for any in-flight exchange, clear the error.

        The participants are fixed inside the round (``quorum.json``, or the votes at N <= 16), not here.
        """
        self._wait_inflight()
        self._errored = None
        self._calls_this_quorum = 0

    def wait_quorum(self) -> None:
        """No-op: the object-store quorum is decided inside each round."""
        return None

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """True when this round's exchange succeeded with at least ``min_replicas`` participants.

        Increments :meth:`current_step` on success (torchft semantics). Raises ``RuntimeError`` after
        more than ``max_retries`` consecutive failures when ``max_retries`` is set.
        """
        self._wait_inflight()
        enough = self._replay or self.num_participants() >= self.min_replicas
        ok = enough and self._errored is None
        if ok:
            self._step += 1
            self._batches_committed += self.num_participants()
            self._commit_failures = 0
        else:
            self._commit_failures += 1
            logger.warning(
                "rank %d: round %d not committed (participants=%s, error=%s)",
                self.rank,
                self._step,
                self._participants,
                self._errored,
            )
            if self._max_retries is not None and self._commit_failures > self._max_retries:
                raise RuntimeError(
                    f"rank {self.rank}: should_commit failed {self._commit_failures} times in a row "
                    f"(max_retries={self._max_retries}); last error: {self._errored}"
                )
        return ok

    def _wait_inflight(self) -> None:
        if self._inflight is not None:
            self._inflight.result()
            self._inflight = None

    def report_error(self, e: Exception) -> None:
        self._errored = e

    def errored(self) -> Exception | None:
        return self._errored

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def num_participants(self) -> int:
        return len(self._participants)

    def participating_rank(self) -> int | None:
        if self._late or self.rank not in self._participants:
            return None
        return self._participants.index(self.rank)

    def is_participating(self) -> bool:
        return self.participating_rank() is not None

    def state_dict(self) -> dict[str, int]:
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        self._load_fns[key] = load_state_dict
        self._save_fns[key] = state_dict

    def disallow_state_dict_read(self) -> None:
        self._readable.clear()

    def allow_state_dict_read(self) -> None:
        self._readable.set()

    def manager_state_dict(self) -> dict[str, Any]:
        """``{"user": {key: save_fn()}, "torchft": state_dict()}`` like torchft's healing payload."""
        if not self._readable.wait(timeout=600):
            raise TimeoutError(f"rank {self.rank}: state dict stayed locked by an optimizer step for 600 s")
        return {"user": {k: fn() for k, fn in self._save_fns.items()}, "torchft": self.state_dict()}

    def load_manager_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a payload from :meth:`manager_state_dict` (registered load fns, then step)."""
        missing = sorted(set(self._load_fns) - set(state["user"]))
        if missing:
            raise KeyError(f"rank {self.rank}: checkpoint lacks state for {missing}")
        for key, fn in self._load_fns.items():
            fn(state["user"][key])
        self.load_state_dict(state["torchft"])

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Within the block, ``allreduce`` returns the stored reduced result of round ``current_step()``."""
        self._wait_inflight()
        self._replay = True
        try:
            yield
        finally:
            self._wait_inflight()
            self._replay = False

    def shutdown(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait)


class ObjectStoreManager(ManagerBase):
    """torchft ``Manager`` whose allreduce is an :class:`~diloco_serverless.exchange.allreduce.ObjectStoreAllReduce`.

    Args:
        url: store URL; rounds live under ``<url>/<run_id>/rounds/``.
        rank, world_size: this replica and the configured number of replicas.
        run_id: the run inside the store.
        min_replicas: fewest participants for a round to commit (default 1; the exchange also uses
            it to close a quorum after the straggler timeout).
        fragments: number of DiLoCo fragments (error-feedback residuals are kept per fragment).
        codec, error_feedback, timeout_s, straggler_timeout_s, storage_options, **exchange_options:
            passed to ``ObjectStoreAllReduce``; rounds are never pruned by the exchange
            (``keep_rounds=None``): the train loop prunes after each checkpoint so replay can heal.
        allreduce: an already built exchange (tests).

    Raises ``ValueError`` for a rank outside ``0..world_size-1`` or an invalid ``min_replicas``.
    """

    def __init__(
        self,
        url: str,
        rank: int,
        world_size: int,
        *,
        run_id: str,
        min_replicas: int | None = None,
        fragments: int = 1,
        codec: str = "fp32",
        error_feedback: bool = False,
        timeout_s: float = ROUND_TIMEOUT_S,
        straggler_timeout_s: float = STRAGGLER_TIMEOUT_S,
        storage_options: dict[str, Any] | None = None,
        max_retries: int | None = None,
        allreduce: Any | None = None,
        **exchange_options: Any,
    ) -> None:
        super().__init__(rank, world_size, min_replicas=min_replicas, fragments=fragments, max_retries=max_retries)
        if allreduce is None:
            exchange_options.setdefault("keep_rounds", None)
            allreduce = ObjectStoreAllReduce(
                url,
                rank,
                world_size,
                run_id=run_id,
                timeout_s=timeout_s,
                min_replicas=min_replicas,
                straggler_timeout_s=straggler_timeout_s,
                codec=codec,
                error_feedback=error_feedback,
                storage_options=storage_options,
                **exchange_options,
            )
        self.exchange = allreduce
        self.url, self.run_id = url, run_id

    def bind_plan(self, round_: int, plan: str) -> None:
        """Round ``round_`` is trained under ``plan`` (``inner.sync_every = "auto"``): the exchange puts it in
        the round's signed ready marker, so replicas that disagree on it fail the round instead of averaging
        it (:meth:`~diloco_serverless.exchange.allreduce.ObjectStoreAllReduce.bind_plan`)."""
        bind = getattr(self.exchange, "bind_plan", None)
        if bind is not None:
            bind(round_, plan)

    def _exchange(self, tensor: torch.Tensor, round_: int, residual_key: str, record: ExchangeRecord) -> torch.Tensor:
        result = self.exchange.allreduce(tensor, round=round_, residual_key=residual_key, abstain=record.abstained)
        stats = getattr(self.exchange, "last_stats", None)
        if stats is not None:
            record.abstained = stats.abstained
            record.participants = sorted(int(r) for r in stats.participants)
            record.late = bool(stats.late)
            record.bytes_up, record.bytes_down = int(stats.bytes_up), int(stats.bytes_down)
        else:
            record.participants = list(range(self.world_size))
        return result

    def _read_round(self, round_: int, like: torch.Tensor) -> torch.Tensor | None:
        unless = self.rank if self.retrain_own_rounds else None
        return self.exchange.read_reduced(round_, like, unless_participant=unless)

    def holds_round(self, round_: int, like: torch.Tensor) -> bool:
        """Whether the store still holds the outcome of ``round_`` (its quorum or votes; no data is read)."""
        return self.exchange.holds_round(round_, like)

    def prune(self, before_round: int) -> None:
        """Delete stored rounds older than ``before_round`` (after a complete checkpoint)."""
        self.exchange.prune(before_round)

    def shutdown(self, wait: bool = True) -> None:
        super().shutdown(wait)
        close = getattr(self.exchange, "close", None)
        if close is not None:
            close()
