"""HFJobsExecutor end to end: the real huggingface_hub client against a fake Jobs server on 127.0.0.1.

The fake server (tests/support/fake_hf_jobs_server.py) runs each submitted Job's command as a local subprocess,
so these tests launch real processes through ``run_job`` / ``inspect_job`` / ``cancel_job`` /
``fetch_job_logs``. The fake replica is tests/support/fake_replica.py.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("huggingface_hub")

from diloco_serverless.executors import ReplicaStatus
from diloco_serverless.executors.base import (
    ExecutorUnavailable,
    ReplicaFailedError,
    handle_from_json,
)
from diloco_serverless.executors.hf_jobs import HFJobsExecutor
from diloco_serverless.executors.registry import executor_for_handle, get_executor
from support import FAKE_REPLICA, pythonpath_env
from support.fake_hf_jobs_server import FakeHFJobsServer

pytestmark = pytest.mark.slow

FAKE = FAKE_REPLICA


@pytest.fixture
def hub() -> Iterator[FakeHFJobsServer]:
    with FakeHFJobsServer() as srv:
        yield srv


@pytest.fixture
def job_env() -> dict[str, str]:
    path = pythonpath_env()
    return {"PYTHONPATH": path, "DILOCO_RUN_URL": "s3://bucket/runs/run-hf-1"}


def _executor(hub: FakeHFJobsServer, **kw: object) -> HFJobsExecutor:
    kw.setdefault("install", None)
    kw.setdefault("poll_interval_s", 0.1)
    kw.setdefault("forward_credentials", False)
    return HFJobsExecutor(  # type: ignore[arg-type]
        flavor="cpu-basic", image="python:3.11", endpoint=hub.url, token=hub.token, **kw
    )


def test_launch_collect_success_with_labels_env_and_secrets(
    hub: FakeHFJobsServer, job_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SECRET", "s3cr3t-value")
    ex = _executor(hub, secrets=["FAKE_SECRET"], retries=0)
    handles = ex.launch_replicas(2, FAKE, ["--sleep-s", "0.2"], env={**job_env, "AWS_SECRET_ACCESS_KEY": "k"})
    results = ex.collect(handles, timeout=60)
    assert [r.status for r in results] == [ReplicaStatus.SUCCEEDED] * 2

    jobs = [hub.jobs[h.data["job_id"]] for h in handles]
    for rank, job in enumerate(jobs):
        spec = job.spec
        assert spec["labels"]["diloco-run"] == "run-hf-1" and spec["labels"]["diloco-rank"] == str(rank)
        assert spec["environment"]["REPLICA_RANK"] == str(rank)
        # credentials travel as secrets, never as plain environment
        assert spec["secrets"] == {"FAKE_SECRET": "s3cr3t-value", "AWS_SECRET_ACCESS_KEY": "k"}
        assert "AWS_SECRET_ACCESS_KEY" not in spec["environment"]
        assert spec["command"][:3] == ["python", "-m", FAKE] and spec["flavor"] == "cpu-basic"
        assert spec["attempts"] == 1
    log = ex.logs(handles[1])
    assert "fake replica rank=1 attempt=0" in log and "FAKE_SECRET_SET=True" in log
    assert "s3cr3t-value" not in json.dumps([h.to_json() for h in handles])
    assert handles[0].data["namespace"] == "fake-user"  # resolved through whoami-v2


def test_failure_reports_rank_exit_code_and_log_tail(hub: FakeHFJobsServer, job_env: dict[str, str]) -> None:
    ex = _executor(hub, retries=0)
    handles = ex.launch_replicas(2, FAKE, ["--exit-code", "5", "--fail-rank", "0"], env=job_env)
    with pytest.raises(ReplicaFailedError) as info:
        ex.collect(handles, timeout=60)
    msg = str(info.value)
    assert "rank(s) 0" in msg and "exit code 5" in msg and "rank 0 fails with boom" in msg
    assert [r.ok for r in info.value.results] == [False, True]


def test_retries_map_to_attempts(hub: FakeHFJobsServer, job_env: dict[str, str]) -> None:
    ex = _executor(hub, retries=2)
    handles = ex.launch_replicas(1, FAKE, ["--crash-attempts", "1"], env=job_env)
    # The Hub does not tell the replica its attempt number, so the fake always crashes on "attempt 0":
    # the Job fails after `attempts` runs, each visible in the log.
    with pytest.raises(ReplicaFailedError, match="exit code 3"):
        ex.collect(handles, timeout=60)
    assert hub.jobs[handles[0].data["job_id"]].spec["attempts"] == 3
    assert ex.logs(handles[0], tail=None).count("crashing on attempt 0") == 3


def test_cancel_and_poll_from_handles_in_another_executor(
    hub: FakeHFJobsServer, job_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = _executor(hub, retries=0)
    handles = ex.launch_replicas(2, FAKE, ["--sleep-s", "600"], env=job_env)
    deadline = time.monotonic() + 30
    while any(s.status is not ReplicaStatus.RUNNING for s in ex.poll(handles)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    records = json.loads(json.dumps([h.to_json() for h in handles]))
    assert records[0]["endpoint"] == hub.url and "token" not in json.dumps(records)

    monkeypatch.setenv("HF_TOKEN", hub.token)
    other_handles = [handle_from_json(r) for r in records]
    other = executor_for_handle(other_handles[0], install=None, poll_interval_s=0.1)
    assert isinstance(other, HFJobsExecutor)
    other.cancel(other_handles)
    hub.wait_all(30)
    assert [s.status for s in other.poll(other_handles)] == [ReplicaStatus.CANCELLED] * 2
    assert all(hub.jobs[h.data["job_id"]].proc.poll() is not None for h in handles)  # type: ignore[union-attr]


def test_bad_configuration_fails_before_launch(hub: FakeHFJobsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ExecutorUnavailable, match="unknown flavor 'h900'"):
        get_executor("hf-jobs", flavor="h900", token="x")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(ExecutorUnavailable, match="HF_TOKEN"):
        get_executor("hf-jobs")
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(ExecutorUnavailable, match="NOT_SET_ANYWHERE"):
        get_executor("hf-jobs", token="x", secrets=["NOT_SET_ANYWHERE"])
    assert not hub.jobs


def test_default_command_installs_the_package() -> None:
    ex = HFJobsExecutor(token="x", forward_credentials=False)
    cmd = ex.command("diloco_serverless.entrypoints.replica", ["--run-url", "s3://b/r"])
    assert cmd[:2] == ["bash", "-c"]
    assert "pip install" in cmd[2] and "diloco-serverless[s3,gcs,hf]==" in cmd[2]
    assert cmd[2].endswith("exec python -m diloco_serverless.entrypoints.replica --run-url s3://b/r")


@pytest.mark.live
@pytest.mark.skipif(not os.environ.get("HF_TOKEN"), reason="live HF Jobs test needs HF_TOKEN")
def test_live_hf_jobs_smoke() -> None:
    """Runs one tiny CPU Job on the real Hub (only with HF_TOKEN): a module from the stdlib."""
    ex = HFJobsExecutor(flavor="cpu-basic", image="python:3.12", install=None, timeout="5m", retries=0,
                        forward_credentials=False, poll_interval_s=5)
    handles = ex.launch_replicas(1, "platform", [], env={"DILOCO_RUN_URL": "memory://live/smoke"})
    try:
        results = ex.collect(handles, timeout=600)
        assert results[0].ok
    finally:
        ex.cancel(handles)
