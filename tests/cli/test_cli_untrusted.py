"""``diloco`` against a bucket an attacker can write to: everything under a run's prefix is untrusted.

Findings of the "trust nothing from the bucket" issue, each proved at the command line:
A: heartbeat text, run.json fields and logs reach the terminal as text (no Rich markup, no escapes);
B: malformed heartbeats and metrics show ``?`` with a note instead of crashing status and plot;
C: ``diloco ls`` skips (and names) a run whose run.json is invalid;
D: a secret refused in --set / -x is never echoed;
E: --max-usd must be finite and positive;
F: local replicas beyond what the machine holds are refused unless -x oversubscribe=true.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from diloco_serverless.cli.app import app
from diloco_serverless.launcher import api, preflight
from diloco_serverless.run.layout import log_key, member_key, metrics_key
from diloco_serverless.store.objectstore import ObjectStore
from support.fake_executor import FakeExecutor, use_fake_executor

runner = CliRunner()

#: Rich markup that crashes (``[/]`` closes nothing) or would become a hyperlink, an OSC 8 hyperlink
#: escape sequence, a colour escape, and a right-to-left override.
EVIL = "[/] [link=http://evil]click[/link] \x1b]8;;http://evil\x1b\\here\x1b]8;;\x1b\\ \x1b[31mred\u202e"
HF_TOKEN = "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH"


def _launched(*args: str) -> str:
    result = runner.invoke(app, ["launch", "--run-id", "r1", "--set", "rounds=3", "--poll-interval", "0.1", *args])
    assert result.exit_code == 0, result.output
    return "runs/r1"


def _heartbeat(run: str, rank: int, body: dict[str, Any] | str) -> None:
    raw = body if isinstance(body, str) else json.dumps(body)
    ObjectStore(run).put(member_key(rank), raw.encode())


def _assert_inert(output: str) -> None:
    """Nothing that drives the terminal: no ESC (ANSI/OSC 8), no bidi override, no traceback."""
    assert "\x1b" not in output and "\u202e" not in output
    assert "Traceback" not in output


# ------------------------------------------------------------------------------------ A: text, not markup
@pytest.mark.parametrize("watch", [False, True], ids=["status", "status --watch"])
def test_status_prints_heartbeat_text_not_markup(workdir: Path, fake: FakeExecutor,
                                                 monkeypatch: pytest.MonkeyPatch, watch: bool) -> None:
    """A: a heartbeat message with ``[/]``, ``[link=...]`` and escape sequences is shown as text."""
    run = _launched()
    no_sdk = lambda launch, run_url=None: (None, "no SDK here")  # noqa: E731 - heartbeats rule
    monkeypatch.setattr(api, "executor_from_launch", no_sdk)
    for rank in range(4):
        _heartbeat(run, rank, {"rank": rank, "round": 3, "state": "failed" if rank == 1 else "done",
                               "time": time.time(), "message": EVIL if rank == 1 else None})
    result = runner.invoke(app, ["status", run, *(["--watch", "--interval", "0.1"] if watch else [])])
    assert result.exit_code == 0, result.output
    _assert_inert(result.output)
    row = next(line for line in result.stdout.splitlines() if line.startswith("│    1 "))
    assert "[/] [link=http://evil]click[/link]" in row  # printed as written, not interpreted
    assert "\\x1b]8;;http" in result.stdout  # the escape made visible (the note cell may wrap)


def test_ls_prints_run_json_fields_as_text(workdir: Path, fake: FakeExecutor) -> None:
    """A: run.json's created_at and launch.executor are shown as text in ``diloco ls``."""
    run = _launched()
    path = workdir / run / "run.json"
    record = json.loads(path.read_text())
    record["created_at"] = "[/]\x1b[2J"
    record["launch"]["executor"] = "[link=http://evil]local[/link]"
    path.write_text(json.dumps(record))
    result = runner.invoke(app, ["ls", "runs"])
    assert result.exit_code == 0, result.output
    _assert_inert(result.output)
    line = next(line for line in result.stdout.splitlines() if " r1 " in line)
    assert "[/]\\x1b[2J" in line and "[link=http://evil]local[/link]" in line


class _EvilLogs(FakeExecutor):
    """Replicas whose log (in the store) holds escape sequences; rank 2 fails."""

    def launch_replicas(self, n_replicas: int, entrypoint: str, entrypoint_args: list[str],
                        env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        handles = super().launch_replicas(n_replicas, entrypoint, entrypoint_args, env)
        store = ObjectStore((env or {})["DILOCO_RUN_URL"])
        store.put(log_key(2), f"starting\n{EVIL}\ncrashed [/]\n".encode())
        return handles


def test_launch_summary_and_failed_log_tail_are_text(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A: the failed rank's log tail printed after an attached launch is text (markup and escapes inert)."""
    use_fake_executor(monkeypatch, _EvilLogs(fail_ranks=(2,)))
    result = runner.invoke(app, ["launch", "--run-id", "r1", "--poll-interval", "0.1"])
    assert result.exit_code == 1, result.output
    _assert_inert(result.output)
    assert "rank 2 failed: exit code 3" in result.stdout
    assert "crashed [/]" in result.stdout and "[link=http://evil]click[/link]" in result.stdout


# ------------------------------------------------------------------------------------ B: malformed data
def test_status_with_malformed_heartbeats_shows_question_marks_and_notes(workdir: Path, fake: FakeExecutor) -> None:
    """B: wrong JSON types in heartbeats never crash status: ``?`` in the cell and a note line."""
    run = _launched()
    _heartbeat(run, 0, {"rank": 0, "round": "x", "step": 4, "state": "done", "time": time.time()})
    _heartbeat(run, 1, '{"rank": 1, "round": 1e309, "loss": "abc", "state": "done", "time": "yesterday"}')
    _heartbeat(run, 2, {"rank": 2, "round": [1], "bytes_up": "lots", "message": {"a": 1}, "state": 7})
    _heartbeat(run, 3, {})  # every field missing
    result = runner.invoke(app, ["status", run])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for note in ("rank 0: heartbeat field 'round' is not an integer",
                 "rank 1: heartbeat field 'round' is not an integer",
                 "rank 1: heartbeat field 'loss' is not a number",
                 "rank 1: heartbeat field 'time' is not a timestamp",
                 "rank 2: heartbeat field 'round' is not an integer",
                 "rank 2: heartbeat field 'state' is not a string",
                 "rank 2: heartbeat field 'bytes_up' is not an integer",
                 "rank 2: heartbeat field 'message' is not a string"):
        assert f"note: {note}" in out, out
    row0 = next(line for line in out.splitlines() if line.startswith("│    0 "))
    assert [cell.strip() for cell in row0.split("│")][3] == "?"  # the round column
    assert "rank 3" not in out.split("state succeeded")[-1]  # missing fields are unknown, not malformed


def test_plot_and_status_with_malformed_metrics(workdir: Path, fake: FakeExecutor) -> None:
    """B: a metrics record with a 400-digit round, a string loss and a list eval loss never crashes."""
    run = _launched()
    store = ObjectStore(run)
    bad = '{"rank": 0, "round": 1' + "0" * 400 + ', "loss": "abc", "eval_loss": [1], "step": "x"}'
    store.put(metrics_key(0, 9), bad.encode())
    plot = runner.invoke(app, ["plot", run, "-o", "loss.png"])
    assert plot.exit_code == 0, plot.output
    assert (workdir / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert "note: rank 0: metrics field 'round' is not an integer" in plot.stdout
    assert "note: rank 0: metrics field 'loss' of a record is not a number" in plot.stdout
    assert "note: rank 0: metrics field 'eval_loss' of a record is not a number" in plot.stdout
    status = runner.invoke(app, ["status", run])
    assert status.exit_code == 0, status.output
    assert "note: rank 0: metrics field 'loss' of a record is not a number" in status.stdout


# ------------------------------------------------------------------------------------ C: invalid run.json
def test_ls_skips_and_names_invalid_runs(workdir: Path, fake: FakeExecutor) -> None:
    """C: a run.json with a run_id that escapes the store, or a config that is not an object, is skipped
    with a note; the other runs are still listed."""
    run = _launched()
    good = json.loads((workdir / run / "run.json").read_text())
    for folder, change in [("evil", {"run_id": "../../etc", "config": {**good["config"], "run_id": "evil"}}),
                           ("other", {"run_id": "r1"}),  # names another run's folder
                           ("listcfg", {"run_id": "listcfg", "config": []})]:
        (workdir / "runs" / folder).mkdir()
        (workdir / "runs" / folder / "run.json").write_text(json.dumps({**good, **change}))
    result = runner.invoke(app, ["ls", "runs"])
    assert result.exit_code == 0, result.output
    assert any(" r1 " in line and "succeeded" in line for line in result.stdout.splitlines())
    notes = [line for line in result.stdout.splitlines() if line.startswith("note: skipped ")]
    assert len(notes) == 3, result.stdout
    text = " ".join(result.stdout.split())  # the console wraps long notes (the temp path's length varies)
    assert "note: skipped evil:" in text and "'../../etc'" in text
    assert "note: skipped other:" in text and "sits in folder 'other'" in text
    assert "note: skipped listcfg:" in text and "'config' must be an object" in text


# ------------------------------------------------------------------------------------ D: secrets
@pytest.mark.parametrize("args,field", [
    (["--set", f"model.name={HF_TOKEN}"], "model.name"),
    (["--set", f"replicas={HF_TOKEN}"], "replicas"),
    (["--set", HF_TOKEN], "key=value"),
    (["-x", HF_TOKEN], "KEY=VALUE"),
], ids=["set model.name", "set replicas", "set without =", "executor-opt"])
def test_refused_secret_is_never_echoed(workdir: Path, fake: FakeExecutor, args: list[str], field: str) -> None:
    """D: the refusal names the field (or what is wrong) and the kind of secret, never the token."""
    result = runner.invoke(app, ["launch", *args])
    assert result.exit_code == 2, result.output
    assert HF_TOKEN not in result.output and HF_TOKEN[:12] not in result.output
    assert field in result.stderr and "a Hugging Face token" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert fake.launched == []


# ------------------------------------------------------------------------------------ E: --max-usd
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1"])
def test_max_usd_must_be_finite_and_positive(workdir: Path, fake: FakeExecutor, value: str) -> None:
    """E: a NaN or infinite budget would never trigger; it is refused before anything is created."""
    result = runner.invoke(app, ["launch", f"--max-usd={value}"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: --max-usd must be positive and finite")
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (workdir / "runs").exists() and fake.launched == []


# ------------------------------------------------------------------------------------ F: local capacity
def test_local_replicas_beyond_the_machine_are_refused(workdir: Path, fake: FakeExecutor,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """F: 9 local replicas on 2 cores (4 per core) are refused with the rule and the override."""
    monkeypatch.setattr(preflight, "usable_cores", lambda: 2)
    monkeypatch.setattr(preflight, "available_memory", lambda: 64 * 2**30)
    result = runner.invoke(app, ["launch", "--replicas", "9"])
    assert result.exit_code == 2, result.output
    assert "2 usable CPU cores hold at most 8 (4 per core)" in result.stderr
    assert "-x oversubscribe=true" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (workdir / "runs").exists() and fake.launched == []
    forced = runner.invoke(app, ["launch", "--replicas", "9", "-x", "oversubscribe=true", "--detach"])
    assert forced.exit_code == 0, forced.output
    assert fake.launched[0]["n"] == 9
