"""Fixtures of the chaos suite: the fault-free reference run, computed once per run shape.

Every chaos test runs a tiny real run (replica processes over moto through the fault proxy, see
support/chaos.py) and compares its final global parameters with the same run without any fault.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from hashlib import sha256
from pathlib import Path

import pytest

from support.chaos import ChaosPlan, ChaosResult, run_chaos


def _shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every worker of this pytest session sees: the session's base temp folder (under xdist the
    workers' own are its children), never one shared with an earlier session."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def chaos_reference(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> Callable[[ChaosPlan], ChaosResult]:
    """``reference(plan)``: the fault-free run of ``plan``'s shape, computed once per shape for the session
    (shared by the xdist workers through a locked file: the runs take a core each for half a minute)."""
    cache: dict[tuple[object, ...], ChaosResult] = {}
    shared = _shared_dir(tmp_path_factory)

    def reference(plan: ChaosPlan) -> ChaosResult:
        shape = plan.shape()
        if shape in cache:
            return cache[shape]
        clean = ChaosPlan(seed=0, replicas=plan.replicas, rounds=plan.rounds, sync_every=plan.sync_every,
                          min_replicas=plan.min_replicas, nan_ranks=plan.nan_ranks, extra=plan.extra,
                          topology=plan.topology)
        name = "chaos-reference-" + sha256(repr(shape).encode()).hexdigest()[:16]
        stored = shared / f"{name}.json"
        with _locked(shared / f"{name}.lock"):
            if stored.exists():  # another worker ran it: what the tests compare (digests, participants)
                doc = json.loads(stored.read_text())
                result = ChaosResult(plan=clean, outcome=doc["outcome"], wall_s=doc["wall_s"], faults={}, requests=0,
                                     kills=[], exits={}, digests={int(r): d for r, d in doc["digests"].items()},
                                     participants={int(k): v for k, v in doc["participants"].items()})
            else:
                result = run_chaos(clean, Path(tmp_path_factory.mktemp("chaos-reference")), s3_server)
                assert result.ok and result.digest is not None, f"the fault-free reference failed: {result.describe()}"
                stored.write_text(json.dumps({"outcome": result.outcome, "wall_s": result.wall_s,
                                              "digests": result.digests, "participants": result.participants}))
        cache[shape] = result
        return result

    return reference
