"""torchft's bucketization boundary bug, and proof that our wiring averages every parameter.

torchft-nightly 2026.10.26 ``_StreamingDiLoCoFragment._bucketize_and_allreduce`` advances its offset
by the bucket size while packing only whole tensors: a tensor that would cross a bucket boundary
is deferred, and the last tensors are never packed at all, so they are silently not averaged.
``build_diloco`` uses one bucket as large as the fragment (one flat buffer per round).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn
from torchft.local_sgd import DiLoCo
from torchft.work import _DummyWork

from diloco_serverless.testing import MockGroup, MockManager
from diloco_serverless.trainer.diloco import build_diloco


def odd_model() -> nn.Module:
    """Tensor sizes 91, 13, 65, 5, 15, 3 (768 bytes): misaligned with any power-of-two bucket."""
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(7, 13), nn.Linear(13, 5), nn.Linear(5, 3))


class _MarkingManager:
    """Records allreduce calls and overwrites every reduced tensor with 7.0."""

    _use_async_quorum = False

    def __init__(self) -> None:
        self.calls: list[int] = []

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> _DummyWork:
        self.calls.append(tensor.numel())
        tensor.fill_(7.0)
        return _DummyWork(tensor)

    def register_state_dict_fn(self, *args: object) -> None:
        pass

    def start_quorum(self) -> None:
        pass

    def current_step(self) -> int:
        return 0


def test_torchft_small_buckets_skip_tensors_at_the_end() -> None:
    model = odd_model()
    manager = _MarkingManager()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    diloco = DiLoCo(manager, [model], inner, outer, sync_every=2, use_bucketization=True,  # type: ignore[arg-type]
                    bucket_cap_mb=400 / 2**20, pin_memory=False)
    fragment = diloco._fragments[0]
    fragment.prepare_sync()
    unreduced = [name for name, g in fragment._grads.items() if not bool((g == 7.0).all())]
    if not unreduced:
        pytest.skip("torchft no longer drops tensors at bucket boundaries")
    assert unreduced == ["2.weight", "2.bias"], unreduced
    assert len(manager.calls) == 2


def test_every_parameter_is_averaged_with_fragment_sized_bucket() -> None:
    """Outer SGD with lr=1, no momentum: new global == mean of the replicas' local parameters, for every tensor."""
    base = odd_model()
    world = 3
    group = MockGroup(world)
    locals_: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    results: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]

    def worker(rank: int) -> None:
        model = copy.deepcopy(base)
        inner = torch.optim.SGD(model.parameters(), lr=0.5)

        def capture(*_: object) -> None:  # runs before DiLoCo's hook (registered first)
            locals_[rank].update({n: p.detach().clone() for n, p in model.named_parameters()})

        inner.register_step_post_hook(capture)
        manager = MockManager(group, rank)
        rep = build_diloco(manager, model, inner, sync_every=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
        gen = torch.Generator().manual_seed(rank)
        with rep:
            x = torch.randn(4, 7, generator=gen)
            inner.zero_grad()
            model(x).pow(2).sum().backward()
            inner.step()
        assert [h.numel for h in manager.history] == [sum(p.numel() for p in model.parameters())]
        results[rank] = rep.global_named_parameters()
        manager.shutdown()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for name, p0 in base.named_parameters():
        mean = torch.stack([loc[name] for loc in locals_]).mean(0)
        assert not torch.equal(locals_[0][name], locals_[1][name]), f"{name}: replicas did not diverge"
        assert not torch.allclose(results[0][name], p0.detach()), f"{name} was not updated"
        torch.testing.assert_close(results[0][name], mean, atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        for r in range(1, world):
            assert torch.equal(results[r][name], results[0][name])
