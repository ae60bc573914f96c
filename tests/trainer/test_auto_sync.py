"""inner.sync_every = "auto" in the replica loop (replicas in threads, file:// store): every replica runs the
H of the stored plans, a forged plan is refused, and a crashed replica resumes exactly with the plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diloco_serverless.cli.render import totals_line
from diloco_serverless.config import RunConfig
from diloco_serverless.launcher.api import Run
from diloco_serverless.run.integrity import RUN_KEY_ENV, mac_json
from diloco_serverless.run.layout import SYNC_PLAN_PREFIX, sync_plan_key
from diloco_serverless.run.members import read_metrics
from diloco_serverless.run.record import create_run
from diloco_serverless.run.sync_plan import PLAN_KIND, PlanRefused, read_plan
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer import checkpoint as ckpt
from diloco_serverless.trainer.loop import ReplicaTrainer
from support.crash_harness import run_two_with_crash
from support.diloco_harness import tiny_run_overrides, write_jsonl

AUTO = {"inner.auto_sync": "true", "inner.auto_sync_min": 1, "inner.auto_sync_max": 6}


def _create(store_url: str, data: str, *, key: bytes | None = None, **kw: object) -> str:
    cfg = RunConfig.load(None, ["run_id=run-auto", *tiny_run_overrides(data, 2, **{**AUTO, **kw})])
    store, _ = create_run(store_url, cfg, key=key)
    return store.url


def _plans(url: str) -> list:
    store = ObjectStore(url)
    keys = store.list(SYNC_PLAN_PREFIX + "/")
    return [read_plan(store, r, None) for r in range(len(keys))]


def _assert_same_globals(a: ReplicaTrainer, b: ReplicaTrainer) -> None:
    ga, gb = a.rep.global_named_parameters(), b.rep.global_named_parameters()
    assert ga.keys() == gb.keys()
    for k in ga:
        assert torch.equal(ga[k], gb[k]), f"{k} differs"


@pytest.mark.slow
def test_replicas_of_different_speeds_run_the_stored_h_of_every_round(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    url = _create(f"file://{tmp_path}/store", data, rounds=4, sync_every=2)  # 8 inner steps, starting at H = 2
    out = run_two_with_crash(url, None, monkeypatch, slow_rank=1)
    plans = _plans(url)
    # rank 0 plans one round ahead: rounds 0 and 1 at the first H, from round 2 on from its timings; the
    # rounds tile the run's 8 inner steps exactly, the last one cut to what is left
    assert [(p.h, p.reason, p.compute_s) for p in plans[:2]] == [(2, "initial", None), (2, "initial", None)]
    assert len(plans) >= 3 and all(p.compute_s is not None and p.exchange_s is not None for p in plans[2:])
    assert [p.start for p in plans] == [sum(q.h for q in plans[:i]) for i in range(len(plans))]
    assert plans[-1].end == 8 and plans[-1].last and not any(p.last for p in plans[:-1])
    assert all(1 <= p.h <= 6 for p in plans)
    for rank in (0, 1):
        assert out[rank].manager.current_step() == len(plans)
        assert out[rank].inner_steps == 8
        metrics = sorted(read_metrics(ObjectStore(url), rank), key=lambda m: m["outer_round"])
        assert [m["inner_steps"] for m in metrics] == [p.h for p in plans]  # what each replica trained
        assert [m["sync_every"] for m in metrics] == [p.h for p in plans]
        assert [m["sync_every_reason"] for m in metrics] == [p.reason for p in plans]
    _assert_same_globals(out[0], out[1])
    status = Run.attach(url).status()  # diloco status: the newest plan's H and why
    assert status.sync_every == (plans[-1].h, plans[-1].reason)
    assert f"H {plans[-1].h} ({plans[-1].reason})" in totals_line(status)


def test_a_forged_plan_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = b"r" * 32
    monkeypatch.setenv(RUN_KEY_ENV, key.hex())
    data = write_jsonl(tmp_path / "data.jsonl")
    url = _create(f"file://{tmp_path}/store", data, key=key, rounds=2, sync_every=2)
    doc = {"round": 0, "h": 6, "start": 0, "last": False, "reason": "drift", "compute_s": None, "exchange_s": None}
    forged = {**mac_json(key, PLAN_KIND, doc, place=sync_plan_key(0)), "h": 1}  # signed, then altered
    ObjectStore(url).put(sync_plan_key(0), json.dumps(forged).encode())
    trainer = ReplicaTrainer.from_run(url, 1)
    with pytest.raises(PlanRefused, match="does not verify"):
        trainer.run()
    assert trainer.inner_steps == 0


@pytest.mark.slow
def test_a_crashed_replica_resumes_exactly_with_the_stored_plans(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference run decides its H; the crash run starts with the reference's plans stored (so both
    train the same rounds: rank 0 uses a stored plan rather than deciding), rank 1 dies mid-round 1 and
    resumes from its checkpointed state: both end with the reference's bits."""
    data = write_jsonl(tmp_path / "data.jsonl")
    ref_url = _create(f"file://{tmp_path}/ref", data, rounds=4, sync_every=2)
    crash_url = _create(f"file://{tmp_path}/crash", data, rounds=4, sync_every=2)
    reference = run_two_with_crash(ref_url, None, monkeypatch)
    ref_store, crash_store = ObjectStore(ref_url), ObjectStore(crash_url)
    crash_store.put(ckpt.INITIAL_KEY, ref_store.get(ckpt.INITIAL_KEY))  # threads share torch's RNG
    for key in ref_store.list(SYNC_PLAN_PREFIX + "/"):
        crash_store.put(key, ref_store.get(key))
    plans = _plans(ref_url)
    assert len(plans) >= 2
    crashed = run_two_with_crash(crash_url, plans[0].h + 1, monkeypatch)  # round 1's 1st step
    assert crashed[1].attempt == 1
    assert _plans(crash_url) == plans
    for rank in (0, 1):
        _assert_same_globals(crashed[rank], reference[rank])
        assert crashed[rank].inner_steps == 8


def test_eval_and_checkpoint_cadence_counts_inner_steps_of_the_first_h(tmp_path: Path) -> None:
    """With auto H, eval_every / checkpoint_every = k fire at the first round boundary past every k x sync_every
    inner steps, whatever H the rounds ran: the same replicas agree (the plans say it), and short rounds do not
    multiply the evaluations."""
    from diloco_serverless.run.sync_plan import RoundPlan, write_plan
    from diloco_serverless.trainer.round_plan import RoundPlanner

    cfg = RunConfig.load(None, ["inner.sync_every=auto", "rounds=10"])  # H = 8 first, 80 inner steps
    store = ObjectStore(f"file://{tmp_path}/run")
    start = 0
    for r, h in enumerate([8, 8, 3, 3, 3, 3, 20]):
        write_plan(store, RoundPlan(r, h, start, reason="drift"), None)
        start += h
    planner = RoundPlanner(store, None, cfg, 1, None, on_rounds=lambda n: None)  # type: ignore[arg-type]
    ends = [planner.steps_before(r + 1) for r in range(7)]
    assert ends == [8, 16, 19, 22, 25, 28, 48]
    assert [planner.crossed(r, 2) for r in range(7)] == [False, True, False, False, False, False, True]
    assert [planner.crossed(r, 1) for r in range(7)] == [True, True, False, False, True, False, True]


def test_auto_is_shorthand_and_the_config_refuses_what_it_cannot_plan() -> None:
    from diloco_serverless.errors import ConfigError

    cfg = RunConfig.load(None, ["inner.sync_every=auto", "rounds=3"])
    assert (cfg.inner.auto_sync, cfg.inner.sync_every) == (True, 8)
    assert RunConfig.load(None, ['inner.sync_every="AUTO"']).inner.auto_sync
    again = RunConfig.model_validate(cfg.model_dump(mode="json"))  # run.json round trip
    assert (again.inner.auto_sync, again.inner.sync_every) == (True, 8)
    with pytest.raises(ConfigError, match="exchange.fragments = 1"):
        RunConfig.load(None, ["inner.sync_every=auto", "exchange.fragments=2"])
    with pytest.raises(ConfigError, match=r"must lie in inner.auto_sync_min..auto_sync_max \(16..128\)"):
        RunConfig.load(None, ["inner.sync_every=auto", "inner.auto_sync_min=16"])
