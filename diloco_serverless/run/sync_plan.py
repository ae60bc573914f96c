"""H decided at run time (``inner.sync_every = "auto"``): one signed, create-only object per round.

    sync_every/<round:08d>.json   {"round", "h", "start", "last", "reason", "compute_s", "exchange_s", "tau"[, "mac"]}

Rank 0 writes the plan of round r before it trains round r (the rule: :mod:`diloco_serverless.trainer.sync_every`);
every other replica reads it before training round r, so every replica runs the same H in every round. A
plan names the round's first inner step (``start``), so it alone says where the round begins: a replica that
restarts, or replays rounds it missed, counts inner steps, data positions and the lr schedule from the stored
plans, never from its own timings. ``last`` marks the round that ends the run (its ``start + h`` is the run's
inner-step budget). ``tau`` (in-round overlap, ``exchange.fragment_sync_delay > 0`` with auto) is how many of
the round's last inner steps its exchange overlaps; 0 without.

With the run key a plan carries an HMAC bound to its key (kind :data:`PLAN_KIND`, place
``sync_every/<round>.json``): one that does not verify, is not a JSON object of the right fields, or names
another round is refused (:class:`PlanRefused`), never guessed around. A missing plan delays the round (the
reader waits, up to its timeout, then fails and heals like any failed round); plans are create-only and
never pruned, so a stored plan never changes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from diloco_serverless.errors import ExchangeError, RunError
from diloco_serverless.run.integrity import MAC_FIELD, mac_json, verify_json
from diloco_serverless.run.layout import SYNC_PLAN_PREFIX, sync_plan_key
from diloco_serverless.store.errors import ObjectNotFound
from diloco_serverless.store.objectstore import ObjectStore

__all__ = ["PLAN_KIND", "PlanRefused", "PlanTimeout", "RoundPlan", "latest_plan", "read_plan", "wait_plan",
           "write_plan"]

#: What a plan's HMAC is bound to (see :mod:`diloco_serverless.run.integrity`).
PLAN_KIND = "sync-plan"
_MAX_PLAN_BYTES = 4096


class PlanRefused(RunError):
    """A stored plan of H is unsigned, forged, copied from another round or malformed: never used."""


class PlanTimeout(ExchangeError):
    """No plan of H for a round appeared within the wait (rank 0 has not decided it)."""


@dataclass(frozen=True)
class RoundPlan:
    """Round ``round`` runs ``h`` inner steps, from global inner step ``start``; ``last``: it ends the run.
    ``reason`` and the timings are what rank 0 decided from (shown in metrics and status, not acted on)."""

    round: int
    h: int
    start: int
    last: bool = False
    reason: str = "initial"
    compute_s: float | None = None  # rank 0's measured seconds per inner step (median of recent rounds)
    exchange_s: float | None = None  # rank 0's measured seconds per exchange (median of recent rounds)
    tau: int = 0  # the round's last inner steps its exchange overlaps (exchange.fragment_sync_delay); < h

    @property
    def end(self) -> int:
        """The first inner step after this round."""
        return self.start + self.h

    def tag(self) -> str:
        """What a replica trains this round under, as the exchange's ready marker carries it: the round, its
        H and its first inner step (the timings and the reason do not change what is trained)."""
        tau = f" tau={self.tau}" if self.tau else ""
        return f"round {self.round}: h={self.h}{tau} from step {self.start}{' (last)' if self.last else ''}"


def _parse(doc: Any, round_: int, where: str) -> RoundPlan:
    if not isinstance(doc, dict):
        raise PlanRefused(f"{where}: not a JSON object; delete it and let rank 0 decide the round again")
    body = {k: v for k, v in doc.items() if k != MAC_FIELD}
    try:
        plan = RoundPlan(**body)
    except TypeError as exc:
        raise PlanRefused(f"{where}: unexpected fields ({exc})") from None
    ints = (plan.round, plan.h, plan.start, plan.tau)
    if (not all(isinstance(v, int) and not isinstance(v, bool) for v in ints) or plan.h < 1 or plan.start < 0
            or not 0 <= plan.tau < plan.h
            or not isinstance(plan.last, bool) or not isinstance(plan.reason, str)
            or any(v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v))
                   for v in (plan.compute_s, plan.exchange_s))):
        raise PlanRefused(f"{where}: fields of the wrong type or range: {body}")
    if plan.round != round_:
        raise PlanRefused(f"{where}: names round {plan.round}, not {round_}")
    return plan


def read_plan(store: ObjectStore, round_: int, key: bytes | None) -> RoundPlan | None:
    """Round ``round_``'s plan, None when none is stored. With ``key`` an unsigned or forged plan raises
    :class:`PlanRefused` (so does a malformed one, with or without the key)."""
    where = sync_plan_key(round_)
    try:
        raw = store.get(where, max_bytes=_MAX_PLAN_BYTES)
    except ObjectNotFound:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise PlanRefused(f"{store.url}/{where}: not valid JSON; never used") from None
    if key is not None and not verify_json(key, PLAN_KIND, doc, place=where):
        raise PlanRefused(f"{store.url}/{where}: its signature does not verify under the run key (unsigned, "
                          "forged, or copied from another round); refusing to train with it. Delete it only if "
                          "you know rank 0 did not write it: rank 0 then writes it again")
    return _parse(doc, round_, f"{store.url}/{where}")


def write_plan(store: ObjectStore, plan: RoundPlan, key: bytes | None) -> RoundPlan:
    """Store ``plan`` create-only (signed with ``key``); returns the stored plan, which is an earlier
    writer's when one exists (a restarted rank 0 keeps what it decided before)."""
    where = sync_plan_key(plan.round)
    doc: dict[str, Any] = asdict(plan)
    if key is not None:
        doc = mac_json(key, PLAN_KIND, doc, place=where)
    if store.put_if_absent(where, json.dumps(doc).encode("utf-8")):
        return plan
    stored = read_plan(store, plan.round, key)
    return plan if stored is None else stored


def wait_plan(store: ObjectStore, round_: int, key: bytes | None, *, timeout_s: float,
              poll_s: float = 0.5) -> RoundPlan:
    """Round ``round_``'s plan, polling (20 ms, backing off to ``poll_s``) until it is stored; raises
    :class:`PlanTimeout` after ``timeout_s`` and :class:`PlanRefused` for a plan that does not verify."""
    deadline = time.monotonic() + timeout_s
    sleep = 0.02
    while True:
        plan = read_plan(store, round_, key)
        if plan is not None:
            return plan
        if time.monotonic() >= deadline:
            raise PlanTimeout(f"{store.url}/{sync_plan_key(round_)}: rank 0 has not decided H of round {round_} "
                              f"within {timeout_s:.0f} s (is rank 0 running? `diloco status` shows it)")
        time.sleep(min(sleep, max(0.0, deadline - time.monotonic())))
        sleep = min(poll_s, sleep * 2)


def latest_plan(store: ObjectStore, key: bytes | None) -> RoundPlan | None:
    """The newest stored plan that reads back (for status): one LIST and one GET; None when there is none
    or it does not verify (status shows, never acts)."""
    keys = sorted(k for k in store.list(SYNC_PLAN_PREFIX + "/") if k.endswith(".json"))
    for where in reversed(keys[-3:]):
        try:
            round_ = int(where.rsplit("/", 1)[-1].split(".", 1)[0])
            plan = read_plan(store, round_, key)
        except (ValueError, PlanRefused):
            continue
        if plan is not None:
            return plan
    return None
