"""One-step-delay DiLoCo (outer.delay = 1): bit-identical global state, the delayed math, the overlap, resume."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from diloco_serverless.config import RunConfig
from diloco_serverless.errors import ConfigError
from diloco_serverless.testing import MockGroup, MockManager
from diloco_serverless.trainer.diloco import DiLoCoReplica, build_diloco
from diloco_serverless.trainer.loop import ReplicaTrainer
from diloco_serverless.trainer.manager import ExchangeRecord
from diloco_serverless.trainer.overlap import DelayedOuterStep, apply_last_update, enable_delay
from support.crash_harness import run_two_with_crash
from support.diloco_harness import assert_close_params, assert_identical, inner_step, make_inner, tiny_model


class DelayedMock(DelayedOuterStep, MockManager):
    """The in-process manager with delayed outer updates; ``exchange_sleep_s`` makes each exchange slow."""

    exchange_sleep_s = 0.0

    def _exchange(self, tensor: torch.Tensor, round_: int, residual_key: str,
                  record: ExchangeRecord) -> torch.Tensor:
        out = super()._exchange(tensor, round_, residual_key, record)
        time.sleep(self.exchange_sleep_s)
        return out


def _run(base: nn.Module, managers: list[DelayedMock], *, rounds: int, h: int, eager: bool,
         steps_seen: list[list[int]] | None = None) -> list[DiLoCoReplica]:
    out: list[DiLoCoReplica | None] = [None] * len(managers)
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            model = copy.deepcopy(base)
            opt = make_inner(model)
            rep = build_diloco(managers[rank], model, opt, sync_every=h, outer_lr=0.7, outer_momentum=0.9)
            enable_delay(rep, eager=eager)
            gen = torch.Generator().manual_seed(100 + rank)
            with rep:
                while managers[rank].current_step() < rounds:
                    inner_step(model, opt, gen)
                    if steps_seen is not None:
                        steps_seen[rank].append(len([r for r in managers[rank].history if r.exchange_s > 0]))
            assert apply_last_update(rep) and not apply_last_update(rep)  # once
            managers[rank].shutdown()
            out[rank] = rep
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(len(managers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return [r for r in out if r is not None]


def _reference(base: nn.Module, world: int, *, rounds: int, h: int, eager: bool) -> dict[str, torch.Tensor]:
    """The delayed algorithm in plain torch: round r's average is applied at the end of round r+1 (zeros at
    round 0, the last one after the last round); eager replicas start from global + their own progress."""
    models = [copy.deepcopy(base) for _ in range(world)]
    opts = [make_inner(m) for m in models]
    gens = [torch.Generator().manual_seed(100 + r) for r in range(world)]
    glob = {n: p.detach().clone().requires_grad_(True) for n, p in base.named_parameters()}
    outer = torch.optim.SGD(list(glob.values()), lr=0.7, momentum=0.9, nesterov=True)
    starts = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]
    previous = {n: torch.zeros_like(p) for n, p in glob.items()}

    def step(avg: dict[str, torch.Tensor]) -> None:
        for n, p in glob.items():
            p.grad = avg[n].clone()
        outer.step()
        outer.zero_grad()

    for _ in range(rounds):
        progress = []
        for m, o, g, s in zip(models, opts, gens, starts):
            for _ in range(h):
                inner_step(m, o, g)
            progress.append({n: (s[n] - p.detach()) for n, p in m.named_parameters()})
        step(previous)
        previous = {n: torch.stack([pg[n] for pg in progress]).mean(0) for n in glob}
        for m, s, pg in zip(models, starts, progress):
            with torch.no_grad():
                for n, p in m.named_parameters():
                    p.copy_(glob[n] - pg[n] if eager else glob[n])
                    s[n] = p.detach().clone()
    step(previous)
    return {n: p.detach() for n, p in glob.items()}


@pytest.mark.parametrize("eager", [True, False])
def test_delayed_rounds_are_bit_identical_and_match_the_reference(eager: bool) -> None:
    base = tiny_model(3)
    group = MockGroup(2)
    reps = _run(base, [DelayedMock(group, r) for r in range(2)], rounds=4, h=3, eager=eager)
    assert_identical(reps)
    assert_close_params(reps[0].global_named_parameters(), _reference(base, 2, rounds=4, h=3, eager=eager))
    # the eager and plain variants differ (the start offset is used), and both differ from no delay
    other = _reference(base, 2, rounds=4, h=3, eager=not eager)
    assert any(not torch.allclose(reps[0].global_named_parameters()[k], other[k]) for k in other)
    assert [r.round for r in reps[0].manager.history] == [0, 1, 2, 3]


def test_the_exchange_runs_while_the_next_round_computes() -> None:
    """Each exchange sleeps 0.3 s; the replicas take inner steps of the next round meanwhile (plain DiLoCo
    would block at the boundary): at most the first steps of a round see the previous exchange unfinished."""
    group = MockGroup(2)
    managers = [DelayedMock(group, r) for r in range(2)]
    for m in managers:
        m.exchange_sleep_s = 0.3
    seen: list[list[int]] = [[], []]
    reps = _run(tiny_model(4), managers, rounds=3, h=4, eager=True, steps_seen=seen)
    assert_identical(reps)
    # steps 5-8 (round 1) ran while round 0's exchange (finished count 0) was still sleeping
    assert seen[0][4] == 0, seen[0]
    blocked = [r.blocked_s for r in managers[0].history]
    assert max(blocked) < 0.3 + 0.25, blocked  # waited at most for the remainder of one exchange


def test_replay_reaches_the_same_global_state() -> None:
    """A replica that replays the stored rounds (healing) ends with the bits of those that trained them."""
    base = tiny_model(5)
    group = MockGroup(2)
    reps = _run(base, [DelayedMock(group, r) for r in range(2)], rounds=3, h=2, eager=True)
    healer = DelayedMock(group, 0)
    model = copy.deepcopy(base)
    rep = build_diloco(healer, model, make_inner(model), sync_every=2, outer_lr=0.7, outer_momentum=0.9)
    enable_delay(rep, eager=True)
    assert rep.catch_up() == 3 and apply_last_update(rep)
    assert_identical([reps[0], rep])


def test_prune_keeps_the_round_a_resume_needs() -> None:
    group = MockGroup(1)
    m = DelayedMock(group, 0)
    group.reduced.update({r: (torch.zeros(2), [0]) for r in range(5)})
    m.prune(4)
    assert sorted(group.reduced) == [3, 4]


def test_config_refuses_delay_with_fragments() -> None:
    with pytest.raises(ConfigError, match="outer.delay = 1 overlaps whole-model rounds"):
        RunConfig.load(None, ["run_id=x", "outer.delay=1", "exchange.fragments=2", "inner.sync_every=4"])
    assert RunConfig.load(None, ["run_id=x", "outer.delay=1"]).outer.eager


@pytest.mark.slow
def test_replica_loop_with_delay_is_identical_and_resumes_exactly(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The real replica loop (file:// store, 2 replicas in threads) with outer.delay = 1: global state
    bit-identical across replicas, and a replica killed mid-round resumes to the same bits."""
    from diloco_serverless.store.objectstore import ObjectStore
    from diloco_serverless.trainer import checkpoint as ckpt
    from support.diloco_harness import create_tiny_run, write_jsonl

    data = write_jsonl(tmp_path / "data.jsonl")
    kw = {"rounds": 3, "checkpoint_every": 1, "outer.delay": 1}
    ref_url = create_tiny_run(f"file://{tmp_path}/ref", data, 2, **kw)
    crash_url = create_tiny_run(f"file://{tmp_path}/crash", data, 2, **kw)
    reference = run_two_with_crash(ref_url, None, monkeypatch)
    _assert_equal(_globals(reference[0]), _globals(reference[1]))
    assert all(isinstance(t.manager, DelayedOuterStep) and t.manager._flushed for t in reference.values())
    ObjectStore(crash_url).put(ckpt.INITIAL_KEY, ObjectStore(ref_url).get(ckpt.INITIAL_KEY))
    crashed = run_two_with_crash(crash_url, 6, monkeypatch)  # H=2: the 2nd inner step of round 2
    assert crashed[1].attempt == 1
    for rank in (0, 1):
        _assert_equal(_globals(crashed[rank]), _globals(reference[rank]))


def _globals(trainer: ReplicaTrainer) -> dict[str, torch.Tensor]:
    return trainer.rep.global_named_parameters()


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"
