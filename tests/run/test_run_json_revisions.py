"""Finding 8: run.json versions are ordered; an older, validly signed run.json put back is refused."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.run.integrity import RUN_KEY_ENV, load_local_revision, new_run_key, parse_run_key
from diloco_serverless.run.record import InvalidRun, create_run, load_run, record_launch

KEY = parse_run_key(new_run_key(), source="test")


def test_an_older_run_json_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCO_KEYS_DIR", str(tmp_path / "keys"))
    monkeypatch.delenv(RUN_KEY_ENV, raising=False)
    cfg = RunConfig.load(None, [f"run_id=run-{uuid.uuid4().hex[:6]}", "replicas=2", f'store="{tmp_path / "s"}"'])
    run_store, _ = create_run(None, cfg, key=KEY)
    first = run_store.get("run.json")
    record_launch(run_store, "local", [{"kind": "local", "rank": 0, "pid": 1}], key=KEY)
    second = run_store.get("run.json")
    record_launch(run_store, "local", [{"kind": "local", "rank": 0, "pid": 2}], key=KEY)
    assert json.loads(run_store.get("run.json"))["revision"] == 3 == load_local_revision(run_store.url)
    for old in (first, second):  # both still carry a valid signature
        run_store.put("run.json", old)
        with pytest.raises(InvalidRun, match="older than revision 3"):
            load_run(run_store.url, key=KEY)
        with pytest.raises(InvalidRun, match="older than revision 3"):
            record_launch(run_store, "local", [], key=KEY)
