"""Hedged reads against the latency tail: how long a batch of K concurrent small GETs waits for its
slowest answer, with and without hedging, through the real-store emulator (issue 15).

Run (from the repo root, venv active):

    python benchmarks/hedge.py                      # s3-standard at 1/10 speed, K in {1, 8, 40}, 30 batches
    python benchmarks/hedge.py --preset r2 --batches 100 --ks 40,100

A phase of the exchange (a gather, the reads of a quorum) waits for the slowest of its K requests,
so it pays about the (1 - 1/K) quantile of one request's first-byte time. With hedging
(``TransferPolicy.hedge_quantile``, default 0.75) a read still unanswered at that quantile of the
store's recent answer times is sent once more and the first answer wins. Both arms use the same
``ObjectStore.get_many`` on moto behind ``tests/support/store_emulator.py`` (the preset's lognormal
first-byte latency, median and p99 from tests/support/store_presets.py), one replica, batches
interleaved (off, on, off, on, ...) after a warm-up that teaches the hedger the store's latency.
The default ``--scale 0.1`` (latencies x10) keeps the emulator and moto, which share this machine's
CPUs, from becoming the bottleneck at K=40 (at scale 1 they queue the requests).

Prints a table (batch wall time p50 / p90 / p99 / mean per K and arm, requests per read) and writes
benchmarks/results/hedge.json. Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from diloco_serverless.store.objectstore import ObjectStore  # noqa: E402
from support.moto_s3 import moto_server  # noqa: E402
from support.store_emulator import StoreEmulator  # noqa: E402
from support.store_presets import PRESETS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "hedge.json"
OBJECT_BYTES = 4096  # small objects: the first byte is the whole cost


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(preset_name: str, scale: float, ks: list[int], batches: int, seed: int) -> dict[str, Any]:
    import boto3

    preset = PRESETS[preset_name]
    out: dict[str, Any] = {"preset": preset.to_json(), "scale": scale, "batches": batches, "rows": []}
    with moto_server() as upstream:
        bucket = f"hedge-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=upstream, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        with StoreEmulator(upstream, preset, scale=scale, seed=seed) as emu:
            options = {"endpoint_url": emu.url, "key": "testing", "secret": "testing",
                       "client_kwargs": {"region_name": "us-east-1"}}
            on = ObjectStore(f"s3://{bucket}", options)
            off = on.with_transfer(replace(on.transfer, hedge_quantile=None))
            keys = [f"b/k/obj-{i:03d}" for i in range(max(ks))]
            payload = os.urandom(OBJECT_BYTES)
            for k in keys:
                on.put(k, payload)
            for _ in range(3):  # warm-up: connections open, the hedger knows the store's answer times
                on.get_many(keys[:16])
            for k in ks:
                times: dict[str, list[float]] = {"off": [], "on": []}
                backups = {"off": 0, "on": 0}  # backup requests sent (the hedger counts them as it sends)
                for _ in range(batches):
                    for arm, store in (("off", off), ("on", on)):
                        before = store.hedger.backups
                        t0 = time.perf_counter()
                        got = store.get_many(keys[:k])
                        times[arm].append(time.perf_counter() - t0)
                        assert len(got) == k
                        backups[arm] += store.hedger.backups - before
                for arm in ("off", "on"):
                    t = times[arm]
                    out["rows"].append({
                        "k": k, "hedge": arm, "p50_ms": 1000 * _quantile(t, 0.5), "p90_ms": 1000 * _quantile(t, 0.9),
                        "p99_ms": 1000 * _quantile(t, 0.99), "mean_ms": 1000 * statistics.fmean(t),
                        "requests_per_read": 1 + backups[arm] / (k * batches),
                    })
            out["abandoned"] = emu.abandoned
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="s3-standard")
    ap.add_argument("--scale", type=float, default=0.1, help="emulator time scale (1 = real time; default 0.1)")
    ap.add_argument("--ks", default="1,8,40", help="comma-separated batch sizes (concurrent GETs)")
    ap.add_argument("--batches", type=int, default=30, help="batches per K and arm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    ks = [int(v) for v in args.ks.split(",") if v]
    if not ks or min(ks) < 1 or args.batches < 1 or not args.scale > 0:
        ap.error("--ks needs counts >= 1, --batches >= 1 and --scale > 0")
    res = run(args.preset, args.scale, ks, args.batches, args.seed)
    p = res["preset"]
    print(f"\nHedged reads: batches of K concurrent {OBJECT_BYTES}-byte GETs, {args.preset} emulation (first byte "
          f"median {p['first_byte_ms']:.0f} ms, p99 {p['first_byte_p99_ms']:.0f} ms) at scale {args.scale}, "
          f"{args.batches} batches per arm, interleaved")
    print(f"{'K':>4} {'hedge':>5} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'req/read':>8}")
    for r in res["rows"]:
        print(f"{r['k']:>4} {r['hedge']:>5} {r['p50_ms']:>8.1f} {r['p90_ms']:>8.1f} {r['p99_ms']:>8.1f} "
              f"{r['mean_ms']:>8.1f} {r['requests_per_read']:>8.2f}")
    res["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
