"""The error-feedback buffers in a replica's exact-resume state, with one process or G local processes.

The exchange keeps one buffer per fragment (``residual_key`` ``fragment-<i>``): the codec's residual,
or with the sparse codec SparseLoCo's ``e`` (``e = beta * e + delta; c = Q(topk(e)); e -= decode(c)``,
:class:`~diloco_serverless.exchange.allreduce.ObjectStoreAllReduce`). A replica of G local processes
(``parallel.devices = G``) exchanges slice g of every pseudo-gradient from local rank g, so each
process holds the buffers of its own slice: :func:`gather_buffers` collects them on every process
(one all-gather per fragment, over the control group) so that local rank 0, which writes the replica
state, stores them all, and :func:`restore_buffers` gives each process back its own.

Names in the replica state: ``residual/<key>`` with one process (as before), and
``residual/<key>/local-<g>`` for local rank g of a multi-device replica.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from diloco_serverless.trainer.local_group import LocalGroup

__all__ = ["gather_buffers", "restore_buffers"]

PREFIX = "residual/"


class _HasBuffers(Protocol):
    def residuals(self) -> dict[str, torch.Tensor]: ...

    def load_residuals(self, residuals: dict[str, torch.Tensor]) -> None: ...


def _exchange_of(manager: Any) -> _HasBuffers | None:
    ex = getattr(manager, "exchange", None)
    return ex if callable(getattr(ex, "residuals", None)) and callable(getattr(ex, "load_residuals", None)) else None


def gather_buffers(manager: Any, local: LocalGroup | None, fragments: int) -> dict[str, torch.Tensor]:
    """This replica's error-feedback buffers as replica-state tensors (see the module docstring). With
    ``local`` (G > 1) this is a collective call: every local process of the replica must make it."""
    ex = _exchange_of(manager)
    mine = ex.residuals() if ex is not None else {}
    if local is None or local.size == 1:
        return {f"{PREFIX}{k}": v for k, v in mine.items()}
    out: dict[str, torch.Tensor] = {}
    for key in (f"fragment-{i}" for i in range(fragments)):
        own = mine.get(key, torch.zeros(0)).reshape(-1).to(device="cpu", dtype=torch.float32)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(local.size)]
        dist.all_gather(sizes, torch.tensor([own.numel()], dtype=torch.long), group=local.control_group)
        width = max(int(s.item()) for s in sizes)
        if width == 0:
            continue
        padded = torch.zeros(width, dtype=torch.float32)
        padded[: own.numel()] = own
        parts = [torch.empty(width, dtype=torch.float32) for _ in range(local.size)]
        dist.all_gather(parts, padded, group=local.control_group)
        for g, (part, size) in enumerate(zip(parts, sizes)):
            if int(size.item()):
                out[f"{PREFIX}{key}/local-{g}"] = part[: int(size.item())].clone()
    return out


def restore_buffers(manager: Any, tensors: dict[str, torch.Tensor], local: LocalGroup | None) -> None:
    """Give the exchange back the buffers :func:`gather_buffers` saved: local rank g takes its own."""
    ex = _exchange_of(manager)
    if ex is None:
        return
    if local is None or local.size == 1:
        ex.load_residuals({k.removeprefix(PREFIX): v for k, v in tensors.items()
                           if k.startswith(PREFIX) and "/local-" not in k})
        return
    suffix = f"/local-{local.rank}"
    ex.load_residuals({k.removeprefix(PREFIX).removesuffix(suffix): v for k, v in tensors.items()
                       if k.startswith(PREFIX) and k.endswith(suffix)})
