"""A replica's side of ``inner.sync_every = "auto"``: each round's H from the signed plans in the store.

Rank 0 decides (:class:`~diloco_serverless.trainer.sync_every.AutoSyncEvery` on its measured timings) and
writes round r's plan create-only before it trains round r, right after round r-1 ends and before it evaluates
or checkpoints, so the others do not wait for that; every replica, rank 0 included, then trains round r with
the stored plan's H (:mod:`diloco_serverless.run.sync_plan`). The plans also say where each round starts, so
inner steps, data positions and the lr schedule after a restart or a replayed round come from the store.
The run's length is ``rounds x sync_every`` inner steps (``sync_every``: the first rounds' H); the last
round is cut to what is left, and the number of rounds is known once its plan is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from diloco_serverless.config import RunConfig
from diloco_serverless.run.sync_plan import PlanRefused, PlanTimeout, RoundPlan, read_plan, wait_plan, write_plan
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer.diloco import DiLoCoReplica
from diloco_serverless.trainer.manager import ExchangeRecord
from diloco_serverless.trainer.sync_every import TAU_SHARE, AutoSyncEvery

logger = logging.getLogger(__name__)

__all__ = ["RoundPlanner"]


class RoundPlanner:
    """The plans of one run as one replica sees them (cached), and rank 0's decisions.

    ``on_rounds(n)`` is called with the run's number of rounds once the last round's plan is read.
    """

    def __init__(self, store: ObjectStore, run_key: bytes | None, cfg: RunConfig, rank: int, rep: DiLoCoReplica,
                 *, on_rounds: Callable[[int], None]) -> None:
        self.store, self.run_key, self.cfg, self.rank, self.rep = store, run_key, cfg, rank, rep
        self.total_steps = cfg.rounds * cfg.inner.sync_every
        self.on_rounds = on_rounds
        self.plans: dict[int, RoundPlan] = {}
        #: in-round overlap (exchange.fragment_sync_delay > 0): each plan also says the round's tau
        self.tau0 = cfg.exchange.fragment_sync_delay
        self.rule = (AutoSyncEvery(overlap=bool(cfg.outer.delay), lo=cfg.inner.auto_sync_min,
                                   hi=cfg.inner.auto_sync_max, tau_share=TAU_SHARE if self.tau0 else None)
                     if rank == 0 else None)

    @property
    def max_rounds(self) -> int:
        """An upper bound of the run's rounds before the last plan is known (every H but the last >= min)."""
        return -(-self.total_steps // self.cfg.inner.auto_sync_min) + 1

    def steps_before(self, round_: int) -> int:
        """Inner steps of the run before round ``round_``: the end of round ``round_ - 1``'s plan (or the
        start of round ``round_``'s). Raises :class:`PlanRefused` when neither is stored."""
        if round_ <= 0:
            return 0
        before = self.stored(round_ - 1)
        if before is not None:
            return before.end
        plan = self.stored(round_)
        if plan is None:
            raise PlanRefused(f"{self.store.url}: neither round {round_ - 1}'s nor round {round_}'s plan of H is "
                              f"stored (sync_every/), so where round {round_} starts is unknown; a plan was deleted")
        return plan.start

    def stored(self, round_: int, *, wait: bool = False) -> RoundPlan | None:
        """Round ``round_``'s plan (cached; ``wait``: until it is stored, at most exchange.round_timeout_s)."""
        plan = self.plans.get(round_)
        if plan is None:
            plan = read_plan(self.store, round_, self.run_key)
            if plan is None and wait:
                plan = wait_plan(self.store, round_, self.run_key, timeout_s=self.cfg.exchange.round_timeout_s,
                                 poll_s=self.cfg.exchange.poll_interval_s or 0.5)
            if plan is None:
                return None
            self.plans[round_] = plan
        if plan.last:
            self.on_rounds(round_ + 1)
        return plan

    def plan(self, round_: int) -> RoundPlan | None:
        """Round ``round_``'s plan, the same on every replica (rank 0 writes it first when none is stored,
        every other replica waits for it), with torchft's H set to it; None when the run's inner steps all
        lie before ``round_``. Rank 0 also writes the next round's plan (see :meth:`ensure`)."""
        plan = self.ensure(round_)
        if plan is None:
            return None
        if self.rule is not None:
            self.ensure(round_ + 1)
        for owner in (self.rep.diloco, *self.rep.diloco._fragments):  # one fragment (config): the round's H
            owner._sync_every = plan.h
            owner._fragment_sync_delay = plan.tau  # and how many of its last steps overlap the exchange
        bind = getattr(self.rep.manager, "bind_plan", None)
        if bind is not None:  # the round's ready marker carries the plan: replicas under different plans fail it
            bind(round_, plan.tag())
        return plan

    def ensure(self, round_: int) -> RoundPlan | None:
        """Round ``round_``'s stored plan, written first by rank 0 when there is none. Rank 0 decides one round
        ahead (round r+2's H at the end of round r, from the timings so far), so a replica waits for a plan only
        when rank 0 is a whole round behind it (rank 0 evaluates and checkpoints between rounds)."""
        start = self.steps_before(round_)
        if start >= self.total_steps:
            self.on_rounds(round_)
            return None
        if self.stored(round_) is None:
            if self.rule is not None:
                self._decide(round_, start)
            else:
                self._await_rank0(round_, start)
        plan = self.stored(round_, wait=True)
        assert plan is not None
        if plan.start != start:
            raise PlanRefused(f"{self.store.url}: the plan of round {round_} starts at inner step {plan.start}, but "
                              f"round {round_ - 1}'s plan ends at {start}; refusing plans that disagree")
        return plan

    def crossed(self, round_: int, every: int) -> bool:
        """Whether round ``round_`` crossed a multiple of ``every`` x sync_every inner steps (``eval_every`` and
        ``checkpoint_every`` count rounds of the first H, so their cadence in tokens does not depend on the H
        chosen)."""
        unit = every * self.cfg.inner.sync_every
        return self.steps_before(round_ + 1) // unit > self.steps_before(round_) // unit

    def _decide(self, round_: int, start: int) -> None:
        """Rank 0: the rule's H for ``round_`` (the configured first H for round 0), stored create-only."""
        assert self.rule is not None
        prev = self.stored(round_ - 1) if round_ > 0 else None
        current = prev.h if prev is not None else self.cfg.inner.sync_every
        h, reason = self.rule.decide(current, measured_before=prev is not None and prev.compute_s is not None)
        if round_ == 0 or (prev is not None and prev.reason == "initial" and self.rule.timings() is None):
            h, reason = self.cfg.inner.sync_every, "initial"
        timed = self.rule.timings()
        h = min(h, self.total_steps - start)
        tau = (min(self.tau0, h - 1) if reason == "initial" else self.rule.tau(h, self.tau0)) if self.tau0 else 0
        decided = RoundPlan(round_, h, start, last=start + h >= self.total_steps, reason=reason,
                            compute_s=timed[0] if timed else None, exchange_s=timed[1] if timed else None, tau=tau)
        write_plan(self.store, decided, self.run_key)
        if h != current:
            logger.info("rank 0: H of round %d is %d (was %d; %.3f s per inner step, %.3f s per exchange)",
                        round_, h, current, *(timed or (0.0, 0.0)))

    def _await_rank0(self, round_: int, start: int) -> None:
        """Not rank 0: wait exchange.straggler_timeout_s for rank 0's plan, then store one that keeps the
        previous round's H (create-only: whichever plan is stored first is every replica's), so a run whose
        rank 0 is down goes on as it does with a number for H."""
        try:
            wait_plan(self.store, round_, self.run_key, timeout_s=self.cfg.exchange.straggler_timeout_s,
                      poll_s=self.cfg.exchange.poll_interval_s or 0.5)
            return
        except PlanTimeout:
            pass
        prev = self.stored(round_ - 1) if round_ > 0 else None
        h = min(prev.h if prev is not None else self.cfg.inner.sync_every, self.total_steps - start)
        tau = min(prev.tau if prev is not None else self.tau0, h - 1) if self.tau0 else 0
        write_plan(self.store, RoundPlan(round_, h, start, last=start + h >= self.total_steps,
                                         reason=f"kept by rank {self.rank}: rank 0 absent", tau=tau), self.run_key)
        logger.warning("rank %d: rank 0 wrote no plan of round %d within exchange.straggler_timeout_s; "
                       "keeping H = %d", self.rank, round_, h)

    def observe(self, steps: int, record: ExchangeRecord | None, inner_s: float) -> None:
        """Rank 0: one round's compute per inner step and exchange time (a live, measured exchange only)."""
        if (self.rule is not None and record is not None and steps > 0 and record.exchange_s > 0
                and not record.replayed and not record.late and record.error is None):
            self.rule.observe(inner_s / steps, record.exchange_s)
