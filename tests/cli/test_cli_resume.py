"""``diloco resume`` end to end: a real local run (tiny model, 2 replicas) is cancelled mid-way, then
resumed from the store with the real replica entrypoint, and finishes with a loadable ``final/``.
``status`` then shows each rank's two attempts (start records of both launches)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from diloco_serverless.cli.app import app

pytestmark = pytest.mark.slow

TINY = ["--replicas", "2", "--set", "inner.sync_every=2", "--set", "data.batch_size=1",
        "--set", "data.seq_len=32", "--set", "data.prompt_len=8", "--set", "data.hint_len=8",
        "--set", "data.eval_batches=1", "--set", "checkpoint_every=1", "--set", "eval_every=2"]
runner = CliRunner()


def _diloco(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "diloco_serverless.cli", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout)


def _heartbeat(run: Path, rank: int) -> dict[str, Any]:
    try:
        return dict(json.loads((run / "members" / f"rank-{rank}.json").read_text()))
    except (FileNotFoundError, ValueError):
        return {}


def test_a_cancelled_run_resumes_to_a_loadable_final_model(tmp_path: Path) -> None:
    launched = _diloco("launch", "--run-id", "rs", "--detach", "--set", "rounds=10", *TINY, cwd=tmp_path, timeout=60)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    run = tmp_path / "runs" / "rs"
    try:
        deadline = time.monotonic() + 150
        while not all(_heartbeat(run, r).get("round", 0) >= 1 for r in (0, 1)):  # round 0 done and checkpointed
            assert time.monotonic() < deadline, "the run did not finish its first round"
            time.sleep(0.3)
        cancelled = _diloco("cancel", str(run), cwd=tmp_path, timeout=60)
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        assert not (run / "final").exists()
        first = json.loads((run / "run.json").read_text())["launch"]

        resumed = _diloco("resume", str(run), "--poll-interval", "0.5", cwd=tmp_path, timeout=300)
    finally:
        _diloco("cancel", str(run), cwd=tmp_path, timeout=60)  # nothing is left running, whatever happened
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed rank(s) 0, 1 of run rs on local" in resumed.stdout
    assert "run rs succeeded" in resumed.stdout and "rounds          : 10/10" in resumed.stdout

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert sum(p.numel() for p in model.parameters()) > 0

    launch = json.loads((run / "run.json").read_text())["launch"]
    assert launch["resumed"] == [0, 1] and launch["launch_id"] != first["launch_id"]
    assert [len(launch["attempts"][r]) for r in ("0", "1")] == [2, 2]
    assert all(launch["attempts"][r][0]["billed_s"] > 0 for r in ("0", "1"))  # the first launch's time
    assert [h["pid"] for h in launch["handles"]] != [h["pid"] for h in first["handles"]]
    status = runner.invoke(app, ["status", str(run)])
    rows = [line for line in status.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == 2 and all("succeeded" in r for r in rows), status.output
    assert all(r.split("│")[8].strip() == "2" for r in rows), status.output  # attempts: one start per launch
