"""What ``launch`` does for run integrity: a fresh key per run, signed run.json, the key only out of
band, no adoption of an earlier run's leftovers, remote code only on the launcher's word."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.errors import LaunchError
from diloco_serverless.launcher.api import Run, launch
from diloco_serverless.run.integrity import RUN_KEY_ENV, load_local_key, verify_json
from diloco_serverless.run.record import InvalidRun
from diloco_serverless.store.objectstore import ObjectStore
from support.fake_executor import FakeExecutor


def _cfg(tmp_path: Path, run_id: str = "run-a", **extra: str) -> RunConfig:
    return RunConfig.load(None, [f"run_id={run_id}", "replicas=2", "rounds=2", f'store="{tmp_path / "runs"}"',
                                 *[f"{k}={v}" for k, v in extra.items()]])


def test_each_run_gets_a_key_that_signs_run_json_and_stays_out_of_the_store(tmp_path: Path) -> None:
    ex = FakeExecutor()
    run = launch(_cfg(tmp_path), executor=ex)
    key_hex = ex.launched[0]["env"][RUN_KEY_ENV]
    key = bytes.fromhex(key_hex)
    assert load_local_key(run.url) == key
    assert verify_json(key, "run.json", json.loads(ObjectStore(run.url).get("run.json")), place="run.json")
    for path in (tmp_path / "runs").rglob("*"):
        if path.is_file():
            assert key_hex.encode() not in path.read_bytes(), path
    other = FakeExecutor()
    launch(_cfg(tmp_path, "run-b"), executor=other)
    assert other.launched[0]["env"][RUN_KEY_ENV] != key_hex


def test_attach_verifies_run_json_on_the_launching_machine(tmp_path: Path) -> None:
    run = launch(_cfg(tmp_path), executor=FakeExecutor())
    assert Run.attach(run.url).verified
    store = ObjectStore(run.url)
    doc = json.loads(store.get("run.json"))
    doc["launch"]["handles"][0]["job"] = "someone-elses-job"
    store.put("run.json", json.dumps(doc).encode())
    with pytest.raises(InvalidRun, match="signature"):
        Run.attach(run.url)


def test_an_earlier_runs_leftovers_are_not_adopted(tmp_path: Path) -> None:
    """Before: launching into a folder that held rounds and a final/ of an old run (but no run.json)
    reported success after training zero rounds, adopting the old final/."""
    old = ObjectStore(str(tmp_path / "runs" / "run-a"))
    old.put("final/DONE.json", b"{}")
    old.put("rounds/00000000/quorum.json", b"{}")
    ex = FakeExecutor()
    with pytest.raises(LaunchError, match=r"already holds 2 objects of an earlier run.*--overwrite"):
        launch(_cfg(tmp_path), executor=ex)
    assert not ex.launched and not old.exists("run.json")
    run = launch(_cfg(tmp_path), executor=ex, overwrite=True)
    assert not ObjectStore(run.url).exists("rounds/00000000/quorum.json")
    assert len(ex.launched) == 1


def test_trust_remote_code_needs_the_launchers_word(tmp_path: Path) -> None:
    ex = FakeExecutor()
    cfg = _cfg(tmp_path, **{"model.trust_remote_code": "true"})
    with pytest.raises(LaunchError, match="--trust-remote-code"):
        launch(cfg, executor=ex)
    assert not ex.launched and not (tmp_path / "runs" / "run-a").exists()
    launch(cfg, executor=ex, trust_remote_code=True)
    assert ex.launched[0]["env"]["DILOCO_TRUST_REMOTE_CODE"] == "1"
    plain = FakeExecutor()
    launch(_cfg(tmp_path, "run-b"), executor=plain)
    assert "DILOCO_TRUST_REMOTE_CODE" not in plain.launched[0]["env"]
