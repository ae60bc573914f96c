"""Multi-device replicas (``parallel.devices = G``) as real processes on CPU (gloo): 2 replicas x 2
local processes against the same run with G = 1, and a local process SIGKILLed mid-run.
(On a machine with a GPU for each local process they run on cuda:g with nccl instead: support/gpus.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file

from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer import checkpoint as ckpt
from support.diloco_harness import create_tiny_run, wait_replicas, write_jsonl
from support.gpus import local_group_env

pytestmark = pytest.mark.slow

REPLICAS = 2


def _spawn(run_url: str, rank: int, log: Path, dump: Path, attempt: int = 0) -> subprocess.Popen[bytes]:
    env = {
        **os.environ, "REPLICA_RANK": str(rank), "DILOCO_RUN_URL": run_url, "DILOCO_ATTEMPT": str(attempt),
        "OMP_NUM_THREADS": "1", "DILOCO_LOG_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
        "DILOCO_DUMP_PARAMS": str(dump), **local_group_env(2),  # the G=1 runs on the same device kind
    }
    with log.open("ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "diloco_serverless.entrypoints.replica"], env=env,
                                stdout=fh, stderr=subprocess.STDOUT)




def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _dumps(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(str(p)) for p in sorted(folder.glob("*.safetensors"))}


def _contrib_bytes(run_root: Path, prefix: str, round_: int, rank: int) -> int:
    """Bytes of rank ``rank``'s contribution objects of ``round_`` under ``prefix``, read from the files."""
    folder = run_root / prefix / f"rounds/{round_:08d}/contrib"
    return sum(p.stat().st_size for p in folder.glob(f"*/rank-{rank}"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run with G = 1 and one with G = 2 (same config otherwise), run to the end concurrently."""
    tmp = tmp_path_factory.mktemp("multi")
    data = write_jsonl(tmp / "data.jsonl")
    out: dict[str, Path] = {}
    procs, logs = [], []
    for g in (1, 2):
        url = create_tiny_run(f"file://{tmp}/store", data, REPLICAS, run_id=f"g{g}", rounds=2, eval_every=0,
                              **{"parallel.devices": g})
        out[f"g{g}"] = tmp / f"dump-g{g}"
        out[f"root{g}"] = Path(url.removeprefix("file://"))
        for r in range(REPLICAS):
            logs.append(tmp / f"g{g}-rank-{r}.log")
            procs.append(_spawn(url, r, logs[-1], out[f"g{g}"]))
    wait_replicas(procs, logs)
    return out


def test_every_process_of_every_replica_ends_identical_and_matches_one_device(runs: dict[str, Path]) -> None:
    g2 = _dumps(runs["g2"])
    assert sorted(g2) == [f"rank-{r}.local-{g}.safetensors" for r in range(REPLICAS) for g in range(2)]
    first = next(iter(g2.values()))
    for name, params in g2.items():
        assert params.keys() == first.keys()
        for k in first:
            assert torch.equal(params[k], first[k]), f"{k}: {name} differs"
    one = load_file(str(runs["g1"] / "rank-0.safetensors"))
    assert one.keys() == first.keys()
    for k, ref in one.items():
        torch.testing.assert_close(first[k], ref, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    initial = load_bytes(ObjectStore(f"file://{runs['root2']}").get("checkpoints/initial.safetensors"))
    assert any(not torch.equal(initial[k], first[k]) for k in first if k in initial), "the run trained"
    # the outer momentum is sharded over the local processes, yet the checkpoint has the one-device format
    stores = [ObjectStore(f"file://{runs[f'root{g}']}") for g in (1, 2)]
    (t1, _), (t2, _) = (ckpt.load_checkpoint(st, ckpt.find_latest_checkpoint(st), None) for st in stores)
    assert t1.keys() == t2.keys() and any("momentum_buffer" in k for k in t2)
    for k in t1:
        torch.testing.assert_close(t2[k], t1[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    # the final model is one Hugging Face folder, written once
    root2 = ObjectStore(f"file://{runs['root2']}")
    assert root2.exists("final/DONE.json") and root2.exists("final/config.json")


def test_exchange_bytes_per_device_are_one_over_g(runs: dict[str, Path]) -> None:
    for rank in range(REPLICAS):
        whole = _contrib_bytes(runs["root1"], "", 0, rank)
        parts = [_contrib_bytes(runs["root2"], f"slices/{g:02d}", 0, rank) for g in range(2)]
        assert whole > 100_000, "the G=1 replica contributed"
        for part in parts:  # one device's uploads: half the tensor, plus its own object headers
            assert abs(part - whole / 2) < 0.01 * whole, (part, whole)
        # the metrics: one device moves half of what a G=1 replica moves, the replica as much
        one = json.loads((runs["root1"] / f"metrics/rank-{rank}/00000000.json").read_text())
        two = json.loads((runs["root2"] / f"metrics/rank-{rank}/00000000.json").read_text())
        assert two["devices"] == 2 and one["devices"] == 1
        assert abs(two["device_bytes_up"] - one["bytes_up"] / 2) < 0.02 * one["bytes_up"]
        assert abs(two["device_bytes_down"] - one["bytes_down"] / 2) < 0.02 * one["bytes_down"]
        assert abs(two["bytes_up"] - one["bytes_up"]) < 0.02 * one["bytes_up"]
        assert abs(two["bytes_down"] - one["bytes_down"]) < 0.02 * one["bytes_down"]
    # one quorum per round: every slice of a round lists the same participants
    for round_ in range(2):
        qs = [json.loads((runs["root2"] / f"slices/{g:02d}/rounds/{round_:08d}/quorum.json").read_text())
              for g in range(2)]
        assert qs[0]["participants"] == qs[1]["participants"] == list(range(REPLICAS))


def test_sigkilled_local_process_restarts_its_replica_as_a_unit(tmp_path: Path, runs: dict[str, Path]) -> None:
    """SIGKILL local process 1 of replica 1 mid-run: its parent stops local process 0 and exits
    non-zero; restarted (as the executor does), the replica heals and the run ends with every
    process of every replica identical, and equal to the undisturbed G=2 run."""
    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(f"file://{tmp_path}/store", data, REPLICAS, run_id="g2", rounds=2, eval_every=0,
                          **{"parallel.devices": 2, "exchange.straggler_timeout_s": 300,
                             "exchange.round_timeout_s": 600})
    root, dump = Path(url.removeprefix("file://")), tmp_path / "dump"
    logs = [tmp_path / f"rank-{r}.log" for r in range(REPLICAS)]
    procs = [_spawn(url, r, logs[r], dump) for r in range(REPLICAS)]
    # mid-run: replica 1's local process 1 has published its slice of round 1 (or round 1 is under way)
    marker = root / "slices/01/rounds/00000000/quorum.json"
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert time.monotonic() < deadline and procs[1].poll() is None, logs[1].read_text(errors="replace")[-3000:]
        time.sleep(0.02)
    locals_ = _children(procs[1].pid)
    assert len(locals_) == 2, "replica 1 runs as two local processes"
    os.kill(locals_[1], signal.SIGKILL)
    assert procs[1].wait(timeout=60) == 1, logs[1].read_text(errors="replace")[-3000:]
    assert "local process 1 of this replica was killed by signal 9" in logs[1].read_text(errors="replace")
    assert not any(_alive(pid) for pid in locals_), "the parent stopped its other local process"
    procs[1] = _spawn(url, 1, logs[1], dump, attempt=1)
    wait_replicas(procs, logs)
    got = _dumps(dump)
    assert len(got) == 2 * REPLICAS
    ref = _dumps(runs["g2"])["rank-0.local-0.safetensors"]
    for name, params in got.items():
        for k in ref:
            assert torch.equal(params[k], ref[k]), f"{k}: {name} differs from the undisturbed run"
    assert ObjectStore(url).exists("final/DONE.json")
