"""The ``diloco`` CLI with an in-process fake executor: bad input, launch summary, status, ls, logs,
plot, cancel, failure propagation and the --max-usd guard. Real processes: test_cli_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from diloco_serverless.cli.app import app
from diloco_serverless.executors import registry
from diloco_serverless.launcher import api
from support import FIXTURES
from support.fake_executor import FakeExecutor, use_fake_executor

runner = CliRunner()


def _runs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def _launched(workdir: Path, *args: str) -> str:
    result = runner.invoke(app, ["launch", "--run-id", "r1", "--set", "rounds=3", *args])
    assert result.exit_code == 0, result.output
    return str(workdir / "runs" / "r1")


# ------------------------------------------------------------------------------------ bad input
BAD_INPUT = [
    (["--executor", "slurm"], "unknown executor 'slurm'"),
    (["--replicas", "0"], "--replicas must be at least 1 (got 0)"),
    (["--set", "inner.lrr=0.1"], "unknown config key 'inner.lrr'"),
    (["--set", "rounds=0"], "rounds"),
    (["--set", "nonsense"], "must look like key=value"),
    (["--executor", "modal", "--gpu", "X100", "--store", "s3://b/p"], "unknown GPU 'X100'"),
    (["--executor", "hf-jobs", "--flavor", "a100-huge", "--store", "s3://b/p"], "unknown HF Jobs flavor"),
    (["--executor", "modal", "--gpu", "H100:99", "--store", "s3://b/p"], "unknown GPU 'H100:99'"),
    (["--gpu", "H100"], "the local executor runs on CPU"),
    (["--executor", "modal", "--store", "./runs"], "cannot see the local folder"),
    (["--store", "memory://x"], "lives in one process"),
    (["--config", "missing.toml"], "config file missing.toml does not exist"),
    (["--max-usd", "0"], "--max-usd must be positive"),
    (["--max-usd", "5", "--detach"], "drop --detach"),
    (["--store", "./runs", "--store-from-terraform", "infra/aws"], "not both"),
    (["--secret", "aws-creds"], "--secret is for modal and hf-jobs replicas"),
    (["-x", "retries"], "must look like KEY=VALUE"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_launch_bad_input_is_one_line_and_creates_nothing(workdir: Path, fake: FakeExecutor,
                                                           args: list[str], message: str) -> None:
    result = runner.invoke(app, ["launch", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert result.stderr.startswith("error: ")
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output
    assert not (workdir / "runs").exists()
    assert fake.launched == []


def test_max_usd_needs_a_known_price(workdir: Path, fake: FakeExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco_serverless.launcher import pricing

    monkeypatch.delitem(pricing.MODAL_USD_PER_HOUR, "T4")  # a GPU the executor knows but the table does not
    result = runner.invoke(app, ["launch", "--executor", "modal", "--gpu", "T4", "--store", "s3://b/p",
                                 "--max-usd", "5"])
    assert result.exit_code == 2
    assert "--max-usd needs a price for modal GPU 'T4'" in result.stderr
    assert fake.launched == []


def test_unknown_executor_option_lists_the_real_ones(workdir: Path) -> None:
    result = runner.invoke(app, ["launch", "-x", "colour=blue"])
    assert result.exit_code == 2
    assert "the local executor has no option 'colour'; its options: retries, log_dir" in result.stderr
    assert not (workdir / "runs").exists()


def test_launch_unwritable_store_is_probed_before_anything(workdir: Path, fake: FakeExecutor) -> None:
    (workdir / "afile").write_text("not a folder")
    result = runner.invoke(app, ["launch", "--store", str(workdir / "afile" / "runs")])
    assert result.exit_code == 2
    assert "cannot use store" in result.stderr and "afile" in result.stderr
    assert fake.launched == []


def test_launch_existing_run_id_is_refused(workdir: Path, fake: FakeExecutor) -> None:
    _launched(workdir)
    result = runner.invoke(app, ["launch", "--run-id", "r1"])
    assert result.exit_code == 2
    assert "already exists" in result.stderr and "--run-id" in result.stderr
    assert len(fake.launched) == 1


def test_executor_sdk_error_is_reported_before_launch(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sdk(kind: str, **options: object) -> None:
        raise ImportError("the modal executor needs the modal SDK: pip install 'diloco-serverless[modal]'")

    monkeypatch.setattr(registry, "get_executor", no_sdk)
    result = runner.invoke(app, ["launch", "--executor", "modal", "--store", "s3://bucket/runs"])
    assert result.exit_code == 2
    assert "pip install 'diloco-serverless[modal]'" in result.stderr
    assert not (workdir / "runs").exists()


@pytest.mark.parametrize("command", [["status"], ["logs"], ["cancel"], ["plot"]])
def test_run_url_without_run_is_one_line_error(workdir: Path, command: list[str]) -> None:
    result = runner.invoke(app, [*command, str(workdir / "runs" / "nope")])
    assert result.exit_code == 2
    assert "no run at" in result.stderr and "nope" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_ls_empty_store(workdir: Path) -> None:
    result = runner.invoke(app, ["ls", str(workdir)])
    assert result.exit_code == 0
    assert "no runs under" in result.stdout


# ------------------------------------------------------------------------------------ a finished run
def test_launch_records_handles_and_prints_summary(workdir: Path, fake: FakeExecutor) -> None:
    result = runner.invoke(app, ["launch", "--run-id", "r1", "--replicas", "3", "--set", "rounds=3",
                                 "--poll-interval", "0.1"])
    assert result.exit_code == 0, result.output
    run_json = json.loads((workdir / "runs" / "r1" / "run.json").read_text())
    assert run_json["config"]["replicas"] == 3 and run_json["config"]["rounds"] == 3
    assert run_json["launch"]["executor"] == "local"
    assert [h["rank"] for h in run_json["launch"]["handles"]] == [0, 1, 2]
    assert fake.launched[0]["entrypoint"] == "diloco_serverless.entrypoints.replica"
    assert fake.launched[0]["env"]["DILOCO_RUN_URL"].endswith("/runs/r1")
    out = result.stdout
    assert "run r1 succeeded" in out
    assert "final eval loss : 4.2000" in out  # rank 0's eval at round 2: 5.0 - 1.0 + 0.2
    assert "bytes moved     : 22.0 KiB" in out  # 3 ranks x 3 rounds x 2500 B = 22500 B
    assert f"model           : file://{workdir}/runs/r1/final" in out
    assert "est. spend      : $0.00" in out
    assert not list((workdir / "runs").glob(".diloco-probe*"))


def test_launch_detach_returns_with_follow_up_commands(workdir: Path, fake: FakeExecutor) -> None:
    result = runner.invoke(app, ["launch", "--run-id", "r1", "--detach"])
    assert result.exit_code == 0, result.output
    assert "diloco status" in result.stdout and "r1" in result.stdout
    assert "final eval loss" not in result.stdout


def test_status_table_of_finished_run(workdir: Path, fake: FakeExecutor) -> None:
    url = _launched(workdir)
    result = runner.invoke(app, ["status", url])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if line.startswith("│") and "succeeded" in line]
    assert len(rows) == 4  # one per replica
    assert "3/3" in result.stdout  # 3 of 3 rounds done
    assert "state succeeded" in result.stdout
    assert "model: file://" in result.stdout


def test_status_watch_stops_when_done(workdir: Path, fake: FakeExecutor) -> None:
    url = _launched(workdir)
    result = runner.invoke(app, ["status", url, "--watch", "--interval", "0.1"])
    assert result.exit_code == 0
    assert "round 3/3" in result.stdout and "state succeeded" in result.stdout


def test_ls_lists_runs(workdir: Path, fake: FakeExecutor) -> None:
    _launched(workdir)
    result = runner.invoke(app, ["ls", "runs"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if " r1 " in f" {line} ")
    assert "succeeded" in line and "local" in line and "3/3" in line


def test_logs_tail_and_bad_rank(workdir: Path, fake: FakeExecutor) -> None:
    url = _launched(workdir)
    result = runner.invoke(app, ["logs", url, "--rank", "2", "--tail", "3"])
    assert result.exit_code == 0
    assert result.stdout.splitlines() == ["rank 2 line 17", "rank 2 line 18", "rank 2 line 19"]
    bad = runner.invoke(app, ["logs", url, "--rank", "9"])
    assert bad.exit_code == 2
    assert "rank 9 is not in run r1: it has ranks 0..3" in bad.stderr


def test_logs_follow_returns_when_replica_is_done(workdir: Path, fake: FakeExecutor) -> None:
    url = _launched(workdir)
    result = runner.invoke(app, ["logs", url, "--rank", "3", "--follow", "--interval", "0.1"])
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0] == "rank 3 line 0" and lines[-1] == "rank 3 line 19" and len(lines) == 20


def test_cancel_of_finished_run_is_a_no_op(workdir: Path, fake: FakeExecutor) -> None:
    url = _launched(workdir)
    result = runner.invoke(app, ["cancel", url])
    assert result.exit_code == 0
    assert "run r1 already succeeded; nothing to cancel" in result.stdout
    assert fake.cancelled == []


def test_plot_writes_png(workdir: Path, fake: FakeExecutor) -> None:
    url = _launched(workdir)
    result = runner.invoke(app, ["plot", url, "-o", "out/loss.png"])
    assert result.exit_code == 0, result.output
    png = (workdir / "out" / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_plot_without_metrics_is_an_error(workdir: Path, fake: FakeExecutor) -> None:
    fake.rounds = 0
    fake.finish = False
    url = _launched(workdir, "--detach")
    result = runner.invoke(app, ["plot", url])
    assert result.exit_code == 2
    assert "has no metrics yet" in result.stderr


def test_cancel_goes_through_the_executor(workdir: Path, fake: FakeExecutor) -> None:
    fake.finish = False
    url = _launched(workdir, "--detach")
    result = runner.invoke(app, ["cancel", url])
    assert result.exit_code == 0, result.output
    assert "cancelled 4 replicas of run r1" in result.stdout
    assert [h["rank"] for h in fake.cancelled[0]] == [0, 1, 2, 3]
    assert "cancelled" in runner.invoke(app, ["status", url]).stdout


# ------------------------------------------------------------------------------------ failures
def test_failed_rank_exits_non_zero_naming_it(workdir: Path, fake: FakeExecutor) -> None:
    fake.fail_ranks = (2,)
    result = runner.invoke(app, ["launch", "--run-id", "r1", "--poll-interval", "0.1"])
    assert result.exit_code == 1
    assert "run r1 failed: rank 2: exit code 3" in result.stderr
    assert "rank 2 failed: exit code 3" in result.stdout
    assert "rank 2 line 19" in result.stdout  # tail of the failed rank's log


def test_max_usd_cancels_before_budget(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ex = FakeExecutor(finish=False, usd_per_replica_hour=3600.0)  # $1 per replica-second
    use_fake_executor(monkeypatch, ex)
    result = runner.invoke(app, ["launch", "--run-id", "r1", "--max-usd", "5", "--poll-interval", "0.2"])
    assert result.exit_code == 1
    assert "would exceed --max-usd 5.00" in result.stderr
    assert len(ex.cancelled) == 1
    run_json = json.loads((workdir / "runs" / "r1" / "run.json").read_text())
    assert run_json["launch"]["usd_per_replica_hour"] == 3600.0


def test_status_without_executor_falls_back_to_heartbeats(workdir: Path, fake: FakeExecutor,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the executor cannot be rebuilt (SDK or token missing here), status reads heartbeats."""
    fake.fail_ranks = (1,)
    fake.finish = False  # ranks 0, 2, 3 still training
    url = _launched(workdir, "--detach")
    monkeypatch.setattr(api, "executor_from_launch", lambda launch, run_url=None: (None, "no modal SDK here"))
    result = runner.invoke(app, ["status", url])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if line.startswith("│    1 "))
    assert "failed" in row and "boom: simulated crash" in row
    cancel = runner.invoke(app, ["cancel", url])
    assert cancel.exit_code == 2 and "no modal SDK here" in cancel.stderr


def test_missing_modal_token_is_reported_before_launch(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(workdir / "no-modal.toml"))
    result = runner.invoke(app, ["launch", "--executor", "modal", "--gpu", "H100", "--store", "s3://bucket/runs"])
    assert result.exit_code == 2
    assert "MODAL_TOKEN_ID" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_missing_hf_token_is_reported_before_launch(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("huggingface_hub")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(workdir / "hf-home"))
    monkeypatch.setenv("HF_TOKEN_PATH", str(workdir / "hf-home" / "token"))
    result = runner.invoke(app, ["launch", "--executor", "hf-jobs", "--flavor", "a10g-small", "--store", "gs://b/runs"])
    assert result.exit_code == 2
    assert "HF_TOKEN" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_run_defaults_to_latest_under_runs_and_accepts_a_bare_id(workdir: Path, fake: FakeExecutor) -> None:
    none = runner.invoke(app, ["status"])
    assert none.exit_code == 2 and "no runs under ./runs" in none.stderr
    _launched(workdir)
    assert runner.invoke(app, ["launch", "--run-id", "r2", "--detach"]).exit_code == 0
    latest = runner.invoke(app, ["status"])
    assert latest.exit_code == 0 and "run r2" in latest.stdout
    by_id = runner.invoke(app, ["logs", "r1", "--rank", "0", "--tail", "1"])
    assert by_id.exit_code == 0 and by_id.stdout == "rank 0 line 19\n"


def test_modal_flags_reach_the_executor(workdir: Path, s3_store_url: str, s3_env: dict,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """--gpu, --secret, --retries and -x become ModalExecutor keyword arguments; the price is recorded."""
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    seen: dict = {}
    ex = FakeExecutor(kind="modal")

    def get_executor(kind: str, **options: object) -> FakeExecutor:
        seen.update(kind=kind, **options)
        return ex

    monkeypatch.setattr(registry, "get_executor", get_executor)
    result = runner.invoke(app, ["launch", "--executor", "modal", "--gpu", "h100:2", "--secret", "diloco-s3",
                                 "--retries", "5", "-x", "timeout_s=600", "--store", s3_store_url,
                                 "--run-id", "m1", "--poll-interval", "0.1"])
    assert result.exit_code == 0, result.output
    assert seen == {"kind": "modal", "gpu": "H100:2", "secrets": ["diloco-s3"], "retries": 5, "timeout_s": 600}
    status = runner.invoke(app, ["status", f"{s3_store_url}/m1"])
    assert "on modal (H100:2)" in status.stdout  # recorded gpu; the price is 2 x H100
    env = dict(ex.launched[0]["env"])
    assert len(env.pop("DILOCO_RUN_KEY")) == 64  # the run key, sent as a secret (docs/security.md)
    launch_id = env.pop("DILOCO_LAUNCH_ID")  # the launch's id, in each replica's start record
    assert len(launch_id) == 12 and all(c in "0123456789abcdef" for c in launch_id)
    assert env == {"DILOCO_RUN_URL": f"{s3_store_url}/m1"}  # no OMP_NUM_THREADS off-machine


def test_store_from_terraform_outputs(workdir: Path, fake: FakeExecutor, s3_store_url: str, s3_env: dict,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    golden = json.loads((FIXTURES / "terraform_output_aws.json").read_text())
    # the golden outputs name a bucket that does not exist here: the probe refuses it, nothing launches
    (workdir / "golden.json").write_text(json.dumps(golden))
    missing = runner.invoke(app, ["launch", "--store-from-terraform", "golden.json"])
    assert missing.exit_code == 2 and "cannot use store s3://acme-diloco-exchange/diloco" in missing.stderr
    (workdir / "empty.json").write_text("{}")
    empty = runner.invoke(app, ["launch", "--store-from-terraform", "empty.json"])
    assert empty.exit_code == 2 and "exchange_url" in empty.stderr
    assert fake.launched == []
    bucket = s3_store_url.removeprefix("s3://")
    golden["bucket"]["value"], golden["exchange_url"]["value"] = bucket, f"s3://{bucket}/diloco/"
    (workdir / "outputs.json").write_text(json.dumps(golden))
    ok = runner.invoke(app, ["launch", "--store-from-terraform", "outputs.json", "--run-id", "tf1", "--detach"])
    assert ok.exit_code == 0, ok.output
    assert f"run URL: s3://{bucket}/diloco/tf1" in ok.stdout
