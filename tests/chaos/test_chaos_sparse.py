"""The chaos suite with the sparse codec and SparseLoCo's error feedback: kills in the exchange and at a
checkpoint, each killed replica restarted; the run ends bit-identical to the fault-free sparse run, which
needs every replica's error-feedback buffer back from its checkpointed state (exact resume)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.chaos import ChaosPlan, run_chaos

pytestmark = pytest.mark.slow

#: SparseLoCo as examples/sparseloco.toml sets it (chunk 256 keeps the tiny model's fragments many chunks),
#: on the protocol ``auto`` picks for a sparse round (direct), and on the sharded fallback (flat).
SPARSELOCO = (("exchange.codec", "sparse"), ("exchange.error_feedback", True), ("exchange.feedback_decay", 0.95),
              ("exchange.sparse.chunk", 256), ("exchange.sparse.k", 16), ("outer.lr", 1.0),
              ("outer.momentum", 0.0), ("outer.nesterov", False))


@pytest.mark.parametrize("topology", ["auto", "flat"])
def test_kills_with_the_sparse_codec_resume_exactly(s3_server: str, tmp_path: Path, chaos_reference,
                                                    topology: str) -> None:
    plan = ChaosPlan(seed=7, topology=topology, extra=SPARSELOCO,
                     kills=((1, "before_upload@0"), (0, "after_upload@1"), (1, "checkpoint@1")))
    result = run_chaos(plan, tmp_path, s3_server)
    assert [(k.rank, k.when) for k in result.kills if k.fired] == list(plan.kills), result.describe()
    assert result.ok, result.describe()
    reference = chaos_reference(plan)
    assert reference.ok and reference.digest is not None
    assert result.digest is not None and result.digest == reference.digest, result.describe()
