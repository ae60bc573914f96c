"""Executors: where the replicas of a run execute (local processes, Modal, Hugging Face Jobs).

    from diloco_serverless.executors import get_executor, executor_for_handle, handle_from_json
    ex = get_executor("local", retries=2)
    handles = ex.launch_replicas(4, "diloco_serverless.entrypoints.replica", ["--run-url", url])
    records = [h.to_json() for h in handles]            # -> run.json
    # later, anywhere (records come from run.json, which replicas can write: they are checked, not trusted):
    hs = [handle_from_json(r) for r in records]
    executor_for_handle(hs[0], run_url=url).poll(hs)

Backends import their SDKs lazily, so ``import diloco_serverless.executors`` needs neither
``modal`` nor ``huggingface_hub``. An executor that ships the launcher's code through the run's store
(hf-jobs) has ``set_code_uploader(uploader)`` (a :data:`CodeUploader`) and, after a launch,
``shipped_code`` (a :class:`ShippedCode`).
"""

from __future__ import annotations

from diloco_serverless.errors import ExecutorError
from diloco_serverless.executors.base import (
    SETUP_ERROR_EXIT_CODE,
    CodeUploader,
    CollectTimeout,
    ExecutorUnavailable,
    ReplicaFailedError,
    ReplicaHandle,
    ReplicaResult,
    ReplicaState,
    ReplicaStatus,
    ServerlessExecutor,
    ShippedCode,
    handle_from_json,
)
from diloco_serverless.executors.registry import (
    EXECUTOR_KINDS,
    build_executor,
    executor_class,
    executor_for_handle,
    executor_from_launch,
    executor_kind,
    executor_options,
    get_executor,
)

__all__ = [
    "EXECUTOR_KINDS",
    "SETUP_ERROR_EXIT_CODE",
    "CodeUploader",
    "CollectTimeout",
    "ExecutorError",
    "ExecutorUnavailable",
    "ReplicaFailedError",
    "ReplicaHandle",
    "ReplicaResult",
    "ReplicaState",
    "ReplicaStatus",
    "ServerlessExecutor",
    "ShippedCode",
    "build_executor",
    "executor_class",
    "executor_for_handle",
    "executor_from_launch",
    "executor_kind",
    "executor_options",
    "get_executor",
    "handle_from_json",
]


