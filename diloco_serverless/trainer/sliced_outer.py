"""The outer optimizer of a multi-device replica, sharded over its local processes.

DiLoCo's outer step is Nesterov-momentum SGD on the global parameters, element-wise. In a replica
of G local processes (``parallel.devices``) each process keeps the momentum of one slice (1/G) of
a fragment's flat parameters only — the same slice it exchanges — updates that slice, and the G
updated slices are all-gathered so every process ends the round with the same whole global
parameters. The arithmetic is ``torch.optim.SGD``'s, element for element.

Checkpoints keep the format of a one-device replica: :meth:`SlicedOuterSGD.state_dict` gathers the
momentum slices into the ``torch.optim.SGD`` state dict (every local process must call it, local
rank 0 writes it), and :meth:`SlicedOuterSGD.load_state_dict` keeps this process's slice: a
checkpoint has the same format whatever ``parallel.devices`` is.
"""

from __future__ import annotations

from typing import Any

import torch

from diloco_serverless.exchange._io import shard_bounds
from diloco_serverless.trainer.diloco import DiLoCoReplica
from diloco_serverless.trainer.local_group import LocalGroup

__all__ = ["SlicedOuterSGD", "shard_outer_optimizers"]


class SlicedOuterSGD:
    """Drop-in for a fragment's ``torch.optim.SGD`` outer optimizer (``step``, ``zero_grad``,
    ``state_dict``, ``load_state_dict``, ``param_groups``, ``defaults``); see the module docstring."""

    def __init__(self, base: torch.optim.SGD, local: LocalGroup) -> None:
        if len(base.param_groups) != 1:
            raise ValueError(f"the outer optimizer has {len(base.param_groups)} parameter groups; expected 1")
        self.base, self.local = base, local
        self.params: list[torch.Tensor] = list(base.param_groups[0]["params"])
        self.defaults, self.param_groups = base.defaults, base.param_groups
        self.numel = sum(p.numel() for p in self.params)
        self.bounds = shard_bounds(self.numel, local.size)
        #: momentum of this process's slice (fp32, CPU); None before the first step
        self.momentum: torch.Tensor | None = None

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in tensors])

    @torch.no_grad()
    def step(self) -> None:
        """``torch.optim.SGD.step`` on this process's slice, then the slices all-gathered into the parameters."""
        hp = self.param_groups[0]
        a, b = self.bounds[self.local.rank]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        grad = self._flat(grads)[a:b]
        param = self._flat(self.params)[a:b].clone()
        if hp.get("maximize"):
            grad = -grad
        if hp["weight_decay"] != 0:
            grad = grad.add(param, alpha=hp["weight_decay"])
        momentum = hp["momentum"]
        if momentum != 0:
            if self.momentum is None:
                self.momentum = torch.clone(grad).detach()
            else:
                self.momentum.mul_(momentum).add_(grad, alpha=1 - hp["dampening"])
            grad = grad.add(self.momentum, alpha=momentum) if hp["nesterov"] else self.momentum
        param.add_(grad, alpha=-hp["lr"])
        whole = self.local.gather_slices(param, self.numel, control=True)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(whole[offset : offset + n].view_as(p))
            offset += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The ``torch.optim.SGD`` state dict of the whole fragment (a collective: every local process calls it)."""
        sd = self.base.state_dict()
        started = self.local.flags_control(self.momentum is not None)
        if not all(started):
            sd["state"] = {}
            return sd
        assert self.momentum is not None
        whole = self.local.gather_slices(self.momentum, self.numel, control=True)
        state: dict[int, dict[str, torch.Tensor]] = {}
        offset = 0
        for i, p in enumerate(self.params):
            n = p.numel()
            state[i] = {"momentum_buffer": whole[offset : offset + n].view_as(p).to(p.dtype).clone()}
            offset += n
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim.SGD`` state dict of the whole fragment: keep this process's momentum slice."""
        self.base.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self.param_groups = self.base.param_groups
        state = state_dict.get("state") or {}
        if not state:
            self.momentum = None
            return
        a, b = self.bounds[self.local.rank]
        bufs = [state[i]["momentum_buffer"] for i in range(len(self.params))]
        self.momentum = self._flat(bufs)[a:b].clone()


def shard_outer_optimizers(rep: DiLoCoReplica, local: LocalGroup) -> None:
    """Replace every fragment's outer optimizer by a :class:`SlicedOuterSGD` over the same parameters."""
    for i, frag in enumerate(rep.diloco._fragments):
        sliced = SlicedOuterSGD(frag._outer_optimizer, local)
        frag._outer_optimizer = sliced  # duck-typed: torchft calls step, zero_grad, state_dict, load_state_dict
        rep.outer_optimizers[i] = sliced  # type: ignore[call-overload]
