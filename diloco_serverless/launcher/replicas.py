"""How the launcher drives a ``ServerlessExecutor`` once it is built (building one is
:mod:`diloco_serverless.executors.registry`'s job).

Starts the replica entrypoint with the run URL, and turns handles and ``poll`` results into plain
data: handles are the JSON dicts stored in run.json; states become
:class:`~diloco_serverless.launcher.status.ExecutorState`.

Failure: a poll that raises (network, expired token) yields ``unknown`` states, so status falls back
to heartbeats instead of failing.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any

from diloco_serverless.config import TRUST_REMOTE_CODE_ENV
from diloco_serverless.errors import LaunchError, one_line
from diloco_serverless.executors.base import ServerlessExecutor, handle_from_json
from diloco_serverless.executors.registry import executor_kind
from diloco_serverless.launcher.status import UNKNOWN, ExecutorState
from diloco_serverless.run.integrity import RUN_KEY_ENV
from diloco_serverless.run.starts import LAUNCH_ID_ENV

#: The module every replica runs: ``python -m diloco_serverless.entrypoints.replica``.
REPLICA_ENTRYPOINT = "diloco_serverless.entrypoints.replica"


def handle_to_dict(handle: Any) -> dict[str, Any]:
    """A handle as the JSON dict stored in run.json."""
    if isinstance(handle, Mapping):
        return dict(handle)
    for attr in ("to_json", "to_dict", "to_json_dict"):
        fn = getattr(handle, attr, None)
        if callable(fn):
            return dict(fn())
    if dataclasses.is_dataclass(handle) and not isinstance(handle, type):
        return dataclasses.asdict(handle)
    raise TypeError(f"executor returned a handle of type {type(handle).__name__} that is not JSON-serialisable")


def handle_rank(handle: Mapping[str, Any]) -> int:
    return int(handle["rank"])


def to_handle(executor: ServerlessExecutor, handle: Mapping[str, Any]) -> Any:
    """The handle object an executor's methods take: a ReplicaHandle for our executors, else the dict."""
    if type(executor).__module__.startswith("diloco_serverless.executors"):

        return handle_from_json(handle)
    return dict(handle)


def executor_logs(executor: ServerlessExecutor, handle: Mapping[str, Any], tail: int | None) -> str | None:
    return executor.logs(to_handle(executor, handle), tail=tail)


def executor_cancel(executor: ServerlessExecutor, handles: Sequence[Mapping[str, Any]]) -> None:
    executor.cancel([to_handle(executor, h) for h in handles])


def launch_args(run_url: str) -> list[str]:
    """Arguments of the replica entrypoint."""
    return ["--run-url", run_url]


def replica_env(executor: ServerlessExecutor, n_replicas: int, run_url: str, *, run_key: str | None = None,
                trust_remote_code: bool = False, launch_id: str | None = None) -> dict[str, str]:
    """Environment added to every replica: the run URL, the run key (its name marks it a secret, so
    remote executors send it as a platform secret), the launcher's word on remote code, the launch's id
    (in the replica's start record) and, for local processes, a fair share of the CPU cores per replica
    (``OMP_NUM_THREADS``) so N torch processes do not oversubscribe the machine; a value the user
    exported wins."""
    env = {"DILOCO_RUN_URL": run_url}
    if launch_id is not None:
        env[LAUNCH_ID_ENV] = launch_id
    if run_key is not None:
        env[RUN_KEY_ENV] = run_key
    if trust_remote_code:
        env[TRUST_REMOTE_CODE_ENV] = "1"
    if executor_kind(executor, "") == "local" and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, cores // max(1, n_replicas)))
    return env


def launch_replicas(executor: ServerlessExecutor, n_replicas: int, run_url: str, *, run_key: str | None = None,
                    trust_remote_code: bool = False, launch_id: str | None = None,
                    ranks: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Start the replica entrypoint for ``run_url`` on every rank of ``n_replicas`` (or only ``ranks``,
    which needs an executor whose ``launch_replicas`` takes ``ranks``); return their handle dicts."""
    env = replica_env(executor, n_replicas, run_url, run_key=run_key, trust_remote_code=trust_remote_code,
                      launch_id=launch_id)
    if ranks is None:
        handles = executor.launch_replicas(n_replicas, REPLICA_ENTRYPOINT, launch_args(run_url), env=env)
    else:
        check_starts_ranks(executor)
        handles = executor.launch_replicas(n_replicas, REPLICA_ENTRYPOINT, launch_args(run_url), env=env,
                                           ranks=list(ranks))
    return [handle_to_dict(h) for h in handles]


def check_starts_ranks(executor: ServerlessExecutor) -> None:
    """LaunchError unless ``executor.launch_replicas`` takes the ``ranks`` keyword (needed to start some
    ranks of a run: ``diloco resume``, a replica to continue)."""
    try:
        params = inspect.signature(executor.launch_replicas).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]  # no signature to read: refused below
    if "ranks" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    name = type(executor).__name__
    raise LaunchError(
        f"executor {name} cannot start some ranks of a run: its launch_replicas has no 'ranks' keyword. Add "
        "`*, ranks: Sequence[int] | None = None` to it (start only those ranks; None: all), or resume on "
        "--executor local, modal or hf-jobs"
    )


def _state_name(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    return str(value).lower()


def normalize_state(state: Any) -> ExecutorState:
    """An executor ``ReplicaState`` (object, dict or enum/str) as an ExecutorState."""
    if isinstance(state, Mapping):
        get = state.get
    else:
        def get(key: str, default: Any = None) -> Any:
            return getattr(state, key, default)
    raw = get("state", None)
    if raw is None:
        raw = get("status", state)
    reason = get("reason", None) or get("error", None) or get("message", None)
    code = get("exit_code", None)
    if reason is None and code not in (None, 0):
        reason = f"exit code {code}"
    return ExecutorState(state=_state_name(raw), reason=None if reason is None else str(reason))


def poll_states(executor: ServerlessExecutor | None, handles: Sequence[Mapping[str, Any]]) -> dict[int, ExecutorState]:
    """Rank -> ExecutorState from ``executor.poll``; {} if there is no executor or polling fails."""
    if executor is None or not handles:
        return {}
    try:
        states = list(executor.poll([to_handle(executor, h) for h in handles]))
    except Exception as e:
        return {handle_rank(h): ExecutorState(UNKNOWN, f"poll failed: {one_line(str(e))[:120]}")
                for h in handles}
    out: dict[int, ExecutorState] = {}
    for handle, state in zip(handles, states):
        rank = getattr(state, "rank", None)
        if rank is None and isinstance(state, Mapping):
            rank = state.get("rank")
        out[int(rank) if rank is not None else handle_rank(handle)] = normalize_state(state)
    return out
