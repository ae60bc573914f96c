"""Deleting objects can delay or fail a round, never change its result (review finding 1).

A co-tenant with write access deletes what decided a round's participants while it closes: a replica's
vote (the others then tombstone it, while it counts itself in) or ``quorum.json`` (a late replica then
creates another). Every replica either applies the one set everyone applies, or fails the round with
:class:`ParticipantsChangedError`; none applies a mean over another set, or a mix of two.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.errors import ParticipantsChangedError
from diloco_serverless.run.integrity import new_run_key, parse_run_key
from diloco_serverless.run.layout import contrib_key, quorum_key, vote_key
from diloco_serverless.store.objectstore import ObjectStore
from support.allreduce import FAST, WithQuorum, run_replicas

KEY = parse_run_key(new_run_key(), source="test")


def _ints(n: int, seed: int) -> torch.Tensor:
    """Small integers: sums are exact in fp32 whatever the order."""
    return torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(seed)).float()


def _wait_for(store: ObjectStore, key: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.exists(key):
        assert time.monotonic() < deadline, f"{key} never appeared"
        time.sleep(0.01)


def _outcomes(first: dict[int, object], others: dict[int, list[torch.Tensor]],
              errors: dict[int, BaseException]) -> dict[int, object]:
    out: dict[int, object] = dict(first)
    out.update({r: o[0] for r, o in others.items() if o})
    out.update(errors)
    return out


def _assert_one_set(outcomes: dict[int, object], xs: dict[int, torch.Tensor]) -> None:
    """Every replica that applied a result applied the same one, the mean over one participant set; the
    others failed with ParticipantsChangedError (and nothing else)."""
    applied = {r: o for r, o in outcomes.items() if isinstance(o, torch.Tensor)}
    failed = {r: o for r, o in outcomes.items() if not isinstance(o, torch.Tensor)}
    assert all(isinstance(e, ParticipantsChangedError) for e in failed.values()), failed
    values = list(applied.values())
    assert all(torch.equal(v, values[0]) for v in values), "replicas applied different results"
    if values:
        means = [sum(xs[r] for r in s) / len(s) for s in ([0, 1], [0, 1, 2])]
        assert any(torch.equal(values[0], m) for m in means), "the result mixes two participant sets"


@pytest.mark.parametrize("topology", ["direct", "flat"])
def test_deleting_a_vote_fails_the_round_and_never_splits_it(tmp_path: Path, topology: str) -> None:
    """Rank 2 votes; its vote is deleted before 0 and 1 read it; they tombstone it and average {0, 1}.
    Rank 2 must not apply {0, 1, 2} (today's main does: it never re-reads its own vote)."""
    url = tmp_path.as_uri()
    store = ObjectStore(url).child("t")
    xs = {r: _ints(600, r) for r in range(3)}
    first: dict[int, object] = {}

    def rank2() -> None:
        try:
            with ObjectStoreAllReduce(url, 2, 3, run_id="t", run_key=KEY, min_replicas=2, keep_rounds=None,
                                      topology=topology, **FAST) as ar:
                first[2] = ar.allreduce(xs[2], round=0)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            first[2] = e

    thread = threading.Thread(target=rank2)
    thread.start()
    vote = contrib_key(0, 0, 2) if topology == "direct" else vote_key(0, 2)
    _wait_for(store, vote)
    store.delete(vote)  # the co-tenant
    outs, errors, _ = run_replicas(url, {0: xs[0], 1: xs[1]}, 3, min_replicas=2, keep_rounds=None,
                                   run_key=KEY, topology=topology)
    thread.join(60)
    outcomes = _outcomes(first, outs, errors)
    assert set(outcomes) == {0, 1, 2}
    _assert_one_set(outcomes, xs)
    assert isinstance(outcomes[2], ParticipantsChangedError)
    assert "vote key" in str(outcomes[2]) or "averages ranks" in str(outcomes[2])


def test_deleting_quorum_json_fails_the_replicas_that_used_it(tmp_path: Path) -> None:
    """Ranks 0 and 1 close a round over {0, 1}; its quorum.json is deleted; late rank 2 then writes a
    second quorum {0, 1, 2}. Whoever used the first one and checks after the deletion fails; nobody applies
    a mean of two sets."""
    url = tmp_path.as_uri()
    store = ObjectStore(url).child("t")
    xs = {r: _ints(600, r) for r in range(3)}
    done = threading.Event()
    first: dict[int, object] = {}

    class DeletesAfterItsGather(WithQuorum):
        """Rank 0: once it has gathered, the co-tenant deletes quorum.json and late rank 2 runs the round."""

        def _gather(self, rs, quorum):  # type: ignore[no-untyped-def]
            out = super()._gather(rs, quorum)
            if self.rank == 0:
                store.delete(quorum_key(0))
                late = WithQuorum(url, 2, 3, run_id="t", run_key=KEY, min_replicas=2, keep_rounds=None, **FAST)
                try:
                    first[2] = late.allreduce(xs[2], round=0)
                except BaseException as e:  # noqa: BLE001 - the test looks at it
                    first[2] = e
                finally:
                    late.close()
                    done.set()
            return out

    outs, errors, _ = run_replicas(url, {0: xs[0], 1: xs[1]}, 3, min_replicas=2, keep_rounds=None, run_key=KEY,
                                   make=DeletesAfterItsGather)
    assert done.wait(30)
    outcomes = _outcomes(first, outs, errors)
    _assert_one_set(outcomes, xs)
    assert isinstance(outcomes[0], ParticipantsChangedError), outcomes[0]  # it re-read quorum.json: gone/replaced
