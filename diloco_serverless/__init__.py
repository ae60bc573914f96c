"""diloco-serverless: DiLoCo across serverless GPU replicas, averaged through an object store.

The folders are the layers (docs/architecture.md): ``store`` < ``run`` < ``exchange`` < ``trainer``
for the replica, ``executors`` < ``launcher`` < ``cli`` for the user's side, with ``config``,
``errors``, ``loss`` and ``data`` beside them. Public names are imported lazily so that
``import diloco_serverless`` stays cheap (no torch
import until a name that needs it is touched) and so that optional extras are only required
by the parts that use them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "ObjectStore": "diloco_serverless.store",
    "ObjectStoreAllReduce": "diloco_serverless.exchange",
    "compose_loss": "diloco_serverless.loss",
    "LossComponents": "diloco_serverless.loss",
    "RunConfig": "diloco_serverless.config",
    "ObjectStoreManager": "diloco_serverless.trainer",
    "MockManager": "diloco_serverless.testing",
    "launch": "diloco_serverless.launcher",
    "Run": "diloco_serverless.launcher",
    "DilocoError": "diloco_serverless.errors",
    "UserInputError": "diloco_serverless.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'diloco_serverless' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
