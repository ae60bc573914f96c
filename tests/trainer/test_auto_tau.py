"""inner.sync_every = "auto" with in-round overlap (exchange.fragment_sync_delay > 0, eager merge): rank 0 decides
each round's H and tau, every replica trains the stored pair, and a crashed replica resumes exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_auto_sync import _assert_same_globals, _create, _plans

from diloco_serverless.config import RunConfig
from diloco_serverless.run.members import read_metrics
from diloco_serverless.run.sync_plan import RoundPlan
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer import checkpoint as ckpt
from diloco_serverless.trainer.sync_every import TAU_SHARE, AutoSyncEvery, choose_tau
from support.crash_harness import run_two_with_crash
from support.diloco_harness import write_jsonl

TAU = {"exchange.fragment_sync_delay": 1, "exchange.fragment_merge": "eager", "inner.auto_sync_max": 8}


def test_the_rule_hides_the_exchange_behind_tau_steps_and_keeps_tau_a_share_of_the_round() -> None:
    assert choose_tau(0.2, 1.0) == 7  # 7 x 0.2 s >= 1.25 x 1.0 s
    assert choose_tau(0.5, 0.0) == 1
    with pytest.raises(ValueError, match="positive, finite"):
        choose_tau(0.0, 1.0)
    rule = AutoSyncEvery(overlap=False, lo=4, hi=128, tau_share=0.5)
    assert rule.tau(8, initial=2) == 2  # no timings yet: the configured first tau
    rule.observe(0.2, 1.0)
    assert rule.decide(8, measured_before=False) == (14, "measured")  # tau 7 is at most half of H
    assert rule.tau(14, initial=2) == 7 and rule.tau(5, initial=2) == 4  # always below H
    for _ in range(3):
        rule.observe(0.2, 3.0)  # a slower store: tau 19, H 38
    assert rule.decide(14, measured_before=True) == (38, "drift") and rule.tau(38, initial=2) == 19
    assert AutoSyncEvery(overlap=False, lo=4, hi=128).tau(8, initial=2) == 0  # no in-round overlap: 0
    default = AutoSyncEvery(overlap=False, lo=4, hi=128, tau_share=TAU_SHARE)
    default.observe(0.2, 1.0)
    assert default.decide(8, measured_before=False) == (math.ceil(7 / TAU_SHARE), "measured")
    with pytest.raises(ValueError, match="tau_share"):
        AutoSyncEvery(overlap=False, lo=4, hi=128, tau_share=1.0)


def test_config_lets_auto_overlap_inside_the_round() -> None:
    cfg = RunConfig.load(None, ["inner.sync_every=auto", "exchange.fragment_sync_delay=2",
                                "exchange.fragment_merge=eager"])
    assert cfg.inner.auto_sync and cfg.inner.sync_every == 8 and cfg.exchange.fragment_sync_delay == 2
    assert RoundPlan(3, 8, 24, tau=2).tag() == "round 3: h=8 tau=2 from step 24"
    assert RoundPlan(3, 8, 24).tag() == "round 3: h=8 from step 24"  # tau 0: the tag of plans before tau


@pytest.mark.slow
def test_auto_h_and_tau_are_every_replicas_and_a_crash_resumes_exactly(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    kw = {"rounds": 4, "sync_every": 2, **TAU}  # 8 inner steps, first rounds H = 2, tau = 1
    url = _create(f"file://{tmp_path}/store", data, **kw)
    out = run_two_with_crash(url, None, monkeypatch, slow_rank=1)
    plans = _plans(url)
    assert [(p.h, p.tau, p.reason) for p in plans[:2]] == [(2, 1, "initial"), (2, 1, "initial")]
    assert all(0 <= p.tau < p.h for p in plans) and plans[-1].end == 8
    for p in plans[2:]:
        if p.reason != "kept":
            assert p.compute_s is not None and p.exchange_s is not None
            assert p.tau == min(choose_tau(p.compute_s, p.exchange_s), p.h - 1)
    for rank in (0, 1):
        metrics = sorted(read_metrics(ObjectStore(url), rank), key=lambda m: m["outer_round"])
        assert [(m["inner_steps"], m["sync_every_tau"]) for m in metrics] == [(p.h, p.tau) for p in plans]
        assert out[rank].inner_steps == 8
    _assert_same_globals(out[0], out[1])
    # rank 1 crashes in round 1 (H = 2, tau = 1: its 1st step ends with the prepare, its 2nd with the sync) at
    # the 1st step (before the prepare) and at the 2nd (between prepare and sync), with the plans pinned
    # (min = max) so the fault-free reference trains the same rounds
    pinned = {**kw, "inner.auto_sync_min": 2, "inner.auto_sync_max": 2}
    ref_url = _create(f"file://{tmp_path}/ref", data, **pinned)
    reference = run_two_with_crash(ref_url, None, monkeypatch)
    assert all(p.tau == 1 for p in _plans(ref_url))
    for crash_at in (3, 4):
        crash_url = _create(f"file://{tmp_path}/crash{crash_at}", data, **pinned)
        ObjectStore(crash_url).put(ckpt.INITIAL_KEY, ObjectStore(ref_url).get(ckpt.INITIAL_KEY))
        crashed = run_two_with_crash(crash_url, crash_at, monkeypatch)
        for rank in (0, 1):
            _assert_same_globals(crashed[rank], reference[rank])
