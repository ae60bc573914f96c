"""A round's plan (``inner.sync_every = "auto"``) travels in its signed ready marker: replicas that trained
the round under different plans (one stored plan deleted and replaced by another) fail it on every
replica with a MismatchError instead of averaging rounds of different lengths."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.errors import CorruptObjectError, MismatchError
from diloco_serverless.exchange.quorum import ReadyMarker
from diloco_serverless.run.sync_plan import RoundPlan
from support.allreduce import randn, run_replicas

KEY = b"k" * 32


def _planned(plans: dict[int, str]) -> Any:
    def make(url: str, rank: int, n: int, **opts: Any) -> ObjectStoreAllReduce:
        ar = ObjectStoreAllReduce(url, rank, n, run_key=KEY, **opts)
        ar.bind_plan(0, plans[rank])
        return ar

    return make


@pytest.mark.parametrize("topology", ["direct", "flat"])
def test_replicas_under_the_same_plan_average_the_round(tmp_path: Any, topology: str) -> None:
    xs = {r: randn(301, r) for r in range(3)}
    plan = RoundPlan(round=0, h=8, start=0).tag()
    outs, errors, _ = run_replicas(f"file://{tmp_path}/s", xs, 3, make=_planned(dict.fromkeys(xs, plan)),
                                   topology=topology)
    assert not errors, errors
    mean = (xs[0] + xs[1] + xs[2]) / 3
    for r in xs:
        assert torch.allclose(outs[r][0], mean, atol=1e-6)
        assert torch.equal(outs[r][0], outs[0][0])


@pytest.mark.parametrize("topology", ["direct", "flat"])
def test_replicas_under_different_plans_fail_the_round_everywhere(tmp_path: Any, topology: str) -> None:
    xs = {r: randn(301, r) for r in range(3)}
    plans = {0: RoundPlan(round=0, h=13, start=0).tag(), 1: RoundPlan(round=0, h=8, start=0).tag(),
             2: RoundPlan(round=0, h=8, start=0).tag()}
    outs, errors, _ = run_replicas(f"file://{tmp_path}/s", xs, 3, make=_planned(plans), topology=topology)
    assert set(errors) == {0, 1, 2}, (errors, outs)
    for e in errors.values():
        assert isinstance(e, MismatchError), e
        assert "round plan" in str(e) and "h=13" in str(e) and "h=8" in str(e)


def test_a_marker_without_a_plan_is_stored_as_before_and_a_bad_plan_is_refused() -> None:
    m = ReadyMarker("t", 0, 1, 2, 10, "torch.float32", [10], "fp32", "direct", 1)
    assert "plan" not in m.to_json()
    planned = ReadyMarker.from_json({**m.to_json(), "plan": "round 0: h=8 from step 0"}, key="k")
    assert planned.plan == "round 0: h=8 from step 0" and planned.signature() != m.signature()
    with pytest.raises(CorruptObjectError, match="plan"):
        ReadyMarker.from_json({**m.to_json(), "plan": 8}, key="k")
