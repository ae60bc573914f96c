"""``python -m support.chaos_replica``: the real replica entrypoint, with a NaN loss on chosen ranks.

The chaos harness (:mod:`support.chaos`) starts this module instead of
``diloco_serverless.entrypoints.replica`` when a plan has ``nan_ranks``. On a rank listed in
``$DILOCO_CHAOS_NAN_RANKS`` (comma-separated), it replaces ``diloco_serverless.trainer.loop.compose_loss``
(the name the training loop calls) by a wrapper whose training loss is NaN from the
``$DILOCO_CHAOS_NAN_FROM_STEP``-th inner step on (0-based, default 0); evaluation (no grad) is left
alone. Then it runs ``diloco_serverless.entrypoints.replica.main()`` unchanged. Other ranks run the
entrypoint untouched.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

NAN_RANKS_ENV = "DILOCO_CHAOS_NAN_RANKS"
NAN_FROM_STEP_ENV = "DILOCO_CHAOS_NAN_FROM_STEP"


def _nan_ranks() -> set[int]:
    return {int(x) for x in os.environ.get(NAN_RANKS_ENV, "").split(",") if x.strip()}


def install_nan_loss(from_step: int = 0) -> None:
    """Make this process's training loss NaN from inner step ``from_step`` on."""
    import torch

    from diloco_serverless.trainer import loop

    original = loop.compose_loss
    calls = [0]

    def nan_loss(model: Any, batch: Any, **kwargs: Any) -> Any:
        comps = original(model, batch, **kwargs)
        if not torch.is_grad_enabled():  # evaluation
            return comps
        calls[0] += 1
        if calls[0] <= from_step:
            return comps
        return dataclasses.replace(comps, total=comps.total * float("nan"))

    loop.compose_loss = nan_loss  # type: ignore[assignment]


def main() -> int:
    rank = os.environ.get("REPLICA_RANK", "")
    if rank.strip().isdigit() and int(rank) in _nan_ranks():
        install_nan_loss(int(os.environ.get(NAN_FROM_STEP_ENV, "0")))
    from diloco_serverless.entrypoints.replica import main as replica_main

    return replica_main()


if __name__ == "__main__":
    sys.exit(main())
