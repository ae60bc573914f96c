"""Reading a run's folder that someone else may have written (the "trust nothing from the bucket"
issue): heartbeats and metrics of any JSON type never raise (B), and run.json's run_id must be a run id
naming its own folder, so ``list_runs`` skips and names a record that is not (C)."""

from __future__ import annotations

import json
import math

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.run.layout import member_key
from diloco_serverless.run.members import Heartbeat, read_members, read_metrics, write_heartbeat
from diloco_serverless.run.record import InvalidRun, RunRecord, create_run, list_runs, load_run
from diloco_serverless.store.objectstore import ObjectStore


def _cfg(run_id: str = "run-a") -> RunConfig:
    return RunConfig.load(None, [f"run_id={run_id!r}", "rounds=2"])


# ------------------------------------------------------------------------------------ B: heartbeats
def test_heartbeat_from_json_dict_marks_bad_fields() -> None:
    hb = Heartbeat.from_json_dict({"rank": 2, "round": "x", "step": 1e309, "loss": "nan", "attempt": [1],
                                   "time": "now", "state": 3, "bytes_up": -1, "message": {"a": 1}})
    assert (hb.rank, hb.round, hb.step, hb.attempt, hb.time, hb.state, hb.bytes_up, hb.message) == (
        2, None, None, None, None, None, None, None)
    assert math.isnan(hb.loss or 0.0)  # "nan" is how a replica writes a non-finite loss
    assert hb.invalid == {"round": "is not an integer", "step": "is not an integer", "attempt": "is not an integer",
                          "time": "is not a timestamp", "state": "is not a string", "bytes_up": "is out of range",
                          "message": "is not a string"}
    assert hb.age_s is None
    assert hb.to_json_dict()["invalid"] == hb.invalid
    with pytest.raises(ValueError, match="heartbeat field 'rank' is not an integer"):
        Heartbeat.from_json_dict({"rank": "x"})
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        Heartbeat.from_json_dict([1, 2])


def test_heartbeat_round_trip_is_unchanged() -> None:
    hb = Heartbeat(rank=1, round=2, step=40, loss=1.5, state="training", bytes_up=10, time=5.0)
    d = hb.to_json_dict()
    assert "invalid" not in d  # nothing new is stored
    assert Heartbeat.from_json_dict(json.loads(json.dumps(d))) == hb


def test_read_members_trusts_the_key_not_the_body(memory_store_url: str) -> None:
    """B: the rank is the one the key names; odd keys and undecodable bodies are skipped, not raised."""
    store, _ = create_run(memory_store_url, _cfg())
    write_heartbeat(store, Heartbeat(rank=0, round=2, state="training"))
    store.put(member_key(1), json.dumps({"rank": 0, "round": 9, "state": "done"}).encode())  # claims rank 0
    store.put("members/rank-01.json", json.dumps({"rank": 1, "round": 7}).encode())  # not a canonical key
    store.put("members/notes.json", b"{}")
    store.put(member_key(2), b"[" * 100_000 + b"]" * 100_000)  # deep enough for a RecursionError
    store.put(member_key(3), json.dumps({"round": "x"}).encode())  # no rank in the body: the key's
    with pytest.warns(UserWarning, match="rank-2.json"):
        members = read_members(store)
    assert sorted(members) == [0, 1, 3]
    assert members[0].round == 2
    assert members[1].round == 9 and members[1].invalid == {"rank": "says 0, but the heartbeat is rank-1.json"}
    assert members[3].round is None and members[3].invalid == {"round": "is not an integer"}


def test_read_metrics_sorts_records_of_any_type(memory_store_url: str) -> None:
    store, _ = create_run(memory_store_url, _cfg())
    store.put("metrics/rank-0/00000001.json", b'{"rank": 0, "round": 1, "loss": 1.0}')
    store.put("metrics/rank-0/00000002.json", b'{"rank": "zero", "round": "two", "loss": 1.0}')
    store.put("metrics/rank-1/00000000.json", b'{"rank": 1, "round": [0]}')
    rows = read_metrics(store)
    assert [r["round"] for r in rows] == ["two", [0], 1]  # unusable rounds (and ranks) first, no TypeError


# ------------------------------------------------------------------------------------ C: run.json
def _record(run_id: object, **extra: object) -> bytes:
    config = _cfg("run-x").to_json_dict()
    body = {"run_id": run_id, "created_at": "t", "version": 1, "config": config, "launch": None, **extra}
    return json.dumps(body).encode()


@pytest.mark.parametrize("folder,body,why", [
    ("run-x", _record("../../etc"), "has run_id '../../etc', which is not a run id"),
    ("run-x", _record(7), "has run_id 7, which is not a run id"),
    ("run-y", _record("run-x"), "has run_id 'run-x' but sits in folder 'run-y'"),
    ("run-x", _record("run-x", config=[]), "'config' must be an object, got list"),
    ("run-x", _record("run-x", config={**_cfg("run-z").to_json_dict()}), "but its config says 'run-z'"),
    ("run-x", b"[" * 100_000, "is not valid JSON (RecursionError)"),
], ids=["escapes the store", "not a string", "another folder", "config a list", "config's run_id",
        "deep nesting"])
def test_list_runs_skips_and_names_invalid_records(memory_store_url: str, folder: str, body: bytes,
                                                   why: str) -> None:
    """C: one invalid run.json is reported through ``skipped`` and the other runs are listed."""
    create_run(memory_store_url, _cfg("run-a"))
    root = ObjectStore(memory_store_url)
    root.put(f"{folder}/run.json", body)
    skipped: list[tuple[str, str]] = []
    assert [r.run_id for r in list_runs(root, skipped=skipped)] == ["run-a"]
    assert len(skipped) == 1 and skipped[0][0] == folder and why in skipped[0][1], skipped
    if why != "is not valid JSON (RecursionError)":  # load_run (status, logs, replicas) refuses it too
        with pytest.raises(InvalidRun, match=why.replace("(", r"\(").replace(")", r"\)")):
            load_run(root.child(folder))


def test_run_record_from_json_dict_without_url_checks_the_pattern_only() -> None:
    record = RunRecord.from_json_dict(json.loads(_record("run-x")), url="")
    assert record.run_id == "run-x"
    with pytest.raises(InvalidRun, match="not a run id"):
        RunRecord.from_json_dict(json.loads(_record("a/b")), url="")


def test_a_null_field_is_unknown_not_invalid() -> None:
    """The trainer writes ``"loss": null`` in its final heartbeat; status must not call that malformed."""
    from diloco_serverless.run.members import Heartbeat

    hb = Heartbeat.from_json_dict({"rank": 0, "round": 3, "loss": None, "message": None, "state": "done"}, rank=0)
    assert hb.loss is None and hb.invalid == {}
