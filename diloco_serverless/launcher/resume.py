"""The pieces of ``diloco resume`` (:meth:`diloco_serverless.launcher.api.Run.resume`) and of a launch that
leaves no orphans.

Resume starts again the ranks of a run that are not running: the launcher machine died, every
replica was preempted, the run was cancelled, or a replica stopped to ``continue`` in a fresh
attempt. The new replicas heal from the store (the latest checkpoint and their own saved state) and
go on; a run that already succeeded is refused. Resuming needs the run key, which only the
launching machine holds (:func:`missing_key_message` says where it lives and how to copy it).

No orphans: once a replica has started, a failure of the launcher (recording the handles in
run.json, anything) cancels what it started; if even that fails, the LaunchError names every handle
(executor kind and ids) so the replicas can be cancelled by hand.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from diloco_serverless.errors import LaunchError, one_line
from diloco_serverless.executors.base import ServerlessExecutor
from diloco_serverless.executors.registry import EXECUTOR_KINDS, build_executor, executor_kind
from diloco_serverless.launcher import preflight
from diloco_serverless.launcher.replicas import executor_cancel
from diloco_serverless.launcher.status import CANCELLED, CONTINUE, FAILED, SUCCEEDED, TERMINAL, UNKNOWN, RunStatus
from diloco_serverless.run.integrity import KEYS_DIR_ENV, RUN_KEY_ENV, local_key_path

__all__ = ["RESUMABLE", "missing_key_message", "ranks_to_resume", "record_or_cancel", "resume_executor"]

#: States of a rank that ``diloco resume`` starts again (besides ranks that have no replica at all).
RESUMABLE = frozenset({FAILED, CANCELLED, CONTINUE, UNKNOWN})
#: Handle fields that identify a replica on its platform, shown when it must be cancelled by hand.
_ID_FIELDS = ("pid", "function_call_id", "app_id", "job_id", "namespace", "job", "id", "url")

T = TypeVar("T")


def missing_key_message(run_url: str) -> str:
    """Why a machine without the run key cannot resume the run at ``run_url``, and how to fix it."""
    path = local_key_path(run_url)
    return (
        f"cannot resume {run_url}: this machine does not hold its run key, which signs run.json and every "
        f"object the replicas exchange. The machine that launched it keeps the key in {path} "
        f"(under ${KEYS_DIR_ENV} or ~/.config/diloco-serverless/run-keys); copy that file to the same path "
        f"here (chmod 600), or export {RUN_KEY_ENV}=<its 64 hex characters>, then resume again"
    )


def ranks_to_resume(status: RunStatus, handled: Sequence[int], ranks: Sequence[int] | None = None) -> list[int]:
    """The ranks to start again: ``ranks`` when given (each must be a rank of the run and not have
    succeeded), else every rank with no replica or in a :data:`RESUMABLE` state. LaunchError when the run
    already succeeded or nothing is to be resumed, naming the states."""
    n = len(status.replicas)
    if status.final_url is not None or status.state == SUCCEEDED:
        raise LaunchError(
            f"run {status.url} already succeeded (final model: {status.final_url or 'every rank done'}); there is "
            "nothing to resume. Start a new run with `diloco launch`"
        )
    by_rank = {r.rank: r for r in status.replicas}
    if ranks is not None:
        for rank in ranks:
            if not 0 <= rank < n:
                raise LaunchError(f"--rank {rank} is not a rank of run {status.run_id}: it has ranks 0..{n - 1}")
            if by_rank[rank].state == SUCCEEDED:
                raise LaunchError(f"rank {rank} of run {status.run_id} already succeeded; resume the other ranks")
        return sorted(set(ranks))
    chosen = [r.rank for r in status.replicas if r.rank not in handled or r.state in RESUMABLE]
    if not chosen:
        states = ", ".join(f"rank {r.rank} {r.state}" for r in status.replicas)
        raise LaunchError(
            f"nothing to resume in run {status.run_id}: no rank is failed, cancelled, to continue or unknown "
            f"({states}). Watch it with `diloco status {status.url}`; to restart it, `diloco cancel {status.url}` "
            "first, or name ranks with --rank"
        )
    return chosen


def resume_executor(executor: ServerlessExecutor | str | None, *, recorded: ServerlessExecutor | None,
                    recorded_kind: str | None, recorded_gpu: str | None, recorded_error: str | None,
                    gpu: str | None, options: Mapping[str, Any] | None, store_url: str,
                    n_ranks: int) -> tuple[ServerlessExecutor, str, str | None]:
    """(executor, kind, gpu) to start the ranks on: ``executor`` (a kind built with ``gpu`` and
    ``options`` after the launch checks, or an executor object), else the one recorded in run.json (built
    afresh with the recorded GPU and ``options``, or ``recorded`` when it is not one of the built-in
    kinds). LaunchError naming what to change when it cannot be built."""
    if executor is None:
        if recorded_kind in EXECUTOR_KINDS and (recorded is None or options or gpu is not None
                                                or executor_kind(recorded, "") != recorded_kind):
            executor = recorded_kind
            gpu = recorded_gpu if gpu is None else gpu
        elif recorded is not None:
            return recorded, executor_kind(recorded, recorded_kind or "custom"), recorded_gpu
        else:
            raise LaunchError(f"cannot resume {store_url} on its {recorded_kind or 'unrecorded'} executor: "
                              f"{recorded_error or 'run.json names none'}; pass --executor local, modal or hf-jobs")
    if not isinstance(executor, str):
        kind = executor_kind(executor, "custom")
        return executor, kind, gpu or getattr(executor, "gpu", None) or getattr(executor, "flavor", None)
    canonical = preflight.check_executor_kind(executor, gpu)
    preflight.check_store_reachable(store_url, executor)
    opts = dict(options or {})
    if executor == "local":
        over = opts.pop(preflight.OVERSUBSCRIBE_OPTION, False)
        if not isinstance(over, bool):
            raise LaunchError(f"-x {preflight.OVERSUBSCRIBE_OPTION} must be true or false, got {over!r}")
        preflight.check_local_capacity(n_ranks, oversubscribe=over)
        if opts.get("secrets"):
            raise LaunchError("--secret is for modal and hf-jobs replicas; local replicas inherit your environment")
    built = build_executor(executor, canonical, opts)
    return built, executor, getattr(built, "gpu", None) or getattr(built, "flavor", None) or canonical


def describe_handles(kind: str, handles: Sequence[Mapping[str, Any]]) -> str:
    """``local rank 0 (pid=123), rank 1 (pid=124)``: what identifies each replica on its platform."""
    parts = []
    for h in handles:
        ids = {k: h[k] for k in _ID_FIELDS if k in h and h[k] is not None}
        shown = ", ".join(f"{k}={v}" for k, v in ids.items()) if ids else json.dumps(dict(h), default=str)[:300]
        parts.append(f"rank {h.get('rank', '?')} ({shown})")
    return f"{kind} " + "; ".join(parts)


def record_or_cancel(executor: ServerlessExecutor, kind: str, handles: Sequence[Mapping[str, Any]],
                     run_url: str, record: Callable[[], T]) -> T:
    """``record()`` (store the handles of replicas just started); if it fails, cancel those replicas and
    raise LaunchError saying so, or, when cancelling fails too, naming every handle to cancel by hand.
    An interrupt (Ctrl-C) cancels them too and is re-raised."""
    try:
        return record()
    except BaseException as e:
        why = one_line(str(e)) or type(e).__name__
        try:
            executor_cancel(executor, handles)
        except Exception as c:
            raise LaunchError(
                f"recording the launch of {run_url} failed ({why}) and cancelling the {len(handles)} replica(s) "
                f"it had started failed too ({one_line(str(c)) or type(c).__name__}); they may still be running "
                f"and billing: cancel them by hand: {describe_handles(kind, handles)}"
            ) from e
        if not isinstance(e, Exception):
            raise
        raise LaunchError(f"recording the launch of {run_url} failed ({why}); cancelled the {len(handles)} "
                          "replica(s) it had started, nothing is left running") from e


def live_ranks(status: RunStatus, chosen: Sequence[int]) -> list[int]:
    """Ranks other than ``chosen`` that are not done (still running, starting or pending somewhere)."""
    return [r.rank for r in status.replicas if r.rank not in chosen and r.state not in TERMINAL]
