"""FSDP2 inside a multi-device replica (``parallel.strategy = "fsdp"``).

A replica of G local processes shards its model over them with ``torch.distributed.fsdp.fully_shard``
(each decoder block named by the model's ``_no_split_modules``, then the root): every process holds
rows ``torch.chunk(full, G, dim=0)[g]`` of every parameter (its *shard*; shards may differ in size,
some may be empty), the inner AdamW steps the shards, and the gradients of the G processes' shares
of a batch are summed by FSDP's reduce-scatter (divide factor 1, plain sums on every backend).

torchft's DiLoCo already works on the local shards of ``DTensor`` parameters: its global parameters,
pseudo-gradients and exchanged flat buffer are the shards, so a device's exchange slice *is* its
shard (P/G numbers, no all-gather of the whole model for the outer step). :func:`use_local_outer`
makes the outer step plain ``torch.optim.SGD`` on fp32 copies of those shards (the momentum is per
shard too). :class:`FSDPReplica` keeps the one-device checkpoint format: it gathers the shards of
the global parameters and the outer momentum into whole tensors to save (every local process calls
it, local rank 0 writes) and keeps its own rows of whole tensors on restore;
:func:`gather_optimizer_state` / :func:`shard_optimizer_state` do the same for the inner AdamW state,
and :func:`full_state_dict` gathers the whole model for ``final/``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from diloco_serverless.trainer.diloco import DiLoCoReplica, _unflatten
from diloco_serverless.trainer.local_group import LocalGroup

__all__ = [
    "FSDPReplica",
    "full_state_dict",
    "gather_optimizer_state",
    "gather_rows",
    "local_rows",
    "shard_model",
    "shard_optimizer_state",
]

_ORIGINAL = re.compile(r"^user/StreamingDiLoCoFragment_(\d+)/original_parameters/(.+)$")
_MOMENTUM = re.compile(r"^user/StreamingDiLoCoFragment_(\d+)/outer_optimizer/state/(\d+)/momentum_buffer$")


def shard_model(model: nn.Module, device: torch.device, local: LocalGroup) -> int:
    """``fully_shard`` ``model`` over the replica's ``local.size`` processes, in place; returns the
    number of FSDP units (blocks + root). Gradients are summed over the processes, not averaged: each
    process's loss is already its share of the whole batch's."""
    if local.size < 2:
        raise ValueError(f"FSDP needs parallel.devices >= 2, got {local.size}")
    mesh = init_device_mesh(device.type, (local.size,))
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    units = 0
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
            units += 1
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return units + 1


def local_rows(full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """Local rank ``rank``'s rows of ``full`` as FSDP2 shards it (``torch.chunk`` on dim 0, empty
    when there are fewer chunks than processes)."""
    if full.dim() == 0:
        raise ValueError("a 0-dim tensor has no rows to shard; FSDP shards parameters on dim 0")
    chunks = torch.chunk(full, size, dim=0)
    return chunks[rank] if rank < len(chunks) else full[0:0]


def _row_counts(shape: torch.Size | tuple[int, ...], size: int) -> list[int]:
    meta = torch.empty(tuple(shape), device="meta")
    return [local_rows(meta, size, g).numel() for g in range(size)]


def gather_rows(local: LocalGroup, part: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The whole CPU tensor of ``shape`` whose rows :func:`local_rows` gives local rank g are that
    process's ``part`` (a DTensor's local shard is taken): a collective over the control group, every
    local process calls it with the same ``shape``. The dtype is ``part``'s (moved as fp32)."""
    if isinstance(part, DTensor):
        part = part.to_local()
    counts = _row_counts(shape, local.size)
    if part.numel() != counts[local.rank]:
        raise ValueError(f"local rank {local.rank} holds {part.numel()} elements of a {tuple(shape)} tensor, "
                         f"expected {counts[local.rank]} (its torch.chunk rows)")
    width = max(counts)
    mine = torch.zeros(width, dtype=torch.float32)
    mine[: part.numel()] = part.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    out = [torch.empty(width, dtype=torch.float32) for _ in range(local.size)]
    dist.all_gather(out, mine, group=local.control_group)
    return torch.cat([o[:n] for o, n in zip(out, counts)]).view(tuple(shape)).to(part.dtype)


def full_state_dict(model: nn.Module, local: LocalGroup) -> dict[str, torch.Tensor]:
    """The whole model's state dict as CPU tensors (a collective: every local process calls it). Tied
    parameters (one parameter under two names) share one tensor, so ``save_pretrained`` sees the tie."""
    params = dict(model.named_parameters(remove_duplicate=False))
    gathered: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        key = id(params[name]) if name in params else id(value)
        if key not in gathered:
            gathered[key] = (gather_rows(local, value, value.shape) if isinstance(value, DTensor)
                             else value.detach().cpu())
        out[name] = gathered[key]
    return out


def gather_optimizer_state(local: LocalGroup, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every sharded state tensor gathered whole (CPU; a collective)."""
    sd = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for idx in sorted(sd["state"]):
        entry = sd["state"][idx]
        state[idx] = {}
        for name in sorted(entry):
            value = entry[name]
            if isinstance(value, DTensor):
                value = gather_rows(local, value, params[idx].shape)
            state[idx][name] = value
    sd["state"] = state
    return sd


def shard_optimizer_state(local: LocalGroup, optimizer: torch.optim.Optimizer,
                          state: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """``state`` (whole tensors, as :func:`gather_optimizer_state` saved them) with each tensor of a
    sharded parameter's shape replaced by this process's rows, as a DTensor like the parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out: dict[int, dict[str, Any]] = {}
    for idx, entry in state.items():
        p = params[idx]
        out[idx] = dict(entry)
        if not isinstance(p, DTensor):
            continue
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(p.shape):
                rows = local_rows(value, local.size, local.rank).to(device=p.device, dtype=p.dtype).contiguous()
                out[idx][name] = DTensor.from_local(rows, p.device_mesh, p.placements, shape=p.shape,
                                                    stride=p.stride())
    return out


class FSDPReplica(DiLoCoReplica):
    """:class:`DiLoCoReplica` whose fragments hold FSDP shards: the exchange and the outer step work on
    this process's shards, the global state it reports and loads is whole (one-device format)."""

    def __init__(self, rep: DiLoCoReplica, local: LocalGroup) -> None:
        super().__init__(rep.manager, rep.model, rep.diloco, rep.fragments, rep.outer_optimizers)
        self.local = local
        #: whole shape of every fragment's parameter, by fragment and local name
        self.shapes: list[dict[str, torch.Size]] = [
            {name: p.shape for name, p in part.named_parameters()} for part in rep.fragments
        ]

    def flat_like(self, fragment: int) -> torch.Tensor:
        """A flat buffer shaped like this process's exchanged pseudo-gradient of ``fragment`` (its shards)."""
        globals_ = list(self.diloco._fragments[fragment].original_parameters.values())
        return torch.zeros(sum(t.numel() for t in globals_), dtype=globals_[0].dtype)

    def global_named_parameters(self) -> dict[str, torch.Tensor]:
        """The whole global parameters by model name (a collective: every local process calls it)."""
        out: dict[str, torch.Tensor] = {}
        for i, (part, fragment) in enumerate(zip(self.fragments, self.diloco._fragments)):
            for name, shard in fragment.original_parameters.items():
                out[part.names[name]] = gather_rows(self.local, shard, self.shapes[i][name])
        return out

    def _whole_shape(self, key: str) -> torch.Size | None:
        if m := _ORIGINAL.match(key):
            return self.shapes[int(m.group(1))][m.group(2)]
        if m := _MOMENTUM.match(key):
            shapes = list(self.shapes[int(m.group(1))].values())
            return shapes[int(m.group(2))]
        return None

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The global state in the one-device format (shards gathered; a collective)."""
        tensors, meta = super().state_tensors()
        for key in sorted(tensors):
            shape = self._whole_shape(key)
            if shape is not None:
                tensors[key] = gather_rows(self.local, tensors[key], shape)
        return tensors, meta

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(self.shapes[i][key.rsplit("/", 1)[-1]]) for key, i in self._global_keys().items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *,
                           source: str = "checkpoint") -> None:
        """Load a one-device state: check the whole shapes, keep this process's rows of each tensor."""
        self.check_compatible(tensors, meta, source=source)
        mine = {k: (local_rows(v, self.local.size, self.local.rank).clone() if self._whole_shape(k) is not None
                    else v) for k, v in tensors.items()}
        state = _unflatten({k: v for k, v in meta.items() if k != "fragments"}, mine)
        self.manager.load_manager_state_dict(state)
        self.reset_to_global()

