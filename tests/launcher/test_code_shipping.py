"""The launcher hands executors that ship code (HF Jobs) an uploader into the run's own folder, and
status trusts a live heartbeat over a platform that still says "pending"."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from diloco_serverless.config import RunConfig
from diloco_serverless.executors.base import ShippedCode
from diloco_serverless.launcher.api import launch
from diloco_serverless.launcher.status import ExecutorState, replica_state
from diloco_serverless.store.objectstore import ObjectStore
from support.fake_executor import FakeExecutor


class ShippingExecutor(FakeExecutor):
    """A FakeExecutor with the hook remote executors use to ship the launching code."""

    def __init__(self) -> None:
        super().__init__(kind="custom")  # a remote kind would (rightly) refuse a local folder store
        self.uploader: Any = None
        self.shipped_code: ShippedCode | None = None

    def set_code_uploader(self, uploader: Any) -> None:
        self.uploader = uploader

    def launch_replicas(self, n_replicas: int, entrypoint: str, entrypoint_args: list[str],
                        env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        wheel = b"PK\x03\x04 a wheel"
        url = self.uploader("diloco_serverless-0.1.0+src.abc-py3-none-any.whl", wheel)
        self.shipped_code = ShippedCode(url, hashlib.sha256(wheel).hexdigest(), "0.1.0+src.abc",
                                        "diloco_serverless-0.1.0+src.abc-py3-none-any.whl")
        return super().launch_replicas(n_replicas, entrypoint, entrypoint_args, env)


def test_shipped_code_lands_in_the_run_folder_and_is_recorded(tmp_path: Path) -> None:
    ex = ShippingExecutor()
    cfg = RunConfig.load(None, ["run_id=ship", "replicas=2", f'store="{tmp_path / "runs"}"'])
    run = launch(cfg, executor=ex)
    store = ObjectStore(run.url)
    assert store.get("code/diloco_serverless-0.1.0+src.abc-py3-none-any.whl") == b"PK\x03\x04 a wheel"
    code = (run.record.launch or {})["code"]
    assert code["url"] == f"{run.url}/code/diloco_serverless-0.1.0+src.abc-py3-none-any.whl"
    assert code["sha256"] == hashlib.sha256(b"PK\x03\x04 a wheel").hexdigest()


def test_a_live_heartbeat_beats_a_lagging_pending() -> None:
    pending = ExecutorState("pending")
    assert replica_state(pending, {"state": "training"}, 5.0, 300.0) == ("running", None)
    assert replica_state(pending, {"state": "training"}, 900.0, 300.0) == ("pending", None)
    assert replica_state(pending, None, None, 300.0) == ("pending", None)
    assert replica_state(ExecutorState("unknown", "result expired"), {"state": "done"}, 5.0, 300.0)[0] == "succeeded"


def test_modal_gpu_cpu_means_a_cpu_container_not_the_default_gpu() -> None:
    """Before: ``--gpu cpu`` normalised to None, so the executor fell back to its A100 default."""
    from diloco_serverless.executors.modal import normalize_gpu
    from diloco_serverless.launcher.preflight import check_executor_kind

    assert check_executor_kind("modal", "cpu") == "cpu"
    assert normalize_gpu(check_executor_kind("modal", "cpu")) is None  # what the executor then builds
    assert check_executor_kind("modal", "h100:2") == "H100:2"
