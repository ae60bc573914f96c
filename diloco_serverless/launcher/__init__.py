"""The user's side of a run: :func:`launch` and :class:`Run`, preflight checks, status, plots, prices.

Never imports torch, torchft or :mod:`diloco_serverless.trainer` (a layer test enforces it), so the
CLI starts fast and runs where torch is not installed. It reads runs through
:mod:`diloco_serverless.run` and talks to replicas only through :mod:`diloco_serverless.executors`.
"""

from __future__ import annotations

from diloco_serverless.errors import LaunchError
from diloco_serverless.launcher.api import BudgetExceeded, Run, RunFailed, launch
from diloco_serverless.launcher.status import ReplicaReport, RunStatus

__all__ = ["BudgetExceeded", "LaunchError", "ReplicaReport", "Run", "RunFailed", "RunStatus", "launch"]
