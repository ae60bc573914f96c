"""diloco-serverless: DiLoCo across serverless GPU replicas, averaged through an object store.

Public names are imported lazily so that ``import diloco_serverless`` stays cheap (no torch
import until a name that needs it is touched) and so that optional extras are only required
by the parts that use them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "ObjectStore": "diloco_serverless.store",
    "ObjectStoreAllReduce": "diloco_serverless.allreduce",
    "compose_loss": "diloco_serverless.loss",
    "LossComponents": "diloco_serverless.loss",
    "RunConfig": "diloco_serverless.config",
    "ObjectStoreManager": "diloco_serverless.manager",
    "MockManager": "diloco_serverless.manager",
    "launch": "diloco_serverless.api",
    "Run": "diloco_serverless.api",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'diloco_serverless' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
