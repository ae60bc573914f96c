"""End to end: a trace replayed against three teachers on a local server (``diloco replay``) gives
``pairs.parquet``, and ``diloco launch`` on the local executor trains on it with ``data.format =
"preference"``: channel 3 (trace-replay SimPO) is on, its loss finite and positive in every round's
metrics, and the hint column feeds channel 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import KEY_ENV
from replay_fixtures import script, write_teachers, write_trace
from typer.testing import CliRunner

from diloco_serverless.cli.app import app
from support.examples_e2e import offline_env, save_tiny_model
from support.fake_openai import FakeOpenAI

pytestmark = pytest.mark.slow

runner = CliRunner()
ROUNDS = 2


def test_replayed_trace_trains_channel_3(tmp_path: Path, api_key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("datasets")
    for name, value in offline_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    trace = write_trace(tmp_path / "trace.jsonl", 24)
    pairs = tmp_path / "pairs.parquet"
    with FakeOpenAI(script) as server:
        teachers = write_teachers(tmp_path / "teachers.toml", server.url, KEY_ENV)
        res = runner.invoke(app, ["replay", str(trace), "--teachers", str(teachers), "--max-usd", "1",
                                  "-o", str(pairs), "-j", "8"])
    assert res.exit_code == 0, res.output
    assert "wrote 23 pairs" in res.output

    model = save_tiny_model(tmp_path / "tiny-qwen2")
    sets = {
        "model.name": json.dumps(str(model)), "data.source": json.dumps(str(pairs)), "data.format": '"preference"',
        "data.seq_len": "256", "data.batch_size": "2", "data.hint_len": "16", "data.eval_batches": "1",
        "data.eval_fraction": "0.1", "data.prefetch": "0", "loss.beta_replay": "1.0", "loss.alpha_sdpo": "0.5",
        "loss.dpo_variant": '"simpo"', "rounds": str(ROUNDS), "inner.sync_every": "2", "inner.warmup_steps": "1",
        "checkpoint_every": "0", "eval_every": "0", "exchange.poll_interval_s": "0.1",
    }
    args = ["launch", "--replicas", "2", "--store", str(tmp_path / "runs"), "--run-id", "replayed", "--retries", "0",
            "--poll-interval", "0.5"]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    res = runner.invoke(app, args)
    run = tmp_path / "runs" / "replayed"
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((run / "logs").glob("rank-*.log")))
    assert res.exit_code == 0, res.output + logs
    for rank in (0, 1):
        records = [json.loads(p.read_text()) for p in sorted((run / "metrics" / f"rank-{rank}").glob("*.json"))]
        assert [m["round"] for m in records] == list(range(ROUNDS)), records
        for m in records:
            assert math.isfinite(m["trace_replay_dpo"]) and m["trace_replay_dpo"] > 0, m  # channel 3 trained
            assert math.isfinite(m["sdpo_jsd"]) and m["sdpo_jsd"] > 0, m  # channel 2 read the hint column
            assert math.isfinite(m["total"])
