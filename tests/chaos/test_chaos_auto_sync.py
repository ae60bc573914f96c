"""SIGKILLs with ``inner.sync_every = "auto"`` (rank 0 writes each round's plan of H; everyone reads it before the
round): the run succeeds, every replica ends with the same global parameters, and the restarted replicas,
rank 0 among them, resume exactly from the stored plans. H is pinned to one value (auto_sync_min = max) so the
fault-free reference trains the same rounds: which H rank 0 picks depends on its timings."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.chaos import ChaosPlan, run_chaos

pytestmark = pytest.mark.slow

AUTO_KILLS = ChaosPlan(seed=11, extra=(("inner.auto_sync", "true"), ("inner.auto_sync_min", 2),
                                       ("inner.auto_sync_max", 2)),
                       kills=((0, "after_upload@0"), (1, "before_upload@1"), (0, "checkpoint@1")))


def test_kills_with_auto_h_resume_exactly_from_the_stored_plans(s3_server: str, tmp_path: Path,
                                                                chaos_reference) -> None:
    result = run_chaos(AUTO_KILLS, tmp_path, s3_server)
    assert [(k.rank, k.when) for k in result.kills if k.fired] == list(AUTO_KILLS.kills), result.describe()
    assert result.ok, result.describe()
    assert result.digest is not None, f"replicas differ after kills: {result.digests}"
    assert result.digest == chaos_reference(AUTO_KILLS).digest, "the restarted replicas did not resume exactly"
