"""HF Jobs end to end with *real* replicas: the huggingface_hub client submits Jobs to a fake Jobs
server on 127.0.0.1, which runs ``python -m diloco_serverless.entrypoints.replica`` as local
processes; the replicas train the tiny model and exchange pseudo-gradients over moto S3.

The fake server scrubs AWS_* from the environment it inherits, so the S3 credentials reach the
replicas only as Job secrets and the endpoint as plain Job environment, as on the real Hub.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("huggingface_hub")
pytest.importorskip("s3fs")
pytest.importorskip("diloco_serverless.entrypoints.replica")

from diloco_serverless.config import RunConfig
from diloco_serverless.executors import ReplicaStatus
from diloco_serverless.executors.base import ReplicaFailedError
from diloco_serverless.executors.hf_jobs import HFJobsExecutor
from diloco_serverless.run.members import read_members
from diloco_serverless.run.record import create_run
from support.fake_hf_jobs_server import FakeHFJobsServer

pytestmark = pytest.mark.slow

REPLICA = "diloco_serverless.entrypoints.replica"


def _tiny_run(store_url: str, storage_options: dict, run_id: str, replicas: int) -> str:
    cfg = RunConfig.load(None, [
        f"store={json.dumps(store_url)}", f"run_id={json.dumps(run_id)}", f"replicas={replicas}", "rounds=1",
        "inner.sync_every=2", "data.seq_len=48", "data.prompt_len=16", "data.batch_size=2",
        "data.eval_batches=1", "checkpoint_every=0", "eval_every=0",
    ])
    run_store, _ = create_run(store_url, cfg, storage_options=storage_options)
    return run_store.url


def test_hf_jobs_replicas_train_over_s3(s3_store_url: str, s3_storage_options: dict, s3_env: dict) -> None:
    run_url = _tiny_run(s3_store_url, s3_storage_options, "hf-e2e", replicas=2)
    with FakeHFJobsServer(log_stream_close_s=0.5) as hub:
        ex = HFJobsExecutor(flavor="cpu-basic", image="python:3.11", endpoint=hub.url, token=hub.token,
                            install=None, retries=0, forward_credentials=False, poll_interval_s=0.5)
        env = {**s3_env, "DILOCO_RUN_URL": run_url, "DILOCO_DEVICE": "cpu"}
        handles = ex.launch_replicas(2, REPLICA, ["--run-url", run_url], env=env)
        spec = hub.jobs[handles[0].data["job_id"]].spec
        assert set(spec["secrets"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        assert spec["environment"]["AWS_ENDPOINT_URL"] == s3_env["AWS_ENDPOINT_URL"]
        results = ex.collect(handles, timeout=600)
        assert [r.status for r in results] == [ReplicaStatus.SUCCEEDED] * 2
        assert "done: 1 rounds" in ex.logs(handles[0], tail=20)

    import s3fs

    fs = s3fs.S3FileSystem(**s3_storage_options)
    root = run_url.removeprefix("s3://")
    assert fs.exists(f"{root}/final/model.safetensors")
    from diloco_serverless.run.record import open_run_store

    members = read_members(open_run_store(run_url, s3_storage_options))
    assert sorted(members) == [0, 1]
    assert all(m.state == "done" and m.bytes_up > 0 and m.bytes_down > 0 for m in members.values())


def test_hf_jobs_real_replica_failure_is_reported(s3_store_url: str, s3_env: dict) -> None:
    missing = f"{s3_store_url}/no-such-run"
    with FakeHFJobsServer(log_stream_close_s=0.5) as hub:
        ex = HFJobsExecutor(flavor="cpu-basic", image="python:3.11", endpoint=hub.url, token=hub.token,
                            install=None, retries=1, forward_credentials=False, poll_interval_s=0.5)
        env = {**s3_env, "DILOCO_RUN_URL": missing, "DILOCO_DEVICE": "cpu"}
        handles = ex.launch_replicas(1, REPLICA, ["--run-url", missing], env=env)
        with pytest.raises(ReplicaFailedError) as info:
            ex.collect(handles, timeout=300)
    msg = str(info.value)
    assert "rank(s) 0" in msg and "exit code 2" in msg
    assert "error: replica rank 0" in msg and "no-such-run" in msg  # the replica's one-line error, from the log
