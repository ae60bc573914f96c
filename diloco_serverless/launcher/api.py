"""The Python API: ``launch(config, executor=...) -> Run`` and ``Run.attach(url)``.

::

    from diloco_serverless import RunConfig, launch
    run = launch(RunConfig.load(None, ["rounds=4"]), executor="local")
    summary = run.wait()          # RunStatus; raises RunFailed naming the failed ranks
    print(summary.eval_loss, summary.final_url)

A run lives in the store (``<store>/<run_id>``), so ``Run.attach(url)`` in another process sees
the same status, logs and handles, and can cancel it. ``resume(url)`` (``Run.resume()``, ``diloco
resume``) starts again the ranks that are not running, on the same executor or another, from the
machine that holds the run key; they heal from the store and go on. ``launch`` checks everything it can *before*
creating the run or starting a replica (see :mod:`diloco_serverless.launcher.preflight`): executor and GPU
type, SDK and tokens, the store (a probe object is written, read back and deleted), the config.

Failure: bad input raises :class:`LaunchError` (a ``ValueError``) with a one-line fix and leaves
nothing behind (once a replica has started, a failure cancels what was started, or names the
handles to cancel by hand); a replica that fails for good makes :meth:`Run.wait` raise :class:`RunFailed`
naming the rank and reason; :meth:`Run.wait` with ``max_usd`` cancels the run and raises
:class:`BudgetExceeded` before the estimate crosses the budget. Every store operation made for a
run is bounded by the run's ``store_timeout_s`` (or ``Run.attach(..., store_timeout_s=...)``), so an
unresponsive store raises ``StoreUnavailable`` naming the URL within about that time.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from diloco_serverless.config import STORE_TIMEOUT_S, RunConfig
from diloco_serverless.errors import DilocoError, LaunchError, StoreError, one_line
from diloco_serverless.executors.base import ServerlessExecutor
from diloco_serverless.executors.registry import executor_from_launch, executor_kind
from diloco_serverless.launcher import pricing
from diloco_serverless.launcher.attempt_plan import attempt_cap, cap_plan
from diloco_serverless.launcher.hub import check_push_ready, push_final, tokens_trained
from diloco_serverless.launcher.launches import current_launches, merge_launches, new_launch_id, of_launch
from diloco_serverless.launcher.plot import as_number, curves, plot_losses
from diloco_serverless.launcher.preflight import (
    check_launch,
    check_max_usd,
    check_trust_remote_code,
    resolve_config,
    with_executor_devices,
)
from diloco_serverless.launcher.replicas import (
    executor_cancel,
    executor_logs,
    handle_rank,
    launch_replicas,
    poll_states,
)
from diloco_serverless.launcher.resume import (
    live_ranks,
    missing_key_message,
    ranks_to_resume,
    record_or_cancel,
    resume_executor,
)
from diloco_serverless.launcher.status import (
    CANCELLED,
    CONTINUE,
    FAILED,
    RUNNING,
    TERMINAL,
    RankStarts,
    ReplicaReport,
    RunStatus,
    billed_seconds,
    build_replica,
    run_state,
)
from diloco_serverless.launcher.user_modules import check_user_modules, hand_user_modules
from diloco_serverless.run.bounded import get_bounded, get_many_bounded
from diloco_serverless.run.final import InvalidFinal, read_done
from diloco_serverless.run.integrity import load_local_key, new_run_key, save_local_key
from diloco_serverless.run.layout import (
    FINAL_PREFIX,
    METRICS_PREFIX,
    code_key,
    log_key,
    metrics_prefix,
)
from diloco_serverless.run.members import Heartbeat, read_members
from diloco_serverless.run.record import (
    RunRecord,
    create_run,
    load_run,
    record_launch,
    store_policy,
    timeout_policy,
)
from diloco_serverless.run.starts import StartRecord, read_starts
from diloco_serverless.run.sync_plan import latest_plan
from diloco_serverless.store.errors import ObjectNotFound, ObjectTooLarge
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.tracking import Tracker, TrackingError, check_backends

logger = logging.getLogger(__name__)

__all__ = ["launch", "resume", "Run", "LaunchError", "RunFailed", "BudgetExceeded"]

#: A running replica whose heartbeat is older than this (or than 3 rounds' wall time, when rounds
#: are slower) is shown as ``stale``: heartbeats are written once per round.
STALE_AFTER_S = 300.0
_METRICS_RANK = re.compile(r"^metrics/rank-(\d{1,6})/")


class RunFailed(DilocoError, RuntimeError):
    """The run ended with failed (or cancelled) replicas; ``status`` holds the final RunStatus."""

    def __init__(self, message: str, status: RunStatus) -> None:
        super().__init__(message)
        self.status = status


class BudgetExceeded(RunFailed):
    """``max_usd`` would have been exceeded, so the run was cancelled."""


class Run:
    """A handle on one run in the store: status, wait, cancel, logs, metrics, plot.

    Build it with :func:`launch` or :meth:`Run.attach`; both are cheap to repeat.
    """

    def __init__(self, store: ObjectStore, record: RunRecord, executor: ServerlessExecutor | None = None,
                 executor_error: str | None = None, run_key: bytes | None = None) -> None:
        self._store = store
        self.record = record
        self._run_key = run_key  # verifies run.json when re-read; None: this machine did not launch it
        self._executor = executor
        self._executor_error = executor_error
        self._metrics_cache: dict[str, dict[str, Any]] = {}
        self._starts_cache: dict[str, StartRecord | None] = {}  # start records never change: read once
        # What this launcher saw itself, for a spend estimate no deletion in the store can lower:
        self._seen_running: dict[int, float] = {}  # rank -> when a poll first said running
        self._seen_stopped: dict[int, float] = {}  # rank -> when a later poll first said it no longer was
        self._est_floor = 0.0  # the highest estimate given so far
        self._trust_remote_code = False  # the launcher's word on remote code, for the ranks it starts again
        self._last_metrics: dict[int, list[dict[str, Any]]] = {}  # what the latest status() read
        #: What preflight warned about at launch (a session token that expires, admin credentials...):
        #: ``diloco launch`` prints them; empty for an attached run.
        self.notes: list[str] = []

    # ------------------------------------------------------------------ identity
    @property
    def url(self) -> str:
        """``<store_url>/<run_id>``: pass it to ``diloco status`` or :meth:`Run.attach`."""
        return self._store.url

    @property
    def run_id(self) -> str:
        return self.record.run_id

    @property
    def config(self) -> RunConfig:
        return self.record.config

    @property
    def handles(self) -> list[dict[str, Any]]:
        """Executor handles recorded in run.json (empty before launch; JSON objects only)."""
        handles = (self.record.launch or {}).get("handles")
        return [h for h in handles if isinstance(h, dict)] if isinstance(handles, list) else []

    @property
    def executor_kind(self) -> str | None:
        return (self.record.launch or {}).get("executor")

    @property
    def gpu(self) -> str | None:
        return (self.record.launch or {}).get("gpu")

    def __repr__(self) -> str:
        return f"Run({self.url!r})"

    @classmethod
    def attach(cls, url: str, *, executor: ServerlessExecutor | None = None,
               storage_options: dict[str, Any] | None = None, store_timeout_s: float | None = None) -> Run:
        """Open an existing run. Raises ``RunNotFound`` (a FileNotFoundError) if there is none.

        The executor is rebuilt from the launch record; when its SDK or token is missing here
        (e.g. a Modal run looked at from a laptop without ``modal``), status falls back to
        heartbeats and :meth:`cancel` raises a LaunchError saying what to install.

        ``store_timeout_s`` bounds every store operation of this handle, the read of run.json
        included (``StoreUnavailable`` naming the URL when it passes); None reads run.json within
        the default ``STORE_TIMEOUT_S`` and then uses the run's own ``store_timeout_s``.
        """
        store = ObjectStore(url, storage_options, retry=timeout_policy(
            STORE_TIMEOUT_S if store_timeout_s is None else store_timeout_s))
        run_key = load_local_key(store.url)
        store, record = load_run(store, key=run_key)
        if store_timeout_s is None:
            store = store.with_retry(store_policy(record.config))
        error = None
        if executor is None and record.launch:
            executor, error = executor_from_launch(record.launch, run_url=store.url)
        return cls(store, record, executor, error, run_key=run_key)

    @property
    def verified(self) -> bool:
        """True when run.json was checked against the run key (this machine launched the run)."""
        return self._run_key is not None

    # ------------------------------------------------------------------ reading
    def refresh(self) -> None:
        """Re-read run.json (the launch record may have changed)."""
        self._store, self.record = load_run(self._store, key=self._run_key)

    def metrics(self) -> dict[int, list[dict[str, Any]]]:
        """Every metrics record, grouped by rank, each list sorted by round.

        Metrics objects are written once per rank and round, so only keys not seen before are
        fetched (one LIST per call plus GETs of the new objects): ``status --watch`` stays cheap.
        """
        keys = [k for k in self._store.list(METRICS_PREFIX + "/") if k.endswith(".json")]
        new = [k for k in keys if k not in self._metrics_cache]
        for key, raw in get_many_bounded(self._store, new, "metrics").items():
            try:
                rec = json.loads(raw.decode("utf-8"))
            except ValueError:
                continue  # being rewritten or corrupt; skipped like run.read_metrics does
            if isinstance(rec, dict):
                self._metrics_cache[key] = rec
        out: dict[int, list[dict[str, Any]]] = {}
        for key in sorted(self._metrics_cache):
            rank = _METRICS_RANK.search(key)  # the key says whose record it is, not the record's body
            if rank is not None:
                out.setdefault(int(rank.group(1)), []).append(self._metrics_cache[key])
        return out

    def latest_metrics(self, rank: int = 0) -> dict[str, Any] | None:
        """Rank ``rank``'s metrics record of its latest round (one LIST and one GET), or None."""
        keys = sorted(k for k in self._store.list(metrics_prefix(rank) + "/") if k.endswith(".json"))
        if not keys:
            return None
        try:
            rec = json.loads(get_bounded(self._store, keys[-1], "metrics").decode("utf-8"))
        except (ValueError, ObjectNotFound, ObjectTooLarge):
            return None
        return rec if isinstance(rec, dict) else None

    def status(self, *, now: float | None = None, with_metrics: bool = True) -> RunStatus:
        """Per-replica state (executor poll + heartbeat), totals and estimated spend.

        ``with_metrics=False`` skips reading the per-round metrics (no eval loss; losses from the
        heartbeats only): a few requests per run, for listing many runs.
        """
        now = time.time() if now is None else now
        metrics = self.metrics() if with_metrics else {}
        if with_metrics:
            self._last_metrics = metrics
        train, eval_curve = curves(metrics)
        walls = [as_number(recs[-1].get("wall_s")) or 0.0 for recs in metrics.values() if recs]
        stale_after_s = max([STALE_AFTER_S, *(3.0 * w for w in walls)])
        heartbeats = read_members(self._store)
        members = {r: _outer(hb.to_json_dict(), self.config.exchange.fragments, train.get(r))
                   for r, hb in heartbeats.items()}
        states = poll_states(self._executor, self.handles) if self.handles else {}
        n = self.config.replicas
        starts = self._rank_starts(heartbeats)
        final = self._has_final()
        replicas = [build_replica(r, states.get(r), members.get(r), now, stale_after_s, starts=starts.get(r),
                                  final=final) for r in range(n)]
        start = _launched_at(self.record)
        elapsed = max(0.0, now - start) if start is not None and self.handles else 0.0
        ages = [r.heartbeat_age_s for r in replicas if r.heartbeat_age_s is not None]
        if ages and all(r.state in TERMINAL for r in replicas):
            elapsed = max(0.0, elapsed - min(ages))  # a finished run's wall time ends at its last heartbeat
        price = self.usd_per_replica_hour
        est = None if price is None else price * sum(billed_seconds(replicas, elapsed)) / 3600.0
        if price is not None and est is not None:  # never below what the executor's own answers imply, never down
            est = max(est, price * self._observed_seconds(states, now) / 3600.0, self._est_floor)
            self._est_floor = est
        final_url = f"{self.url}/{FINAL_PREFIX}" if final else None
        return RunStatus(
            run_id=self.run_id, url=self.url, executor=self.executor_kind, gpu=self.gpu,
            rounds_total=self.config.rounds, replicas=replicas,
            state=run_state(replicas, self.config.effective_min_replicas), elapsed_s=elapsed,
            est_usd=est, eval_loss=eval_curve[-1][1] if eval_curve else None, final_url=final_url,
            devices_per_replica=self.config.parallel.devices,
            failures=[(r.rank, r.reason or r.state) for r in replicas if r.state == FAILED],
            sync_every=self._sync_every(),
        )

    def _sync_every(self) -> tuple[int, str] | None:
        """inner.sync_every = "auto": the newest plan's (H, reason), from a plan that verifies; else None."""
        if not self.config.inner.auto_sync:
            return None
        try:
            plan = latest_plan(self._store, self._run_key)
        except (StoreError, ValueError):
            return None
        return None if plan is None else (plan.h, plan.reason)

    def _rank_starts(self, heartbeats: dict[int, Heartbeat]) -> dict[int, RankStarts]:
        """Each rank's launches (run.json) matched with its start records and heartbeat (see RankStarts)."""
        records = read_starts(self._store, key=self._run_key, cache=self._starts_cache)
        launches = current_launches(self.record.launch)
        out: dict[int, RankStarts] = {}
        for rank in range(self.config.replicas):
            mine, hb = records.get(rank, []), heartbeats.get(rank)
            if rank not in launches:
                out[rank] = RankStarts(len(mine), mine[0].time if mine else None, bool(mine) or hb is not None)
                continue
            current, billed_before = launches[rank]
            own = of_launch(mine, current)
            hb_current = hb is not None and hb.time is not None and (
                current.launched_at is None or hb.time >= current.launched_at)
            out[rank] = RankStarts(len(mine), own[0].time if own else None, bool(own) or hb_current, billed_before)
        return out

    def _observed_seconds(self, states: Mapping[int, Any], now: float) -> float:
        """Replica-seconds the executor's polls (not the store) show running: from the first poll that said
        a rank runs until the first that said it no longer does (or now). Heartbeats and start records can
        be deleted by anyone who can write the bucket; what this launcher polled cannot."""
        total = 0.0
        for rank, st in states.items():
            if getattr(st, "state", None) == RUNNING:
                self._seen_running.setdefault(rank, now)
                self._seen_stopped.pop(rank, None)
            elif rank in self._seen_running:
                self._seen_stopped.setdefault(rank, now)
            if rank in self._seen_running:
                total += max(0.0, self._seen_stopped.get(rank, now) - self._seen_running[rank])
        return total

    def _has_final(self) -> bool:
        """Whether the run's final model is written: a ``final/DONE.json`` signed with the run key (this
        machine's copy; without one its shape is all that is checked). Other objects under ``final/``, or a
        planted DONE.json, never make a replica count as succeeded (``Run.wait`` ends on it)."""
        try:
            return read_done(self._store, self._run_key) is not None
        except InvalidFinal:
            return False

    def logs(self, rank: int, *, tail: int | None = None) -> str:
        """Rank ``rank``'s log: from the executor, else ``<run>/logs/rank-<r>.log`` in the store."""
        self._check_rank(rank)
        handle = next((h for h in self.handles if handle_rank(h) == rank), None)
        text: str | None = None
        why = "the replica may not have started"
        if self._executor is not None and handle is not None:
            try:
                text = executor_logs(self._executor, handle, tail)
            except Exception as e:
                why = f"the {self.executor_kind} executor could not read it: {one_line(str(e)) or type(e).__name__}"
        if text is None:
            key = log_key(rank)
            if not self._store.exists(key):
                raise LaunchError(f"no log for rank {rank} of {self.url} yet; {why}")
            text = self._store.get(key).decode("utf-8", errors="replace")
            if tail is not None:
                text = "".join(text.splitlines(keepends=True)[-tail:])
        return text

    def _check_rank(self, rank: int) -> None:
        n = self.config.replicas
        if not 0 <= rank < n:
            raise LaunchError(f"rank {rank} is not in run {self.run_id}: it has ranks 0..{n - 1}")

    def plot(self, out: str | Path) -> Path:
        """Write the loss curves PNG (see :func:`diloco_serverless.launcher.plot.plot_losses`)."""
        return plot_losses(self.metrics(), out, title=self.run_id)

    # ------------------------------------------------------------------ tracking and the Hub
    def open_tracker(self) -> Tracker:
        """The trackers of ``config.tracking.backends`` for this run (TrackingError if one cannot start)."""
        return Tracker.open(self.config, run_url=self.url)

    def track(self, *, follow: bool = False, poll_interval_s: float = 2.0,
              on_update: Callable[[RunStatus], None] | None = None) -> RunStatus:
        """Log the run's per-round series to its configured trackers (``tracking.backends``): every
        round written so far, and with ``follow`` every later one until the run ends; then the
        summary. For a run launched with ``--detach`` (an attached launch tracks by itself).
        Returns the last RunStatus; TrackingError when no backend is configured or one cannot start."""
        if not self.config.tracking.backends:
            raise TrackingError(f"run {self.run_id} has no tracking.backends; launch with --set "
                                "tracking.backends=trackio (or wandb, tensorboard) to track a run")
        tracker = self.open_tracker()
        status = self.status()
        try:
            while True:
                if on_update is not None:
                    on_update(status)
                tracker.update(self._last_metrics, done=status.done)
                if status.done or not follow:
                    break
                time.sleep(poll_interval_s)
                status = self.status()
        finally:
            tracker.finish(self.tracking_summary(status) if status.done else None)
        return status

    def tracking_summary(self, status: RunStatus) -> dict[str, float | str | None]:
        """What a tracker's summary holds at the end of the run."""
        return {
            "final/state": status.state,
            "final/eval_loss": status.eval_loss,
            "final/train_loss": status.loss,
            "final/rounds": status.round,
            "final/tokens": tokens_trained(self._last_metrics),
            "final/bytes_moved": status.bytes_moved,
            "final/wall_s": status.elapsed_s,
            "final/est_usd": status.est_usd,
        }

    def _tracker_or_none(self) -> Tracker | None:
        """The run's trackers for :meth:`wait`: None without backends; a backend that cannot start is
        a warning, never a reason to stop following (or billing) the run."""
        if not self.config.tracking.backends:
            return None
        try:
            return self.open_tracker()
        except TrackingError as e:
            logger.warning("tracking is off for run %s: %s", self.run_id, one_line(str(e)))
            return None

    def push_to_hub(self, repo_id: str | None = None, *, private: bool | None = None, api: Any = None) -> str:
        """Upload ``final/`` with a model card and the loss plot to the Hub; return the repository URL.

        ``repo_id`` ("ORG/NAME") defaults to the config's ``hub.repo_id``, ``private`` to ``hub.private``
        (true). Refused (LaunchError) unless the run succeeded with a complete final model; the token
        is this machine's (HF_TOKEN or ``hf auth login``). See :mod:`diloco_serverless.launcher.hub`.
        """
        repo = repo_id or self.config.hub.repo_id
        if not repo:
            raise LaunchError(f"no Hub repository for run {self.run_id}: name one (diloco push RUN ORG/NAME) "
                              "or launch with --push-to-hub ORG/NAME")
        status = self.status()
        return push_final(self._store, self.config, status, self._last_metrics, repo,
                          private=self.config.hub.private if private is None else private, api=api,
                          run_key=self._run_key)

    # ------------------------------------------------------------------ control
    def cancel(self) -> None:
        """Cancel every replica through the executor recorded in run.json."""
        if not self.handles:
            raise LaunchError(f"run {self.url} has no launched replicas to cancel")
        if self._executor is None:
            raise LaunchError(f"cannot cancel {self.url}: {self._executor_error or 'no executor'}")
        executor_cancel(self._executor, self.handles)

    def resume(self, executor: ServerlessExecutor | str | None = None, *, gpu: str | None = None,
               executor_options: dict[str, Any] | None = None, trust_remote_code: bool | None = None,
               ranks: Sequence[int] | None = None) -> list[int]:
        """Start again the ranks that are not running (failed, cancelled, to ``continue``, unknown, or
        never started), or exactly ``ranks``; return the ranks started. They heal from the store.

        ``executor`` is a kind ("local", "modal", "hf-jobs") built with ``gpu`` and ``executor_options``
        (the launch checks apply), an executor object, or None for the one run.json records (its GPU;
        options such as secrets are not recorded, pass them again). Another kind than the recorded one
        is refused while ranks of the run are still alive on the first. ``trust_remote_code`` confirms
        ``model.trust_remote_code`` again (None: what this handle was launched with).

        The new handles replace their ranks' in run.json; the older ones stay in its ``attempts``
        (:mod:`diloco_serverless.launcher.launches`) with the seconds they were billed. LaunchError, with
        nothing started, when this machine lacks the run key, the run already succeeded, nothing is to
        be resumed, or the executor cannot start some ranks (a custom one without ``ranks``).
        """
        if self._run_key is None:
            raise LaunchError(missing_key_message(self.url))
        trust = self._trust_remote_code if trust_remote_code is None else trust_remote_code
        check_trust_remote_code(self.config, trust)
        self.refresh()
        status = self.status(with_metrics=False)
        handled = [handle_rank(h) for h in self.handles]
        chosen = ranks_to_resume(status, handled, ranks)
        ex, kind, gpu = resume_executor(
            executor, recorded=self._executor, recorded_kind=self.executor_kind, recorded_gpu=self.gpu,
            recorded_error=self._executor_error, gpu=gpu, options=executor_options, store_url=self.config.store,
            n_ranks=len(chosen))
        same_kind = kind == self.executor_kind
        alive = live_ranks(status, chosen)
        if not same_kind and alive and self.handles:
            states = ", ".join(f"rank {r} {status.replicas[r].state}" for r in alive)
            raise LaunchError(
                f"rank(s) {alive} of run {self.run_id} are still alive ({states}) on the {self.executor_kind} "
                f"executor; resume on it (drop --executor), or `diloco cancel {self.url}` first to move the whole run"
            )
        billed = {r.rank: _own_billed(r, status.elapsed_s) for r in status.replicas if r.rank in chosen}
        hand_user_modules(ex, check_user_modules(self.config))
        launch_id, started_at = new_launch_id(), time.time()
        _ship_code_through(self._store, ex)
        try:
            handles = launch_replicas(ex, self.config.replicas, self.url, run_key=self._run_key.hex(),
                                      trust_remote_code=trust, launch_id=launch_id, ranks=chosen)
        except LaunchError:
            raise
        except Exception as e:
            raise LaunchError(f"resuming rank(s) {chosen} of {self.url} failed: {one_line(str(e))}") from e
        previous = self.record.launch if same_kind else {**(self.record.launch or {}), "handles": []}
        all_handles, attempts = merge_launches(previous, kind, handles, launch_id, started_at, billed)
        if not same_kind:  # only this executor's handles: status polls them with it, the rest from heartbeats
            all_handles = [h for h in all_handles if h.get("kind", kind) == kind and handle_rank(h) in chosen]
        shipped = getattr(ex, "shipped_code", None)
        key = self._run_key
        self.record = record_or_cancel(ex, kind, handles, self.url, lambda: record_launch(
            self._store, kind, all_handles, gpu=gpu, replicas=self.config.replicas,
            usd_per_replica_hour=_price_of(kind, gpu, ex), key=key, launch_id=launch_id, attempts=attempts,
            resumed=chosen, **({"code": shipped.to_json()} if shipped is not None else {})))
        self._executor, self._executor_error, self._trust_remote_code = ex, None, trust
        return chosen

    def wait(self, *, timeout_s: float | None = None, poll_interval_s: float = 2.0,
             on_update: Callable[[RunStatus], None] | None = None,
             max_usd: float | None = None, track: bool = True) -> RunStatus:
        """Poll until the run ends; return its final RunStatus.

        Raises RunFailed naming every failed rank (with the executor's reason), BudgetExceeded
        after cancelling the run when the next poll interval could cross ``max_usd``, and
        TimeoutError (the run keeps going) after ``timeout_s``. ``max_usd`` must be a finite
        positive number (LaunchError otherwise, before anything is polled).

        With ``track`` (default) and ``tracking.backends`` in the config, every poll also logs the
        rounds finished since the last one to those trackers, and the end of the run their summary
        (:mod:`diloco_serverless.tracking`); a tracker that fails is dropped with a warning.

        A rank in state ``continue`` (it stopped before its platform's time cap with its state saved) is
        started again through :meth:`resume`, in a fresh attempt that does not count as a failure.
        """
        if max_usd is not None:
            max_usd = check_max_usd(max_usd, "max_usd")  # NaN, inf or <= 0 would disable the guard
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        price = self.usd_per_replica_hour
        if max_usd is not None and price is None:
            raise LaunchError(f"cannot enforce max_usd for run {self.run_id}: no price known for "
                              f"{self.executor_kind} GPU {self.gpu!r}; add it to diloco_serverless/launcher/pricing.py")
        tracker = self._tracker_or_none() if track else None
        status: RunStatus | None = None
        try:
            while True:
                status = self.status()
                # only the executor's word restarts a rank: a heartbeat saying "continuing" is shown, not obeyed
                continuing = [r.rank for r in status.replicas if r.state == CONTINUE and not r.from_heartbeat]
                if continuing:
                    self.resume(ranks=continuing)
                    status = self.status()
                if on_update is not None:
                    on_update(status)
                if tracker is not None:
                    tracker.update(self._last_metrics, done=status.done)
                if status.settled:  # a heartbeat alone saying "failed" or "done" never ends the wait
                    return self._finish(status)
                if max_usd is not None and _over_budget(status, price or 0.0, poll_interval_s, max_usd):
                    self.cancel()
                    raise BudgetExceeded(
                        f"cancelled run {self.run_id}: estimated spend {status.est_usd or 0:.2f} USD would "
                        f"exceed --max-usd {max_usd:.2f} before the next check; raise --max-usd to go further",
                        status)
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"run {self.url} still {status.state} after {timeout_s:.0f}s; it keeps running")
                time.sleep(poll_interval_s)
        finally:
            if tracker is not None:
                tracker.finish(self.tracking_summary(status) if status is not None and status.done else None)

    def attempt_plan(self, status: RunStatus) -> str | None:
        """One line of plan when, at the pace of ``status``, the run will outlast one attempt of its
        executor (Modal's 24 h call timeout, the HF Job timeout): how many attempts and who starts them.
        None when it will not, or when the executor or the pace is unknown."""
        done = status.round or 0
        return cap_plan(attempt_cap(self._executor), self.executor_kind, rounds_total=self.config.rounds,
                        rounds_done=done, elapsed_s=status.elapsed_s)

    @property
    def usd_per_replica_hour(self) -> float | None:
        """Price of one replica-hour recorded at launch (from :mod:`pricing`), or None if unknown."""
        launch = self.record.launch or {}
        if launch.get("usd_per_replica_hour") is not None:
            return float(launch["usd_per_replica_hour"])
        return _price_of(self.executor_kind, self.gpu, None)

    def _finish(self, status: RunStatus) -> RunStatus:
        live = [r.rank for r in status.replicas if r.state not in TERMINAL]
        if status.state == FAILED and live and self._executor is not None:
            self.cancel()  # too few replicas left to finish: stop the rest instead of billing them
            status = replace(status, failures=status.failures + [(r, "cancelled: run failed") for r in live])
        if status.state == FAILED or status.failures:
            detail = "; ".join(f"rank {r}: {why}" for r, why in status.failures) or "see `diloco logs`"
            raise RunFailed(f"run {self.run_id} failed: {detail}", status)
        if status.state == CANCELLED:
            raise RunFailed(f"run {self.run_id} was cancelled", status)
        return status


def _outer(heartbeat: dict[str, Any], fragments: int, train_curve: list[tuple[float, float]] | None) -> dict[str, Any]:
    """A heartbeat as status shows it: ``round`` counted in outer rounds done (the heartbeat counts
    fragment syncs) and, when the heartbeat carries no loss (evaluating, done), the rank's latest
    training loss from its metrics."""
    hb = dict(heartbeat)
    if hb.get("round") is not None and fragments > 1:
        hb["round"] = int(hb["round"]) // fragments
    if hb.get("loss") is None and train_curve:
        hb["loss"] = train_curve[-1][1]
    return hb


def _own_billed(replica: ReplicaReport, elapsed_s: float) -> float:
    """Seconds ``replica``'s current launch was billed (without its earlier launches)."""
    return max(0.0, billed_seconds([replica], elapsed_s)[0] - replica.billed_before_s)


def _over_budget(status: RunStatus, usd_per_hour: float, horizon_s: float, max_usd: float) -> bool:
    live = sum(r.state not in TERMINAL for r in status.replicas)
    return pricing.would_exceed(status.est_usd or 0.0, usd_per_hour, live, horizon_s * 2, max_usd)


def _price_of(kind: str | None, gpu: str | None, executor: ServerlessExecutor | None) -> float | None:
    """USD per replica-hour: the executor's own ``usd_per_replica_hour`` or the price table's."""
    own = getattr(executor, "usd_per_replica_hour", None)
    if isinstance(own, (int, float)):
        return float(own)
    return pricing.usd_per_replica_hour(kind, gpu) if kind is not None else None


def _launched_at(record: RunRecord) -> float | None:
    stamp = (record.launch or {}).get("launched_at") or record.created_at
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def check_extras(cfg: RunConfig) -> None:
    """LaunchError before anything is created when the config's trackers or Hub push cannot work from
    here (a tracker package missing, W&B without a login, no Hub token)."""
    try:
        check_backends(cfg.tracking)
    except TrackingError as e:
        raise LaunchError(str(e)) from None
    if cfg.hub.repo_id is not None:
        check_push_ready(cfg.hub.repo_id)


def _ship_code_through(run_store: ObjectStore, executor: ServerlessExecutor) -> None:
    """Executors that ship the launching code to their replicas (HF Jobs) upload it into the run's own
    folder (``code/<wheel>``): no package index or extra permission needed. ``put``, not create-only,
    so an object planted there cannot block a launch; the replicas check the SHA-256 the executor pins."""
    setter = getattr(executor, "set_code_uploader", None)
    if not callable(setter):
        return

    def upload(filename: str, data: bytes) -> str:
        key = code_key(filename)
        run_store.put(key, data)
        return f"{run_store.url}/{key}"

    setter(upload)


def launch(config: RunConfig | str | Path | None = None, executor: ServerlessExecutor | str = "local", *,
           overrides: Sequence[str] = (), replicas: int | None = None, store: str | None = None,
           run_id: str | None = None, gpu: str | None = None,
           store_from_terraform: str | Path | None = None,
           executor_options: dict[str, Any] | None = None,
           storage_options: dict[str, Any] | None = None,
           trust_remote_code: bool = False, overwrite: bool = False,
           store_timeout_s: float | None = None, push_to_hub: str | None = None) -> Run:
    """Validate, create the run in the store, start its replicas, record their handles.

    ``config`` is a RunConfig, a TOML path, or None for the defaults; ``overrides`` are
    ``key=value`` strings applied on top (on an object via :meth:`RunConfig.with_overrides`,
    on a file or the defaults via :meth:`RunConfig.load`); ``replicas``/``store``/``run_id``/
    ``store_timeout_s`` win over both. The config's ``store_timeout_s`` bounds every store operation
    of the launch (probe, create, record) and of the returned Run, and is what replicas use.
    ``executor`` is a kind ("local", "modal", "hf-jobs") built with ``executor_options`` and
    ``gpu``, or a ready ServerlessExecutor. ``store_from_terraform`` names a Terraform directory
    (or saved ``terraform output -json`` file) whose ``exchange_url`` becomes the store.

    A fresh run key signs run.json and reaches the replicas out of band (docs/security.md); this
    machine keeps a copy so that :meth:`Run.attach` here can verify the run. ``trust_remote_code``
    confirms a config's ``model.trust_remote_code``; ``overwrite`` deletes what an earlier run left
    in the run folder (otherwise such a folder is refused). ``push_to_hub`` ("ORG/NAME") sets the config's
    ``hub.repo_id``: :meth:`Run.push_to_hub` (``diloco launch --push-to-hub``) uploads the final model
    there once the run succeeded; a Hub token must then be available here. ``tracking.backends`` in the
    config are checked here (package installed, W&B login) and logged to by :meth:`Run.wait`.

    Raises LaunchError before anything is created when any input is wrong.
    """
    cfg = resolve_config(config, overrides, replicas=replicas, store=store, run_id=run_id,
                         store_from_terraform=store_from_terraform, store_timeout_s=store_timeout_s,
                         push_to_hub=push_to_hub)
    check_extras(cfg)
    plan = check_launch(cfg, executor, gpu=gpu, executor_options=executor_options,
                        storage_options=storage_options, trust_remote_code=trust_remote_code, overwrite=overwrite)
    cfg = with_executor_devices(cfg, plan.executor, plan.kind)
    if plan.leftovers:
        plan.root.delete(cfg.run_id, recursive=True)
    key_hex = new_run_key()
    key = bytes.fromhex(key_hex)
    run_store, record = create_run(plan.root, cfg, key=key)
    save_local_key(run_store.url, key_hex)
    kind = executor_kind(plan.executor, plan.kind)
    launch_id, started_at = new_launch_id(), time.time()
    _ship_code_through(run_store, plan.executor)
    try:
        handles = launch_replicas(plan.executor, cfg.replicas, run_store.url, run_key=key_hex,
                                  trust_remote_code=trust_remote_code, launch_id=launch_id)
    except Exception as e:
        try:
            record_launch(run_store, kind, [], gpu=plan.gpu, error=one_line(str(e))[:500], key=key)
        except Exception as rec:  # the launch error is what the user needs; the record is a nicety
            logger.warning("could not record the failed launch of %s: %s", run_store.url, one_line(str(rec)))
        raise LaunchError(f"launching replicas of {run_store.url} failed: {one_line(str(e))}") from e
    # from here on replicas run (and bill): any failure cancels them (resume.record_or_cancel)
    shipped = getattr(plan.executor, "shipped_code", None)
    all_handles, attempts = merge_launches(None, kind, handles, launch_id, started_at)
    record = record_or_cancel(plan.executor, kind, handles, run_store.url, lambda: record_launch(
        run_store, kind, all_handles, gpu=plan.gpu, replicas=cfg.replicas,
        usd_per_replica_hour=_price_of(kind, plan.gpu, plan.executor), key=key, launch_id=launch_id,
        attempts=attempts, **({"code": shipped.to_json()} if shipped is not None else {})))
    run = Run(run_store, record, plan.executor, run_key=key)
    run._trust_remote_code = trust_remote_code
    run.notes = list(plan.warnings)
    return run


def resume(run_url: str, executor: ServerlessExecutor | str | None = None, *, gpu: str | None = None,
           executor_options: dict[str, Any] | None = None, storage_options: dict[str, Any] | None = None,
           store_timeout_s: float | None = None, trust_remote_code: bool = False,
           ranks: Sequence[int] | None = None) -> Run:
    """Open the run at ``run_url`` and start again its ranks that are not running (see :meth:`Run.resume`);
    return the Run, to :meth:`Run.wait` on. Needs this machine to hold the run key (LaunchError saying
    where it lives otherwise); ``store_timeout_s`` bounds each store operation as in :meth:`Run.attach`."""
    run = Run.attach(run_url, storage_options=storage_options, store_timeout_s=store_timeout_s)
    run.resume(executor, gpu=gpu, executor_options=executor_options, trust_remote_code=trust_remote_code,
               ranks=ranks)
    return run
