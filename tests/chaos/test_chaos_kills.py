"""(c) SIGKILLs at exact protocol steps, with checkpoint_every=1, each killed replica restarted like
the local executor does (same rank, DILOCO_ATTEMPT + 1): the run succeeds with a complete final/ and
every replica ends with the same global parameters — and, with exact resume (each checkpoint holds
every replica's own state: inner optimizer, RNG, data position), the fault-free run's parameters.

The kill moments are detected from the replicas' own requests at the proxy (support/chaos.py):
before a replica's first contribution PUT, after the store stored its ready marker, at its
create-only PUT of the reduced shard it owns, at its PUT of a checkpoint shard, and at the first
PUT of a model file under final/ by whichever replica holds final/LOCK.json.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from support.chaos import ANY_RANK, ChaosPlan, ChaosResult, run_chaos

pytestmark = pytest.mark.slow

#: One run, five kills: four on alternating ranks in the exchange and the checkpoints, then whichever replica
#: holds final/LOCK.json as it uploads the model.
EXCHANGE_AND_CHECKPOINT_KILLS = ChaosPlan(
    seed=5,
    kills=((1, "before_upload@0"), (0, "after_upload@1"), (1, "checkpoint@1"), (0, "owning_shard@2"),
           (ANY_RANK, "final")),
)


def _fired(result: ChaosResult) -> list[tuple[int, str | float]]:
    """The kills that fired, as planned (a kill of ANY_RANK is listed as such, whoever it hit)."""
    planned = dict(enumerate(result.plan.kills))
    return [(planned[i][0] if planned[i][0] == ANY_RANK else k.rank, k.when)
            for i, k in enumerate(result.kills) if k.fired]


@pytest.fixture(scope="module")
def killed_run(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> ChaosResult:
    return run_chaos(EXCHANGE_AND_CHECKPOINT_KILLS, Path(tmp_path_factory.mktemp("kills")), s3_server)


def test_kills_during_exchange_and_checkpoint_the_run_succeeds(killed_run: ChaosResult) -> None:
    result = killed_run
    assert _fired(result) == list(EXCHANGE_AND_CHECKPOINT_KILLS.kills), result.describe()
    assert result.ok, result.describe()
    assert all(codes[-1] == 0 and codes.count(-9) >= 1 for codes in result.exits.values()), result.exits
    assert result.digest is not None, f"replicas differ after kills: {result.digests}"


#: The same kills on the protocol ``exchange.topology = "auto"`` picks at N=2 ("direct": whole tensors, no
#: reduced shards, so no ``owning_shard`` moment).
DIRECT_KILLS = ChaosPlan(seed=6, topology="auto",
                         kills=((1, "before_upload@0"), (0, "after_upload@1"), (1, "checkpoint@1")))


def test_kills_on_the_direct_protocol_resume_exactly(s3_server: str, tmp_path: Path, chaos_reference) -> None:
    result = run_chaos(DIRECT_KILLS, tmp_path, s3_server)
    assert [(k.rank, k.when) for k in result.kills if k.fired] == list(DIRECT_KILLS.kills), result.describe()
    assert result.ok, result.describe()
    # At N=2 the direct and the sharded protocol compute the same mean bit for bit, so the flat fault-free
    # run (already computed for the plans above) is the reference: exact resume, and the same bits as flat.
    reference = chaos_reference(replace(DIRECT_KILLS, topology="flat"))
    assert result.digest is not None and result.digest == reference.digest, result.describe()


def test_kills_during_exchange_and_checkpoint_exact_resume(killed_run: ChaosResult, chaos_reference) -> None:
    """EXACT RESUME: the killed-and-restarted run ends bit-identical to the run without kills."""
    reference = chaos_reference(EXCHANGE_AND_CHECKPOINT_KILLS)
    assert killed_run.ok, killed_run.describe()
    assert killed_run.participants == reference.participants, "a round went on without a killed replica"
    assert killed_run.digest == reference.digest, "the restarted replicas did not resume exactly"


def test_kill_of_the_final_writer_still_completes_final(killed_run: ChaosResult) -> None:
    """The replica holding final/LOCK.json dies while uploading the model (the last kill of the run above);
    its restart (or another replica) must still complete final/, not leave a lock that blocks every
    writer for 10 minutes."""
    final = killed_run.kills[-1]
    assert final.when == "final" and final.fired, killed_run.describe()
    assert killed_run.final_done is not None, (
        f"final/ incomplete after the final writer was killed: {killed_run.final_files}\n{killed_run.describe()}")
    assert all(codes[-1] == 0 for codes in killed_run.exits.values()), killed_run.describe()


def _attempt_log(result: ChaosResult, rank: int, attempt: int) -> str:
    """What attempt ``attempt`` of ``rank`` logged (the harness appends every attempt to one file)."""
    text = result.logs[rank].read_text()
    after = text.split(f"===== chaos harness: rank {rank} attempt {attempt} =====", 1)[1]
    return after.split("===== chaos harness", 1)[0]


def test_replica_killed_in_round_0_and_back_after_it_closed_exact_resume(s3_server: str, chaos_reference,
                                                                         tmp_path: Path) -> None:
    """EXACT RESUME before the first checkpoint: rank 1 dies at its create-only PUT of the shard it owns
    in round 0 and comes back after rank 0 took that shard over and closed the round (restart delay 8 s >
    takeover 5 s) but before rank 0 gives up waiting for rank 1's checkpoint shard (60 s). No checkpoint
    exists yet, so the restarted replica must re-train round 0 from the initial state (fresh inner
    optimizer, seeded RNG, data position 0 — all known) rather than replay it: replaying leaves its inner
    optimizer empty, and its later contributions differ."""
    plan = ChaosPlan(seed=8, kills=((1, "owning_shard@0"),), restart_delay_s=8.0, straggler_timeout_s=60.0)
    result = run_chaos(plan, tmp_path, s3_server)
    assert result.kills[0].fired and result.ok, result.describe()
    assert "loaded checkpoint" not in _attempt_log(result, 1, 1), result.describe()
    assert result.digest is not None, f"replicas differ: {result.digests}"
    assert result.participants == chaos_reference(plan).participants
    assert result.digest == chaos_reference(plan).digest, (
        "the replica restarted before the first checkpoint replayed round 0 instead of re-training it")


def test_replica_back_after_its_shard_of_the_first_checkpoint_was_taken_over_exact_resume(
        s3_server: str, chaos_reference, tmp_path: Path) -> None:
    """EXACT RESUME when the first checkpoint holds everything but the restarted replica's own state: rank 1
    dies at its owned shard of round 0 and comes back 20 s later, after rank 0 closed round 0 (takeover 5 s)
    and, 5 s (the straggler timeout) into the checkpoint, wrote rank 1's checkpoint shard itself. Loading that
    checkpoint would go on with a fresh inner optimizer; the replica instead re-trains round 0 from the
    run's start (still stored), and the run ends bit-identical to the fault-free one."""
    plan = ChaosPlan(seed=9, kills=((1, "owning_shard@0"),), restart_delay_s=20.0, straggler_timeout_s=5.0)
    result = run_chaos(plan, tmp_path, s3_server)
    assert result.kills[0].fired and result.ok, result.describe()
    assert "lacks this replica's own state" in _attempt_log(result, 1, 1), result.describe()
    assert result.digest is not None, f"replicas differ: {result.digests}"
    assert result.participants == chaos_reference(plan).participants
    assert result.digest == chaos_reference(plan).digest, (
        "the replica that lost its own state loaded the checkpoint instead of re-training from the start")
