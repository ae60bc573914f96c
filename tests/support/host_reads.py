"""Count reads of tensor values into Python (host-device syncs on a GPU) made by this package's code.

``with HostReads() as reads: ...`` records every ``item``, ``bool``/``int``/``float`` of a tensor,
``tolist``, ``nonzero``, ``torch.equal``, boolean-mask indexing, ... whose nearest caller outside torch
is in ``diloco_serverless`` (torch functions it calls, such as the optimizer or ``clip_grad_norm_``,
count for the caller; reads made inside transformers' models do not count). ``reads.sites`` lists
them as ``"module.py:line"``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.numpy,
    torch.equal, torch.Tensor.equal, torch.masked_select, torch.Tensor.masked_select, torch.argwhere,
    torch.Tensor.argwhere, torch.unique, torch.Tensor.unique,
}


def _is_read(func: Any, args: tuple[Any, ...]) -> bool:
    if func in _READS:
        return True
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in index)
    return False


class HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if _is_read(func, args):
            frame = sys._getframe(1)
            while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
                frame = frame.f_back  # type: ignore[assignment]
            if frame is not None and "/diloco_serverless/" in frame.f_code.co_filename:
                name = frame.f_code.co_filename.rsplit("/diloco_serverless/", 1)[1]
                self.sites.append(f"{name}:{frame.f_lineno}")
        return func(*args, **(kwargs or {}))

    def __len__(self) -> int:
        return len(self.sites)
