"""``exchange.fragment_merge = "eager"``: keep the steps trained while a round's exchange was in flight.

With ``exchange.fragment_sync_delay = tau`` (Streaming DiLoCo, arXiv 2501.18512) a round's pseudo-gradient
is taken ``tau`` inner steps before the round ends, and the exchange runs while the replica trains those
``tau`` steps. torchft then sets the replica to the new global parameters (``fragment_update_alpha = 0``,
``merge = "replace"``): the ``tau`` steps are trained, their tokens read, and their progress discarded.

The eager merge (the idea of eager one-step-delay DiLoCo, arXiv 2502.12996, applied inside a round)
keeps them: at the sync the replica becomes

    new_global + (theta_sync - theta_prepare)

its own progress since the pseudo-gradient was taken, added to the new global parameters. The next
round's pseudo-gradient is torchft's ``global - theta`` as always, so those ``tau`` steps are sent (and
averaged) with the next round: nothing is discarded and nothing is counted twice.

* **Global state** (the fragment's global parameters, the outer optimizer, the manager step) is untouched:
  torchft computes it from the averaged pseudo-gradients before the merge, so it stays bit-identical
  across replicas and replay reaches the same bits.
* **Replica state**: the offset is this replica's own; it is part of the replica's saved state
  (``fragment_merge/<name>`` tensors next to its inner optimizer). A checkpoint cannot fall between
  ``prepare_sync`` and ``perform_sync`` (checkpoints are written at round boundaries, where no exchange
  is prepared), so the snapshot taken at ``prepare_sync`` is never needed after a restart; the offset
  applied at the last sync is, because the parameters at that boundary include it.
* **No offset** after a failed round (the parameters went back to the old global parameters and the
  replica heals), a replayed round (not this replica's progress), or a non-finite offset.

Needs one fragment on one device (the config refuses other combinations).
"""

from __future__ import annotations

from typing import Any

import torch

from diloco_serverless.trainer.diloco import DiLoCoReplica

__all__ = ["EagerFragmentMerge", "enable_fragment_merge", "merge_state", "load_merge_state"]

#: prefix of the offset tensors in a replica's saved state
STATE_PREFIX = "fragment_merge/"


class EagerFragmentMerge:
    """Wraps fragment 0's ``prepare_sync``/``perform_sync`` to carry the ``tau`` steps over the sync."""

    def __init__(self, rep: DiLoCoReplica) -> None:
        if len(rep.diloco._fragments) != 1:
            raise ValueError("exchange.fragment_merge = 'eager' supports exchange.fragments = 1 only")
        self.rep = rep
        self.fragment = rep.diloco._fragments[0]
        #: the parameters when the round's pseudo-gradient was taken (between prepare and sync only)
        self.snapshot: dict[str, torch.Tensor] = {}
        #: the progress added at the last sync (the replica's own state until the next sync)
        self.offset: dict[str, torch.Tensor] = {}
        self._prepare_sync = self.fragment.prepare_sync
        self._perform_sync = self.fragment.perform_sync
        self.fragment.prepare_sync = self.prepare_sync
        self.fragment.perform_sync = self.perform_sync

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.fragment._model_fragment.named_parameters())

    def prepare_sync(self) -> None:
        with torch.no_grad():
            self.snapshot = {name: p.data.detach().clone() for name, p in self._params()}
        self._prepare_sync()

    def perform_sync(self) -> bool:
        replay = bool(getattr(self.rep.manager, "_replay", False))
        progress: dict[str, torch.Tensor] = {}
        if self.snapshot and not replay:
            with torch.no_grad():  # theta_sync - theta_prepare, into the snapshot's memory
                progress = {name: torch.sub(p.data, self.snapshot[name], out=self.snapshot[name])
                            for name, p in self._params()}
        self.snapshot = {}
        ok = bool(self._perform_sync())  # the parameters are now the new (or, failed: the old) global ones
        if progress and (not ok or not bool(torch.stack([torch.isfinite(t).all() for t in progress.values()]).all())):
            progress = {}
        self.offset = progress
        self._apply()
        return ok

    def _apply(self) -> None:
        with torch.no_grad():
            for name, p in self._params():
                if name in self.offset:
                    p.data.add_(self.offset[name].to(device=p.device, dtype=p.dtype))

    def state(self) -> dict[str, torch.Tensor]:
        return {f"{STATE_PREFIX}{name}": t.detach().to("cpu").clone() for name, t in self.offset.items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back a saved offset; the parameters must be the global ones (a checkpoint was just loaded)."""
        self.offset = {k[len(STATE_PREFIX):]: v.clone() for k, v in tensors.items() if k.startswith(STATE_PREFIX)}
        self.snapshot = {}
        self._apply()


def enable_fragment_merge(rep: DiLoCoReplica, merge: str) -> EagerFragmentMerge | None:
    """Install ``exchange.fragment_merge`` on ``rep``: ``"replace"`` is torchft's own (None is returned)."""
    if merge == "replace":
        return None
    if merge != "eager":
        raise ValueError(f"exchange.fragment_merge must be 'replace' or 'eager', got {merge!r}")
    if rep.diloco._fragment_sync_delay <= 0:
        raise ValueError("exchange.fragment_merge = 'eager' needs exchange.fragment_sync_delay > 0 "
                         "(without it no step is trained while the exchange runs)")
    return EagerFragmentMerge(rep)


def merge_state(merge: Any) -> dict[str, torch.Tensor]:
    """The replica's offset tensors to save (none without an eager merge)."""
    return merge.state() if isinstance(merge, EagerFragmentMerge) else {}


def load_merge_state(merge: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Put back :func:`merge_state`'s tensors (nothing without an eager merge)."""
    if isinstance(merge, EagerFragmentMerge):
        merge.load(tensors)
