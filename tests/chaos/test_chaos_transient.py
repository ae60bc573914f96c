"""(a) Transient store faults only — 503 SlowDown, 500 InternalError, connections closed before the
store acts, 1-2 s delays, at a few percent of every request of launch() and of the replicas — change
nothing: the final global parameters are bit-identical to the fault-free run's on every replica."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.chaos import ChaosPlan, run_chaos
from support.fault_proxy import TRANSIENT_KINDS

pytestmark = pytest.mark.slow


def test_transient_faults_leave_the_final_parameters_bit_identical(s3_server: str, chaos_reference,
                                                                    tmp_path: Path) -> None:
    plan = ChaosPlan(seed=11, fault_rate=0.05, fault_kinds=TRANSIENT_KINDS)
    reference = chaos_reference(plan)
    result = run_chaos(plan, tmp_path, s3_server)
    assert result.ok, result.describe()
    assert sum(result.faults.values()) >= 5, f"too few faults injected to prove anything: {result.faults}"
    assert result.faults["drop_after"] == 0
    assert len({k for k, v in result.faults.items() if v}) >= 3, result.faults  # several kinds, not one
    assert all(code == 0 for codes in result.exits.values() for code in codes), result.exits  # no crash, no restart
    assert result.digest is not None, f"replicas differ: {result.digests}"
    assert result.digest == reference.digest, "transient faults changed the final parameters"
    assert result.participants == reference.participants  # every round had every replica
