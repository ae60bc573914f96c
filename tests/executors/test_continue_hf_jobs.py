"""HF Jobs runs longer than the Job ``timeout``: the real huggingface_hub client against the fake Jobs server
(tests/support/fake_hf_jobs_server.py runs each Job's command as a local process). A replica that exits 75
(tests/support/continue_replica.py) ends its Job cleanly with the continue marker, uses no attempt, and polls
as ``continue``; the Job's shell told it the deadline from the timeout."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("huggingface_hub")

from diloco_serverless.executors import ReplicaStatus
from diloco_serverless.executors.base import CONTINUE_MARKER, ExecutorUnavailable
from diloco_serverless.executors.hf_jobs import HFJobsExecutor, timeout_seconds
from support import pythonpath_env
from support.fake_hf_jobs_server import FakeHFJobsServer

REPLICA = "support.continue_replica"


@pytest.fixture
def hub() -> Iterator[FakeHFJobsServer]:
    with FakeHFJobsServer(log_stream_close_s=0.5) as srv:
        yield srv


def _executor(hub: FakeHFJobsServer, timeout: str | int | None) -> HFJobsExecutor:
    return HFJobsExecutor(flavor="cpu-basic", image="python:3.11", endpoint=hub.url, token=hub.token, install=None,
                          poll_interval_s=0.1, forward_credentials=False, retries=2, timeout=timeout)


def _wait_ended(ex: HFJobsExecutor, handles: list, timeout_s: float = 60.0) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        states = ex.poll(handles)
        if all(s.status not in (ReplicaStatus.PENDING, ReplicaStatus.RUNNING) for s in states):
            return states
        assert time.monotonic() < deadline, states
        time.sleep(0.1)


@pytest.mark.slow
def test_a_replica_that_stops_before_the_timeout_polls_continue_without_using_an_attempt(
    hub: FakeHFJobsServer,
) -> None:
    ex = _executor(hub, "2h")
    env = {"PYTHONPATH": pythonpath_env(), "DILOCO_RUN_URL": "s3://bucket/runs/run-hf-long",
           "FAKE_CONTINUE_ATTEMPTS": "1"}
    before = time.time()
    handles = ex.launch_replicas(2, REPLICA, [], env=env)
    states = _wait_ended(ex, handles)
    assert [s.status for s in states] == [ReplicaStatus.CONTINUE] * 2, states
    assert all(s.exit_code == 75 and "start a fresh Job of this rank" in (s.reason or "") for s in states)
    for h in handles:
        job = hub.jobs[h.data["job_id"]]
        assert job.stage == "COMPLETED" and job.spec["attempts"] == 3
        assert job.spec["environment"]["DILOCO_ATTEMPT_TIMEOUT_S"] == "7200"
        log = ex.logs(h, tail=None)
        assert log.count(f"continue replica rank={h.rank} attempt=0") == 1  # the Hub did not re-run it
        assert CONTINUE_MARKER in log
        line = next(ln for ln in log.splitlines() if ln.startswith("continue replica"))
        deadline = int(line.rsplit("deadline=", 1)[1])  # the Job's shell: its start + the timeout
        assert int(before) + 7200 <= deadline <= time.time() + 7200


def test_a_job_without_a_timeout_gets_no_deadline_and_a_clean_exit_still_succeeds(hub: FakeHFJobsServer) -> None:
    ex = _executor(hub, None)
    env = {"PYTHONPATH": pythonpath_env(), "DILOCO_RUN_URL": "s3://bucket/runs/run-hf-free"}
    handles = ex.launch_replicas(1, REPLICA, [], env=env)
    (state,) = _wait_ended(ex, handles)
    assert state.status is ReplicaStatus.SUCCEEDED
    assert "timeout=None deadline=None" in ex.logs(handles[0], tail=None)
    assert "DILOCO_ATTEMPT_TIMEOUT_S" not in hub.jobs[handles[0].data["job_id"]].spec["environment"]


def test_timeout_is_read_as_the_jobs_api_does() -> None:
    assert timeout_seconds("12h") == 43200 and timeout_seconds("90m") == 5400 and timeout_seconds("2d") == 172800
    assert timeout_seconds(3600) == 3600 and timeout_seconds("45") == 45 and timeout_seconds(None) is None
    for bad in ("soon", "-1h", 0, "0s", True):
        with pytest.raises(ExecutorUnavailable, match="timeout must be seconds above 0"):
            timeout_seconds(bad)
