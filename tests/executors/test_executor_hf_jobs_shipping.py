"""HF Jobs run the code that launched them, in a clean room.

The fake Jobs server runs each attempt in a fresh venv that has this environment's dependencies but
**not** ``diloco_serverless`` (``FakeHFJobsServer(clean_room=True)``, pip without an index). The
executor builds a wheel of the running package, the test's uploader (standing in for the launcher)
puts it in the run's own store on moto S3, and each Job installs the requirements, fetches the
wheel with the Job's storage secrets, checks its SHA-256 and installs it: a Job trains only if the
shipped code installs and runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")
pytest.importorskip("s3fs")

from diloco_serverless.config import RunConfig
from diloco_serverless.executors import ReplicaStatus
from diloco_serverless.executors.base import ExecutorUnavailable, ReplicaFailedError
from diloco_serverless.executors.hf_jobs import HFJobsExecutor
from diloco_serverless.run.record import create_run
from diloco_serverless.store import ObjectStore
from support.fake_hf_jobs_server import CleanRoom, FakeHFJobsServer

pytestmark = pytest.mark.slow

REPLICA = "diloco_serverless.entrypoints.replica"


@pytest.fixture(scope="module")
def clean_room() -> CleanRoom:
    room = CleanRoom()
    yield room
    room.close()


def _run(store_url: str, storage_options: dict, run_id: str, replicas: int = 2, rounds: int = 1) -> str:
    cfg = RunConfig.load(None, [
        f"store={json.dumps(store_url)}", f"run_id={json.dumps(run_id)}", f"replicas={replicas}", f"rounds={rounds}",
        "inner.sync_every=2", "data.seq_len=48", "data.prompt_len=16", "data.batch_size=2",
        "data.eval_batches=1", "checkpoint_every=0", "eval_every=0",
    ])
    run_store, _ = create_run(store_url, cfg, storage_options=storage_options)
    return run_store.url


def _uploader(run_url: str, storage_options: dict, uploads: list[str], tamper: bool = False):
    """What the launcher passes: store the wheel at <run>/code/<name> in the run's store, return its URL."""
    store = ObjectStore(run_url, storage_options)

    def upload(name: str, data: bytes) -> str:
        uploads.append(name)
        store.put(f"code/{name}", data + (b"tampered" if tamper else b""))
        return f"{run_url}/code/{name}"

    return upload


def _executor(hub: FakeHFJobsServer, **kw: object) -> HFJobsExecutor:
    kw.setdefault("retries", 1)
    return HFJobsExecutor(flavor="cpu-basic", image="python:3.11", endpoint=hub.url, token=hub.token,  # type: ignore[arg-type]
                          forward_credentials=False, poll_interval_s=0.5, **kw)


def test_the_clean_room_lacks_the_package(clean_room: CleanRoom) -> None:
    import os
    import subprocess

    env_dir = clean_room.new_env()
    env = clean_room.environ(env_dir, dict(os.environ))
    probe = ("import importlib.util as u, torch, s3fs, pip;"
             "print('has-package' if u.find_spec('diloco_serverless') else 'no-package')")
    out = subprocess.run([str(env_dir / "bin" / "python"), "-c", probe], env=env, cwd=env_dir,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no-package"


def test_without_an_uploader_nothing_is_submitted(s3_store_url: str, s3_storage_options: dict) -> None:
    run_url = _run(s3_store_url, s3_storage_options, "no-uploader")
    with FakeHFJobsServer(log_stream_close_s=0.5) as hub:
        ex = _executor(hub)  # install="local" is the default
        with pytest.raises(ExecutorUnavailable, match="no code uploader is set"):
            ex.launch_replicas(2, REPLICA, ["--run-url", run_url], env={"DILOCO_RUN_URL": run_url})
        assert hub.jobs == {}


def test_a_replaced_wheel_is_refused_and_not_retried(
    s3_store_url: str, s3_storage_options: dict, s3_env: dict, clean_room: CleanRoom
) -> None:
    """The SHA-256 in the Job's command is the launcher's; a wheel swapped in the bucket is never installed."""
    run_url = _run(s3_store_url, s3_storage_options, "tampered")
    uploads: list[str] = []
    with FakeHFJobsServer(clean_room=clean_room, log_stream_close_s=0.5) as hub:
        ex = _executor(hub, retries=2)
        ex.set_code_uploader(_uploader(run_url, s3_storage_options, uploads, tamper=True))
        handles = ex.launch_replicas(1, REPLICA, ["--run-url", run_url], env={**s3_env, "DILOCO_RUN_URL": run_url})
        with pytest.raises(ReplicaFailedError) as info:
            ex.collect(handles, timeout=300)
        log = ex.logs(handles[0], tail=None)
    (result,) = info.value.results
    assert result.status is ReplicaStatus.FAILED and result.exit_code == 2
    assert "SHA-256" in (result.reason or "") and "refusing to install it" in (result.reason or "")
    assert log.count("installing diloco_serverless-") == 1, log  # a setup error: no second attempt
    assert "Successfully installed" not in log


def test_shipped_code_reports_setup_errors_without_retrying(
    s3_store_url: str, s3_storage_options: dict, s3_env: dict, clean_room: CleanRoom
) -> None:
    """The wheel installs in the clean room and the replica runs from it; a missing run is exit code 2,
    which the Hub's attempts never re-run; poll names the replica's own error line."""
    run_url = _run(s3_store_url, s3_storage_options, "shipped")
    missing = f"{s3_store_url}/no-such-run"
    uploads: list[str] = []
    with FakeHFJobsServer(clean_room=clean_room, log_stream_close_s=0.5) as hub:
        ex = _executor(hub, retries=2)
        ex.set_code_uploader(_uploader(run_url, s3_storage_options, uploads))
        handles = ex.launch_replicas(1, REPLICA, ["--run-url", missing], env={**s3_env, "DILOCO_RUN_URL": missing})
        with pytest.raises(ReplicaFailedError) as info:
            ex.collect(handles, timeout=300)
        log = ex.logs(handles[0], tail=None)
        spec = hub.jobs[handles[0].data["job_id"]].spec
    (result,) = info.value.results
    assert result.status is ReplicaStatus.FAILED and result.exit_code == 2
    assert "setup error, not retried" in (result.reason or "") and "no-such-run" in (result.reason or "")
    assert log.count("[diloco] fetched") == 1 and log.count("error: replica rank 0") == 1, log
    code = ex.shipped_code
    assert code is not None and uploads == [code.filename]
    assert code.url == f"{run_url}/code/{code.filename}" and code.version.startswith("0.1.0+src.")
    assert spec["environment"]["DILOCO_CODE_SHA256"] == code.sha256 and code.sha256 in spec["command"][2]
    assert handles[0].data["code_sha256"] == code.sha256 and handles[0].data["code_version"] == code.version


def test_shipped_code_trains_in_a_clean_room_over_s3(
    s3_store_url: str, s3_storage_options: dict, s3_env: dict, clean_room: CleanRoom, tmp_path: Path
) -> None:
    """Two real replicas from the shipped wheel, tiny model, one round, over moto S3: a loadable final/."""
    run_url = _run(s3_store_url, s3_storage_options, "clean.room-e2e", replicas=2, rounds=1)
    uploads: list[str] = []
    with FakeHFJobsServer(clean_room=clean_room, log_stream_close_s=0.5) as hub:
        ex = _executor(hub, retries=0)
        ex.set_code_uploader(_uploader(run_url, s3_storage_options, uploads))
        env = {**s3_env, "DILOCO_RUN_URL": run_url, "DILOCO_DEVICE": "cpu"}
        handles = ex.launch_replicas(2, REPLICA, ["--run-url", run_url], env=env)
        results = ex.collect(handles, timeout=900)
        logs = [ex.logs(h, tail=None) for h in handles]
        labels = [hub.jobs[h.data["job_id"]].spec["labels"] for h in handles]
    assert [r.status for r in results] == [ReplicaStatus.SUCCEEDED] * 2, logs
    assert all("[diloco] fetched" in log and "done: 1 rounds" in log for log in logs), logs
    assert len(uploads) == 1  # one wheel per launch, whatever the replica count
    assert labels[0]["diloco-run"].startswith("clean-room-e2e-") and "." not in labels[0]["diloco-run"]

    from transformers import AutoModelForCausalLM

    from diloco_serverless.trainer.model import download_pretrained

    local = download_pretrained(ObjectStore(run_url, s3_storage_options), "final", tmp_path / "final")
    model = AutoModelForCausalLM.from_pretrained(local)
    assert sum(p.numel() for p in model.parameters()) > 0
