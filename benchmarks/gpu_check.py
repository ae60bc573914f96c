"""Every GPU-only path in one command: what runs when a CUDA machine is lent.

Run (from the repo root, venv active):

    python benchmarks/gpu_check.py                  # everything that fits the machine, under 10 minutes
    python benchmarks/gpu_check.py --only host-sync --only generation
    python benchmarks/gpu_check.py --plan           # print what it would run and exit (any machine)

Prints one table (path, result, seconds, detail) and writes benchmarks/results/gpu_check.json. On a
machine without CUDA it prints the plan, says why nothing ran, and exits 0; ``--plan`` does the same
anywhere. Exit code 1 when a path that ran failed.

The paths (the tests named pick the GPU themselves: the trainer trains on ``cuda`` when torch sees
one, and a multi-device replica starts one process per GPU with NCCL):

  host-sync    tests/trainer/test_gpu_sync.py (its CUDA test): the inner step syncs host and device at most once per
               step (``torch.cuda.set_sync_debug_mode("warn")``); the only test that skips on CPU
  bf16-fused   tests/trainer/test_precision.py + test_inner_step.py on the GPU: bf16 autocast with
               fp32 masters, bf16 parameters, fused AdamW (its found_inf / grad_scale path on CUDA)
  nccl-devices tests/trainer/test_multi_device.py: 2 replicas x 2 devices, NCCL inside a replica
               (needs 2 or more GPUs; skipped with the count otherwise)
  fsdp         tests/trainer/test_fsdp.py: FSDP2 over 2 devices per replica (needs 2 or more GPUs)
  generation   the tiny model built by the trainer's ``build_model``, in bf16 on the GPU, after
               ``for_inference``: greedy ``generate`` with the KV cache equals it without the cache
               (in-process, seconds)

Each pytest path runs in its own process with a deadline (``--timeout-s``, default 180 s each); the
whole check stays under 10 minutes on one GPU. Benchmarks never assert: a failure is a row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.json"


@dataclass(frozen=True)
class GpuPath:
    name: str
    what: str
    tests: tuple[str, ...] = ()  # pytest paths (run in a subprocess); empty: ``run`` in-process
    min_gpus: int = 1
    run: Callable[[], str] | None = None


@dataclass
class Row:
    path: str
    result: str  # passed, failed, skipped, not run
    seconds: float = 0.0
    detail: str = ""
    command: list[str] = field(default_factory=list)


def generation(device: str = "cuda", new_tokens: int = 24) -> str:
    """Greedy generate with and without the KV cache agree, in bf16 on ``device``."""
    import torch

    from diloco_serverless.config import ModelConfig
    from diloco_serverless.trainer.model import build_model, for_inference

    model, tok = build_model(ModelConfig(dtype="bfloat16"), seed=0)
    model = model.to(device).eval()
    ids = tok("def main():\n    return", return_tensors="pt")["input_ids"].to(device)
    with for_inference(model), torch.no_grad():
        assert model.config.use_cache, "for_inference did not switch the KV cache back on"
        cached = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, use_cache=True)
        plain = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, use_cache=False)
    if not torch.equal(cached, plain):
        raise AssertionError(f"KV-cache generation differs: {cached.tolist()} vs {plain.tolist()}")
    return f"{cached.shape[1] - ids.shape[1]} tokens, cached == uncached"


PATHS: tuple[GpuPath, ...] = (
    GpuPath("host-sync", "inner step: at most one host-device sync per step",
            ("tests/trainer/test_gpu_sync.py::test_inner_steps_sync_at_most_once_per_step_on_cuda",)),
    GpuPath("bf16-fused", "bf16 autocast / bf16 parameters, fused AdamW on CUDA",
            ("tests/trainer/test_precision.py", "tests/trainer/test_inner_step.py")),
    GpuPath("nccl-devices", "2 devices per replica over NCCL", ("tests/trainer/test_multi_device.py",), min_gpus=2),
    GpuPath("fsdp", "FSDP2 over 2 devices per replica", ("tests/trainer/test_fsdp.py",), min_gpus=2),
    GpuPath("generation", "bf16 generate: KV cache == no cache", run=generation),
)


def pytest_command(path: GpuPath, timeout_s: int) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs",
            f"--timeout={timeout_s}", *path.tests]


def _pytest_result(rc: int, out: str) -> tuple[str, str]:
    tail = [line for line in out.strip().splitlines() if line.strip()][-1:] or [""]
    summary = tail[0].strip("= ")
    if rc == 0 and " passed" not in summary and "skipped" in summary:
        return "skipped", summary
    return ("passed" if rc == 0 else "failed"), summary


def run_path(path: GpuPath, gpus: int, timeout_s: int) -> Row:
    cmd = pytest_command(path, timeout_s) if path.tests else [f"(in-process) {path.run.__name__ if path.run else ''}"]
    if gpus < path.min_gpus:
        return Row(path.name, "skipped", 0.0, f"needs {path.min_gpus} GPUs, {gpus} found", cmd)
    t0 = time.perf_counter()
    if path.run is not None:
        try:
            detail = path.run()
            result = "passed"
        except Exception as exc:  # a failure is a row, not a crash
            result, detail = "failed", f"{type(exc).__name__}: {exc}"[:300]
        return Row(path.name, result, time.perf_counter() - t0, detail, cmd)
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": pythonpath}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s + 60)
        result, detail = _pytest_result(proc.returncode, proc.stdout + proc.stderr)
        if result == "failed":
            detail += " | " + " / ".join((proc.stdout + proc.stderr).strip().splitlines()[-6:-1])[:400]
    except subprocess.TimeoutExpired:
        result, detail = "failed", f"no answer in {timeout_s + 60} s"
    return Row(path.name, result, time.perf_counter() - t0, detail, cmd)


def table(rows: list[Row]) -> str:
    lines = [f"{'path':<13} {'result':<8} {'seconds':>8}  detail", "-" * 78]
    lines += [f"{r.path:<13} {r.result:<8} {r.seconds:>8.1f}  {r.detail}" for r in rows]
    return "\n".join(lines)


def cuda_devices() -> tuple[int, str]:
    """(CUDA devices torch sees, why none when 0)."""
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return 0, f"torch {torch.__version__} ({build}) sees no CUDA device"
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=[p.name for p in PATHS], help="run only these paths")
    ap.add_argument("--plan", action="store_true", help="print what would run and exit 0")
    ap.add_argument("--timeout-s", type=int, default=180, help="deadline of each pytest path (default 180)")
    ap.add_argument("--json", type=Path, default=RESULTS, help=f"where to write the results (default {RESULTS})")
    args = ap.parse_args(argv)
    paths = [p for p in PATHS if not args.only or p.name in args.only]
    gpus, device = cuda_devices()
    print(f"device: {device if gpus else 'none'} ({gpus} CUDA device{'s' if gpus != 1 else ''})")
    if args.plan or gpus == 0:
        why = "--plan" if args.plan else device
        print(f"not running ({why}); on a CUDA machine this runs:")
        rows = [Row(p.name, "not run", 0.0, p.what + (f" (needs {p.min_gpus} GPUs)" if p.min_gpus > 1 else ""),
                    pytest_command(p, args.timeout_s) if p.tests else [f"(in-process) {p.name}"]) for p in paths]
        for r in rows:
            print(f"  {r.path:<13} {' '.join(r.command[1:]) if r.command[0] == sys.executable else r.command[0]}")
    else:
        rows = []
        for p in paths:
            rows.append(run_path(p, gpus, args.timeout_s))
            print(f"  {rows[-1].path}: {rows[-1].result} ({rows[-1].seconds:.1f} s)", flush=True)
    print(table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"device": device, "cuda_devices": gpus, "rows": [asdict(r) for r in rows]},
                                    indent=2) + "\n")
    print(f"wrote {args.json}")
    return 1 if any(r.result == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
