"""The outer lr as a function of the round (``outer.lr_schedule``, e.g. Covenant-72B's 1 then 0.65).

Every fragment's ``perform_sync`` (torchft's outer step: ``should_commit`` then the outer
optimizer's ``step``) first sets its outer optimizer's lr to ``lr_at(r)``, where ``r`` is the
manager's ``current_step()`` before the sync: the 0-based round that the sync ends. The lr is a
function of the round number alone, so every replica, a replay of a stored round (healing) and a
resumed replica step with the same lr; nothing is added to the checkpoint (the optimizer's saved
lr is overwritten before the next step). The optimizer is looked up at each sync, so the fp32
global copies (``keep_global_state_fp32``) and sliced outer optimizers installed later are covered.
"""

from __future__ import annotations

from collections.abc import Callable

from diloco_serverless.trainer.diloco import DiLoCoReplica

__all__ = ["schedule_outer_lr"]


def schedule_outer_lr(rep: DiLoCoReplica, lr_at: Callable[[int], float]) -> None:
    """Make every fragment of ``rep`` step with ``lr_at(round)`` (see the module docstring)."""
    manager = rep.manager
    for fragment in rep.diloco._fragments:
        sync = fragment.perform_sync

        def perform_sync(fragment: object = fragment, sync: Callable[[], bool] = sync) -> bool:
            lr = lr_at(manager.current_step())
            for group in fragment._outer_optimizer.param_groups:  # type: ignore[attr-defined]
                group["lr"] = lr
            return bool(sync())

        fragment.perform_sync = perform_sync
