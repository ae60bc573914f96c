"""Threads as replicas of an ``ObjectStoreAllReduce`` (fast exchange tests on any store URL)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce, RoundStats
from diloco_serverless.exchange.votes import VotedRound

FAST: dict[str, Any] = dict(timeout_s=20.0, straggler_timeout_s=0.3, takeover_timeout_s=0.3, poll_interval_s=0.02)


def run_replicas(
    url: str, inputs: dict[int, torch.Tensor], world_size: int, *, rounds: int = 1,
    make: Callable[..., ObjectStoreAllReduce] = ObjectStoreAllReduce, **kw: Any,
) -> tuple[dict[int, list[torch.Tensor]], dict[int, BaseException], dict[int, RoundStats]]:
    """Run ``rounds`` all-reduces of ``inputs[r]`` on one thread per rank in ``inputs``."""
    opts = {**FAST, "run_id": "t", **kw}
    outs: dict[int, list[torch.Tensor]] = {r: [] for r in inputs}
    errors: dict[int, BaseException] = {}
    stats: dict[int, RoundStats] = {}

    def one(r: int) -> None:
        try:
            with make(url, r, world_size, **opts) as ar:
                for k in range(rounds):
                    outs[r].append(ar.allreduce(inputs[r] * (k + 1)))
                assert ar.last_stats is not None
                stats[r] = ar.last_stats
        except BaseException as e:
            errors[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outs, errors, stats


def randn(n: int, seed: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    return torch.randn(shape or (n,), generator=torch.Generator().manual_seed(seed))


def assert_identical(outs: dict[int, list[torch.Tensor]]) -> None:
    first = outs[min(outs)]
    for r, o in outs.items():
        assert len(o) == len(first)
        for a, b in zip(first, o):
            assert torch.equal(a, b), f"rank {r} differs from rank {min(outs)}"


class WithQuorum(ObjectStoreAllReduce):
    """An exchange whose every round has a quorum object, as a sliced exchange's do: the tests of the
    quorum protocol itself run their flat and direct rounds through it at small N."""

    _QUORUM = True


class DiesAfterReady(ObjectStoreAllReduce):
    """Writes its contributions and ready marker (in a round without a quorum: its contributions and its
    create-only vote), then 'dies' before reducing its shard."""

    def _publish(self, rs: Any, flat: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[override]
        super()._publish(rs, flat)
        raise SystemExit("simulated death after ready")

    def _quorumless(self, rs: Any, flat: torch.Tensor, *, fresh: bool = False) -> torch.Tensor:
        assert self._io is not None

        def put_share(values: torch.Tensor) -> None:
            self._put_contributions(rs, values)

        VotedRound(self._io, rs.me, self._wait(rs.deadline), None if rs.me.protocol == "direct" else put_share).publish(
            flat, None, fresh=fresh)
        raise SystemExit("simulated death after its contribution (and vote)")
