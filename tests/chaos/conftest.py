"""Fixtures of the chaos suite: the fault-free reference run, computed once per run shape.

Every chaos test runs a tiny real run (replica processes over moto through the fault proxy, see
support/chaos.py) and compares its final global parameters with the same run without any fault.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from support.chaos import ChaosPlan, ChaosResult, run_chaos


@pytest.fixture(scope="session")
def chaos_reference(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> Callable[[ChaosPlan], ChaosResult]:
    """``reference(plan)``: the fault-free run of ``plan``'s shape (cached per shape for the session)."""
    cache: dict[tuple[object, ...], ChaosResult] = {}

    def reference(plan: ChaosPlan) -> ChaosResult:
        shape = plan.shape()
        if shape not in cache:
            clean = ChaosPlan(seed=0, replicas=plan.replicas, rounds=plan.rounds, sync_every=plan.sync_every,
                              min_replicas=plan.min_replicas, nan_ranks=plan.nan_ranks, extra=plan.extra,
                              topology=plan.topology)
            result = run_chaos(clean, Path(tmp_path_factory.mktemp("chaos-reference")), s3_server)
            assert result.ok and result.digest is not None, f"the fault-free reference failed: {result.describe()}"
            cache[shape] = result
        return cache[shape]

    return reference

