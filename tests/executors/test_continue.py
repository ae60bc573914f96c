"""Runs longer than an attempt's cap, locally: ``LocalProcessExecutor(attempt_timeout_s=...)`` rehearses a
platform deadline of seconds. Real replica processes (tiny random model, 2 replicas, file store) stop before
the deadline at a round boundary with their state saved (exit code 75); the supervisor starts the next attempt
at once without using a retry; the run ends with the very parameters of the same run without a deadline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diloco_serverless.errors import LaunchError
from diloco_serverless.executors import ReplicaStatus
from diloco_serverless.executors.base import CONTINUE_EXIT_CODE
from diloco_serverless.executors.local import LocalProcessExecutor, replica_paths
from diloco_serverless.executors.registry import build_executor
from diloco_serverless.store.objectstore import ObjectStore
from support.diloco_harness import create_tiny_run, write_jsonl

REPLICA = "diloco_serverless.entrypoints.replica"


def _run(tmp: Path, data: str, attempt_timeout_s: float | None) -> tuple[str, Path, LocalProcessExecutor]:
    """The same tiny run (2 outer rounds, no scheduled checkpoint before the last) in its own store;
    returns (run URL, folder of the replicas' final parameters, executor)."""
    url = create_tiny_run(f"file://{tmp}/store", data, 2, run_id="long", rounds=2, checkpoint_every=0, eval_every=0)
    dump = tmp / "dump"
    env = {"DILOCO_RUN_URL": url, "DILOCO_DUMP_PARAMS": str(dump), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "DILOCO_LOG_LEVEL": "INFO"}
    ex = LocalProcessExecutor(retries=0, log_dir=tmp / "logs", restart_delay_s=0.05, poll_interval_s=0.2,
                              attempt_timeout_s=attempt_timeout_s)
    handles = ex.launch_replicas(2, REPLICA, [], env=env)
    results = ex.collect(handles, timeout=400)
    assert [r.status for r in results] == [ReplicaStatus.SUCCEEDED] * 2
    return url, dump, ex


@pytest.mark.slow
def test_every_replica_continues_and_the_run_ends_as_without_a_deadline(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    # a 1 s cap: every attempt trains one round (the least an attempt does), then stops before the deadline
    url, dump, ex = _run(tmp_path / "capped", data, attempt_timeout_s=1.0)
    store = ObjectStore(url)
    for rank in range(2):
        log_path, state_path = replica_paths(tmp_path / "capped" / "logs", rank)
        state = json.loads(state_path.read_text())
        log = log_path.read_text()
        assert state["restarts"] == [], f"a continuation used a retry: {state}"
        assert [c["attempt"] for c in state["continuations"]] == [0], state
        assert state["attempt"] == 1 and state["status"] == "succeeded"
        assert log.count(f"exited with code {CONTINUE_EXIT_CODE}") == 1, log[-3000:]
        assert "stopped after round 0 before its platform deadline" in log
        assert "state saved, a fresh attempt continues from it" in log
        # no checkpoint was due after round 0: the stopping replicas wrote it (nobody else would
        # have), and the fresh attempt healed from it with its own state (exact resume)
        assert "loaded checkpoint of round 0 (step 1) with this replica's own state" in log, log[-3000:]
        # each attempt trained the round after the one its predecessor stopped at (none replayed)
        trained = {m["outer_round"]: m["attempt"] for m in
                   (store.get_json(k) for k in store.list(f"metrics/rank-{rank}/"))}
        assert trained == {0: 0, 1: 1}, trained
        hb = store.get_json(f"members/rank-{rank}.json")
        assert hb["state"] == "done" and hb["attempt"] == 1
    assert store.exists("final/DONE.json")

    _, ref_dump, _ = _run(tmp_path / "free", data, attempt_timeout_s=None)
    for rank in range(2):
        got = load_file(str(dump / f"rank-{rank}.safetensors"))
        want = load_file(str(ref_dump / f"rank-{rank}.safetensors"))
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {rank} {name}: the continued run did not resume exactly"


def test_attempt_timeout_reaches_each_attempt_and_continuations_use_no_retry(tmp_path: Path) -> None:
    """The supervisor alone (support/continue_replica.py as the replica): exit 75 twice, then 0, with
    retries=0; every attempt sees DILOCO_ATTEMPT_TIMEOUT_S and its own DILOCO_ATTEMPT."""
    from support import pythonpath_env

    env = {"PYTHONPATH": pythonpath_env(), "DILOCO_RUN_URL": str(tmp_path / "store" / "run-c"),
           "FAKE_CONTINUE_ATTEMPTS": "2"}
    ex = LocalProcessExecutor(retries=0, log_dir=tmp_path / "logs", restart_delay_s=30.0, poll_interval_s=0.05,
                              attempt_timeout_s=2.5)
    handles = ex.launch_replicas(1, "support.continue_replica", [], env=env)
    (result,) = ex.collect(handles, timeout=60)  # a 30 s restart delay would show: continuations do not wait
    assert result.ok
    log = ex.logs(handles[0], tail=None)
    for attempt in range(3):
        assert f"continue replica rank=0 attempt={attempt} timeout=2.5" in log
    state = json.loads(replica_paths(tmp_path / "logs", 0)[1].read_text())
    assert state["restarts"] == [] and len(state["continuations"]) == 2 and state["attempt"] == 2


def test_attempt_timeout_option_is_checked_and_reachable_from_the_cli_options() -> None:
    ex = build_executor("local", None, {"attempt_timeout_s": 5})
    assert isinstance(ex, LocalProcessExecutor) and ex.attempt_timeout_s == 5.0
    for bad in (0, -1, float("nan"), float("inf"), "soon", True):
        with pytest.raises(LaunchError, match="attempt_timeout_s must be a number of seconds above 0"):
            build_executor("local", None, {"attempt_timeout_s": bad})


def test_supervisor_without_timeout_sets_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from support import pythonpath_env

    env = {"PYTHONPATH": pythonpath_env(), "DILOCO_RUN_URL": str(tmp_path / "store" / "run-c")}
    monkeypatch.delenv("DILOCO_ATTEMPT_TIMEOUT_S", raising=False)
    ex = LocalProcessExecutor(retries=0, log_dir=tmp_path / "logs", poll_interval_s=0.05)
    handles = ex.launch_replicas(1, "support.continue_replica", [], env=env)
    assert ex.collect(handles, timeout=60)[0].ok
    assert "continue replica rank=0 attempt=0 timeout=None" in ex.logs(handles[0], tail=None)
