"""The ServerlessExecutor protocol: launch N replicas somewhere, then poll, collect, cancel, read logs.

An executor starts ``python -m <entrypoint> <args...>`` once per rank with ``REPLICA_RANK`` (and
``DILOCO_ATTEMPT`` where the backend can tell) in the environment. Everything a later process needs
to find the replicas again is in the JSON-serialisable :class:`ReplicaHandle`, which the launcher
records in the run's ``run.json``; ``diloco status/logs/cancel`` rebuild an executor from the handle's
``kind`` (see :func:`diloco_serverless.executors.executor_for_handle`) and never need the launching
process. Credentials are never part of a handle, and a handle is never trusted: run.json is
writable by every replica credential, so executors check what a handle says (see each
``from_handle``) before acting on it.

Failure: :meth:`ServerlessExecutor.collect` raises :class:`ReplicaFailedError` naming every failed or
cancelled rank (and every rank that ended with an unknown outcome) with its exit code or remote
exception and the tail of its log; a timeout raises :class:`CollectTimeout` naming the ranks still
running (they are not cancelled). A replica that exits with :data:`SETUP_ERROR_EXIT_CODE` (2: the
input is wrong) is never retried by any executor.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from diloco_serverless.errors import ExecutorError


class ExecutorUnavailable(ExecutorError):
    """An executor cannot be used as configured (missing SDK, missing credentials, unknown GPU/flavor).

    Raised from ``__init__`` before anything is launched or billed; the message says what to change.
    """


class CollectTimeout(ExecutorError, TimeoutError):
    """``collect`` ran out of time; ``pending_ranks`` are still running and were not cancelled."""

    def __init__(self, message: str, pending_ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.pending_ranks = list(pending_ranks)


class ReplicaStatus(StrEnum):
    """Lifecycle of one replica. ``str`` valued so it serialises to JSON as a plain string."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    #: the platform cannot tell (e.g. Modal no longer keeps the call's result): callers defer to the
    #: replica's heartbeat in the store; ``reason`` says why
    UNKNOWN = "unknown"
    #: the attempt ended on purpose before its platform's time cap, with its state saved in the store
    #: (exit code :data:`CONTINUE_EXIT_CODE`); a fresh attempt of the rank must be started, and it
    #: does not count as a retry. Not terminal: the replica is not done.
    CONTINUE = "continue"

    @property
    def terminal(self) -> bool:
        """True once the replica will not run again (succeeded, failed or cancelled)."""
        return self in (ReplicaStatus.SUCCEEDED, ReplicaStatus.FAILED, ReplicaStatus.CANCELLED)


@dataclass(frozen=True)
class ReplicaHandle:
    """Where one replica runs. ``data`` is executor specific and JSON-serialisable; no secrets."""

    kind: str
    rank: int
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A flat JSON object ``{"kind", "rank", **data}`` (the form recorded in ``run.json``)."""
        return {"kind": self.kind, "rank": self.rank, **dict(self.data)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | str) -> ReplicaHandle:
        """Inverse of :meth:`to_json`; accepts the dict or its JSON text."""
        if isinstance(obj, str):
            obj = json.loads(obj)
        if not isinstance(obj, Mapping) or "kind" not in obj or "rank" not in obj:
            raise ValueError(f"not a replica handle (needs 'kind' and 'rank'): {obj!r}")
        data = {k: v for k, v in obj.items() if k not in ("kind", "rank")}
        return cls(kind=str(obj["kind"]), rank=int(obj["rank"]), data=data)


def handle_from_json(obj: Mapping[str, Any] | str | ReplicaHandle) -> ReplicaHandle:
    """Rebuild a :class:`ReplicaHandle` from its JSON form (a handle is returned unchanged)."""
    if isinstance(obj, ReplicaHandle):
        return obj
    return ReplicaHandle.from_json(obj)


@dataclass(frozen=True)
class ReplicaState:
    """A point-in-time view of one replica, as returned by ``poll``."""

    rank: int
    status: ReplicaStatus
    reason: str | None = None
    exit_code: int | None = None
    attempt: int = 0
    detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    @property
    def ended(self) -> bool:
        """True when the replica will not run again, even if its outcome is unknown (an UNKNOWN
        state with ``detail["ended"]``, e.g. an expired Modal result): ``collect`` stops waiting."""
        return self.terminal or (self.status is ReplicaStatus.UNKNOWN and self.detail.get("ended") is True)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "status": self.status.value,
            "reason": self.reason,
            "exit_code": self.exit_code,
            "attempt": self.attempt,
            **dict(self.detail),
        }


@dataclass(frozen=True)
class ReplicaResult:
    """The outcome of one replica once it is terminal, as returned by ``collect``."""

    rank: int
    status: ReplicaStatus
    exit_code: int | None = None
    reason: str | None = None
    attempt: int = 0
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is ReplicaStatus.SUCCEEDED

    def describe(self) -> str:
        """One line: ``rank 2 failed (exit code 1): <reason>``."""
        parts = [f"rank {self.rank} {self.status.value}"]
        if self.exit_code is not None:
            parts.append(f"(exit code {self.exit_code})")
        if self.reason and self.reason != self.status.value:
            parts.append(f": {self.reason}")
        return " ".join(parts).replace(" :", ":")


class ReplicaFailedError(ExecutorError):
    """One or more replicas failed or were cancelled. ``results`` holds every rank's result."""

    def __init__(self, results: Sequence[ReplicaResult], *, kind: str = "") -> None:
        self.results = list(results)
        self.failed = [r for r in self.results if not r.ok]
        super().__init__(format_failures(self.failed, kind=kind))


def format_failures(failed: Sequence[ReplicaResult], *, kind: str = "", tail_lines: int = 20) -> str:
    """The text of :class:`ReplicaFailedError`: every failed rank, its cause and its log tail."""
    where = f" ({kind} executor)" if kind else ""
    ranks = ", ".join(str(r.rank) for r in failed)
    lines = [f"{len(failed)} replica(s) did not succeed{where}: rank(s) {ranks}"]
    for r in failed:
        lines.append(f"- {r.describe()}")
        tail = [ln for ln in r.log_tail.splitlines() if ln.strip()][-tail_lines:]
        if tail:
            lines.append(f"  last {len(tail)} log line(s) of rank {r.rank}:")
            lines.extend(f"    | {ln}" for ln in tail)
    lines.append("Full logs: `diloco logs RUN_URL --rank R`.")
    return "\n".join(lines)


@runtime_checkable
class ServerlessExecutor(Protocol):
    """Launches and tracks the N replicas of a run (local processes, Modal, Hugging Face Jobs).

    ``entrypoint`` is a Python module run as ``python -m <entrypoint> *entrypoint_args``; ``env`` is
    added to each replica's environment together with ``REPLICA_RANK``. Handles returned by
    ``launch_replicas`` are JSON-serialisable and can be used by a different process (or a new
    executor instance of the same ``kind``) to poll, collect, cancel or read logs.
    """

    kind: str

    @property
    def attempt_cap_s(self) -> float | None:
        """The platform's cap on one attempt of a replica, in seconds (Modal's call timeout, the HF Job
        timeout, the local executor's rehearsal cap); None when there is none. A replica stops on its
        own before it and a fresh attempt continues the run."""
        ...

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: str,
        entrypoint_args: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        ranks: Sequence[int] | None = None,
    ) -> list[ReplicaHandle]:
        """Start ranks ``0..n_replicas-1``, or only ``ranks`` (a resume: the run has ``n_replicas``
        ranks and the others are still running or done); one handle per started rank, in order."""
        ...

    def poll(self, handles: Sequence[ReplicaHandle]) -> list[ReplicaState]: ...

    def collect(
        self, handles: Sequence[ReplicaHandle], timeout: float | timedelta | None = None
    ) -> list[ReplicaResult]: ...

    def cancel(self, handles: Sequence[ReplicaHandle]) -> None: ...

    def logs(self, handle: ReplicaHandle, tail: int | None = 200) -> str: ...


class ExecutorFactory(Protocol):
    """An executor class as the registry uses it: build one from options, or rebuild one from a
    handle stored in run.json (to poll, cancel or read logs of replicas another process launched).

    ``from_handle`` treats the handle as untrusted (run.json is writable by every replica): no
    setting that decides where credentials go, which files are read or written, or which
    processes are signalled may be taken from it unchecked. ``run_url`` is the run as the caller
    knows it (None when unknown)."""

    def __call__(self, **options: Any) -> ServerlessExecutor: ...

    def from_handle(
        self, handle: ReplicaHandle, *, run_url: str | None = None, **options: Any
    ) -> ServerlessExecutor: ...


def timeout_seconds(timeout: float | timedelta | None) -> float | None:
    """Normalise a ``collect`` timeout (seconds or timedelta) to seconds; ``None`` waits forever."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


def collect_by_polling(
    executor: ServerlessExecutor,
    handles: Sequence[ReplicaHandle],
    timeout: float | timedelta | None,
    *,
    poll_interval_s: float = 1.0,
    tail: int = 40,
    raise_on_failure: bool = True,
) -> list[ReplicaResult]:
    """Poll until every replica is terminal, then build results (with log tails for failures).

    Raises :class:`CollectTimeout` if ``timeout`` passes first (replicas keep running) and
    :class:`ReplicaFailedError` if any replica failed or was cancelled (unless ``raise_on_failure``
    is False, in which case the results are returned as they are).
    """
    timeout_s = timeout_seconds(timeout)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        states = executor.poll(handles)
        pending = [s.rank for s in states if not s.ended]
        if not pending:
            break
        if deadline is not None and time.monotonic() >= deadline:
            raise CollectTimeout(
                f"{executor.kind} executor: rank(s) {pending} still running after {timeout_s:.0f} s; "
                "they were not cancelled (call cancel() or `diloco cancel RUN_URL` to stop them)",
                pending,
            )
        sleep_s = poll_interval_s if deadline is None else min(poll_interval_s, max(0.0, deadline - time.monotonic()))
        time.sleep(sleep_s)
    by_rank = {h.rank: h for h in handles}
    results = [_result_from_state(executor, by_rank[s.rank], s, tail) for s in states]
    if raise_on_failure and any(not r.ok for r in results):
        raise ReplicaFailedError(results, kind=executor.kind)
    return results


def _result_from_state(
    executor: ServerlessExecutor, handle: ReplicaHandle, state: ReplicaState, tail: int
) -> ReplicaResult:
    log_tail = ""
    if state.status is not ReplicaStatus.SUCCEEDED:
        try:
            log_tail = executor.logs(handle, tail=tail)
        except Exception as exc:  # logs are best effort: the failure itself must still be reported
            log_tail = f"(could not read the log of rank {handle.rank}: {exc})"
    return ReplicaResult(
        rank=state.rank,
        status=state.status,
        exit_code=state.exit_code,
        reason=state.reason,
        attempt=state.attempt,
        log_tail=log_tail,
    )


# --- exit codes and shipped code ----------------------------------------------------------------

#: Exit code of a replica that found a problem before training (bad run.json, rank outside the run,
#: unreachable store, wrong shipped code; see entrypoints/replica.py). Retrying cannot fix it, so no
#: executor retries it: the local supervisor stops, the Modal function returns it as its result
#: instead of raising (so ``modal.Retries`` does not apply), and an HF Job exits 0 after printing
#: :data:`SETUP_ERROR_MARKER` (so the Jobs ``attempts`` do not apply); ``poll`` reports ``failed``.
SETUP_ERROR_EXIT_CODE = 2
#: The line a remote wrapper prints before ending a replica that exited with SETUP_ERROR_EXIT_CODE.
SETUP_ERROR_MARKER = "[diloco] setup error (exit code 2), not retried"

#: Exit code of a replica that stopped at a round boundary before its attempt's platform deadline
#: (``DILOCO_ATTEMPT_DEADLINE``), after writing its state to the store (EX_TEMPFAIL). Executors start a
#: fresh attempt of the rank for it, which does not count as a retry.
CONTINUE_EXIT_CODE = 75
#: Environment variable naming when the current attempt will be killed by its platform: a Unix time in
#: seconds (float). Executors that know their platform's cap set it (or ``DILOCO_ATTEMPT_TIMEOUT_S``,
#: seconds from the process start, which the replica turns into a deadline).
ATTEMPT_DEADLINE_ENV, ATTEMPT_TIMEOUT_ENV = "DILOCO_ATTEMPT_DEADLINE", "DILOCO_ATTEMPT_TIMEOUT_S"
#: The line a remote wrapper prints before ending an attempt whose replica exited with CONTINUE_EXIT_CODE.
CONTINUE_MARKER = "[diloco] continue (exit code 75): state saved before the attempt's deadline"

#: Set in the environment of a replica that runs shipped code: the wheel's version (with its
#: ``+src.<hash>`` label), SHA-256 and URL. The replica refuses to start (exit code 2) when the
#: installed package beside the imported one has another version (entrypoints/replica.py).
CODE_VERSION_ENV, CODE_SHA256_ENV, CODE_URL_ENV = "DILOCO_CODE_VERSION", "DILOCO_CODE_SHA256", "DILOCO_CODE_URL"

#: ``uploader(filename, data) -> url``: stores one file of the code a remote executor ships (the
#: launcher puts it in the run's own store, ``<run>/code/<filename>``) and returns the fsspec URL a
#: replica holding the run's storage credentials reads it from.
CodeUploader = Callable[[str, bytes], str]


@dataclass(frozen=True)
class ShippedCode:
    """The code a remote executor shipped for a launch: a wheel of the launching package."""

    url: str
    sha256: str
    version: str
    filename: str

    def to_json(self) -> dict[str, str]:
        return {"url": self.url, "sha256": self.sha256, "version": self.version, "filename": self.filename}


def setup_error_reason(log_tail: str) -> str:
    """The reason of a setup error from a log tail: the replica's last ``error: ...`` line, else the
    last line of output that is not the wrappers' own (``[diloco] ...``), else the marker."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    if errors:
        return errors[-1]
    own = [ln for ln in lines if not ln.startswith("[diloco")]
    return own[-1][:500] if own else SETUP_ERROR_MARKER


# --- environment helpers shared by the executors ------------------------------------------------

#: Storage credential variables forwarded as secrets (never as plain environment) by remote executors.
STORAGE_SECRET_ENV: tuple[str, ...] = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "GOOGLE_APPLICATION_CREDENTIALS_JSON",
    "DILOCO_STORAGE_OPTIONS",
)

#: Non-secret storage settings that remote executors may copy into the replicas' plain environment.
STORAGE_CONFIG_ENV: tuple[str, ...] = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "STORAGE_EMULATOR_HOST",
)

_SECRET_NAME = re.compile(r"(SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|_KEY$|_KEY_ID$)", re.IGNORECASE)


def looks_secret(name: str) -> bool:
    """True for environment names that may carry credentials (values must go through secrets)."""
    return name in STORAGE_SECRET_ENV or bool(_SECRET_NAME.search(name))


def split_secret_env(env: Mapping[str, str] | None) -> tuple[dict[str, str], dict[str, str]]:
    """Split ``env`` into (plain, secret) by :func:`looks_secret`."""
    plain: dict[str, str] = {}
    secret: dict[str, str] = {}
    for name, value in (env or {}).items():
        (secret if looks_secret(name) else plain)[name] = str(value)
    return plain, secret


def run_url_from(env: Mapping[str, str] | None, entrypoint_args: Sequence[str]) -> str | None:
    """The run URL from ``--run-url URL`` / ``--run-url=URL`` in the args, else ``DILOCO_RUN_URL``."""
    args = list(entrypoint_args)
    for i, arg in enumerate(args):
        if arg == "--run-url" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--run-url="):
            return arg.split("=", 1)[1]
    return (env or {}).get("DILOCO_RUN_URL")


def run_id_from_url(run_url: str | None) -> str | None:
    """The last path component of a run URL (the run id), or None."""
    if not run_url:
        return None
    tail = run_url.rstrip("/").rsplit("/", 1)[-1]
    return tail or None


def check_replica_count(n_replicas: int, kind: str) -> None:
    """Refuse ``n_replicas < 1`` before anything is launched."""
    if not isinstance(n_replicas, int) or n_replicas < 1:
        raise ValueError(f"{kind} executor: n_replicas must be a positive integer, got {n_replicas!r}")


def ranks_to_start(n_replicas: int, ranks: Sequence[int] | None, kind: str) -> list[int]:
    """The ranks a ``launch_replicas`` call starts: all of ``0..n_replicas-1``, or ``ranks``, which must
    be distinct ranks of the run (ValueError naming the bad one otherwise, before anything starts)."""
    check_replica_count(n_replicas, kind)
    if ranks is None:
        return list(range(n_replicas))
    chosen = list(ranks)
    if not chosen:
        raise ValueError(f"{kind} executor: ranks is empty; pass None to start every rank")
    for rank in chosen:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n_replicas:
            raise ValueError(f"{kind} executor: rank {rank!r} is not a rank of a run of {n_replicas} replicas "
                             f"(0..{n_replicas - 1})")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"{kind} executor: ranks {chosen} name a rank twice; each rank runs once")
    return chosen
