"""``diloco`` end to end with the local executor and the real replica entrypoint, as subprocesses.

One tiny training run (2 replicas, 4 rounds of 2 inner steps) in which rank 1's replica is
SIGKILLed mid-run: its supervisor restarts it, it heals from the store and the run still finishes;
then status, ls, logs and plot read that finished run. Also: a replica that dies with no retries
left fails the launch (exit 1, naming the rank) and the survivors are cancelled; and
``launch --detach`` + ``diloco cancel`` from another process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from diloco_serverless.cli.app import app
from diloco_serverless.executors.local import replica_paths

pytestmark = pytest.mark.slow

TINY = ["--replicas", "2", "--set", "inner.sync_every=2", "--set", "data.batch_size=1",
        "--set", "data.seq_len=32", "--set", "data.prompt_len=8", "--set", "data.hint_len=8",
        "--set", "data.eval_batches=1", "--set", "checkpoint_every=1", "--set", "eval_every=2",
        "--poll-interval", "0.5"]
runner = CliRunner()


def _default_sigint() -> None:
    """A test run started in the background of a shell without job control inherits SIGINT ignored,
    and Python then leaves it ignored: give the CLI the disposition a terminal's Ctrl-C finds."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _diloco(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "diloco_serverless.cli", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint)


def _wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _kill_replica_after_round(run: Path, rank: int, round_: int, timeout_s: float = 150) -> int:
    """SIGKILL rank's replica process (not its supervisor) once its heartbeat reports ``round_``
    (in whatever phase: training, evaluating, checkpointing), before the run's last round."""
    def trained() -> bool:
        hb = _json(run / "members" / f"rank-{rank}.json")
        return bool(hb and round_ <= hb["round"] <= round_ + 1 and hb["state"] not in ("done", "failed"))

    _wait_for(trained, timeout_s, f"rank {rank} to finish round {round_}")
    state = _wait_for(lambda: (s := _json(replica_paths(run / "logs", rank)[1])) and s.get("child_pid") and s,
                      10, f"rank {rank}'s replica pid")
    os.kill(int(state["child_pid"]), signal.SIGKILL)
    return int(state["child_pid"])


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


@pytest.fixture(scope="module")
def healed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A finished run in which rank 1 was killed after round 1 and restarted."""
    cwd = tmp_path_factory.mktemp("e2e")
    proc = _diloco("launch", "--run-id", "healed", "--set", "rounds=4", "--retries", "1", *TINY, cwd=cwd)
    run = cwd / "runs" / "healed"
    try:
        _kill_replica_after_round(run, rank=1, round_=1)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run([sys.executable, "-m", "diloco_serverless.cli", "cancel", str(run)], cwd=cwd)
    return run, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_killed_replica_is_restarted_and_run_finishes(healed_run: tuple[Path, Any]) -> None:
    run, result = healed_run
    assert result.returncode == 0, result.stdout + result.stderr
    assert "run healed succeeded" in result.stdout
    assert "rounds          : 4/4" in result.stdout
    assert "final eval loss : " in result.stdout and "final eval loss : -" not in result.stdout
    assert f"model           : file://{run}/final" in result.stdout
    assert (run / "final").is_dir() and any((run / "final").glob("*.safetensors"))
    hb = json.loads((run / "members" / "rank-1.json").read_text())
    assert hb["attempt"] == 1 and hb["state"] == "done"
    launch = json.loads((run / "run.json").read_text())["launch"]
    assert launch["executor"] == "local" and len(launch["handles"]) == 2


def test_status_ls_logs_plot_on_finished_run(healed_run: tuple[Path, Any], tmp_path: Path) -> None:
    run, _ = healed_run
    status = runner.invoke(app, ["status", str(run)])
    assert status.exit_code == 0, status.output
    rows = [line for line in status.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == 2 and all("succeeded" in r and "MiB" in r for r in rows)
    assert "state succeeded | round 4/4" in status.stdout and "est. spend $0.00 on local" in status.stdout

    ls = runner.invoke(app, ["ls", str(run.parent)])
    assert ls.exit_code == 0 and "healed" in ls.stdout and "4/4" in ls.stdout

    logs = runner.invoke(app, ["logs", str(run), "--rank", "1"])
    assert logs.exit_code == 0
    assert "attempt 0" in logs.stdout and "attempt 1" in logs.stdout  # supervisor lines: killed, restarted

    png = tmp_path / "loss.png"
    plot = runner.invoke(app, ["plot", str(run), "-o", str(png)])
    assert plot.exit_code == 0, plot.output
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_replica_death_without_retries_fails_launch_naming_rank(tmp_path: Path) -> None:
    proc = _diloco("launch", "--run-id", "dies", "--set", "rounds=6", "--retries", "0", *TINY, cwd=tmp_path)
    run = tmp_path / "runs" / "dies"
    try:
        _kill_replica_after_round(run, rank=1, round_=1)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out + err
    assert "run dies failed: rank 1:" in err
    assert len(err.strip().splitlines()) == 1
    assert "rank 1 failed" in out
    states = [_json(replica_paths(run / "logs", r)[1]) for r in (0, 1)]
    assert states[1]["status"] == "failed"
    assert states[0]["status"] in ("cancelled", "failed")  # the survivor is stopped, not left billing


def test_detach_then_cancel_from_another_process(tmp_path: Path) -> None:
    launched = _diloco("launch", "--run-id", "c1", "--detach", "--set", "rounds=50", *TINY, cwd=tmp_path)
    out, err = launched.communicate(timeout=60)
    assert launched.returncode == 0, out + err
    assert "diloco status" in out
    run = tmp_path / "runs" / "c1"
    handles = json.loads((run / "run.json").read_text())["launch"]["handles"]
    cancelled = _diloco("cancel", str(run), cwd=tmp_path)
    out, err = cancelled.communicate(timeout=60)
    assert cancelled.returncode == 0, out + err
    assert "cancelled 2 replicas of run c1" in out
    assert all(_pid_gone(int(h["pid"])) for h in handles)
    status = runner.invoke(app, ["status", str(run)])
    assert "state cancelled" in status.stdout


def test_hf_jobs_through_the_cli(s3_store_url: str, s3_env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """`diloco launch --executor hf-jobs` with the real huggingface_hub client against a fake Jobs
    server on 127.0.0.1 (tests/support/fake_hf_jobs_server.py) whose Jobs are local replicas training over
    moto S3; then status and logs rebuild the executor from run.json's handles."""
    pytest.importorskip("huggingface_hub")
    from support.fake_hf_jobs_server import FakeHFJobsServer

    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    with FakeHFJobsServer(log_stream_close_s=0.5) as hub:
        monkeypatch.setenv("HF_TOKEN", hub.token)
        launched = runner.invoke(app, [
            "launch", "--executor", "hf-jobs", "--flavor", "cpu-basic", "--store", s3_store_url, "--run-id", "hf1",
            "--set", "rounds=2", "--retries", "0", "-x", f"endpoint={hub.url}", "-x", "install=none",
            "-x", "image=python:3.11", "-x", "poll_interval_s=0.5", *TINY])
        assert launched.exit_code == 0, launched.output
        assert "run hf1 succeeded" in launched.stdout and "rounds          : 2/2" in launched.stdout
        assert f"model           : {s3_store_url}/hf1/final" in launched.stdout
        url = f"{s3_store_url}/hf1"
        # the Hub endpoint comes from the environment, never from the handles in run.json (docs/security.md)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        status = runner.invoke(app, ["status", url])
        rows = [line for line in status.stdout.splitlines() if line.startswith("│")]
        assert len(rows) == 2 and all("succeeded" in r for r in rows), status.output
        assert "on hf-jobs (cpu-basic)" in status.stdout
        logs = runner.invoke(app, ["logs", url, "--rank", "1", "--tail", "5"])
        assert logs.exit_code == 0 and "done: 2 rounds" in logs.stdout


def test_ctrl_c_during_attached_launch_cancels_the_run(tmp_path: Path) -> None:
    proc = _diloco("launch", "--run-id", "i1", "--set", "rounds=50", *TINY, cwd=tmp_path)
    run = tmp_path / "runs" / "i1"
    try:
        _wait_for(lambda: (_json(run / "run.json") or {}).get("launch"), 60, "the launch record")
        time.sleep(1.0)  # let the launcher enter its progress loop
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    assert "interrupted: cancelled run" in err and "--detach" in err
    states = [_json(replica_paths(run / "logs", r)[1]) for r in (0, 1)]
    assert all(s and s["status"] == "cancelled" for s in states), states
