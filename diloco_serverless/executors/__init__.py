"""Executors: where the replicas of a run execute (local processes, Modal, Hugging Face Jobs).

    from diloco_serverless.executors import get_executor, executor_for_handle, handle_from_json
    ex = get_executor("local", retries=2)
    handles = ex.launch_replicas(4, "diloco_serverless.entrypoints.replica", ["--run-url", url])
    records = [h.to_json() for h in handles]            # -> run.json
    # later, anywhere:
    hs = [handle_from_json(r) for r in records]
    executor_for_handle(hs[0]).poll(hs)

Backends import their SDKs lazily, so ``import diloco_serverless.executors`` needs neither
``modal`` nor ``huggingface_hub``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco_serverless.executors.base import (
    CollectTimeout,
    ExecutorError,
    ExecutorUnavailable,
    ReplicaFailedError,
    ReplicaHandle,
    ReplicaResult,
    ReplicaState,
    ReplicaStatus,
    ServerlessExecutor,
    handle_from_json,
)

#: executor kind -> "module:Class" (imported on first use)
EXECUTOR_KINDS: dict[str, str] = {
    "local": "diloco_serverless.executors.local:LocalProcessExecutor",
    "modal": "diloco_serverless.executors.modal:ModalExecutor",
    "hf-jobs": "diloco_serverless.executors.hf_jobs:HFJobsExecutor",
}

__all__ = [
    "EXECUTOR_KINDS",
    "CollectTimeout",
    "ExecutorError",
    "ExecutorUnavailable",
    "ReplicaFailedError",
    "ReplicaHandle",
    "ReplicaResult",
    "ReplicaState",
    "ReplicaStatus",
    "ServerlessExecutor",
    "executor_class",
    "executor_for_handle",
    "get_executor",
    "handle_from_json",
]


def executor_class(kind: str) -> type:
    """The executor class for ``kind``; ValueError listing the known kinds otherwise."""
    target = EXECUTOR_KINDS.get(kind.strip().lower().replace("_", "-"))
    if target is None:
        known = ", ".join(sorted(EXECUTOR_KINDS))
        raise ValueError(f"unknown executor {kind!r}: choose one of {known}")
    module_name, cls_name = target.split(":")
    import importlib

    return getattr(importlib.import_module(module_name), cls_name)


def get_executor(kind: str, **options: Any) -> ServerlessExecutor:
    """Build the executor ``kind`` ("local", "modal", "hf-jobs") with its keyword options.

    Raises ValueError for an unknown kind and ExecutorUnavailable when the backend's SDK or
    credentials are missing (before anything is launched).
    """
    return executor_class(kind)(**options)


def executor_for_handle(handle: ReplicaHandle | Mapping[str, Any] | str, **options: Any) -> ServerlessExecutor:
    """An executor that can poll/cancel/read logs of ``handle`` (e.g. loaded from ``run.json``).

    Backend settings stored in the handle (HF endpoint and namespace, ...) are reused; credentials
    come from the environment (or ``options``), never from the handle.
    """
    h = handle_from_json(handle)
    return executor_class(h.kind).from_handle(h, **options)
