"""Experiment tracking: a run's per-round series sent to trackio, Weights & Biases or TensorBoard.

The user's side of a run (no torch): the launcher logs the metrics replicas write to the store
while it follows a run, so tracker logins stay on the launching machine. Each backend is an optional
extra (``pip install 'diloco-serverless[trackio]'``, ``[wandb]``, ``[tensorboard]``, or
``[tracking]`` for all three) imported only when it is used. Imports ``config`` and ``errors`` only;
``launcher`` uses it. See :mod:`diloco_serverless.tracking.tracker`.
"""

from __future__ import annotations

from diloco_serverless.tracking.series import GLOBAL_KEYS, TOTAL_KEYS, global_values, replica_values
from diloco_serverless.tracking.tracker import (
    BACKENDS,
    Tracker,
    TrackingError,
    check_backends,
    missing_packages,
    wandb_run_id,
)

__all__ = [
    "BACKENDS",
    "GLOBAL_KEYS",
    "TOTAL_KEYS",
    "Tracker",
    "TrackingError",
    "check_backends",
    "global_values",
    "missing_packages",
    "replica_values",
    "wandb_run_id",
]
