"""Multi-GPU replicas on each executor: the GPU count an executor gives a replica becomes the run's
``parallel.devices`` (what the replica entrypoint starts that many local processes from), a config
asking for another count is refused, and a count the platform cannot give is refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.errors import LaunchError
from diloco_serverless.executors.base import ExecutorUnavailable
from diloco_serverless.executors.hf_jobs import flavor_gpus
from diloco_serverless.executors.local import LocalProcessExecutor
from diloco_serverless.executors.modal import gpu_count
from diloco_serverless.executors.registry import get_executor
from diloco_serverless.launcher.preflight import with_executor_devices
from support import FAKE_REPLICA, pythonpath_env
from support.fake_hf_jobs_server import FakeHFJobsServer


@pytest.fixture
def modal_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The real ``modal`` SDK against the fake Modal server (tests/support/modal_grpc_server.py)."""
    pytest.importorskip("modal")
    from support.modal_grpc_server import fake_modal

    with fake_modal(monkeypatch) as srv:
        yield srv

RUN_URL = "s3://bucket/runs/run-g8"


def _cfg(*overrides: str) -> RunConfig:
    return RunConfig.load(None, ["run_id=run-g8", *overrides])


def test_modal_gpu_count_is_the_replicas_devices(modal_server: Any) -> None:
    ex = get_executor("modal", gpu="h100:8", show_output=False)
    assert ex.devices_per_replica == 8
    ex.launch_replicas(2, "diloco_serverless.entrypoints.replica", ["--run-url", RUN_URL],
                       env={"DILOCO_RUN_URL": RUN_URL})
    (create,) = modal_server.sent("FunctionCreate")
    gpu = create.function.resources.gpu_config
    assert (gpu.gpu_type, gpu.count) == ("H100", 8)  # one container with 8 GPUs per replica
    assert len(modal_server.sent("FunctionMap")) == 2
    cfg = with_executor_devices(_cfg(), ex, "modal")
    assert cfg.parallel.devices == 8 and cfg.run_id == "run-g8"
    with pytest.raises(LaunchError, match=r"parallel.devices is 4 but the modal executor gives each replica 8"):
        with_executor_devices(_cfg("parallel.devices=4"), ex, "modal")
    assert with_executor_devices(_cfg("parallel.devices=8"), ex, "modal").parallel.devices == 8


def test_modal_refuses_a_count_it_cannot_give(modal_server: Any) -> None:
    with pytest.raises(ExecutorUnavailable, match=r"unknown GPU 'H100:9'.*N <= 8"):
        get_executor("modal", gpu="H100:9")
    assert gpu_count("A100") == 1 and gpu_count(None) is None


def test_hf_jobs_flavor_gpus_and_submitted_flavor() -> None:
    hub = pytest.importorskip("huggingface_hub")
    flavors = {f.value for f in hub.JobHardware}
    for flavor in flavors:
        n = flavor_gpus(flavor)
        assert (n is None) == flavor.startswith("cpu"), flavor
    assert flavor_gpus("h200x8") == 8 and flavor_gpus("a10g-largex2") == 2 and flavor_gpus("a100-large") == 1
    with FakeHFJobsServer(log_stream_close_s=0.5) as srv:
        ex = get_executor("hf-jobs", flavor="h200x8", image="python:3.11", endpoint=srv.url, token=srv.token,
                          install=None, forward_credentials=False, poll_interval_s=0.1)
        assert ex.devices_per_replica == 8
        env = {"PYTHONPATH": pythonpath_env(), "DILOCO_RUN_URL": RUN_URL}
        (handle,) = ex.launch_replicas(1, FAKE_REPLICA, ["--sleep-s", "0"], env=env)
        ex.collect([handle], timeout=60)
        assert srv.jobs[handle.data["job_id"]].spec["flavor"] == "h200x8"  # one job with 8 GPUs per replica
        assert with_executor_devices(_cfg(), ex, "hf-jobs").parallel.devices == 8
        with pytest.raises(LaunchError, match=r"parallel.devices=8 or change the GPU count"):
            with_executor_devices(_cfg("parallel.devices=2"), ex, "hf-jobs")


def test_local_devices_per_replica_option() -> None:
    ex = LocalProcessExecutor(devices_per_replica="2")
    assert ex.devices_per_replica == 2
    assert with_executor_devices(_cfg(), ex, "local").parallel.devices == 2
    assert LocalProcessExecutor().devices_per_replica is None  # the config decides
    assert with_executor_devices(_cfg("parallel.devices=3"), LocalProcessExecutor(), "local").parallel.devices == 3
    for bad in ("0", "two", 65):
        with pytest.raises(ValueError, match="devices_per_replica must be an integer in 1..64"):
            LocalProcessExecutor(devices_per_replica=bad)
    with pytest.raises(LaunchError, match=r"-x devices_per_replica"):
        with_executor_devices(_cfg("parallel.devices=4"), ex, "local")
