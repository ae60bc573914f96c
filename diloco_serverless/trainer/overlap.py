"""One-step-delay DiLoCo (``outer.delay = 1``): each round's exchange runs while the next round computes.

Plain DiLoCo waits at every round's end for the averaged pseudo-gradient before the next round can
start from the new global parameters. With ``outer.delay = 1`` (one-step-delay / eager DiLoCo, arXiv
2502.12996) round r's exchange is started at its end and runs in the background through round r+1;
at the end of round r+1 its average is applied, one round late:

* **global state**: the outer step at the end of round r applies the average of round r-1
  (zero at round 0); the average of the last round is applied once, after the last round
  (:func:`apply_last_update`). The global parameters and outer momentum are a function of the stored
  averages alone, in the same order on every replica, so every replica applies bit-identical global
  state (same inputs, same torchft code path), and replay (healing) applies them the same way;
* **the replica's start** (``outer.eager = true``, :class:`EagerStart`): round r+1 starts from the
  new global parameters plus this replica's own progress of round r (``theta_r - start_r``): its
  round-r local result with its own stale contribution swapped for the previous round's average.
  The pseudo-gradient a round sends is still ``start - theta`` (this round's progress only), so the
  global trajectory is that of DiLoCo on those pseudo-gradients. With ``eager = false`` every
  replica starts from the (stale) global parameters, the delayed variant of the same paper;
* **resume**: the in-flight round is re-derived from the store (the exchange keeps one more round
  than usual, :meth:`DelayedOuterStep.prune`): a replica that loads the checkpoint of step s reads
  round s-1's average from ``rounds/`` before applying it. Its own start offset (eager) is part of
  its own saved state, so a crashed replica resumes bit-exactly;
* **faults**: when a background exchange failed on this replica, the round's average is read from the
  store (the others closed it); when no one closed it, this round's pseudo-gradient is sent to the
  failed round again, synchronously (the exchange's retry, as in plain DiLoCo) and to this round in
  the background, so the run moves on (a small double count of that replica's progress, on a fault
  path only).

Supported with one fragment, no ``fragment_sync_delay`` and one device per replica (the config
refuses other combinations).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp

from diloco_serverless.trainer.diloco import DiLoCoReplica
from diloco_serverless.trainer.manager import (
    ExchangeRecord,
    ExchangeWork,
    ManagerBase,
    ObjectStoreManager,
    _TrackingFuture,
)

logger = logging.getLogger(__name__)

__all__ = ["DelayedObjectStoreManager", "DelayedOuterStep", "EagerStart", "apply_last_update", "enable_delay"]


class DelayedOuterStep(ManagerBase):
    """Mixin over a manager: ``allreduce`` of round r starts round r's exchange in the background and
    returns round r-1's average at once (zeros at round 0). Put it first in the bases:
    ``class M(DelayedOuterStep, ObjectStoreManager)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: torch.Tensor | None = None  # the average of round current_step() - 1, when in hand
        self._pending_trusted = False  # the pending average came from the store or a replay (no quorum seen)
        self._bg: Future[torch.Tensor] | None = None  # the background exchange of round current_step() - 1
        self._bg_record: ExchangeRecord | None = None
        self._flushing = False
        self._flushed = False  # the last round's average was applied (apply_last_update)
        #: the eager start of this replica (set by enable_delay), saved in the replica's own state
        self.eager: EagerStart | None = None
        #: the record of the round whose average the last boundary applied (its exchange overlapped a round)
        self.applied: ExchangeRecord | None = None

    # -- the round ------------------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False,
                  reduce_op: ReduceOp.RedOpType = ReduceOp.AVG) -> ExchangeWork:
        if reduce_op != ReduceOp.AVG:
            raise ValueError(f"outer.delay = 1 averages pseudo-gradients only (ReduceOp.AVG), got {reduce_op}")
        if not torch.is_floating_point(tensor):
            raise ValueError(f"allreduce needs a floating point tensor, got {tensor.dtype}")
        future = _TrackingFuture()
        if self._errored is not None:
            future.set_result(tensor)
            return ExchangeWork(future, None)
        if self._calls_this_quorum:
            raise RuntimeError(f"{type(self).__name__} rank {self.rank}: second allreduce in round {self._step}; "
                               "build DiLoCo with diloco_serverless.trainer.diloco.build_diloco")
        self._calls_this_quorum += 1
        round_ = self._step
        record = ExchangeRecord(round=round_, numel=tensor.numel(), replayed=self._replay,
                                abstained=self.abstain_reason)
        self.abstain_reason = None
        start = time.monotonic()
        host = tensor.detach().to("cpu", copy=True)
        try:
            if self._replay:
                previous = self._previous(round_, host, retry_with=None)
                following = self._read_round(round_, host)
                if following is None:
                    raise LookupError(f"round {round_} has no stored reduced result to replay")
                self._pending, self._pending_trusted = following, True
                self.history.append(record)
            elif self._flushing:
                previous = self._previous(round_, host, retry_with=None)
            else:
                previous = self._previous(round_, host, retry_with=host)
                self._launch(host, record)
            with torch.no_grad():
                tensor.copy_(previous)
        except Exception as exc:
            logger.warning("rank %d: the delayed outer step of round %d failed: %s", self.rank, round_, exc)
            record.error, record.failure = f"{type(exc).__name__}: {exc}", exc
            if record not in self.history:
                self.history.append(record)
            self.report_error(exc)
            with torch.no_grad():
                tensor.zero_()
        record.blocked_s += time.monotonic() - start
        future.set_result(tensor)
        return ExchangeWork(future, record, tensor.device)

    def _launch(self, host: torch.Tensor, record: ExchangeRecord) -> None:
        """Start round ``record.round``'s exchange of ``host`` on the exchange thread."""
        self.history.append(record)
        self._bg_record = record
        self._bg = self._executor.submit(self._background, host, record)

    def _background(self, host: torch.Tensor, record: ExchangeRecord) -> torch.Tensor:
        start = time.monotonic()
        try:
            return self._exchange(host, record.round, f"fragment-{record.round % self.fragments}", record)
        except Exception as exc:
            logger.warning("rank %d: background exchange of round %d failed: %s", self.rank, record.round, exc)
            record.error, record.failure = f"{type(exc).__name__}: {exc}", exc
            raise
        finally:
            record.exchange_s = time.monotonic() - start

    def _previous(self, round_: int, like: torch.Tensor, *, retry_with: torch.Tensor | None) -> torch.Tensor:
        """The average of round ``round_ - 1`` (zeros before round 0): in hand, from the background
        exchange, from the store, or (``retry_with``) by sending ``retry_with`` to that round again."""
        self._participants, self._late = list(range(self.world_size)), False
        self.applied = None
        if round_ == 0:
            self._pending_trusted = True
            return torch.zeros_like(like)
        if self._pending is not None:
            got, self._pending = self._pending, None
            return got
        bg, record, self._bg, self._bg_record = self._bg, self._bg_record, None, None
        if bg is not None and record is not None and record.round == round_ - 1:
            try:
                got = bg.result()
                self._participants, self._late = list(record.participants), record.late
                self._pending_trusted = False
                self.applied = record
                return got
            except Exception:
                pass  # logged by _background; the store may hold the round's result all the same
        stored = self._read_stored(round_ - 1, like)
        if stored is not None:
            self._pending_trusted = True
            return stored
        if retry_with is None:
            raise LookupError(f"round {round_ - 1}'s average is neither in hand nor in the store")
        retry = ExchangeRecord(round=round_ - 1, numel=like.numel())
        got = self._exchange(retry_with.clone(), round_ - 1, f"fragment-{(round_ - 1) % self.fragments}", retry)
        self._participants, self._late = list(retry.participants), retry.late
        self._pending_trusted = False
        self.applied = retry
        return got

    def _read_stored(self, round_: int, like: torch.Tensor) -> torch.Tensor | None:
        """A closed round's average from the store, whoever took part (the exchange's ``read_reduced``)."""
        exchange = getattr(self, "exchange", None)
        if exchange is not None:
            got: torch.Tensor | None = exchange.read_reduced(round_, like)
            return got
        return self._read_round(round_, like)

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """True when the average applied at this boundary was had (with enough participants, or read
        back from the store); the round's own exchange is still running. Does not count the last
        update (:func:`apply_last_update`) as a round."""
        if self._flushing:
            return self._errored is None
        enough = self._replay or self._pending_trusted or len(self._participants) >= self.min_replicas
        ok = enough and self._errored is None
        if ok:
            self._step += 1
            self._batches_committed += len(self._participants)
            self._commit_failures = 0
        else:
            self._commit_failures += 1
            logger.warning("rank %d: round %d not committed (participants=%s, error=%s)", self.rank, self._step,
                           self._participants, self._errored)
            if self._max_retries is not None and self._commit_failures > self._max_retries:
                raise RuntimeError(f"rank {self.rank}: should_commit failed {self._commit_failures} times in a row "
                                   f"(max_retries={self._max_retries}); last error: {self._errored}")
        return ok

    def in_flight(self, round_: int) -> bool:
        """Whether this replica's own exchange of ``round_`` is running or done and not yet applied."""
        return self._bg is not None and self._bg_record is not None and self._bg_record.round == round_

    @contextlib.contextmanager
    def flushing(self) -> Iterator[None]:
        """Within the block ``allreduce`` returns the last round's average and starts nothing."""
        self._flushing = True
        try:
            yield
        finally:
            self._flushing = False

    def prune(self, before_round: int) -> None:
        """Keep one more round than asked: a replica resuming at step s reads round s-1's average."""
        super().prune(max(0, before_round - 1))  # type: ignore[safe-super]  # a concrete manager follows in the MRO

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "delay_flushed": int(self._flushed)}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        super().load_state_dict(state_dict)
        self._flushed = bool(state_dict.get("delay_flushed", 0))
        self._pending, self._bg, self._bg_record = None, None, None

    def own_state(self) -> dict[str, torch.Tensor]:
        """What only this replica knows about its start (eager): saved with its inner optimizer."""
        return self.eager.state() if self.eager is not None else {}

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.eager is not None:
            self.eager.load(tensors)

    def shutdown(self, wait: bool = True) -> None:
        if self._bg is not None and wait:
            with contextlib.suppress(Exception):
                self._bg.result()
        super().shutdown(wait)


class DelayedObjectStoreManager(DelayedOuterStep, ObjectStoreManager):
    """The object-store manager with one-step-delay outer updates (``outer.delay = 1``)."""


class EagerStart:
    """The replica's own progress of its last round, added to the global parameters at each round's
    start (``outer.eager = true``) and taken out of the next pseudo-gradient, so that what a round sends
    is that round's progress only. Kept in fp32, per parameter of fragment 0."""

    def __init__(self, rep: DiLoCoReplica, manager: DelayedOuterStep) -> None:
        self.rep, self.manager = rep, manager
        self.fragment = rep.diloco._fragments[0]
        self.offset: dict[str, torch.Tensor] = {}
        self._next: dict[str, torch.Tensor] = {}
        self._save_grads = self.fragment._save_grads
        self._perform_sync = self.fragment.perform_sync
        self.fragment._save_grads = self.save_grads
        self.fragment.perform_sync = self.perform_sync

    def save_grads(self) -> None:
        """torchft's pseudo-gradient ``global - theta``, then minus the offset: ``start - theta``."""
        self._save_grads()
        self._next = {}
        with torch.no_grad():
            for name, grad in self.fragment._grads.items():
                if name in self.offset:
                    grad.add_(self.offset[name].to(device=grad.device, dtype=grad.dtype))
                self._next[name] = grad.detach().to(torch.float32).neg()  # theta - start
        if self._next and not bool(torch.stack([torch.isfinite(t).all() for t in self._next.values()]).all()):
            self._next = {}  # a diverged round: start the next one from the global parameters

    def perform_sync(self) -> bool:
        ok = bool(self._perform_sync())
        skip = self.manager._replay or self.manager._flushing or not ok
        self.offset = {} if skip else self._next
        self._next = {}
        self._apply()
        return ok

    def _apply(self) -> None:
        with torch.no_grad():
            for name, param in self.fragment._model_fragment.named_parameters():
                if name in self.offset:
                    param.data.add_(self.offset[name].to(device=param.device, dtype=param.dtype))

    def state(self) -> dict[str, torch.Tensor]:
        return {f"eager/{name}": t.detach().to("cpu").clone() for name, t in self.offset.items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back a saved offset (after the global state was loaded: the parameters are the globals)."""
        self.offset = {k.split("/", 1)[1]: v.clone() for k, v in tensors.items() if k.startswith("eager/")}
        self._apply()


def enable_delay(rep: DiLoCoReplica, *, eager: bool) -> None:
    """Check ``rep`` can run one-step-delay rounds (its manager is a :class:`DelayedOuterStep`, one
    fragment, no fragment_sync_delay) and install the eager start when asked."""
    manager = rep.manager
    if not isinstance(manager, DelayedOuterStep):
        raise TypeError(f"outer.delay = 1 needs a DelayedOuterStep manager, got {type(manager).__name__}")
    if len(rep.fragments) != 1 or rep.diloco._fragment_sync_delay != 0:
        raise ValueError("outer.delay = 1 supports exchange.fragments = 1 and exchange.fragment_sync_delay = 0 only")
    if eager:
        manager.eager = EagerStart(rep, manager)


def apply_last_update(rep: DiLoCoReplica) -> bool:
    """Apply the last round's average (one round late, as every other) to the global state, once.

    Returns True when it was applied now; False when the manager does not delay, nothing was
    exchanged yet, or it was applied before (the flag is part of the checkpointed manager state).
    Raises LookupError when the last round's average is neither in hand nor in the store.
    """
    manager = rep.manager
    if not isinstance(manager, DelayedOuterStep) or manager._flushed or manager.current_step() == 0:
        return False
    fragment = rep.diloco._fragments[0]
    with manager.flushing():
        manager.start_quorum()
        fragment.prepare_sync()
        ok = bool(fragment.perform_sync())
    if not ok:
        raise LookupError(f"rank {manager.rank}: the last round's average could not be applied: {manager.errored()}")
    manager._flushed = True
    rep.reset_to_global()
    return True


def shown_record(manager: ManagerBase, round_: int, record: ExchangeRecord | None) -> ExchangeRecord | None:
    """The exchange a round's metrics describe: the round's own (``None`` when ``record`` is another
    round's); with ``outer.delay = 1`` the one that ran during it and was applied at its end (round - 1)."""
    if isinstance(manager, DelayedOuterStep) and not manager._replay:
        return manager.applied
    return record if record is not None and record.round == round_ else None
