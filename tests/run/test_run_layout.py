"""run.py: layout keys, create-only run.json, load errors, launch record, heartbeats, metrics, listing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.run.layout import (
    RUN_JSON,
    abstain_key,
    checkpoint_prefix,
    contrib_key,
    control_spread,
    log_key,
    member_key,
    metrics_key,
    quorum_key,
    ready_key,
    ready_prefixes,
    reduced_key,
)
from diloco_serverless.run.members import (
    Heartbeat,
    read_members,
    read_metrics,
    write_heartbeat,
    write_metrics,
)
from diloco_serverless.run.record import (
    InvalidRun,
    RunExists,
    RunNotFound,
    create_run,
    join_run_url,
    list_runs,
    load_run,
    record_launch,
    split_run_url,
)
from diloco_serverless.store.objectstore import ObjectStore


def _cfg(run_id: str = "run-a", **kw: object) -> RunConfig:
    return RunConfig(run_id=run_id, **kw)  # type: ignore[arg-type]


def test_keys_match_the_documented_layout() -> None:
    assert ready_key(3, 1) == "rounds/00000003/ready/rank-1"
    assert ready_key(3, 1, "0a9f") == "rounds/00000003/ready/rank-1.0a9f"
    # above 64 replicas the markers (and abstentions) of rank r are under x<r mod control_spread(N)>
    assert [control_spread(n) for n in (16, 17, 64, 65, 256, 1024)] == [1, 1, 1, 2, 4, 16]
    assert ready_key(3, 17, "0a9f", spread=16) == "x01/00000003/ready/rank-17.0a9f"
    assert abstain_key(3, 17, 16) == "x01/00000003/ready/abstain-17"
    assert abstain_key(3, 17) == "rounds/00000003/ready/abstain-17"
    assert ready_prefixes(3) == ["rounds/00000003/ready"] and len(set(ready_prefixes(3, 16))) == 16
    for bad_tag in ("", "0A9F", "../x", "g1", "a" * 129):
        with pytest.raises(ValueError, match="tag"):
            ready_key(3, 1, bad_tag)
    assert quorum_key(0) == "rounds/00000000/quorum.json"
    assert contrib_key(12, 2, 7) == "rounds/00000012/contrib/0002/rank-7"
    assert reduced_key(12, 2) == "rounds/00000012/reduced/0002"
    assert checkpoint_prefix(5) == "checkpoints/00000005"
    assert member_key(3) == "members/rank-3.json"
    assert metrics_key(0, 9) == "metrics/rank-0/00000009.json"
    assert log_key(2) == "logs/rank-2.log"
    for bad in (-1, 10**8, 1.5, True):
        with pytest.raises(ValueError, match="round"):
            ready_key(bad, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shard"):
        reduced_key(0, 10_000)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://b/prefix/run-x", ("s3://b/prefix", "run-x")),
        ("s3://b/run-x/", ("s3://b", "run-x")),
        ("file:///tmp/runs/r", ("file:///tmp/runs", "r")),
        ("runs/run-x", ("runs", "run-x")),
        ("run-x", (".", "run-x")),
        ("/run-x", ("/", "run-x")),
    ],
)
def test_split_run_url(url: str, expected: tuple[str, str]) -> None:
    assert split_run_url(url) == expected
    if expected[0] not in (".", "/"):
        assert join_run_url(*expected) == url.rstrip("/")


def test_split_run_url_without_run_id() -> None:
    with pytest.raises(ValueError, match="has no run id"):
        split_run_url("s3://bucket")


def test_create_is_create_only_and_load_round_trips(file_store_url: str) -> None:
    store, record = create_run(file_store_url, _cfg(replicas=2))
    assert store.url.endswith("/store/run-a") and record.launch is None
    assert record.config.store == ObjectStore(file_store_url).url  # normalised, absolute
    with pytest.raises(RunExists, match="run-a already exists"):
        create_run(file_store_url, _cfg(replicas=3))
    loaded_store, loaded = load_run(join_run_url(file_store_url, "run-a"))
    assert loaded.config == record.config and loaded.config.replicas == 2
    assert loaded.run_id == "run-a" and loaded.version == 1 and loaded.url == loaded_store.url
    raw = json.loads(store.get(RUN_JSON))
    assert set(raw) == {"run_id", "created_at", "version", "config", "launch", "revision"}


def test_create_uses_config_store_when_none(tmp_path: Path) -> None:
    store, _ = create_run(None, _cfg(store=str(tmp_path / "s")))
    assert (tmp_path / "s" / "run-a" / RUN_JSON).is_file() and store.exists(RUN_JSON)


def test_load_errors_name_the_url(memory_store_url: str) -> None:
    root = ObjectStore(memory_store_url)
    with pytest.raises(RunNotFound, match=f"no run at {memory_store_url}/missing"):
        load_run(f"{memory_store_url}/missing")
    root.put("broken/run.json", b"{not json")
    with pytest.raises(InvalidRun, match="broken/run.json is not valid JSON"):
        load_run(f"{memory_store_url}/broken")
    root.put_json("partial/run.json", {"run_id": "partial"})
    with pytest.raises(InvalidRun, match="lacks"):
        load_run(f"{memory_store_url}/partial")
    bad_cfg = {"run_id": "x", "created_at": "t", "version": 1, "config": {"replicas": 0}, "launch": None}
    root.put_json("badcfg/run.json", bad_cfg)
    with pytest.raises(InvalidRun, match=r"badcfg/run.json[\s\S]*replicas"):
        load_run(f"{memory_store_url}/badcfg")
    root.put_json("future/run.json", {**bad_cfg, "version": 99, "config": {}})
    with pytest.raises(InvalidRun, match="upgrade"):
        load_run(f"{memory_store_url}/future")


def test_record_launch(memory_store_url: str) -> None:
    store, _ = create_run(memory_store_url, _cfg())
    handles = [{"kind": "local", "rank": r, "pid": 100 + r} for r in range(2)]
    rec = record_launch(store.url, "local", handles, gpu=None)
    assert rec.launch is not None and rec.launch["executor"] == "local" and rec.launch["handles"] == handles
    assert load_run(store.url)[1].launch == rec.launch
    with pytest.raises(ValueError, match="looks like an AWS access key id"):
        record_launch(store, "modal", [{"kind": "modal", "rank": 0, "env": "AKIAIOSFODNN7EXAMPLE"}])
    with pytest.raises(ValueError, match="JSON-serialisable"):
        record_launch(store, "local", [{"kind": "local", "rank": 0, "obj": object()}])
    assert load_run(store)[1].launch == rec.launch  # failed records leave run.json unchanged


def test_heartbeats(memory_store_url: str) -> None:
    store, _ = create_run(memory_store_url, _cfg())
    assert read_members(store) == {}
    write_heartbeat(store, Heartbeat(rank=1, round=2, step=40, loss=1.5, state="training", bytes_up=10))
    write_heartbeat(store, Heartbeat(rank=0, round=2, step=41, loss=math.nan, state="syncing"))
    write_heartbeat(store, Heartbeat(rank=1, round=3, step=56, loss=1.2, state="training"))
    members = read_members(store)
    assert list(members) == [0, 1]
    assert members[1].round == 3 and members[1].loss == 1.2 and members[1].age_s >= 0
    assert math.isnan(members[0].loss or 0.0)
    with pytest.raises(ValueError, match="state 'sleeping' of rank 0"):
        write_heartbeat(store, Heartbeat(rank=0, state="sleeping"))
    store.put("members/rank-7.json", b"garbage")
    with pytest.warns(UserWarning, match="rank-7.json"):
        assert list(read_members(store)) == [0, 1]


def test_metrics(memory_store_url: str) -> None:
    store, _ = create_run(memory_store_url, _cfg())
    write_metrics(store, 1, 0, {"loss": 2.0})
    write_metrics(store, 0, 1, {"loss": 1.5, "eval_loss": math.inf})
    write_metrics(store, 0, 0, {"loss": 2.1, "tokens_per_s": 1000.0})
    rows = read_metrics(store)
    assert [(r["round"], r["rank"]) for r in rows] == [(0, 0), (0, 1), (1, 0)]
    assert rows[2]["eval_loss"] == math.inf and "time" in rows[0]
    assert [r["round"] for r in read_metrics(store, rank=0)] == [0, 1]
    with pytest.raises(ValueError, match="rank 0 round 2"):
        write_metrics(store, 0, 2, {"bad": object()})


def test_list_runs(memory_store_url: str) -> None:
    create_run(memory_store_url, _cfg("run-b"))
    create_run(memory_store_url, _cfg("run-a"))
    root = ObjectStore(memory_store_url)
    root.put("not-a-run/file.txt", b"x")
    root.put("run-a/members/rank-0.json", b"{}")
    root.put("corrupt/run.json", b"[]")
    with pytest.warns(UserWarning, match="corrupt"):
        runs = list_runs(memory_store_url)
    assert sorted(r.run_id for r in runs) == ["run-a", "run-b"]
    assert all(r.url == join_run_url(root.url, r.run_id) for r in runs)
    assert list_runs(f"{memory_store_url}/empty") == []


@pytest.mark.parametrize("backend", ["memory", "file", "s3", "gcs"])
def test_list_runs_reads_only_top_level_run_json(backend: str, request: pytest.FixtureRequest,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    url = request.getfixturevalue(f"{backend}_store_url") + "/runs"
    options = request.getfixturevalue(f"{backend}_storage_options") if backend in ("s3", "gcs") else None
    root = ObjectStore(url, options)
    create_run(root, _cfg("run-a"))
    create_run(root, _cfg("run-b"))
    root.put("run-a/rounds/00000000/quorum.json", b"{}")
    root.put("run-b/nested/run.json", b"[]")  # not a run: not directly under the store
    root.put("loose/deeper/run.json", b"[]")
    root.put("run.json", b"[]")  # a file at the top, not a run folder

    def no_recursive_listing(self: ObjectStore, prefix: str = "") -> list[str]:
        raise AssertionError(f"list_runs listed {self.url}/{prefix} recursively")

    monkeypatch.setattr(ObjectStore, "list", no_recursive_listing)
    runs = list_runs(root)
    assert [r.run_id for r in runs] == ["run-a", "run-b"]
    assert [r.url for r in runs] == [join_run_url(root.url, "run-a"), join_run_url(root.url, "run-b")]
    assert list_runs(root.child("run-a")) == []


def test_create_makes_a_relative_jsonl_source_absolute(
    tmp_path: Path, memory_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "train.jsonl").write_text('{"prompt": "p", "response": "r"}\n')
    monkeypatch.chdir(tmp_path)
    _, record = create_run(memory_store_url, _cfg(data={"source": "train.jsonl"}))
    assert record.config.data.source == str(tmp_path / "train.jsonl")
    _, remote = create_run(memory_store_url, _cfg("run-s3", data={"source": "s3://b/train.jsonl"}))
    assert remote.config.data.source == "s3://b/train.jsonl"
