"""exchange.fragment_merge = "eager": the tau steps trained during the exchange are kept, not discarded."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch
from test_train import _assert_equal
from torch import nn

from diloco_serverless.config import RunConfig
from diloco_serverless.errors import ConfigError
from diloco_serverless.testing import MockGroup, MockManager
from diloco_serverless.trainer.diloco import DiLoCoReplica, build_diloco
from diloco_serverless.trainer.fragment_merge import EagerFragmentMerge, enable_fragment_merge
from support.crash_harness import run_two_with_crash
from support.diloco_harness import (
    assert_close_params,
    assert_identical,
    inner_step,
    make_inner,
    run_replicas,
    tiny_model,
)


def _run(base: nn.Module, world: int, *, rounds: int, h: int, tau: int, merge: str,
         after_sync: list[list[dict[str, torch.Tensor]]] | None = None) -> list[DiLoCoReplica]:
    """``world`` replicas in threads over the in-process manager (outer lr 0.7, Nesterov 0.9);
    ``after_sync[rank]`` gets the replica's parameters after each round's sync."""
    group = MockGroup(world)
    return run_replicas(base, lambda rank: MockManager(group, rank), world, rounds=rounds, sync_every=h,
                        delay=tau, merge=merge, after_sync=after_sync)


def _reference(base: nn.Module, world: int, *, rounds: int, h: int, tau: int, merge: str
               ) -> tuple[dict[str, torch.Tensor], list[list[dict[str, torch.Tensor]]]]:
    """Plain torch: the pseudo-gradient ``global - theta`` after ``h - tau`` steps, averaged, one Nesterov
    outer step; then each replica becomes the new global (replace) or new global + (theta_sync -
    theta_prepare) (eager). Returns the global parameters and each replica's parameters after each sync."""
    models = [copy.deepcopy(base) for _ in range(world)]
    opts = [make_inner(m) for m in models]
    gens = [torch.Generator().manual_seed(100 + r) for r in range(world)]
    glob = {n: p.detach().clone().requires_grad_(True) for n, p in base.named_parameters()}
    outer = torch.optim.SGD(list(glob.values()), lr=0.7, momentum=0.9, nesterov=True)
    after: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(world)]
    for _ in range(rounds):
        pgs, snaps = [], []
        for m, o, g in zip(models, opts, gens):
            for step in range(1, h + 1):
                inner_step(m, o, g)
                if step == h - tau:
                    pgs.append({n: glob[n].detach() - p.detach() for n, p in m.named_parameters()})
                    snaps.append({n: p.detach().clone() for n, p in m.named_parameters()})
        for n, p in glob.items():
            p.grad = torch.stack([pg[n] for pg in pgs]).mean(0)
        outer.step()
        outer.zero_grad()
        for rank, (m, snap) in enumerate(zip(models, snaps)):
            with torch.no_grad():
                for n, p in m.named_parameters():
                    progress = p.detach() - snap[n]
                    p.copy_(glob[n])
                    if merge == "eager":
                        p.add_(progress)
            after[rank].append({n: p.detach().clone() for n, p in m.named_parameters()})
    return {n: p.detach() for n, p in glob.items()}, after


@pytest.mark.parametrize("merge", ["eager", "replace"])
def test_global_state_is_bit_identical_and_matches_the_reference(merge: str) -> None:
    base = tiny_model(7)
    reps = _run(base, 2, rounds=4, h=4, tau=2, merge=merge)
    assert_identical(reps)
    want, _ = _reference(base, 2, rounds=4, h=4, tau=2, merge=merge)
    assert_close_params(reps[0].global_named_parameters(), want)
    other, _ = _reference(base, 2, rounds=4, h=4, tau=2, merge="replace" if merge == "eager" else "eager")
    assert any(not torch.allclose(want[k], other[k]) for k in want)  # the merge changes the training


def test_the_merge_is_new_global_plus_own_progress_since_prepare() -> None:
    """After every sync an eager replica's parameters are, bit for bit, the new global parameters plus
    what it trained between the prepare and the sync; a replacing replica's are the global ones."""
    base = tiny_model(8)
    seen: list[list[dict[str, torch.Tensor]]] = [[], []]
    reps = _run(base, 2, rounds=3, h=5, tau=3, merge="eager", after_sync=seen)
    _, want = _reference(base, 2, rounds=3, h=5, tau=3, merge="eager")
    for rank in (0, 1):
        assert len(seen[rank]) == 3
        for got, exp in zip(seen[rank], want[rank]):
            assert_close_params(got, exp)
    glob = reps[1].global_named_parameters()
    merge = reps[1].diloco._fragments[0].perform_sync.__self__
    assert isinstance(merge, EagerFragmentMerge)
    for name, param in reps[1].fragments[0].named_parameters():
        model_name = reps[1].fragments[0].names[name]
        assert torch.equal(param.detach(), glob[model_name] + merge.offset[name])  # exactly
        assert merge.offset[name].abs().sum() > 0
    plain: list[list[dict[str, torch.Tensor]]] = [[], []]
    reps = _run(base, 2, rounds=2, h=5, tau=3, merge="replace", after_sync=plain)
    glob = reps[0].global_named_parameters()
    assert all(torch.equal(plain[0][-1][n], glob[n]) for n in glob)


def test_replay_drops_the_offset_and_reaches_the_same_global_state() -> None:
    base = tiny_model(9)
    group = MockGroup(2)
    reps: list[DiLoCoReplica] = []

    def worker(rank: int) -> None:
        manager = MockManager(group, rank)
        model = copy.deepcopy(base)
        rep = build_diloco(manager, model, make_inner(model), sync_every=3, fragment_sync_delay=1)
        enable_fragment_merge(rep, "eager")
        gen = torch.Generator().manual_seed(100 + rank)
        with rep:
            while manager.current_step() < 3:
                inner_step(model, rep.diloco._local_optimizer, gen)
        reps.append(rep)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    healer_model = copy.deepcopy(base)
    healer = build_diloco(MockManager(group, 0), healer_model, make_inner(healer_model), sync_every=3,
                          fragment_sync_delay=1)
    merge = enable_fragment_merge(healer, "eager")
    assert merge is not None and healer.catch_up() == 3
    assert_identical([reps[0], healer])
    assert merge.offset == {}
    glob = healer.global_named_parameters()
    assert all(torch.equal(p.detach(), glob[n]) for n, p in healer_model.named_parameters())


def test_config_accepts_one_fragment_with_a_delay_and_refuses_the_rest() -> None:
    cfg = RunConfig.load(None, ["run_id=x", "inner.sync_every=8", "exchange.fragment_sync_delay=2",
                                "exchange.fragment_merge=eager"])
    assert cfg.exchange.fragments == 1 and cfg.exchange.fragment_merge == "eager"
    assert RunConfig.load(None, ["run_id=x", "inner.sync_every=8",
                                 "exchange.fragment_sync_delay=3"]).exchange.fragment_merge == "replace"
    with pytest.raises(ConfigError, match=r"needs exchange.fragment_sync_delay > 0.*got 0, 1, 1"):
        RunConfig.load(None, ["run_id=x", "exchange.fragment_merge=eager"])
    with pytest.raises(ConfigError, match=r"exchange.fragments = 1.*got 1, 2, 1"):
        RunConfig.load(None, ["run_id=x", "inner.sync_every=8", "exchange.fragments=2",
                              "exchange.fragment_sync_delay=1", "exchange.fragment_merge=eager"])
    with pytest.raises(ConfigError, match=r"parallel.devices = 1.*got 2, 1, 2"):
        RunConfig.load(None, ["run_id=x", "inner.sync_every=8", "exchange.fragment_sync_delay=2",
                              "exchange.fragment_merge=eager", "parallel.devices=2"])
    with pytest.raises(ConfigError, match="fragment_merge"):
        RunConfig.load(None, ["run_id=x", "inner.sync_every=8", "exchange.fragment_sync_delay=2",
                              "exchange.fragment_merge=keep"])
    with pytest.raises(ValueError, match="needs exchange.fragment_sync_delay > 0"):
        model = tiny_model(0)
        enable_fragment_merge(build_diloco(MockManager(MockGroup(1), 0), model, make_inner(model), sync_every=2),
                              "eager")


@pytest.mark.slow
def test_replica_loop_with_eager_merge_is_identical_and_resumes_exactly(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The real replica loop (file:// store, 2 replicas in threads), H = 4, tau = 2, eager merge: global state
    bit-identical across replicas, and rank 1 killed between a round's prepare and its sync resumes from the
    checkpoint (its saved offset included) to the fault-free bits."""
    from diloco_serverless.store.objectstore import ObjectStore
    from diloco_serverless.trainer import checkpoint as ckpt
    from support.diloco_harness import create_tiny_run, write_jsonl

    data = write_jsonl(tmp_path / "data.jsonl")
    kw = {"rounds": 3, "sync_every": 4, "checkpoint_every": 1, "exchange.fragment_sync_delay": 2,
          "exchange.fragment_merge": "eager"}
    ref_url = create_tiny_run(f"file://{tmp_path}/ref", data, 2, **kw)
    reference = run_two_with_crash(ref_url, None, monkeypatch)
    _assert_equal(reference[0].rep.global_named_parameters(), reference[1].rep.global_named_parameters())
    assert all(isinstance(t.merge, EagerFragmentMerge) and t.merge.offset for t in reference.values())
    # round 2's 1st step (its pseudo-gradient is computed again after the restart, from the checkpoint of
    # round 1 plus rank 1's saved offset), and its 3rd (after its prepare: the contribution is stored)
    for crash_at in (9, 11):
        crash_url = create_tiny_run(f"file://{tmp_path}/crash{crash_at}", data, 2, **kw)
        ObjectStore(crash_url).put(ckpt.INITIAL_KEY, ObjectStore(ref_url).get(ckpt.INITIAL_KEY))
        crashed = run_two_with_crash(crash_url, crash_at, monkeypatch)
        assert crashed[1].attempt == 1
        for rank in (0, 1):
            _assert_equal(crashed[rank].rep.global_named_parameters(),
                          reference[rank].rep.global_named_parameters())
