"""``diloco replay``: a trace against three teachers on a local server, into a preference dataset the
data layer reads (and hints for prompt_response); a re-run pays nothing; bad input is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import KEY_ENV
from replay_fixtures import N_STATES, script, write_teachers, write_trace
from typer.testing import CliRunner

from diloco_serverless.cli.app import app
from diloco_serverless.config import DataColumns
from diloco_serverless.data.formats import detect_format, record_from_row
from diloco_serverless.replay.output import read_rows
from support.fake_openai import FakeOpenAI

runner = CliRunner()


def test_replay_writes_a_preference_dataset(tmp_path: Path, api_key: str) -> None:
    pytest.importorskip("pyarrow")
    trace = write_trace(tmp_path / "trace.jsonl")
    out, hints, calls = tmp_path / "pairs.parquet", tmp_path / "hints.parquet", tmp_path / "calls.jsonl"
    with FakeOpenAI(script) as server:
        teachers = write_teachers(tmp_path / "teachers.toml", server.url, KEY_ENV)
        args = ["replay", str(trace), "--teachers", str(teachers), "--max-usd", "1", "-o", str(out),
                "--hints", str(hints), "--records", str(calls), "-j", "4"]
        res = runner.invoke(app, args)
        assert res.exit_code == 0, res.output
        asked = len(server.requests)
        assert asked == 3 * N_STATES
        # the table per teacher and the reasons
        assert "teachers" in res.output and "agreement" in res.output
        assert "no pair, the teachers' consensus is the student's own action: 1" in res.output
        assert f"wrote {N_STATES - 1} pairs" in res.output

        again = runner.invoke(app, args)  # the re-run: every answer from the cache
        assert again.exit_code == 0, again.output
        assert len(server.requests) == asked and "spent $0.0000" in again.output

    rows = read_rows(out)
    assert len(rows) == N_STATES - 1
    cols = DataColumns()
    assert detect_format(list(rows[0]), cols, "pairs") == "preference"
    for row in rows:
        rec = record_from_row(row, "preference", cols, row["state_id"])  # what data.format = "preference" reads
        assert rec.chosen == row["chosen"] and rec.rejected == row["rejected"] and rec.hint == row["hint"]
        assert isinstance(rec.prompt, tuple) and rec.prompt[-1][0] == "tool"
        assert '"name": "read_file"' in row["chosen"] and row["n_teachers_agreeing"] >= 2
        assert row["chosen_messages"][-1] == {"role": "assistant", "content": row["chosen"]}
    even = next(r for r in rows if r["state_id"] == "ep1-0")
    assert even["rejected"] == '{"arguments": {"path": "/etc/passwd"}, "name": "cat"}'
    assert even["prompt"][2]["content"] == '{"arguments": {"path": "/etc"}, "name": "ls"}'  # a tool call as text
    hint_rows = read_rows(hints)
    assert {r["state_id"] for r in hint_rows} == {f"ep1-{i}" for i in range(N_STATES)}
    for row in hint_rows:
        rec = record_from_row(row, "prompt_response", cols, row["state_id"])
        assert rec.hint and rec.hint.startswith("A reference answer: ")
    records = calls.read_text()
    assert api_key not in records and api_key not in res.output and api_key not in again.output
    assert all(api_key not in p.read_text() for p in (tmp_path / "pairs.cache").rglob("*.json"))


def test_budget_stop_is_reported_and_exit_zero(tmp_path: Path, api_key: str) -> None:
    trace = write_trace(tmp_path / "trace.jsonl")
    with FakeOpenAI(script) as server:
        teachers = write_teachers(tmp_path / "teachers.toml", server.url, KEY_ENV)
        res = runner.invoke(app, ["replay", str(trace), "--teachers", str(teachers), "--max-usd", "0.003",
                                  "-o", str(tmp_path / "p.jsonl"), "-j", "2"])
    assert res.exit_code == 0, res.output
    assert "stopped: budget ceiling" in res.output and "not replayed" in res.output


@pytest.mark.parametrize(("extra", "message"), [
    (["--teachers", "no-such-preset"], "is neither a teacher file nor a preset (openrouter-frontier)"),
    (["--teachers", "openrouter-frontier", "-o", "x.csv"], "must end with .parquet or .jsonl"),
    (["--teachers", "openrouter-frontier", "--max-usd", "-1"], "--max-usd must be >= 0"),
    (["--teachers", "openrouter-frontier"], "$OPENROUTER_API_KEY, which is not set"),
])
def test_bad_input_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str],
                               message: str) -> None:
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    trace = write_trace(tmp_path / "trace.jsonl", 2)
    base = {"--max-usd": "1", "-o": str(tmp_path / "p.jsonl")}
    args = ["replay", str(trace)]
    for k, v in base.items():
        if k not in extra:
            args += [k, v]
    res = runner.invoke(app, args + extra)
    assert res.exit_code == 2, res.output
    assert message in res.output
