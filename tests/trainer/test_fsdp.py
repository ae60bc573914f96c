"""FSDP2 inside a multi-device replica (``parallel.strategy = "fsdp"``) as real processes on CPU (gloo):
2 replicas x 2 local processes against the same run with G = 1, with gradient accumulation and a
batch that does not split evenly over the devices; plus the shard/gather helpers in 2 processes.
(On a machine with a GPU for each local process they run on cuda:g with nccl instead: support/gpus.py.)"""

from __future__ import annotations

import copy
import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file

from diloco_serverless.entrypoints.local_group import free_port
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer import checkpoint as ckpt
from diloco_serverless.trainer.fsdp import (
    gather_optimizer_state,
    gather_rows,
    local_rows,
    shard_model,
    shard_optimizer_state,
)
from diloco_serverless.trainer.local_group import LocalGroup
from support.diloco_harness import create_tiny_run, wait_replicas, write_jsonl
from support.gpus import local_group_env

pytestmark = pytest.mark.slow

REPLICAS = 2
#: 3 rows in micro-batches of 1: G=1 accumulates 3, FSDP local rank 0 two and local rank 1 one (plus a
#: zero pass, so both make as many FSDP collectives)
SHAPE = {"data.batch_size": 3, "data.micro_batch_size": 1}


def _spawn(run_url: str, rank: int, log: Path, dump: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ, "REPLICA_RANK": str(rank), "DILOCO_RUN_URL": run_url, "OMP_NUM_THREADS": "1",
        "DILOCO_LOG_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "DILOCO_DUMP_PARAMS": str(dump),
        **local_group_env(2),  # the G=1 run on the same device kind
    }
    with log.open("ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "diloco_serverless.entrypoints.replica"], env=env,
                                stdout=fh, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run with G = 1 and one with 2 FSDP devices per replica (same data and steps), run concurrently."""
    tmp = tmp_path_factory.mktemp("fsdp")
    data = write_jsonl(tmp / "data.jsonl")
    out: dict[str, Path] = {}
    procs, logs = [], []
    for name, extra in (("g1", {}), ("fsdp", {"parallel.devices": 2, "parallel.strategy": '"fsdp"'})):
        url = create_tiny_run(f"file://{tmp}/store", data, REPLICAS, run_id=name, rounds=2, eval_every=1,
                              **SHAPE, **extra)
        out[name], out[f"root-{name}"] = tmp / f"dump-{name}", Path(url.removeprefix("file://"))
        for r in range(REPLICAS):
            logs.append(tmp / f"{name}-rank-{r}.log")
            procs.append(_spawn(url, r, logs[-1], out[name]))
    wait_replicas(procs, logs)
    return out


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: {sorted(set(a) ^ set(b))}"
    for k in a:
        def note(m: str, k: str = k) -> str:
            return f"{what} {k}: {m}"

        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=note)


def test_fsdp_processes_end_identical_and_match_one_device(runs: dict[str, Path]) -> None:
    dumps = {p.name: load_file(str(p)) for p in sorted(runs["fsdp"].glob("*.safetensors"))}
    assert sorted(dumps) == [f"rank-{r}.local-{g}.safetensors" for r in range(REPLICAS) for g in range(2)]
    first = dumps["rank-0.local-0.safetensors"]
    for name, params in dumps.items():  # gathered from the shards: every process of every replica agrees
        assert params.keys() == first.keys()
        for k in first:
            assert torch.equal(params[k], first[k]), f"{k}: {name} differs"
    one = load_file(str(runs["g1"] / "rank-0.safetensors"))
    _close(first, one, "global parameter")
    initial = load_bytes(ObjectStore(f"file://{runs['root-fsdp']}").get("checkpoints/initial.safetensors"))
    assert any(not torch.equal(initial[k], first[k]) for k in first if k in initial), "the run trained"
    # the evaluation (a collective FSDP forward) and the loss see the whole model and batch
    for rank in range(REPLICAS):
        m1, m2 = (json.loads((runs[f"root-{n}"] / f"metrics/rank-{rank}/00000001.json").read_text())
                  for n in ("g1", "fsdp"))
        assert m2["devices"] == 2
        assert m2["total"] == pytest.approx(m1["total"], rel=1e-4)
        if rank == 0:
            assert m2["eval_loss"] == pytest.approx(m1["eval_loss"], rel=1e-4)


def test_fsdp_checkpoints_and_final_have_the_one_device_format(runs: dict[str, Path]) -> None:
    stores = {n: ObjectStore(f"file://{runs[f'root-{n}']}") for n in ("g1", "fsdp")}
    latest = {n: ckpt.find_latest_checkpoint(st) for n, st in stores.items()}
    round_ = latest["g1"]
    assert round_ is not None and latest["fsdp"] == round_
    (t1, _), (t2, _) = (ckpt.load_checkpoint(stores[n], round_, None) for n in ("g1", "fsdp"))
    assert any("momentum_buffer" in k for k in t2), "the outer momentum (sharded) is saved whole"
    _close(t2, t1, "checkpoint")
    for rank in range(REPLICAS):  # the inner AdamW moments (sharded) are saved whole, too
        own1, own2 = (ckpt.load_replica_state(stores[n], round_, rank, None) for n in ("g1", "fsdp"))
        assert own1 is not None and own2 is not None
        moments = {k: v for k, v in own1[0].items() if k.startswith("optim/")}
        assert any(k.endswith("exp_avg") for k in moments)
        _close({k: v for k, v in own2[0].items() if k.startswith("optim/")}, moments, f"rank {rank} inner state")
    # final/: one Hugging Face folder, written once, tied embeddings saved once, the whole model
    for st in stores.values():
        assert st.exists("final/DONE.json")
    f1, f2 = (load_bytes(stores[n].get("final/model.safetensors")) for n in ("g1", "fsdp"))
    _close(f2, f1, "final/")


def test_fsdp_exchange_slices_are_the_shards(runs: dict[str, Path]) -> None:
    for rank in range(REPLICAS):
        whole = sum(p.stat().st_size for p in (runs["root-g1"] / "rounds/00000000/contrib").glob(f"*/rank-{rank}"))
        parts = [sum(p.stat().st_size for p in
                     (runs["root-fsdp"] / f"slices/{g:02d}/rounds/00000000/contrib").glob(f"*/rank-{rank}"))
                 for g in range(2)]
        assert whole > 100_000, "the G=1 replica contributed"
        assert parts[0] != parts[1], "the shards (torch.chunk rows of every parameter) differ in size"
        for part in parts:  # each device uploads its shards only: about half
            assert abs(part - whole / 2) < 0.01 * whole, (part, whole)
        one = json.loads((runs["root-g1"] / f"metrics/rank-{rank}/00000000.json").read_text())
        two = json.loads((runs["root-fsdp"] / f"metrics/rank-{rank}/00000000.json").read_text())
        assert abs(two["device_bytes_up"] - one["bytes_up"] / 2) < 0.02 * one["bytes_up"]
        assert abs(two["device_bytes_down"] - one["bytes_down"] / 2) < 0.02 * one["bytes_down"]
        assert abs(two["bytes_up"] - one["bytes_up"]) < 0.02 * one["bytes_up"]
    for round_ in range(2):  # one quorum per round for both slices
        qs = [json.loads((runs["root-fsdp"] / f"slices/{g:02d}/rounds/{round_:08d}/quorum.json").read_text())
              for g in range(2)]
        assert qs[0]["participants"] == qs[1]["participants"] == list(range(REPLICAS))


def _helpers_worker(rank: int, size: int, port: int, errors: Any) -> None:
    """Local rank ``rank`` of ``size``: the shard/gather helpers against whole tensors every process knows."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(size))
        local = LocalGroup.from_env(torch.device("cpu"), timeout_s=60)
        assert local is not None
        # uneven rows and empty shards (fewer rows than processes): the rows FSDP2 gives each process
        for shape in ((7, 3), (5,), (1, 4), (2, 2, 2)):
            whole = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
            mine = local_rows(whole, size, rank)
            assert torch.equal(gather_rows(local, mine.clone(), whole.shape), whole), shape
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 1))
        reference = copy.deepcopy(model)
        shard_model(model, torch.device("cpu"), local)
        for p, q in zip(model.parameters(), reference.parameters()):  # FSDP2's shards are local_rows'
            assert torch.equal(p.to_local(), local_rows(q.detach(), size, rank))  # type: ignore[attr-defined]
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(3, 5)).sum().backward()
        opt.step()
        saved = gather_optimizer_state(local, opt)
        for idx, p in enumerate(model.parameters()):
            assert tuple(saved["state"][idx]["exp_avg"].shape) == tuple(p.shape), "moments are saved whole"
        fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
        fresh.load_state_dict({"state": shard_optimizer_state(local, fresh, saved["state"]),
                               "param_groups": saved["param_groups"]})
        for idx, p in enumerate(model.parameters()):
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(fresh.state[p][name].to_local(), opt.state[p][name].to_local()), (idx, name)
        local.close()
    except BaseException as exc:  # reported to the test, which fails with it
        errors.put(f"local rank {rank}: {type(exc).__name__}: {exc}")
        raise


def test_shards_gather_to_whole_tensors_and_back_in_two_processes() -> None:
    """``local_rows`` is FSDP2's sharding (also for uneven and empty shards), ``gather_rows`` inverts
    it, and the inner AdamW state survives gather-to-whole then shard-on-restore bit for bit."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_helpers_worker, args=(g, 2, port, errors)) for g in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    found = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not found and all(p.exitcode == 0 for p in procs), (found, [p.exitcode for p in procs])
