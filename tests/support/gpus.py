"""The GPUs the multi-device tests may use.

A replica of G local processes gives process g ``cuda:g`` when the machine has GPUs, so on a machine
with fewer GPUs than G (one GPU is the common case) those tests would start ``cuda:1`` and fail, and
the replica itself now refuses to start. :func:`local_group_env` pins such a test's replicas to the
CPU (gloo, what the tests assert on a machine without GPUs) unless there is a GPU for every process,
and says why; with enough GPUs the replicas pick ``cuda:g`` and NCCL (``benchmarks/gpu_check.py``'s
``nccl-devices`` and ``fsdp`` paths). The count is the replica parent's own
(:func:`~diloco_serverless.entrypoints.local_group.cuda_device_count`: device files and
``CUDA_VISIBLE_DEVICES``, no CUDA initialised in the test process).
"""

from __future__ import annotations

from diloco_serverless.entrypoints.local_group import cuda_device_count

__all__ = ["local_group_env"]


def local_group_env(devices: int, gpus: int | None = None) -> dict[str, str]:
    """Environment for the replicas of a test whose replicas run ``devices`` local processes:
    ``DILOCO_DEVICE=cpu`` unless ``gpus`` (default: this machine's count) gives each its own GPU."""
    count = cuda_device_count() if gpus is None else gpus
    return {} if count >= devices else {"DILOCO_DEVICE": "cpu"}

