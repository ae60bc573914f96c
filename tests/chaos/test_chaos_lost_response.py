"""(b) A lost response to a create-only write: the store creates the object, the writer never hears
(the proxy forwards the PUT with ``If-None-Match: *``, receives the store's 200 and closes the
connection). Whoever re-sends (our retry, or aiohttp itself, which silently re-sends an idempotent PUT
whose reused connection closed) gets 412 PreconditionFailed for its *own* object; the writer must not
conclude that someone else created it.

One run loses the first answer to each kind of create-only object the package writes: run.json (through
``launch()``), a replica's vote in a round, a reduced shard, a checkpoint manifest and final/LOCK.json (each
writer a different moment of the run, so every loss is its own fault). The run must succeed with a
complete final/ (final/DONE.json and the model files), the same parameters on every replica and the
fault-free run's parameters.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.chaos import CREATE_ONLY_KEYS, ChaosPlan, lost_response_rule, run_chaos

pytestmark = pytest.mark.slow


def test_lost_responses_to_create_only_writes(s3_server: str, chaos_reference, tmp_path: Path) -> None:
    plan = ChaosPlan(seed=0, rules=tuple(lost_response_rule(kind) for kind in CREATE_ONLY_KEYS))
    reference = chaos_reference(plan)
    result = run_chaos(plan, tmp_path, s3_server)
    lost = [e[3] for e in result.fault_events if e[1] == "drop_after"]
    for kind, pattern in CREATE_ONLY_KEYS.items():
        assert len([k for k in lost if re.search(pattern, k)]) == 1, f"the fault did not hit {kind} once: {lost}"
    assert len(lost) == len(CREATE_ONLY_KEYS), lost
    assert result.outcome != "launch-failed", f"launch() failed after a lost run.json response: {result.error}"
    assert result.final_done is not None, f"final/DONE.json missing after lost responses: {result.describe()}"
    assert result.ok, result.describe()
    assert any(f.endswith("model.safetensors") for f in result.final_done["files"])
    assert result.digest == reference.digest, f"lost create-only responses changed the final parameters: {lost}"
