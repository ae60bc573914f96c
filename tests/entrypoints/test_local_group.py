"""entrypoints/local_group.py: the G local processes of a replica live and die as one unit
(real subprocesses of a stand-in child, tests/support/local_child.py; no torch, fast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco_serverless.entrypoints.local_group import LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV, child_env, run_local_group
from support import pythonpath_env


def _run(tmp_path: Path, plan: str, monkeypatch: pytest.MonkeyPatch, *, cuda: bool = False) -> tuple[int, list[dict]]:
    monkeypatch.setenv("PYTHONPATH", pythonpath_env())
    monkeypatch.setenv("LOCAL_CHILD_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_CHILD_PLAN", plan)
    monkeypatch.delenv("DILOCO_DEVICE", raising=False)
    code = run_local_group(["--run-url", "x"], len(plan.split(",")), cuda=cuda, module="support.local_child")
    records = [json.loads((tmp_path / f"{g}.json").read_text()) for g in range(len(plan.split(",")))]
    return code, records


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_all_local_processes_start_with_their_rank_and_one_rendezvous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, records = _run(tmp_path, "ok,ok,ok", monkeypatch, cuda=True)
    assert code == 0
    assert [r["LOCAL_RANK"] for r in records] == ["0", "1", "2"]
    assert {r["LOCAL_WORLD_SIZE"] for r in records} == {"3"} and {r["MASTER_ADDR"] for r in records} == {"127.0.0.1"}
    assert len({r["MASTER_PORT"] for r in records}) == 1 and records[0]["MASTER_PORT"].isdigit()
    assert [r["DILOCO_DEVICE"] for r in records] == ["cuda:0", "cuda:1", "cuda:2"]  # one device each
    assert all(r["argv"] == ["--run-url", "x"] for r in records)


def test_a_failing_local_process_stops_the_others_and_fails_the_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    code, records = _run(tmp_path, "hang,exit3", monkeypatch)
    assert code == 1  # non-zero: the executor restarts the whole replica
    assert time.monotonic() - started < 30, "the hanging sibling was stopped, not waited for"
    assert not _alive(records[0]["pid"])
    assert "local process 1 of this replica exited with code 3" in capsys.readouterr().err
    assert records[0]["DILOCO_DEVICE"] is None  # CPU: no device assigned


def test_a_setup_error_of_a_local_process_is_the_replicas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, _ = _run(tmp_path, "exit2,hang", monkeypatch)
    assert code == 2  # a setup error (exit code 2) is not retried by the executors


def test_a_killed_local_process_fails_the_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal
    import threading

    def kill_rank_1() -> None:
        deadline = time.monotonic() + 30
        while not (tmp_path / "1.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(json.loads((tmp_path / "1.json").read_text())["pid"], signal.SIGKILL)

    threading.Thread(target=kill_rank_1, daemon=True).start()
    code, records = _run(tmp_path, "hang,hang", monkeypatch)
    assert code == 1 and not any(_alive(r["pid"]) for r in records)


def test_a_replica_whose_processes_stop_before_the_deadline_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 75 from every local process (one decision, local rank 0's) is the replica's exit 75: the
    executor starts a fresh attempt; a 75 beside a failure is still a failure."""
    code, _ = _run(tmp_path, "exit75,exit75", monkeypatch)
    assert code == 75
    for f in tmp_path.glob("*.json"):
        f.unlink()
    code, _ = _run(tmp_path, "exit75,exit1", monkeypatch)
    assert code == 1


def test_the_parent_of_a_local_group_loads_no_torch() -> None:
    """The parent only starts and watches its local processes: importing the replica entrypoint loads
    neither torch nor transformers (each costs seconds of start-up, paid again by every local process),
    and it sets the variables the trainer's ``LocalGroup`` reads."""
    code = ("import sys, diloco_serverless.entrypoints.replica\n"
            "print(','.join(sorted(m for m in ('torch', 'torchft', 'transformers', 'safetensors.torch')"
            " if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == ""
    from diloco_serverless.trainer import local_group as trainer_side

    env = child_env({}, 1, 2, 1234, cuda=False)
    assert (env[trainer_side.LOCAL_RANK_ENV], env[trainer_side.LOCAL_WORLD_SIZE_ENV]) == ("1", "2")
    assert (LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV) == (trainer_side.LOCAL_RANK_ENV, trainer_side.LOCAL_WORLD_SIZE_ENV)


# ------------------------------------------------------------------ how many GPUs a replica may use
def _dev(tmp_path: Path, *names: str) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir(parents=True)
    for name in names:
        (dev / name).touch()
    return dev


def test_cuda_devices_are_counted_from_the_gpu_device_files_and_cuda_visible_devices(tmp_path: Path) -> None:
    from diloco_serverless.entrypoints.local_group import cuda_device_count

    # the driver's other device files (nvidia-uvm, nvidia-modeset, nvidia-caps) are not GPUs
    one = _dev(tmp_path, "nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "nvidia-caps")
    assert cuda_device_count(one, {}) == 1
    (one / "nvidia1").touch()
    (one / "nvidia12").touch()
    assert cuda_device_count(one, {}) == 3
    visible = {"0": 1, "1,0": 2, "GPU-8c1f,GPU-2a7e": 2, "0,1,2,3,4": 3, "": 0, "-1": 0, "0,-1,1": 1, " 0 , 1 ": 2}
    for value, want in visible.items():
        assert cuda_device_count(one, {"CUDA_VISIBLE_DEVICES": value}) == want, value
    assert cuda_device_count(_dev(tmp_path / "x", "nvidia0"), {}) == 0  # no driver control file: no usable GPU
    (tmp_path / "none").mkdir()
    assert cuda_device_count(tmp_path / "none", {}) == 0


@pytest.mark.parametrize(("gpus", "device", "want"), [
    (0, None, ("run", False)), (1, None, ("exit", 2)), (2, None, ("run", True)), (8, None, ("run", True)),
    (1, "cpu", ("run", False)),
])
def test_a_replica_with_fewer_gpus_than_local_processes_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], gpus: int, device: str | None,
    want: tuple[str, object],
) -> None:
    """Process g of a G-process replica gets cuda:g: with 1 GPU for 2 processes the second would fail on
    cuda:1, so the replica stops at once with a setup error naming both counts (DILOCO_DEVICE=cpu: CPU)."""
    from diloco_serverless.entrypoints import replica

    started: list[bool] = []
    monkeypatch.setattr(replica, "_devices_per_replica", lambda url: 2)
    monkeypatch.setattr(replica, "cuda_device_count", lambda: gpus)
    monkeypatch.setattr(replica, "run_local_group", lambda argv, devices, *, cuda: started.append(cuda) or 0)
    for name in ("DILOCO_DEVICE", "DILOCO_CODE_VERSION", "DILOCO_ATTEMPT_DEADLINE", "DILOCO_ATTEMPT_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REPLICA_RANK", "0")
    argv = ["--run-url", "file:///nowhere/run"] + (["--device", device] if device else [])
    code = replica.main(argv)
    if want[0] == "run":
        assert code == 0 and started == [want[1]]
    else:
        assert code == want[1] and not started
        err = capsys.readouterr().err
        assert "parallel.devices=2 starts one process per GPU, and this machine has 1 CUDA device;" in err
        assert "set DILOCO_DEVICE=cpu" in err


def test_multi_device_tests_pin_the_cpu_unless_each_process_has_a_gpu() -> None:
    from support.gpus import local_group_env

    assert local_group_env(2, gpus=0) == {"DILOCO_DEVICE": "cpu"}
    assert local_group_env(2, gpus=1) == {"DILOCO_DEVICE": "cpu"}  # not cuda:0 and cuda:1 on one GPU
    assert local_group_env(2, gpus=2) == {} and local_group_env(2, gpus=8) == {}
    assert local_group_env(4, gpus=2) == {"DILOCO_DEVICE": "cpu"}
