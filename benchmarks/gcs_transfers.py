"""Large objects on GCS: one request per object (gcsfs's own reads and writes, what the package did
before) against parallel ranged GETs and part-sized exchange objects, through the real-store emulator
in front of gcp-storage-emulator (issue 15, "Transfers that reach the NIC").

Run (from the repo root, venv active):

    python benchmarks/gcs_transfers.py                   # gcs-standard at 1/10 speed, 64 and 256 MB reads
    python benchmarks/gcs_transfers.py --sizes 16,64 --repeats 5 --exchange-mb 32

Two arms, interleaved, on the same emulated store:

* ``whole``: ``TransferPolicy(part_size=4 GiB)``: every object is one upload and one GET, and the
  exchange never cuts its objects (one upload per share), i.e. GCS as gcsfs moves it: one connection's
  stream per object.
* ``parts``: the default ``TransferPolicy`` (16 MiB parts, 8 at a time): composite uploads of parallel
  parts, ranged GETs in parallel sized from the first answer, and exchange objects cut to the part
  size (``topology.split_for``).

Measured: the wall time of ``ObjectStore.put`` and ``ObjectStore.get`` of one object per size, and of one exchange round
(``ObjectStoreAllReduce``, N = 2 replicas as threads, ``--exchange-mb`` of fp32, topology ``auto``,
i.e. direct). The emulator applies the ``gcs-standard`` preset (tests/support/store_presets.py: first
byte 40 / 200 ms median / p99, 100 MB/s per connection, 1,250 MB/s per client); ``--scale 0.1``
divides its bandwidths by 10 and multiplies its latencies by 10, so that the emulator and
gcp-storage-emulator (pure Python, one thread) on this machine are not the bottleneck. gcsfs sends
no rank in its User-Agent, so both replicas share one client cap; that is the same in both arms.

Prints a table and writes benchmarks/results/gcs_transfers.json. Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # the emulator has no gRPC bucket-type endpoint

from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce  # noqa: E402
from diloco_serverless.store._transfer import TransferPolicy  # noqa: E402
from diloco_serverless.store.objectstore import ObjectStore  # noqa: E402
from support.gcs_emulator import gcs_emulator  # noqa: E402
from support.store_emulator import StoreEmulator  # noqa: E402
from support.store_presets import PRESETS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gcs_transfers.json"
MiB = 1 << 20
ARMS = {"whole": TransferPolicy(part_size=4096 * MiB), "parts": TransferPolicy()}


def _exchange(url: str, options: dict[str, Any], transfer: TransferPolicy, mb: int, run_id: str) -> float:
    """Wall time of one N = 2 exchange round of ``mb`` MB of fp32 (both replicas done)."""
    n = mb * MiB // 4
    outs: dict[int, Any] = {}

    def one(rank: int) -> None:
        try:
            with ObjectStoreAllReduce(url, rank, 2, run_id=run_id, storage_options=options, transfer=transfer,
                                      timeout_s=600.0, poll_interval_s=0.05) as ar:
                outs[rank] = ar.allreduce(torch.full((n,), float(rank + 1)))
        except Exception as exc:  # noqa: BLE001 - reported below
            outs[rank] = exc

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for r, out in outs.items():
        if not isinstance(out, torch.Tensor) or not torch.all(out == 1.5):
            raise RuntimeError(f"exchange replica {r} failed: {out!r}")
    return wall


def run(scale: float, sizes: list[int], repeats: int, exchange_mb: int, seed: int) -> dict[str, Any]:
    preset = PRESETS["gcs-standard"]
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # its 404s are the exchange polling
    out: dict[str, Any] = {"preset": preset.to_json(), "scale": scale, "repeats": repeats, "rows": []}
    with gcs_emulator() as upstream, StoreEmulator(upstream, preset, scale=scale, seed=seed) as emu:
        import gcsfs

        options = {"endpoint_url": emu.url, "token": "anon"}
        bucket = f"gcs-bench-{uuid.uuid4().hex[:8]}"
        gcsfs.GCSFileSystem(endpoint_url=upstream, token="anon", skip_instance_cache=True).mkdir(bucket)
        stores = {arm: ObjectStore(f"gs://{bucket}/objects", options, transfer=t) for arm, t in ARMS.items()}
        payload = {mb: os.urandom(mb * MiB) for mb in sizes}
        for mb in sizes:
            stores["parts"].put(f"obj-{mb}", payload[mb])
            stores["parts"].get(f"obj-{mb}")  # warm-up: connections open, the hedger learns
        times: dict[tuple[str, str], list[float]] = {}
        for i in range(repeats):
            for arm, store in stores.items():
                for mb in sizes:
                    t0 = time.perf_counter()
                    store.put(f"put-{arm}-{mb}-{i}", payload[mb])
                    times.setdefault((f"PUT {mb} MB", arm), []).append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    got = store.get(f"obj-{mb}")
                    times.setdefault((f"GET {mb} MB", arm), []).append(time.perf_counter() - t0)
                    assert len(got) == mb * MiB
                if exchange_mb:
                    wall = _exchange(f"gs://{bucket}", options, ARMS[arm], exchange_mb, f"x-{arm}-{i}")
                    times.setdefault((f"exchange N=2 {exchange_mb} MB", arm), []).append(wall)
        for (what, arm), t in times.items():
            out["rows"].append({"what": what, "arm": arm, "mean_s": statistics.fmean(t), "min_s": min(t),
                                "max_s": max(t), "runs": t})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.1, help="emulator time scale (1 = real time; default 0.1)")
    ap.add_argument("--sizes", default="64,256", help="comma-separated object sizes to GET, MB")
    ap.add_argument("--exchange-mb", type=int, default=64, help="tensor of the N = 2 exchange round, MB (0: none)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per arm, interleaved")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    sizes = [int(v) for v in args.sizes.split(",") if v]
    if min(sizes, default=1) < 1 or args.repeats < 1 or args.exchange_mb < 0 or not args.scale > 0:
        ap.error("--sizes needs MB >= 1, --repeats >= 1, --exchange-mb >= 0 and --scale > 0")
    res = run(args.scale, sizes, args.repeats, args.exchange_mb, args.seed)
    print(f"\nGCS transfers, gcs-standard emulation at scale {args.scale} (seconds are emulated: divide by "
          f"{1 / args.scale:g} for a real store), {args.repeats} runs per arm, interleaved")
    print(f"{'operation':<24} {'arm':>6} {'mean s':>8} {'min s':>8} {'max s':>8} {'speed-up':>9}")
    means = {(r["what"], r["arm"]): r["mean_s"] for r in res["rows"]}
    for r in res["rows"]:
        base = means.get((r["what"], "whole"))
        ratio = f"{base / r['mean_s']:.2f}x" if base else "-"
        print(f"{r['what']:<24} {r['arm']:>6} {r['mean_s']:>8.2f} {r['min_s']:>8.2f} {r['max_s']:>8.2f} {ratio:>9}")
    res["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
