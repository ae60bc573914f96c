"""The one home of executor kinds: from a kind (``"local"``, ``"modal"``, ``"hf-jobs"``) or a stored
handle to a :class:`~diloco_serverless.executors.base.ServerlessExecutor`.

    ex = get_executor("local", retries=2)
    ex = build_executor("modal", "H100", {"timeout_s": 3600})    # LaunchError naming a bad option
    ex = executor_for_handle(run_record.launch["handles"][0], run_url=url)  # poll/cancel/logs of a stored run

Backends are imported on first use, so this module needs neither ``modal`` nor ``huggingface_hub``.
To add an executor, implement the Protocol in a module of this package and add one line to
:data:`EXECUTOR_KINDS` (docs/architecture.md, "Where to add things").
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any, cast

from diloco_serverless.errors import LaunchError, one_line
from diloco_serverless.executors.base import (
    ExecutorFactory,
    ReplicaHandle,
    ServerlessExecutor,
    handle_from_json,
)

__all__ = [
    "EXECUTOR_KINDS",
    "build_executor",
    "executor_class",
    "executor_for_handle",
    "executor_from_launch",
    "executor_kind",
    "executor_options",
    "get_executor",
]

#: executor kind -> "module:Class" (imported on first use)
EXECUTOR_KINDS: dict[str, str] = {
    "local": "diloco_serverless.executors.local:LocalProcessExecutor",
    "modal": "diloco_serverless.executors.modal:ModalExecutor",
    "hf-jobs": "diloco_serverless.executors.hf_jobs:HFJobsExecutor",
}

#: The executor option that takes ``--gpu`` (local replicas run on what the machine has).
_GPU_OPTION = {"modal": "gpu", "hf-jobs": "flavor"}


_BUILD_ERRORS = (ImportError, ValueError, RuntimeError, TypeError, OSError, KeyError)


def build_executor(kind: str, gpu: str | None, options: dict[str, Any]) -> ServerlessExecutor:
    """``executors.get_executor(kind, gpu=/flavor=..., **options)``; LaunchError on any failure."""
    if kind in _GPU_OPTION and gpu is not None:
        options.setdefault(_GPU_OPTION[kind], gpu)
    try:
        cls = executor_class(kind)
        unknown = sorted(set(options) - set(executor_options(cls)))
        if unknown:
            raise LaunchError(f"the {kind} executor has no option {unknown[0]!r}; "
                              f"its options: {', '.join(executor_options(cls))}")
        return get_executor(kind, **options)
    except _BUILD_ERRORS as e:
        raise LaunchError(one_line(str(e)) or f"cannot build the {kind} executor ({type(e).__name__})") from None


def executor_options(cls: ExecutorFactory) -> list[str]:
    """Keyword options an executor class accepts (its ``__init__`` parameters)."""
    params = inspect.signature(cls).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def executor_from_launch(
    launch: Mapping[str, Any], run_url: str | None = None
) -> tuple[ServerlessExecutor | None, str | None]:
    """Rebuild the executor recorded in run.json: (executor, None) or (None, why not).

    ``run_url`` is the run's URL as the caller knows it (not as run.json says): the local executor
    derives its log and state paths from it. With handles, see :func:`executor_for_handle`;
    run.json is writable by every replica, so nothing in it decides where credentials go.
    """
    handles = list(launch.get("handles") or [])
    kind = str(launch.get("executor", ""))
    try:
        if handles:
            try:
                return executor_for_handle(handles[0], run_url=run_url), None
            except _BUILD_ERRORS as e:
                raise LaunchError(one_line(str(e)) or f"cannot rebuild the {kind} executor") from None
        return build_executor(kind, launch.get("gpu"), {}), None
    except LaunchError as e:
        return None, str(e)


def executor_kind(executor: object, default: str) -> str:
    """The executor's kind string ("local", "modal", "hf-jobs"), from ``.kind`` or its class name."""
    kind = getattr(executor, "kind", None)
    if isinstance(kind, str) and kind:
        return kind
    name = type(executor).__name__.lower()
    for k, marker in (("local", "local"), ("modal", "modal"), ("hf-jobs", "hf")):
        if name.startswith(marker):
            return k
    return default


def executor_class(kind: str) -> ExecutorFactory:
    """The executor class for ``kind``; ValueError listing the known kinds otherwise."""
    target = EXECUTOR_KINDS.get(kind.strip().lower().replace("_", "-"))
    if target is None:
        known = ", ".join(sorted(EXECUTOR_KINDS))
        raise ValueError(f"unknown executor {kind!r}: choose one of {known}")
    module_name, cls_name = target.split(":")
    return cast(ExecutorFactory, getattr(importlib.import_module(module_name), cls_name))


def get_executor(kind: str, **options: Any) -> ServerlessExecutor:
    """Build the executor ``kind`` ("local", "modal", "hf-jobs") with its keyword options.

    Raises ValueError for an unknown kind and ExecutorUnavailable when the backend's SDK or
    credentials are missing (before anything is launched).
    """
    return executor_class(kind)(**options)


def executor_for_handle(
    handle: ReplicaHandle | Mapping[str, Any] | str, *, run_url: str | None = None, **options: Any
) -> ServerlessExecutor:
    """An executor that can poll/cancel/read logs of ``handle`` (e.g. loaded from ``run.json``).

    A handle is untrusted input (any replica credential can rewrite run.json): credentials come
    from the environment (or ``options``), and so does every setting that decides where they are
    sent (the HF endpoint is ``HF_ENDPOINT`` or the default; a handle naming another one is
    refused). Harmless settings such as the HF namespace are reused. ``run_url`` is the run as
    the caller knows it; the local executor derives log and state paths from it.
    """
    h = handle_from_json(handle)
    return executor_class(h.kind).from_handle(h, run_url=run_url, **options)
