"""Status tells the truth: pending vs starting vs running, unknown executor results deferring to the
heartbeat and the final model, attempts counted from start records, spend from each replica's start.
Pure functions (launcher/status.py, launcher/launches.py) plus start records in a real local store."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from diloco_serverless.launcher.launches import RankLaunch, current_launches, merge_launches, of_launch
from diloco_serverless.launcher.status import (
    ExecutorState,
    RankStarts,
    ReplicaReport,
    billed_seconds,
    build_replica,
    replica_state,
    run_state,
)
from diloco_serverless.run.starts import StartRecord, read_starts, write_start
from diloco_serverless.store.objectstore import ObjectStore

NOW = 10_000.0
HB = {"rank": 0, "round": 2, "step": 8, "loss": 3.0, "time": NOW - 5, "state": "training"}


@pytest.mark.parametrize(("executor", "heartbeat", "started", "final", "expected"), [
    # queued on the platform: pending, even with a heartbeat of an earlier launch
    (ExecutorState("pending"), None, False, False, "pending"),
    (ExecutorState("pending"), HB, False, False, "pending"),
    # the platform runs it but the replica has not written its start record: starting, not running
    (ExecutorState("running"), None, False, False, "starting"),
    (ExecutorState("running"), HB, False, False, "starting"),
    # a start record (no heartbeat yet) or a heartbeat of this launch: running
    (ExecutorState("running"), None, True, False, "running"),
    (ExecutorState("running"), HB, True, False, "running"),
    (ExecutorState("pending"), HB, True, False, "running"),  # the platform's view lags
    # the executor's verdicts stand
    (ExecutorState("failed", "exit code 1"), HB, True, True, "failed"),
    (ExecutorState("continue"), HB, True, False, "continue"),
    # unknown (an expired Modal result, a failed poll): the heartbeat decides, then the final model
    (ExecutorState("unknown", "result expired"), {**HB, "state": "done"}, True, False, "succeeded"),
    (ExecutorState("unknown", "result expired"), {**HB, "state": "failed"}, True, True, "failed"),
    (ExecutorState("unknown", "result expired"), HB, True, True, "succeeded"),
    (ExecutorState("unknown", "result expired"), None, None, True, "succeeded"),
    (ExecutorState("unknown", "result expired"), HB, True, False, "running"),
    (ExecutorState("unknown", "result expired"), None, None, False, "unknown"),
    (ExecutorState("unknown", "result expired"), {**HB, "state": "continuing"}, True, False, "continue"),
    # no executor here (SDK missing): heartbeats only
    (None, None, None, False, "pending"),
    (None, None, True, False, "running"),
])
def test_replica_state_cases(executor: ExecutorState | None, heartbeat: dict | None, started: bool | None,
                             final: bool, expected: str) -> None:
    age = None if heartbeat is None else NOW - heartbeat["time"]
    state, _ = replica_state(executor, heartbeat, age, 300.0, started=started, final=final)
    assert state == expected


def test_unknown_with_an_old_heartbeat_is_stale_until_the_final_model_exists() -> None:
    old = {**HB, "time": NOW - 900}
    assert replica_state(ExecutorState("unknown"), old, 900.0, 300.0, started=True)[0] == "stale"
    state, reason = replica_state(ExecutorState("unknown"), old, 900.0, 300.0, started=True, final=True)
    assert state == "succeeded" and "final model" in (reason or "")


def test_run_state_is_starting_until_a_replica_reports() -> None:
    rows = [ReplicaReport(rank=0, state="starting"), ReplicaReport(rank=1, state="pending")]
    assert run_state(rows, 2) == "starting"
    assert run_state([ReplicaReport(rank=0, state="running"), rows[0]], 2) == "running"
    assert run_state([ReplicaReport(rank=0, state="continue"), ReplicaReport(rank=1, state="succeeded")], 2) == \
        "running"  # to continue: not done


def test_build_replica_reports_attempts_and_start_age() -> None:
    starts = RankStarts(attempts=3, started_at=NOW - 40, current_seen=True, billed_before_s=120.0)
    r = build_replica(0, ExecutorState("running"), HB, NOW, 300.0, starts=starts)
    assert (r.state, r.attempts, r.started_age_s, r.billed_before_s) == ("running", 3, 40.0, 120.0)
    waiting = build_replica(1, ExecutorState("running"), None, NOW, 300.0, starts=RankStarts())
    assert (waiting.state, waiting.attempts, waiting.started_age_s) == ("starting", 0, None)


def test_spend_counts_from_each_start_and_not_while_pending() -> None:
    rows = [
        ReplicaReport(rank=0, state="running", started_age_s=30.0, heartbeat_age_s=1.0),  # started 30 s ago
        ReplicaReport(rank=1, state="pending"),  # queued: costs nothing
        ReplicaReport(rank=2, state="starting", heartbeat_age_s=500.0),  # an earlier launch's heartbeat
        ReplicaReport(rank=3, state="succeeded", started_age_s=100.0, heartbeat_age_s=25.0),  # ran 75 s
        ReplicaReport(rank=4, state="running", started_age_s=10.0, billed_before_s=600.0),  # resumed
        ReplicaReport(rank=5, state="failed", started_age_s=10.0, heartbeat_age_s=50.0),  # heartbeat predates start
    ]
    assert billed_seconds(rows, elapsed_s=1000.0) == [30.0, 0.0, 0.0, 75.0, 610.0, 0.0]


def test_start_records_round_trip_signed_and_skip_forgeries(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path / "run"))
    key = b"k" * 32
    write_start(store, 0, 0, launch_id="aaa", key=key, now=100.0)
    write_start(store, 0, 1, launch_id="aaa", key=key, now=200.0)
    write_start(store, 1, 0, launch_id="bbb", key=key, now=150.0)
    write_start(store, 1, 0, launch_id="bbb", key=b"x" * 32, now=160.0)  # someone without the key
    store.put("members/starts/rank-1/0000000000170-zz.json", b"[1, 2]")  # not a record
    cache: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = read_starts(store, key=key, cache=cache)
    assert {r: [(s.time, s.attempt, s.launch_id) for s in recs] for r, recs in got.items()} == {
        0: [(100.0, 0, "aaa"), (200.0, 1, "aaa")], 1: [(150.0, 0, "bbb")]}
    assert sum("signature" in str(w.message) for w in caught) == 1
    assert sum("not a JSON object" in str(w.message) for w in caught) == 1
    assert len(cache) == 5  # each record read once; a later poll only lists
    with pytest.warns(UserWarning, match="not a JSON object"):  # a fresh cache reads it again
        unsigned = read_starts(store)  # without the key: a hint, every well-formed record counts
    assert len(unsigned[1]) == 2
    with pytest.raises(ValueError, match="launch id"):
        write_start(store, 0, 0, launch_id="bad id/..")


def test_launch_history_keeps_older_handles_and_their_billing() -> None:
    first, attempts = merge_launches(None, "local", [{"kind": "local", "rank": 0, "pid": 1},
                                                      {"kind": "local", "rank": 1, "pid": 2}], "L1", 1000.0)
    launch = {"executor": "local", "handles": first, "launch_id": "L1", "attempts": attempts}
    handles, attempts = merge_launches(launch, "local", [{"kind": "local", "rank": 1, "pid": 3}], "L2", 2000.0,
                                       billed={1: 812.34})
    assert [h["pid"] for h in handles] == [1, 3]  # rank 1's newest handle; rank 0 keeps its own
    assert [e["launch_id"] for e in attempts["1"]] == ["L1", "L2"] and attempts["1"][0]["billed_s"] == 812.3
    current = current_launches({"handles": handles, "attempts": attempts})
    assert current[1] == (RankLaunch("L2", 2000.0, None), 812.3) and current[0][1] == 0.0
    # an older record without attempts: each handle is one launch made at launched_at
    legacy = current_launches({"handles": [{"kind": "local", "rank": 0}], "launched_at": "1970-01-01T00:16:40Z"})
    assert legacy[0][0].launched_at == 1000.0
    # bad entries written into run.json are left out, never raise
    assert current_launches({"attempts": {"0": "x", "y": [], "1": [5, {"billed_s": -1}]}}) == {
        1: (RankLaunch(None, None, None), 0.0)}


def test_start_records_of_the_current_launch() -> None:
    recs = [StartRecord(0, 50.0, 0, "L1"), StartRecord(0, 150.0, 0, "L2"), StartRecord(0, 160.0, 1, None)]
    assert of_launch(recs, RankLaunch("L2", 100.0)) == [recs[1]]
    assert of_launch(recs, RankLaunch("L3", 155.0)) == [recs[2]]  # an older replica without launch ids
    assert of_launch(recs, RankLaunch(None, None)) == []
