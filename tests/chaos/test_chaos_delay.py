"""SIGKILLs with ``outer.delay = 1`` (each round's exchange runs while the next round computes): the run
succeeds, every replica ends with the same global parameters, and the restarted replicas resume exactly
(the fault-free run's bits): the in-flight round's average is read back from the store, the replica's
start offset comes from its own saved state (trainer/overlap.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.chaos import ChaosPlan, run_chaos

pytestmark = pytest.mark.slow

DELAY_KILLS = ChaosPlan(seed=9, extra=(("outer.delay", 1),),
                        kills=((1, "before_upload@0"), (0, "after_upload@1"), (1, "checkpoint@1")))


def test_kills_with_delayed_outer_steps_resume_exactly(s3_server: str, tmp_path: Path, chaos_reference) -> None:
    result = run_chaos(DELAY_KILLS, tmp_path, s3_server)
    assert [(k.rank, k.when) for k in result.kills if k.fired] == list(DELAY_KILLS.kills), result.describe()
    assert result.ok, result.describe()
    assert result.digest is not None, f"replicas differ after kills: {result.digests}"
    assert result.digest == chaos_reference(DELAY_KILLS).digest, "the restarted replicas did not resume exactly"
