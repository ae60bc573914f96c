"""``benchmarks/gpu_check.py``: on a machine without CUDA it lists every GPU path it would run and exits
0; its runner turns a pytest file, a GPU count it lacks and an in-process check into rows; the
generation check's own code agrees on the CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from support import REPO_ROOT, pythonpath_env

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.py"
NAMES = ["host-sync", "bf16-fused", "nccl-devices", "fsdp", "generation"]


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_gpu_path_is_planned_and_the_tests_it_names_exist(gpu_check: ModuleType) -> None:
    assert [p.name for p in gpu_check.PATHS] == NAMES
    for path in gpu_check.PATHS:
        for test in path.tests:
            file, _, name = test.partition("::")
            assert (REPO_ROOT / file).is_file(), test
            assert not name or f"def {name}(" in (REPO_ROOT / file).read_text(), test


def test_plan_lists_every_path_and_exits_0(gpu_check: ModuleType, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert gpu_check.main(["--plan", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in NAMES) and "not running (--plan)" in printed
    doc = json.loads(out.read_text())
    assert [r["path"] for r in doc["rows"]] == NAMES and {r["result"] for r in doc["rows"]} == {"not run"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the script runs the GPU paths")
@pytest.mark.slow
def test_on_cpu_the_command_says_what_it_would_run_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": pythonpath_env(), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "sees no CUDA device" in proc.stdout and all(name in proc.stdout for name in NAMES)
    assert "tests/trainer/test_gpu_sync.py::test_inner_steps_sync_at_most_once_per_step_on_cuda" in proc.stdout
    assert json.loads(out.read_text())["cuda_devices"] == 0


@pytest.mark.slow
def test_the_runner_reports_passed_skipped_and_failed_rows(gpu_check: ModuleType) -> None:
    passing = gpu_check.GpuPath("p", "a fast test", ("tests/test_config.py::test_examples_load",))
    row = gpu_check.run_path(passing, 1, 120)
    assert row.result == "passed" and row.seconds > 0 and "1 passed" in row.detail, row
    two = gpu_check.GpuPath("two", "needs two", ("tests/test_config.py",), min_gpus=2)
    assert gpu_check.run_path(two, 1, 120).detail == "needs 2 GPUs, 1 found"

    def broken() -> str:
        raise RuntimeError("CUDA error: an illegal memory access")

    row = gpu_check.run_path(gpu_check.GpuPath("b", "raises", run=broken), 1, 120)
    assert row.result == "failed" and "illegal memory access" in row.detail
    assert "failed" in gpu_check.table([row])


@pytest.mark.slow
def test_the_generation_check_passes_on_the_cpu(gpu_check: ModuleType) -> None:
    assert gpu_check.generation("cpu", new_tokens=6) == "6 tokens, cached == uncached"
