"""HFJobsExecutor end to end: the real huggingface_hub client against a fake Jobs server on 127.0.0.1.

The fake server (tests/support/fake_hf_jobs_server.py) runs each submitted Job's command as a local subprocess,
so these tests launch real processes through ``run_job`` / ``inspect_job`` / ``cancel_job`` /
``fetch_job_logs``. The fake replica is tests/support/fake_replica.py.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import version

import pytest

pytest.importorskip("huggingface_hub")

from diloco_serverless.errors import ExecutorError
from diloco_serverless.executors import ReplicaStatus, _package
from diloco_serverless.executors.base import (
    ExecutorUnavailable,
    ReplicaFailedError,
    ShippedCode,
    handle_from_json,
)
from diloco_serverless.executors.hf_jobs import HFJobsExecutor, label_value
from diloco_serverless.executors.registry import executor_for_handle, executor_from_launch, get_executor
from support import FAKE_REPLICA, pythonpath_env
from support.fake_hf_jobs_server import FakeHFJobsServer

pytestmark = pytest.mark.slow

FAKE = FAKE_REPLICA


@pytest.fixture
def hub() -> Iterator[FakeHFJobsServer]:
    # idle log streams end after 0.5 s here (the SDK's own 5 s read timeout would add 5 s per log read);
    # test_logs_from_a_stream_that_stays_open keeps the Hub's behaviour
    with FakeHFJobsServer(log_stream_close_s=0.5) as srv:
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
        assert spec["command"][:2] == ["bash", "-c"] and f"python -m {FAKE} --sleep-s 0.2 &" in spec["command"][2]
        assert spec["flavor"] == "cpu-basic"
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
    monkeypatch.setenv("HF_ENDPOINT", hub.url)  # the endpoint comes from here, never from run.json
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


def test_default_ships_the_running_code_and_published_releases_are_explicit() -> None:
    """Finding 1: the default no longer pip-installs an unpublished ``diloco-serverless==<version>``."""
    ex = HFJobsExecutor(token="x", forward_credentials=False)
    assert ex.install == "local" and ex.extras == ("s3", "gcs", "hf")
    code = ShippedCode(url="s3://b/runs/r/code/diloco_serverless-0.1.0+src.abc-py3-none-any.whl", sha256="ab" * 32,
                       version="0.1.0+src.abc", filename="diloco_serverless-0.1.0+src.abc-py3-none-any.whl")
    script = ex.command("diloco_serverless.entrypoints.replica", ["--run-url", "s3://b/r"], code)[2]
    assert "diloco-serverless[s3,gcs,hf]==" not in script
    assert f" {code.url} {code.sha256} " in script  # the fetch step checks the launcher's SHA-256
    assert '"${TMPDIR:-/tmp}/diloco-code/diloco_serverless-0.1.0+src.abc-py3-none-any.whl[s3,gcs,hf]"' in script
    assert "'s3fs>=2024.6'" in script  # the requirements, from the index
    # with torch pinned to the version the launcher runs (the image's own 2.7.1 is what CI never tests)
    assert f" {_package.tested_torch()} " in script and "torch>=2.7" not in script
    assert _package.tested_torch() == f"torch=={version('torch').split('+')[0]}"
    assert "python -m diloco_serverless.entrypoints.replica --run-url s3://b/r &" in script
    with pytest.raises(ExecutorError, match="needs the shipped code"):
        ex.command("m", [])
    published = HFJobsExecutor(token="x", forward_credentials=False, install="diloco-serverless[s3,hf]==0.1.0")
    assert "pip install --quiet 'diloco-serverless[s3,hf]==0.1.0' || exit $?" in published.command("m", [])[2]
    for none in (None, "none", "None", ""):
        bare = HFJobsExecutor(token="x", forward_credentials=False, install=none)
        assert bare.install is None and "pip install" not in bare.command("m", [])[2]
    with pytest.raises(ExecutorUnavailable, match="extras must be plain names"):
        HFJobsExecutor(token="x", extras=["s3];rm -rf /"])


def test_setup_error_exit_code_2_is_not_retried(hub: FakeHFJobsServer, job_env: dict[str, str]) -> None:
    """Finding 5: exit code 2 (bad input) ends the Job without using its attempts; poll says failed."""
    ex = _executor(hub, retries=2)
    handles = ex.launch_replicas(1, FAKE, ["--exit-code", "2"], env=job_env)
    with pytest.raises(ReplicaFailedError) as info:
        ex.collect(handles, timeout=60)
    (result,) = info.value.results
    assert result.exit_code == 2 and "setup error, not retried" in (result.reason or "")
    assert "rank 0 fails with boom (exit 2)" in (result.reason or "")
    job = hub.jobs[handles[0].data["job_id"]]
    assert job.spec["attempts"] == 3 and job.stage == "COMPLETED"  # the Hub saw a clean exit: no re-run
    assert ex.logs(handles[0], tail=None).count("fake replica rank=0 attempt=0") == 1
    # a crash (any other code) still uses the attempts
    crash = ex.launch_replicas(1, FAKE, ["--exit-code", "3"], env=job_env)
    with pytest.raises(ReplicaFailedError, match="exit code 3"):
        ex.collect(crash, timeout=60)
    assert ex.logs(crash[0], tail=None).count("fake replica rank=0 attempt=0") == 3


def test_label_values_are_sanitized(hub: FakeHFJobsServer, job_env: dict[str, str]) -> None:
    """Finding 3: run ids may contain '.', which Job labels (stored as tags) reject."""
    assert label_value("run-20261129-214455-ab12") == "run-20261129-214455-ab12"  # plain ids are kept
    dotted = label_value("exp.v1.2")
    assert re.fullmatch(r"exp-v1-2-[0-9a-f]{8}", dotted) and dotted != label_value("exp-v1-2")
    assert len(label_value("a" * 128)) <= 63 and label_value("a" * 128) != label_value("a" * 127)
    env = {**job_env, "DILOCO_RUN_URL": "s3://bucket/runs/exp.v1.2"}
    handles = _executor(hub, retries=0).launch_replicas(1, FAKE, [], env=env)
    labels = hub.jobs[handles[0].data["job_id"]].spec["labels"]
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{1,63}", v) for v in labels.values()), labels
    assert labels["diloco-run"] == dotted == handles[0].data["label"] and handles[0].data["run_id"] == "exp.v1.2"


def test_an_unknown_stage_is_unknown_not_pending(hub: FakeHFJobsServer, job_env: dict[str, str]) -> None:
    ex = _executor(hub, retries=0)
    handles = ex.launch_replicas(1, FAKE, ["--sleep-s", "600"], env=job_env)
    job = hub.jobs[handles[0].data["job_id"]]
    with job.lock:
        job.stage = "PAUSED"
    (state,) = ex.poll(handles)
    assert state.status is ReplicaStatus.UNKNOWN and "PAUSED" in (state.reason or "")
    ex.cancel(handles)


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


# --- run.json is writable by every replica credential: a handle never decides where the token goes ---

class _Recorder:
    """A tiny HTTP server on 127.0.0.1 that records every request's method, path and Authorization."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str | None]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _record(self) -> None:
                recorder.requests.append((self.command, self.path, self.headers.get("Authorization")))
                body = b'{"error": "recorded"}'
                self.send_response(404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = _record

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def test_a_handle_endpoint_never_receives_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 1: an hf-jobs handle whose endpoint points elsewhere is refused before any request."""
    token = "hf_user_token_that_must_not_leak"
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    recorder = _Recorder()
    try:
        forged = {"kind": "hf-jobs", "rank": 0, "job_id": "0123456789abcdef01234567", "namespace": "someone",
                  "endpoint": recorder.url}
        executor, error = executor_from_launch({"executor": "hf-jobs", "handles": [forged]})
        if executor is not None:  # what `diloco status / logs / cancel` would then do
            handle = handle_from_json(forged)
            for action in (lambda: executor.poll([handle]), lambda: executor.logs(handle),
                           lambda: executor.cancel([handle])):
                try:
                    action()
                except Exception:
                    pass
        assert not [r for r in recorder.requests if r[2] and token in r[2]], "the token reached the handle's endpoint"
        assert recorder.requests == []
        assert executor is None and error is not None
        assert f"names endpoint '{recorder.url}'" in error and "refusing to send your HF token" in error
        assert "\n" not in error
        with pytest.raises(ExecutorUnavailable, match="set HF_ENDPOINT to it"):
            executor_for_handle(forged)
        # the endpoint in use is HF_ENDPOINT (read now), or an explicit option; then the same handle is used
        monkeypatch.setenv("HF_ENDPOINT", recorder.url + "/")
        assert isinstance(executor_for_handle(forged), HFJobsExecutor)
        monkeypatch.delenv("HF_ENDPOINT")
        assert executor_for_handle(forged, endpoint=recorder.url).endpoint == recorder.url  # type: ignore[attr-defined]
    finally:
        recorder.close()


@pytest.mark.parametrize("field, value", [
    ("job_id", "x/../../../whoami-v2"), ("job_id", None), ("namespace", "../../api/whoami-v2"),
])
def test_job_ids_and_namespaces_from_handles_must_be_plain_names(
    hub: FakeHFJobsServer, monkeypatch: pytest.MonkeyPatch, field: str, value: object
) -> None:
    """A handle cannot steer the token to another path of the (right) endpoint either."""
    monkeypatch.setenv("HF_TOKEN", hub.token)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    forged = {"kind": "hf-jobs", "rank": 1, "job_id": "0123456789abcdef01234567", "namespace": "fake-user",
              "endpoint": hub.url, field: value}
    handle = handle_from_json(forged)
    with pytest.raises(ExecutorError, match=rf"rank 1's handle has {field}=.*not a plain name"):
        ex = executor_for_handle(forged, namespace="fake-user")
        ex.poll([handle])
    with pytest.raises(ExecutorError, match=rf"{field}=.*not a plain name"):
        ex = executor_for_handle(forged, namespace="fake-user")
        ex.cancel([handle])
    assert hub.requests == []


def test_the_flavor_price_table_is_exactly_the_sdks_job_hardware() -> None:
    """A flavor the Hub refuses must not be priced or suggested (``h100`` / ``h100x8`` were), and every
    flavor the SDK offers has an estimate for --max-usd."""
    from huggingface_hub import JobHardware

    from diloco_serverless.launcher.pricing import HF_JOBS_USD_PER_HOUR

    offered = {f.value for f in JobHardware}
    assert set(HF_JOBS_USD_PER_HOUR) - offered == set(), "priced flavors the Hub does not have"
    assert offered - set(HF_JOBS_USD_PER_HOUR) == set(), "flavors without a price estimate"


def test_a_job_being_updated_is_running(hub: FakeHFJobsServer, job_env: dict[str, str]) -> None:
    ex = HFJobsExecutor(endpoint=hub.url, token=hub.token, install=None, poll_interval_s=0.05)
    (handle,) = ex.launch_replicas(1, FAKE, ["--sleep-s", "3"], env=job_env)
    (job,) = hub.jobs.values()
    deadline = time.monotonic() + 20
    while job.stage != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.02)
    with job.lock:
        job.stage = "UPDATING"  # what the Hub reports while a running Job's settings change
    (state,) = ex.poll([handle])
    assert state.status is ReplicaStatus.RUNNING and state.detail["stage"] == "UPDATING"
    ex.cancel([handle])


def test_logs_from_a_stream_that_stays_open(job_env: dict[str, str]) -> None:
    """The Hub's log stream stays open after its replay (keep-alives, new lines as they come): the SDK ends a
    no-follow read itself (its 5 s read timeout, or a line newer than the response's Date)."""
    with FakeHFJobsServer() as srv:
        ex = HFJobsExecutor(endpoint=srv.url, token=srv.token, install=None, poll_interval_s=0.05)
        handles = ex.launch_replicas(1, FAKE, [], env=job_env)
        (result,) = ex.collect(handles, timeout=60)
        assert result.ok
        assert "fake replica rank=0" in ex.logs(handles[0], tail=20)
        running = ex.launch_replicas(1, FAKE, ["--sleep-s", "30"], env=job_env)
        deadline = time.monotonic() + 20
        while "fake replica rank=0" not in (text := ex.logs(running[0], tail=20)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "fake replica rank=0" in text  # read while the Job runs and its stream stays open
        ex.cancel(running)
