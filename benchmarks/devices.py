"""Multi-device replicas: bytes per device and wall time per round of the sliced exchange.

Run (from the repo root, venv active):

    python benchmarks/devices.py                 # N=4 replicas x G in {1,2,4}, P=64 MB fp32, file://
    python benchmarks/devices.py --p-mb 256      # the target size (needs ~3 GB RAM per G x N/4)
    python benchmarks/devices.py --backend s3    # through moto's S3 server on 127.0.0.1 instead

Prints a table and writes benchmarks/results/devices.json.

Each replica is G OS processes (spawned), as ``parallel.devices = G`` runs it: local rank g
exchanges slice g of the replica's flat P-byte pseudo-gradient through the store
(:class:`~diloco_serverless.exchange.sliced.SlicedAllReduce`, one quorum per round) and the G reduced
slices are all-gathered inside the replica over gloo; G = 1 is the plain
:class:`~diloco_serverless.exchange.allreduce.ObjectStoreAllReduce`. A round is timed on every
process from a barrier shared by all N x G processes until that process holds the whole mean; a
replica's wall time is its slowest process's. Bytes are counted BY THE BENCHMARK, not by the code
under test: each process's ``rchar``/``wchar`` of ``/proc/self/io`` around the round (file://
object bodies plus small JSON markers), read before the all-gather inside the replica (whose
socket traffic stays in the node); on s3:// a WSGI middleware in front of moto counts each process's
HTTP request and response bodies (listings included) by its User-Agent, averaged over the rounds.
Every process checks the mean it got against the exact one.

On a machine with fewer cores than N x G processes the processes time-share the CPUs: the speedup
of G then measures what splitting the exchange saves once the cores are the limit, not what G
separate devices with their own NICs would give.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

MB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"


def _io() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def _worker(rank: int, g: int, devices: int, replicas: int, numel: int, store: str, options: dict[str, Any],
            port: int, rounds: int, barrier: Any, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from diloco_serverless.exchange._io import shard_bounds
    from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
    from diloco_serverless.exchange.sliced import SlicedAllReduce

    torch.set_num_threads(1)
    if options:  # s3: the benchmark's counter in front of moto tells the processes apart by User-Agent
        options = {**options, "config_kwargs": {"user_agent_extra": f"bench-rank-{rank * devices + g}"}}
    opts: dict[str, Any] = {"run_id": f"bench-g{devices}", "timeout_s": 1800, "poll_interval_s": 0.05,
                            "keep_rounds": 2, "storage_options": options or None}
    if devices > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=g, world_size=devices)
        ex: ObjectStoreAllReduce = SlicedAllReduce(store, rank, replicas, slice_index=g, slices=devices, **opts)
    else:
        ex = ObjectStoreAllReduce(store, rank, replicas, **opts)
    bounds = shard_bounds(numel, devices)
    a, b = bounds[g]
    full = torch.arange(numel, dtype=torch.float32) * 1e-6 + rank
    want = torch.arange(numel, dtype=torch.float32) * 1e-6 + (replicas - 1) / 2
    records = []
    for r in range(rounds):
        barrier.wait()
        r0, w0 = _io()
        t0 = time.perf_counter()
        part = ex.allreduce(full[a:b].clone(), round=r)
        r1, w1 = _io()  # the store's bytes; the all-gather inside the replica is not the store's
        if devices > 1:
            width = max(e - s for s, e in bounds)
            mine = torch.zeros(width)
            mine[: part.numel()] = part
            parts = [torch.empty(width) for _ in range(devices)]
            dist.all_gather(parts, mine)
            result = torch.cat([p[: e - s] for p, (s, e) in zip(parts, bounds)])
        else:
            result = part
        wall = time.perf_counter() - t0
        err = float((result - want).abs().max())
        records.append({"round": r, "wall_s": wall, "down": r1 - r0, "up": w1 - w0, "max_err": err})
    ex.close()
    out.put((rank, g, records))
    if devices > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_case(devices: int, replicas: int, p_mb: int, rounds: int, store: str,
             options: dict[str, Any], counter: Any = None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    numel = p_mb * MB // 4
    barrier, out = ctx.Barrier(replicas * devices), ctx.Queue()
    procs = []
    for rank in range(replicas):
        port = _free_port()
        for g in range(devices):
            procs.append(ctx.Process(target=_worker, args=(rank, g, devices, replicas, numel, store, options, port,
                                                           rounds, barrier, out)))
    for p in procs:
        p.start()
    got = [out.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a benchmark process exited with {p.exitcode}")
    per_round = []
    for r in range(1, rounds):  # round 0 warms up (imports, thread pools, first files)
        walls = {}
        for rank, _, recs in got:
            walls[rank] = max(walls.get(rank, 0.0), recs[r]["wall_s"])
        per_round.append(sum(walls.values()) / len(walls))
    dev = [recs[-1] for _, _, recs in got]
    if counter is not None:  # HTTP bodies per process, per round
        counts = counter.snapshot()
        dev = [{"up": counts[i][0] / rounds, "down": counts[i][1] / rounds} for i in range(replicas * devices)]
        counter.reset()
    return {
        "devices": devices, "replicas": replicas, "p_mb": p_mb,
        "wall_per_round_s": min(per_round), "wall_per_round_all_s": per_round,
        "up_mb_per_device": sum(d["up"] for d in dev) / len(dev) / MB,
        "down_mb_per_device": sum(d["down"] for d in dev) / len(dev) / MB,
        "max_err": max(d["max_err"] for _, _, recs in got for d in recs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--devices", default="1,2,4")
    parser.add_argument("--p-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=["file", "s3"], default="file")
    args = parser.parse_args()
    rows = []
    options: dict[str, Any] = {}
    counter: Any = None
    if args.backend == "s3":
        import boto3
        from allreduce import start_moto  # benchmarks/allreduce.py: moto on 127.0.0.1, create-only PUTs atomic

        os.environ.setdefault("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(1 << 30))  # objects in RAM
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
        endpoint, counter, _ = start_moto()
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
        options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
                   "client_kwargs": {"region_name": "us-east-1"}}
    for devices in [int(x) for x in args.devices.split(",")]:
        root = Path(tempfile.mkdtemp(prefix=f"bench-devices-g{devices}-"))
        store = f"file://{root}/store" if args.backend == "file" else f"s3://bench/g{devices}"
        try:
            rows.append(run_case(devices, args.replicas, args.p_mb, args.rounds, store, options, counter))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    base = next((r for r in rows if r["devices"] == 1), None)
    print(f"N={args.replicas} replicas, P={args.p_mb} MB fp32 per replica, {args.backend}:// on {os.cpu_count()} cores")
    print(f"{'G':>3} {'up MB/dev':>10} {'down MB/dev':>12} {'wall/round s':>13} {'vs G=1':>7} {'max err':>9}")
    for r in rows:
        speed = base["wall_per_round_s"] / r["wall_per_round_s"] if base else float("nan")
        r["speedup_vs_g1"] = speed
        print(f"{r['devices']:>3} {r['up_mb_per_device']:>10.1f} {r['down_mb_per_device']:>12.1f} "
              f"{r['wall_per_round_s']:>13.2f} {speed:>6.2f}x {r['max_err']:>9.1e}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "args": vars(args), "rows": rows}
    name = "devices.json" if args.backend == "file" else f"devices-{args.backend}.json"
    (RESULTS / name).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
