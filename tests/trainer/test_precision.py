"""model.precision in the replica: bf16 autocast with fp32 master weights, and bf16 parameters whose
global state (DiLoCo's global parameters, the outer momentum, the exchanged pseudo-gradients) stays fp32."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train import _assert_equal, _globals, _train

from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer import checkpoint as ckpt
from diloco_serverless.trainer import loop
from diloco_serverless.trainer.loop import ReplicaTrainer, _Segment
from diloco_serverless.trainer.manager import ObjectStoreManager
from support.diloco_harness import create_tiny_run, write_jsonl


def test_bf16_autocast_keeps_fp32_master_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(f"file://{tmp_path}/store", data, 1, rounds=1, **{"model.precision": '"bf16-autocast"'})
    trainer = ReplicaTrainer.from_run(url, 0)
    seen: list[tuple[bool, torch.dtype, torch.dtype]] = []
    real = loop.compose_loss

    def spy(model: torch.nn.Module, batch: dict, **kw: Any):  # type: ignore[no-untyped-def]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), logits.dtype))
        return real(model, batch, **kw)

    monkeypatch.setattr(loop, "compose_loss", spy)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with trainer.rep:
        trainer._inner_step(_Segment())
    assert seen == [(True, torch.bfloat16, torch.bfloat16)], "forward under bf16 autocast"
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}, "fp32 master weights"
    assert {s["exp_avg"].dtype for s in trainer.inner.state.values()} == {torch.float32}
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters()), "a step was taken"
    assert {t.dtype for t in _globals(trainer).values()} == {torch.float32}
    trainer.manager.shutdown()


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, tuple[Any, ReplicaTrainer]], list]:
    """Two replicas with bf16 parameters, 2 rounds of H=2, a checkpoint every round."""
    tmp = tmp_path_factory.mktemp("bf16")
    data = write_jsonl(tmp / "data.jsonl")
    url = create_tiny_run(f"file://{tmp}/store", data, 2, rounds=2, **{"model.precision": "bf16"})
    exchanged: list[torch.dtype] = []
    real = ObjectStoreManager.allreduce

    def spy(self: ObjectStoreManager, tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
        exchanged.append(tensor.dtype)
        return real(self, tensor, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ObjectStoreManager, "allreduce", spy)
        results = _train(url, [0, 1])
    return url, results, exchanged


def test_bf16_parameters_keep_the_global_state_fp32(bf16_run) -> None:  # type: ignore[no-untyped-def]
    url, results, exchanged = bf16_run
    (_, t0), (_, t1) = results[0], results[1]
    _assert_equal(_globals(t0), _globals(t1))
    assert {p.dtype for p in t0.model.parameters()} == {torch.bfloat16}, "bf16 parameters"
    assert {s["exp_avg"].dtype for s in t0.inner.state.values()} == {torch.bfloat16}, "bf16 inner AdamW"
    globals_ = _globals(t0)
    assert {t.dtype for t in globals_.values()} == {torch.float32}, "fp32 global parameters"
    assert any(not torch.equal(g, g.bfloat16().float()) for g in globals_.values()), "more than bf16 precision"
    params = dict(t0.model.named_parameters())
    for name, g in globals_.items():  # the replica continues from the new globals, rounded to bf16
        assert torch.equal(params[name].detach(), g.bfloat16()), name
    momentum = [s["momentum_buffer"] for opt in t0.rep.outer_optimizers for s in opt.state.values()]
    assert momentum and {m.dtype for m in momentum} == {torch.float32}, "fp32 outer momentum"
    assert exchanged and set(exchanged) == {torch.float32}, "fp32 pseudo-gradients exchanged and averaged"
    tensors, _ = ckpt.load_checkpoint(ObjectStore(url), 1)
    kinds = {k.split("/")[-2] if "original_parameters" in k else "momentum": v.dtype for k, v in tensors.items()
             if "original_parameters" in k or "momentum_buffer" in k}
    assert set(kinds.values()) == {torch.float32}, kinds


def test_bf16_late_replica_heals_bit_identical(bf16_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Replay of every stored round runs through the same fp32 global state: the same bits."""
    url, results, _ = bf16_run
    copy = tmp_path / "copy" / "run-test"
    shutil.copytree(url.removeprefix("file://"), copy)
    for p in (copy / "checkpoints").glob("0*"):
        shutil.rmtree(p)
    trainer = ReplicaTrainer.from_run(f"file://{copy}", 1)
    trainer.exact_resume = False  # replay, not re-training, is under test
    assert trainer.heal() == 2 and trainer.replayed == 2
    _assert_equal(_globals(trainer), _globals(results[0][1]))
    trainer.manager.shutdown()


def test_fp32_state_is_left_to_torchft(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    trainer = ReplicaTrainer.from_run(create_tiny_run(f"file://{tmp_path}/store", data, 1, rounds=1), 0)
    fragment = trainer.rep.diloco._fragments[0]
    assert "_set_grads" not in vars(fragment) and "save_parameters" not in vars(fragment)
    assert fragment._outer_optimizer is trainer.rep.outer_optimizers[0]
    assert trainer._fused and trainer.inner.param_groups[0]["fused"], "fused AdamW on the CPU"
    trainer.manager.shutdown()
