"""A replica whose values are not finite abstains from the round instead of poisoning it."""

from __future__ import annotations

import uuid

import pytest
import torch

from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.codec import unpack
from diloco_serverless.exchange.errors import AbstainedError
from diloco_serverless.exchange.votes import EXCLUDED
from diloco_serverless.run.layout import vote_key
from diloco_serverless.store.objectstore import ObjectStore
from support.allreduce import WithQuorum, assert_identical, randn, run_replicas


def _url() -> str:
    return f"memory://abstain-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("quorum", [False, True], ids=["votes", "quorum"])
def test_a_nan_replica_is_left_out_and_receives_the_mean_of_the_others(quorum: bool) -> None:
    url = _url()
    xs = {r: randn(1000, r) for r in range(3)}
    xs[2][17] = float("nan")
    # a straggler deadline far longer than the test: the round must close because rank 2 said it abstains
    outs, errors, stats = run_replicas(url, xs, 3, min_replicas=2, straggler_timeout_s=120.0,
                                       make=WithQuorum if quorum else ObjectStoreAllReduce)
    assert not errors
    assert_identical(outs)
    torch.testing.assert_close(outs[0][0], (xs[0] + xs[1]) / 2, atol=1e-6, rtol=0)
    assert all(torch.isfinite(o[0]).all() for o in outs.values())
    assert stats[0].participants == [0, 1]
    assert stats[2].late and stats[2].abstained is not None and "non-finite" in stats[2].abstained
    assert stats[0].abstained is None
    assert max(s.total_s for s in stats.values()) < 60.0
    store = ObjectStore(url).child("t")
    if quorum:  # an abstention marker beside the ready markers
        assert store.exists("rounds/00000000/ready/abstain-2")
        assert not [k for k in store.list("rounds/00000000/ready") if "/rank-2" in k]
    else:  # a flat round without a quorum: rank 2's vote key holds its own tombstone, with the reason
        header = unpack(store.get(vote_key(0, 2)), key="vote")[1]
        assert header["by"] == 2 and "non-finite" in header[EXCLUDED]
        assert not store.exists("rounds/00000000/ready") and not store.exists("rounds/00000000/quorum.json")
    assert not [k for k in store.list("rounds/00000000/contrib") if k.endswith("rank-2")]


def test_an_explicit_abstention_needs_no_bad_values() -> None:
    xs = {r: randn(64, r) for r in range(2)}

    class Diverged(ObjectStoreAllReduce):
        def allreduce(self, tensor: torch.Tensor, **kw: object) -> torch.Tensor:  # type: ignore[override]
            reason = "loss is nan at inner step 3" if self.rank == 1 else None
            return super().allreduce(tensor, abstain=reason, **kw)  # type: ignore[arg-type]

    outs, errors, stats = run_replicas(_url(), xs, 2, min_replicas=1, straggler_timeout_s=120.0, make=Diverged)
    assert not errors
    assert torch.equal(outs[1][0], xs[0]) and torch.equal(outs[0][0], xs[0])
    assert stats[1].abstained == "loss is nan at inner step 3"


def test_without_enough_replicas_every_replica_raises_naming_the_abstainer() -> None:
    xs = {r: randn(500, r) for r in range(3)}
    xs[1][:] = float("inf")
    outs, errors, _ = run_replicas(_url(), xs, 3, straggler_timeout_s=120.0)  # min_replicas = all
    assert sorted(errors) == [0, 1, 2]
    for e in errors.values():
        assert isinstance(e, AbstainedError)
        assert "rank 1: pseudo-gradient has 500 non-finite values" in str(e)
        assert "min_replicas=3" in str(e)


def test_a_lone_replica_with_nan_raises_instead_of_returning_nan() -> None:
    with ObjectStoreAllReduce(_url(), 0, 1, run_id="t") as ar:
        with pytest.raises(AbstainedError, match="only replica cannot contribute"):
            ar.allreduce(torch.tensor([1.0, float("nan")]))
