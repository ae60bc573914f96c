"""``diloco doctor`` end to end: on the local executor, and on Modal through the real ``modal`` SDK against
the fake Modal server (tests/support/modal_grpc_server.py; its containers are local subprocesses) with an
S3 store on moto. The live tests in the suite run the same command against real accounts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from diloco_serverless.cli.app import app
from diloco_serverless.errors import LaunchError
from diloco_serverless.launcher.doctor import CHECKS, run_doctor
from support import pythonpath_env

runner = CliRunner()


@pytest.mark.slow
def test_doctor_on_the_local_executor(tmp_path: Path) -> None:
    result = runner.invoke(app, ["doctor", "--executor", "local", "--store", str(tmp_path / "runs"), "--cap-s", "6"])
    assert result.exit_code == 0, result.output
    for name in CHECKS:
        row = next(ln for ln in result.output.splitlines() if ln.startswith(name))
        assert row[len(name):].split()[0] == "ok", row
    assert "all checks held" in result.output
    (probe_run,) = (tmp_path / "runs").iterdir()
    records = sorted(p.name for p in (probe_run / "doctor").rglob("*.json"))
    assert records == ["attempt-0.json", "attempt-0.json", "attempt-1.json"]


@pytest.mark.slow
def test_doctor_on_modal_through_the_sdk(monkeypatch: pytest.MonkeyPatch, s3_store_url: str,
                                         s3_env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("modal")
    from support.modal_grpc_server import fake_modal

    for k, v in s3_env.items():
        monkeypatch.setenv(k, v)
    container_env = {**s3_env, "PYTHONPATH": pythonpath_env()}
    with fake_modal(monkeypatch, execute=True, container_env=container_env) as srv:
        report = run_doctor("modal", f"{s3_store_url}/runs", cap_s=8, hold_s=2, timeout_s=120, poll_interval_s=0.3,
                            executor_options={"show_output": False, "secrets": ["diloco-s3"]})
        table = report.table()
        print(table)
        assert report.ok, table
        launch = report.check("launch 2 ranks").detail
        assert "(detached App diloco-doctor-" in launch and "launched by a process that has exited" in launch
        assert "after the launcher exited" in report.check("status while running").detail
        # the launching process ended its App session before the first poll (AppClientDisconnect)
        names = srv.rpc_names()
        assert names.index("AppClientDisconnect") < names.index("FunctionGetOutputs")
        # rank 1's first call spawned its next call from inside its input; the doctor cancelled that one
        first = srv.sent("FunctionMap")[1]
        chained = [r for r in srv.sent("FunctionMap") if r.parent_input_id]
        assert len(chained) == 1 and not first.parent_input_id
        (cancel,) = srv.sent("FunctionCallCancel")
        assert cancel.terminate_containers and cancel.function_call_id in srv.calls
        assert srv.calls[cancel.function_call_id].parent_input_id == chained[0].parent_input_id
        assert [s.deployment_name for s in srv.sent("SecretGetOrCreate")] == ["diloco-s3"]
    assert "all checks held" in capsys.readouterr().out


def test_doctor_that_times_out_says_where_and_cancels(monkeypatch: pytest.MonkeyPatch, s3_store_url: str,
                                                      s3_env: dict[str, str]) -> None:
    """Calls that never get a container: the table names the first check that did not hold, and nothing is
    left running."""
    pytest.importorskip("modal")
    from support.modal_grpc_server import fake_modal

    for k, v in s3_env.items():
        monkeypatch.setenv(k, v)
    with fake_modal(monkeypatch) as srv:
        report = run_doctor("modal", f"{s3_store_url}/runs", cap_s=30, timeout_s=1.0, poll_interval_s=0.1,
                            executor_options={"show_output": False}, launch_in_child=False)
        assert not report.ok
        assert report.check("launch 2 ranks").ok
        failed = report.check("status while running")
        assert failed.ok is False and "timed out after 1 s" in failed.detail and "pending" in failed.detail
        assert report.check("cancel").ok is None and "FAILED" in report.table()
        assert sorted(r.function_call_id for r in srv.sent("FunctionCallCancel")) == sorted(srv.calls)


def test_doctor_refuses_what_cannot_work(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="unknown executor 'lambda'"):
        run_doctor("lambda", str(tmp_path))
    with pytest.raises(LaunchError, match="cannot see the local folder"):
        run_doctor("modal", str(tmp_path))
    assert not os.listdir(tmp_path)


@pytest.mark.live
@pytest.mark.skipif(not (os.environ.get("MODAL_TOKEN_ID") and os.environ.get("DILOCO_LIVE_STORE")),
                    reason="live: needs MODAL_TOKEN_ID and DILOCO_LIVE_STORE (+ DILOCO_LIVE_MODAL_SECRET)")
def test_live_modal_doctor() -> None:
    secret = os.environ.get("DILOCO_LIVE_MODAL_SECRET")
    report = run_doctor("modal", os.environ["DILOCO_LIVE_STORE"],
                        executor_options={"secrets": [secret]} if secret else {})
    assert report.ok, report.table()


@pytest.mark.live
@pytest.mark.skipif(not (os.environ.get("HF_TOKEN") and os.environ.get("DILOCO_LIVE_STORE")),
                    reason="live: needs HF_TOKEN and DILOCO_LIVE_STORE (+ storage credentials in the environment)")
def test_live_hf_jobs_doctor() -> None:
    secrets = [k for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION") if os.environ.get(k)]
    report = run_doctor("hf-jobs", os.environ["DILOCO_LIVE_STORE"], executor_options={"secrets": secrets})
    assert report.ok, report.table()


@pytest.mark.slow
def test_doctor_on_hf_jobs_through_the_sdk(monkeypatch: pytest.MonkeyPatch, s3_store_url: str,
                                           s3_env: dict[str, str]) -> None:
    """The real ``HfApi`` against the fake Jobs server (Jobs run as local processes): HF Jobs do not chain,
    so rank 1's Job ends ``continue`` at the cap and the doctor starts its next attempt as a Job."""
    pytest.importorskip("huggingface_hub")
    from support.fake_hf_jobs_server import FakeHFJobsServer

    for k, v in s3_env.items():
        monkeypatch.setenv(k, v)
    with FakeHFJobsServer(log_stream_close_s=0.5) as hub:
        report = run_doctor("hf-jobs", f"{s3_store_url}/runs", cap_s=8, hold_s=2, timeout_s=120,
                            poll_interval_s=0.3, extra_env={"PYTHONPATH": pythonpath_env()},
                            executor_options={"endpoint": hub.url, "token": hub.token, "install": None})
        assert report.ok, report.table()
        assert len(hub.jobs) == 3  # rank 0, rank 1's first Job, rank 1's next attempt
        stages = sorted(job.stage for job in hub.jobs.values())
        assert stages == ["CANCELED", "COMPLETED", "COMPLETED"]
