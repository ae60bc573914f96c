"""What a replica process runs: the model, torchft's DiLoCo over the store, the loop, checkpoints.

:class:`~.loop.ReplicaTrainer` is the whole replica (healing, H inner steps of ``compose_loss``, the
outer step, metrics, checkpoints, ``final/``). :class:`~.manager.ObjectStoreManager` fills the slot of
torchft's ``Manager`` with an exchange through the store; :mod:`.diloco` wires torchft's ``DiLoCo``.
Only replicas import this package; the launcher never does. See docs/architecture.md.
"""

from __future__ import annotations

from diloco_serverless.trainer.checkpoint import CheckpointCorrupt
from diloco_serverless.trainer.diloco import (
    CheckpointMismatch,
    DiLoCoReplica,
    build_diloco,
)
from diloco_serverless.trainer.loop import ReplicaTrainer, TrainResult
from diloco_serverless.trainer.manager import (
    ExchangeRecord,
    ManagerBase,
    ObjectStoreManager,
)
from diloco_serverless.trainer.model import ModelLoadError, build_model

__all__ = [
    "CheckpointCorrupt",
    "CheckpointMismatch",
    "DiLoCoReplica",
    "ExchangeRecord",
    "ManagerBase",
    "ModelLoadError",
    "ObjectStoreManager",
    "ReplicaTrainer",
    "TrainResult",
    "build_diloco",
    "build_model",
]
