"""The G local processes of one multi-device replica (``parallel.devices = G``) and their collectives.

The replica entrypoint starts G processes with ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (:mod:`diloco_serverless.entrypoints.local_group`);
:meth:`LocalGroup.from_env` joins them in a ``torch.distributed`` process group (nccl on CUDA, gloo
on CPU) for the gradient all-reduce of the inner steps, plus two gloo groups over CPU tensors: one
for the exchange thread (reassembling the reduced slices), one for the train loop's control
decisions, so that the two threads never share a group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from diloco_serverless.exchange._io import shard_bounds

__all__ = ["LOCAL_RANK_ENV", "LOCAL_WORLD_SIZE_ENV", "LocalGroup"]

LOCAL_RANK_ENV = "LOCAL_RANK"
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"


@dataclass
class LocalGroup:
    """This process's place in its replica: local rank ``rank`` of ``size``."""

    rank: int
    size: int
    exchange_group: Any  # gloo ProcessGroup used only by the exchange thread
    control_group: Any  # gloo ProcessGroup used only by the train loop's thread

    @classmethod
    def from_env(cls, device: torch.device, *, timeout_s: float = 1800.0) -> LocalGroup | None:
        """Join the replica's local group described by the environment; ``None`` when this process
        is the replica's only one (no ``LOCAL_WORLD_SIZE`` or 1). ValueError names a bad variable."""
        size = _env_int(LOCAL_WORLD_SIZE_ENV, 1)
        if size <= 1:
            return None
        rank = _env_int(LOCAL_RANK_ENV, -1)
        if not 0 <= rank < size:
            raise ValueError(f"{LOCAL_RANK_ENV} must be in 0..{size - 1} when {LOCAL_WORLD_SIZE_ENV}={size}, "
                             f"got {os.environ.get(LOCAL_RANK_ENV)!r}")
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise ValueError(f"{name} must be set for a replica's local processes (the entrypoint sets it)")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s))
        return cls(rank, size, dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))

    # ------------------------------------------------------------------ inner steps (train loop thread)
    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's ``.grad`` over the local processes (missing grads count as zero),
        one flat all-reduce per dtype: afterwards each process holds the whole batch's gradient."""
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group if p.grad is not None])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in group:
                assert p.grad is not None
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the local processes (default group, the tensor's device)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def leader_int(self, value: int) -> int:
        """Local rank 0's ``value`` on every local process (control group): one decision per replica."""
        t = torch.tensor([value], dtype=torch.long)
        dist.broadcast(t, src=0, group=self.control_group)
        return int(t.item())

    def flags_control(self, flag: bool) -> list[bool]:
        """Every local process's ``flag``, by local rank (control group, the train loop's thread)."""
        t = torch.tensor([int(flag)], dtype=torch.long)
        out = [torch.zeros(1, dtype=torch.long) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.control_group)
        return [bool(x.item()) for x in out]

    # ------------------------------------------------------------------ the exchange (exchange thread)
    def flags(self, flag: bool) -> list[bool]:
        """Every local process's ``flag``, by local rank (exchange group)."""
        t = torch.tensor([int(flag)], dtype=torch.long)
        out = [torch.zeros(1, dtype=torch.long) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.exchange_group)
        return [bool(x.item()) for x in out]

    def sums(self, values: list[int]) -> list[int]:
        """``values`` summed element-wise over the local processes (exchange group)."""
        t = torch.tensor(values, dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.exchange_group)
        return [int(v) for v in t.tolist()]

    def slice_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This process's slice of a flat tensor (slice g of G, as :func:`shard_bounds` cuts it)."""
        a, b = shard_bounds(flat.numel(), self.size)[self.rank]
        return flat.reshape(-1)[a:b]

    def gather_slices(self, part: torch.Tensor, numel: int, *, control: bool = False) -> torch.Tensor:
        """The flat fp32 CPU tensor of ``numel`` elements whose slice g is local rank g's ``part``
        (over the exchange group, or the control group from the train loop's thread)."""
        bounds = shard_bounds(numel, self.size)
        width = max(b - a for a, b in bounds)
        mine = torch.zeros(width, dtype=torch.float32)
        mine[: part.numel()] = part.reshape(-1).to(device="cpu", dtype=torch.float32)
        out = [torch.empty(width, dtype=torch.float32) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.control_group if control else self.exchange_group)
        return torch.cat([o[: b - a] for o, (a, b) in zip(out, bounds)])

    def close(self) -> None:
        """Leave the process group (end of the replica)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    if not raw.strip().isdigit():
        raise ValueError(f"{name} must be a non-negative integer, got {raw!r}")
    return int(raw)
