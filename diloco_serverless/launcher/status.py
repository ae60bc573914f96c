"""What a run is doing: executor states merged with the heartbeats replicas write to the store.

Pure functions over plain data (no I/O), so ``diloco status``, ``Run.status()`` and the launch
progress display share one definition of "state", and tests can build any situation by hand.

A replica's state comes from the executor's ``poll`` when the executor is reachable (it knows
about crashes, restarts and cancellation); otherwise from its heartbeat in
``<run>/members/rank-<r>.json`` and the run's final model. A heartbeat older than ``stale_after_s``
marks a running replica ``stale`` (it may be preempted or hung); it is a hint, not a verdict.

``pending`` (queued on the platform) is not ``running``: a replica is running once this launch's
replica has written its start record (``members/starts/``, :mod:`diloco_serverless.run.starts`) or a
heartbeat; an executor that says running before that shows ``starting``. ``continue`` is a replica that
stopped before its platform's time cap with its state saved: the launcher starts a fresh attempt.
An executor that cannot tell (``unknown``: a result that expired, a poll that failed) defers to the
heartbeat and the final model: ``done`` or a written ``final/`` is ``succeeded``.

Heartbeats come from the bucket, which anyone with write access to the run can fill: a field of
the wrong type or range is left unknown (None), named in ``ReplicaReport.invalid`` and explained
in ``ReplicaReport.notes`` ("rank 2: heartbeat field 'round' is not an integer"); it never raises.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diloco_serverless.executors.base import ReplicaStatus
from diloco_serverless.run.members import (
    HEARTBEAT_CONTINUING,
    HEARTBEAT_DONE,
    HEARTBEAT_FAILED,
    HEARTBEAT_FIELDS,
    parse_heartbeat_field,
)
from diloco_serverless.run.rl_metrics import mean_over

#: A replica's state in ``diloco status``: the executor's states (one definition, ReplicaStatus) ...
PENDING, RUNNING = ReplicaStatus.PENDING.value, ReplicaStatus.RUNNING.value
SUCCEEDED, FAILED, CANCELLED = ReplicaStatus.SUCCEEDED.value, ReplicaStatus.FAILED.value, ReplicaStatus.CANCELLED.value
#: ... plus two that only status can tell: a silent heartbeat, and an executor that could not be asked ...
STALE, UNKNOWN = "stale", ReplicaStatus.UNKNOWN.value
#: ... a replica the platform runs that has not started yet (no start record, no heartbeat of this
#: launch), and one to continue in a fresh attempt (ReplicaStatus.CONTINUE).
STARTING, CONTINUE = "starting", ReplicaStatus.CONTINUE.value
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})

#: Heartbeat ``state`` values a replica may write, mapped onto executor states (the first two are
#: what :mod:`diloco_serverless.trainer.loop` writes; the rest are accepted from other writers).
_HEARTBEAT_STATES: dict[str, str] = {
    HEARTBEAT_DONE: SUCCEEDED, HEARTBEAT_FAILED: FAILED, "finished": SUCCEEDED, "succeeded": SUCCEEDED,
    "completed": SUCCEEDED, "error": FAILED, "cancelled": CANCELLED, HEARTBEAT_CONTINUING: CONTINUE,
}


@dataclass(frozen=True)
class ExecutorState:
    """One replica as the executor sees it (normalised from the executor's ``ReplicaState``)."""

    state: str
    reason: str | None = None


@dataclass(frozen=True)
class RankStarts:
    """What run.json and the start records say about one rank's launches (for :func:`build_replica`).

    ``attempts`` counts the rank's start records of every launch; ``started_at`` is the first start
    record (Unix s) of its current launch, None before the replica started; ``current_seen`` whether a
    start record or heartbeat of the current launch exists; ``billed_before_s`` what its earlier
    launches were billed (recorded in run.json when the rank was resumed).
    """

    attempts: int = 0
    started_at: float | None = None
    current_seen: bool = False
    billed_before_s: float = 0.0


@dataclass(frozen=True)
class ReplicaReport:
    """One row of ``diloco status``."""

    rank: int
    state: str
    round: int | None = None
    step: int | None = None
    loss: float | None = None
    attempt: int | None = None
    heartbeat_age_s: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    reason: str | None = None
    #: Heartbeat fields whose stored value was unusable (shown as ``?``), and one note per field.
    invalid: frozenset[str] = frozenset()
    notes: tuple[str, ...] = ()
    #: Starts of this rank's replica (start records of every launch); None: not known (no records read).
    attempts: int | None = None
    #: Seconds since the rank's replica started in its current launch (first start record); None: not yet.
    started_age_s: float | None = None
    #: Seconds its earlier launches were billed (see :func:`billed_seconds`).
    billed_before_s: float = 0.0
    #: The state came from the replica's (unsigned) heartbeat alone, the executor not knowing the replica:
    #: shown, never acted on (``Run.wait`` neither restarts, nor ends on, such a state; docs/security.md).
    from_heartbeat: bool = False
    #: An RL run's numbers of the rank's last round, from its heartbeat (:mod:`diloco_serverless.run.rl_metrics`).
    rl: dict[str, float] | None = None

    @property
    def bytes_moved(self) -> int:
        return self.bytes_up + self.bytes_down


@dataclass(frozen=True)
class RunStatus:
    """The whole run: per-replica rows, totals and the spend estimate."""

    run_id: str
    url: str
    executor: str | None
    gpu: str | None
    rounds_total: int | None
    replicas: list[ReplicaReport]
    state: str
    elapsed_s: float
    est_usd: float | None = None
    eval_loss: float | None = None
    final_url: str | None = None
    failures: list[tuple[int, str]] = field(default_factory=list)
    #: devices (local processes) per replica, ``parallel.devices``; the spend estimate counts each
    #: (the executor's price is per replica, all its GPUs)
    devices_per_replica: int = 1
    #: inner.sync_every = "auto": H of the newest round rank 0 planned and why (run/sync_plan.py)
    sync_every: tuple[int, str] | None = None

    @property
    def round(self) -> int | None:
        """The furthest round any replica has reported (rounds are 0-based)."""
        rounds = [r.round for r in self.replicas if r.round is not None]
        return max(rounds) if rounds else None

    @property
    def loss(self) -> float | None:
        """Mean of the replicas' latest training losses."""
        losses = [r.loss for r in self.replicas if r.loss is not None]
        return sum(losses) / len(losses) if losses else None

    @property
    def bytes_moved(self) -> int:
        return sum(r.bytes_moved for r in self.replicas)

    @property
    def rl(self) -> dict[str, float] | None:
        """An RL run's numbers of the replicas' last rounds, each the mean over the replicas that report it;
        None for a supervised run (no replica's heartbeat carries them)."""
        summaries = [r.rl for r in self.replicas if r.rl]
        return mean_over(summaries) if summaries else None

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @property
    def settled(self) -> bool:
        """:attr:`done`, from what may be acted on: no replica's terminal state comes from its heartbeat
        alone (a heartbeat is unsigned: anyone who can write the bucket can say "failed" or "done")."""
        return self.done and not any(r.from_heartbeat and r.state in TERMINAL for r in self.replicas)

    @property
    def notes(self) -> list[str]:
        """What could not be read from the replicas' heartbeats, one line per rank and field."""
        return [note for r in self.replicas for note in r.notes]


def replica_state(executor: ExecutorState | None, heartbeat: Mapping[str, Any] | None,
                  heartbeat_age_s: float | None, stale_after_s: float, *, started: bool | None = None,
                  final: bool = False) -> tuple[str, str | None]:
    """Merge what the executor, the heartbeat and the start records say about one replica into
    (state, reason).

    ``started``: whether a start record or heartbeat of the replica's current launch was seen (None:
    not known, then any heartbeat counts). ``final``: the run's final model is written. The executor
    decides when it can tell: ``running`` before the replica started is ``starting``; ``pending`` with
    a live heartbeat of this launch is ``running`` (the platform's view lags). An ``unknown`` executor
    state or none at all defers to the heartbeat, then to ``final``.
    """
    hb_state = _HEARTBEAT_STATES.get(str(heartbeat.get("state", "")).lower()) if heartbeat is not None else None
    if executor is not None and executor.state != UNKNOWN:
        state = executor.state
        if state == CONTINUE:
            return CONTINUE, executor.reason or "stopped before its platform's time cap, state saved; to continue"
        if state == RUNNING and started is False:
            return STARTING, executor.reason or "the platform started it; the replica has not reported yet"
        if state == RUNNING and heartbeat_age_s is not None and heartbeat_age_s > stale_after_s:
            return STALE, f"no heartbeat for {heartbeat_age_s:.0f}s"
        fresh = heartbeat_age_s is not None and heartbeat_age_s <= stale_after_s
        if state == PENDING and heartbeat is not None and fresh and hb_state is None and started is not False:
            return RUNNING, None  # the platform's view lags (Modal's call graph): a live heartbeat means running
        return state, executor.reason
    why = None if executor is None else executor.reason
    if heartbeat is None or started is False:
        if final and executor is not None:  # it ran (the platform had it) and the run finished
            return SUCCEEDED, "the run's final model is written (the executor no longer knows this replica)"
        if started:  # a start record but no heartbeat yet
            return RUNNING, None
        return (PENDING, None) if executor is None else (UNKNOWN, why)
    if hb_state is not None:
        return hb_state, _reason_of(heartbeat)
    if final:
        return SUCCEEDED, "the run's final model is written"
    if heartbeat_age_s is not None and heartbeat_age_s > stale_after_s:
        return STALE, f"no heartbeat for {heartbeat_age_s:.0f}s"
    return RUNNING, None


def run_state(replicas: Sequence[ReplicaReport], min_replicas: int) -> str:
    """The run's state: failed once too few replicas can still finish, else the least-done state.

    A failed or cancelled replica does not fail the run while at least ``min_replicas`` others
    are alive (the exchange continues without it); the run is ``failed`` at the end if any rank
    failed, so the launcher exits non-zero naming that rank.
    """
    states = [r.state for r in replicas]
    if not states:
        return PENDING
    alive = sum(s not in TERMINAL for s in states)
    succeeded = states.count(SUCCEEDED)
    if alive == 0:
        if FAILED in states:
            return FAILED
        return SUCCEEDED if succeeded == len(states) else CANCELLED
    if FAILED in states and alive + succeeded < min_replicas:
        return FAILED
    if CANCELLED in states and alive + succeeded < min_replicas:
        return CANCELLED
    if all(s in (PENDING, UNKNOWN, STARTING) for s in states):
        return STARTING if STARTING in states else PENDING
    return RUNNING


def build_replica(rank: int, executor: ExecutorState | None, heartbeat: Mapping[str, Any] | None,
                  now: float, stale_after_s: float, *, starts: RankStarts | None = None,
                  final: bool = False) -> ReplicaReport:
    """One ``ReplicaReport`` from the executor's view and the rank's heartbeat (either may be None),
    its launches and start records (``starts``; None: not read) and whether ``final/`` is written.

    A heartbeat field of the wrong type (``"round": "x"``, a list, ``1e309``) is reported as unknown
    with a note instead of raising; so is one that ``Heartbeat.from_json_dict`` already marked in
    the heartbeat's ``invalid`` mapping.
    """
    hb = dict(heartbeat or {})
    invalid: dict[str, str] = {}
    marked = hb.pop("invalid", None)
    if isinstance(marked, Mapping):
        invalid.update((k, v) for k, v in marked.items() if k in (*HEARTBEAT_FIELDS, "rank") and isinstance(v, str))
    values: dict[str, Any] = {}
    for name in HEARTBEAT_FIELDS:
        if hb.get(name) is None:
            values[name] = None
            continue
        values[name], why = parse_heartbeat_field(name, hb[name])
        if why is not None:
            invalid.setdefault(name, why)
            hb[name] = None
    age = now - values["time"] if values["time"] is not None else None
    state, reason = replica_state(executor, hb if heartbeat is not None else None, age, stale_after_s,
                                  started=None if starts is None else starts.current_seen, final=final)
    started_age = None if starts is None or starts.started_at is None else max(0.0, now - starts.started_at)
    return ReplicaReport(
        rank=rank, state=state, round=values["round"], step=values["step"], loss=values["loss"],
        attempt=values["attempt"], heartbeat_age_s=age, bytes_up=values["bytes_up"] or 0,
        bytes_down=values["bytes_down"] or 0, reason=reason, invalid=frozenset(invalid),
        notes=tuple(f"rank {rank}: heartbeat field '{name}' {why}" for name, why in sorted(
            invalid.items(), key=lambda item: _FIELD_ORDER.get(item[0], -1))),
        attempts=None if starts is None else starts.attempts, started_age_s=started_age,
        billed_before_s=0.0 if starts is None else starts.billed_before_s,
        from_heartbeat=_from_heartbeat(executor, heartbeat, starts, final, state), rl=values["rl"],
    )


def _from_heartbeat(executor: ExecutorState | None, heartbeat: Mapping[str, Any] | None,
                    starts: RankStarts | None, final: bool, state: str) -> bool:
    """Whether :func:`replica_state` took ``state`` from the heartbeat alone (the executor does not know
    the replica, and no signed final model says the run finished)."""
    if executor is not None and executor.state != UNKNOWN:
        return False
    if heartbeat is None or (starts is not None and starts.current_seen is False):
        return False
    return not (final and state == SUCCEEDED) and \
        _HEARTBEAT_STATES.get(str(heartbeat.get("state", "")).lower()) == state


_FIELD_ORDER = {name: i for i, name in enumerate(("rank", *HEARTBEAT_FIELDS))}


def billed_seconds(replicas: Sequence[ReplicaReport], elapsed_s: float) -> list[float]:
    """Seconds each replica has been billed for, approximately.

    A replica is billed from when it started in its current launch (its first start record,
    ``started_age_s`` ago) until now, or until its last heartbeat once it is finished; plus what its
    earlier launches were billed (``billed_before_s``). Time spent pending or starting (queued, before
    the replica wrote its start record) is not billed: the estimate leaves out container start-up. A
    replica without start records (written by an older version) but with a heartbeat is billed from
    the launch (``elapsed_s`` ago), as before; one with neither has not started and costs nothing.
    """
    out = []
    for r in replicas:
        since = r.started_age_s
        if since is None:
            since = elapsed_s if r.heartbeat_age_s is not None and r.state not in (PENDING, STARTING) else 0.0
        until = r.heartbeat_age_s if r.state in TERMINAL and r.heartbeat_age_s is not None else 0.0
        out.append(r.billed_before_s + max(0.0, since - min(until, since)))
    return out


def _reason_of(heartbeat: Mapping[str, Any]) -> str | None:
    """The first non-empty text among a heartbeat's ``message``, ``error`` and ``reason``."""
    for key in ("message", "error", "reason"):
        value = heartbeat.get(key)
        if isinstance(value, str) and value:
            return value
    return None
