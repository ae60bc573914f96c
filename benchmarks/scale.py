"""How the exchange's requests, bytes and time scale to N = 1,024 replicas, flat vs hierarchical.

Run (from the repo root, venv active):
    python benchmarks/scale.py            # simulation N in {8, 64, 256, 1024} + real run N in {2..32}
    python benchmarks/scale.py --quick    # simulation + real run N in {2, 4, 8}

Prints tables and writes benchmarks/results/scale.json.

Part 1, simulation (simulated time, no sleeps): every replica's requests of one round are generated
from the protocol's schedule (:mod:`diloco_serverless.exchange.topology` for shard counts, groups and
owners) with the real key builders (:mod:`diloco_serverless.run.layout`), phase by phase, and sent
to a counting/shaping store model that applies a store preset (tests/support/store_presets.py):
per-request first-byte latency (the preset's median), per-connection and per-client bandwidth, and
the per-prefix request-rate limits, with the prefix taken as the first ``prefix_depth`` components
below the bucket of ``s3://bucket/<run_id>/<key>`` (so ``<run_id>/x<hh>`` for a spread key). Phases
run in lockstep (every replica needs the previous phase's objects); a phase lasts as long as its
slowest replica (ceil(requests / 16 connections) x latency + bytes / bandwidth), stretched where a
prefix's requests exceed its rate limit (what a store's 503 SlowDown + retry does). Each waiting
phase costs one extra poll per replica (a LIST of ready markers, or GETs of objects not yet there):
the real exchange backs off from 20 ms, so on a store with 60 ms latency most waits see one poll.

Part 2, real run: ObjectStoreAllReduce itself, N replicas as threads in one process (2-core VM: one
process per replica does not fit at N = 32), on file://, 1 MB fp32 tensors, one warm-up round then
one timed round: wall time, bytes per replica (the exchange's own counters) vs the bound, for flat,
hierarchical and auto (direct at N = 2), plus the naive exchange's bytes (N-1)P down at the same N.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce  # noqa: E402
from diloco_serverless.exchange.topology import AUTO_HIERARCHICAL_FROM, group_count, group_size  # noqa: E402
from diloco_serverless.launcher.pricing import MODAL_USD_PER_HOUR  # noqa: E402
from diloco_serverless.run.layout import (  # noqa: E402
    contrib_key,
    partial_key,
    quorum_key,
    ready_key,
    ready_prefix,
    reduced_key,
    spread_count,
)
from support.store_presets import StorePreset, preset  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "scale.json"
RUN_ID = "run-0123abcd"  # a run folder directly under the bucket: s3://bucket/<run_id>/...
CONNECTIONS = 16  # concurrent requests per replica (the exchange's pools)
HEADER_BYTES = 900  # safetensors header + MAC of one exchange object (measured: ~0.9 KB)
#: Cost assumptions for "request spend vs GPU spend" (stated in the output).
GPU, INNER_STEPS, STEP_S = "H100", 500, 0.5


@dataclass
class Req:
    op: str  # PUT, GET, LIST
    key: str
    nbytes: int = 0


@dataclass
class Phase:
    name: str
    reqs: dict[int, list[Req]] = field(default_factory=lambda: defaultdict(list))  # replica -> requests


def _bounds(p: int, s: int) -> list[int]:
    base, extra = divmod(p, s)
    return [base + (1 if j < extra else 0) for j in range(s)]


def schedule(n: int, topology: str, p: int) -> list[Phase]:
    """One round's requests per replica, phase by phase (all N take part; nobody dies)."""
    spread = spread_count(n)
    hier = topology == "hierarchical"
    s = group_size(n) if hier else n
    size = _bounds(p, s)
    obj = [b + HEADER_BYTES for b in size]
    pub, quo = Phase("publish"), Phase("quorum")
    for q in range(n):
        pub.reqs[q] += [Req("PUT", contrib_key(0, j, q, spread), obj[j]) for j in range(s)]
        pub.reqs[q].append(Req("PUT", ready_key(0, q), 300))
        quo.reqs[q] += [Req("LIST", ready_prefix(0)) for _ in range(max(1, math.ceil(n / 1000)) * 2)]  # + 1 poll
        quo.reqs[q].append(Req("GET", quorum_key(0), 300 * n))
    quo.reqs[0] += [Req("GET", ready_key(0, q), 300) for q in range(n)] + [Req("PUT", quorum_key(0), 300 * n)]
    phases = [pub, quo]
    if not hier:
        red, gat = Phase("reduce"), Phase("gather")
        for q in range(n):
            red.reqs[q] += [Req("GET", contrib_key(0, q, o, spread), obj[q]) for o in range(n) if o != q]
            red.reqs[q].append(Req("PUT", reduced_key(0, q, spread), obj[q]))
            others = [j for j in range(n) if j != q]
            if spread == 1:
                gat.reqs[q].append(Req("LIST", "rounds/00000000/reduced"))
            gat.reqs[q] += [Req("GET", reduced_key(0, j, spread), obj[j]) for j in others]
            gat.reqs[q].append(Req("GET", reduced_key(0, others[0], spread)))  # one poll that missed
        return phases + [red, gat]
    g, groups = group_size(n), group_count(n)
    members = {k: [q for q in range(n) if q // g == k] for k in range(groups)}
    part, red, gat = Phase("partial"), Phase("reduce"), Phase("gather")
    for k, mem in members.items():
        for j in range(s):
            owner = mem[j % len(mem)]
            part.reqs[owner] += [Req("GET", contrib_key(0, j, q, spread), obj[j]) for q in mem if q != owner]
            part.reqs[owner].append(Req("PUT", partial_key(0, k, j, spread), size[j] + HEADER_BYTES))
    for j in range(s):
        owner = n - 1 - j % n
        red.reqs[owner] += [Req("GET", partial_key(0, k, j, spread), size[j] + HEADER_BYTES) for k in range(groups)]
        red.reqs[owner].append(Req("GET", partial_key(0, 0, j, spread)))  # one poll that missed
        red.reqs[owner].append(Req("PUT", reduced_key(0, j, spread), obj[j]))
    for q in range(n):
        mine = {j for j in range(s) if n - 1 - j % n == q}
        gat.reqs[q] += [Req("GET", reduced_key(0, j, spread), obj[j]) for j in range(s) if j not in mine]
        gat.reqs[q] += [Req("GET", reduced_key(0, j, spread)) for j in range(s) if j not in mine]  # one missed poll
    return phases + [part, red, gat]


def prefix_of(key: str, depth: int) -> str:
    return "/".join(f"{RUN_ID}/{key}".split("/")[:depth])


def simulate(n: int, topology: str, p: int, st: StorePreset) -> dict[str, Any]:
    """Run one round's schedule against the store model; per-replica and per-prefix numbers."""
    lat = st.first_byte_ms / 1000
    bw = min(st.client_mb_s, CONNECTIONS * st.conn_mb_s) * 1e6
    total_s, puts = 0.0, 0
    reqs: dict[int, int] = defaultdict(int)
    up: dict[int, int] = defaultdict(int)
    down: dict[int, int] = defaultdict(int)
    peak: dict[str, float] = {"PUT": 0.0, "GET": 0.0}
    phases_s: dict[str, float] = {}
    for ph in schedule(n, topology, p):
        t_client = 0.0
        per_prefix: dict[tuple[str, str], int] = defaultdict(int)
        for q, rs in ph.reqs.items():
            moved = 0
            for r in rs:
                reqs[q] += 1
                if r.op == "PUT":
                    puts += 1
                    up[q] += r.nbytes
                else:
                    down[q] += r.nbytes
                moved += r.nbytes
                per_prefix[("PUT" if r.op == "PUT" else "GET", prefix_of(r.key, st.prefix_depth))] += 1
            t_client = max(t_client, math.ceil(len(rs) / CONNECTIONS) * lat + moved / bw)
        limit = {"PUT": st.put_rate, "GET": st.get_rate}
        t_rate = max((c / limit[op] for (op, _), c in per_prefix.items()), default=0.0)
        t = max(t_client, t_rate)  # a prefix over its limit stretches the phase (503s and retries)
        for (op, _), c in per_prefix.items():
            peak[op] = max(peak[op], c / t_client if t_client > 0 else 0.0)  # offered rate, before shaping
        phases_s[ph.name] = t
        total_s += t
    bound = p + 2 * p * (n - 1) / n
    mean_reqs = sum(reqs.values()) / n
    total_reqs = sum(reqs.values())
    req_usd = (puts * st.usd_per_1k_put + (total_reqs - puts) * st.usd_per_1k_get) / 1000
    gpu_usd = n * MODAL_USD_PER_HOUR[GPU] * (INNER_STEPS * STEP_S + total_s) / 3600
    return {
        "n": n,
        "topology": topology,
        "spread_prefixes": spread_count(n),
        "reqs_per_replica_mean": mean_reqs,
        "reqs_per_replica_max": max(reqs.values()),
        "peak_put_per_prefix_s": peak["PUT"],
        "peak_get_per_prefix_s": peak["GET"],
        "put_limit": st.put_rate,
        "get_limit": st.get_rate,
        "bytes_per_replica_mean_vs_bound": sum(up[q] + down[q] for q in range(n)) / n / bound,
        "bytes_per_replica_max_vs_bound": max(up[q] + down[q] for q in range(n)) / bound,
        "round_s": total_s,
        "phases_s": phases_s,
        "request_usd": req_usd,
        "gpu_usd": gpu_usd,
        "request_share_of_gpu": req_usd / gpu_usd,
    }


# ---------------------------------------------------------------------------------- real run


def real_round(url: str, n: int, topology: str, numel: int) -> dict[str, Any]:
    """One warm-up and one timed round of ObjectStoreAllReduce with N threads on ``url``."""
    out: dict[int, Any] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def one(r: int) -> None:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(r))
        try:
            with ObjectStoreAllReduce(url, r, n, run_id="scale", topology=topology, poll_interval_s=0.05,
                                      straggler_timeout_s=30, takeover_timeout_s=30, timeout_s=300) as ar:
                ar.allreduce(x)
                barrier.wait()
                t = time.perf_counter()
                ar.allreduce(x)
                wall = time.perf_counter() - t
                assert ar.last_stats is not None
                out[r] = (wall, ar.last_stats.bytes_up + ar.last_stats.bytes_down)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    p = numel * 4
    bound = p + 2 * p * (n - 1) / n
    return {
        "n": n,
        "topology": topology,
        "wall_s": max(w for w, _ in out.values()),
        "bytes_per_replica_vs_bound": sum(b for _, b in out.values()) / n / bound,
        "naive_bytes_vs_bound": (p + (n - 1) * p) / bound,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="real run only at N in {2, 4, 8}")
    ap.add_argument("--preset", default="s3-standard", help="store preset (tests/support/store_presets.py)")
    ap.add_argument("--params", type=float, default=100e6, help="simulated pseudo-gradient size (fp32 elements)")
    args = ap.parse_args()
    st = preset(args.preset)
    p = int(args.params * 4)
    sim = [simulate(n, t, p, st) for n in (8, 64, 256, 1024) for t in ("flat", "hierarchical")]
    print(f"Simulation: preset {st.name}, P = {p / 1e6:.0f} MB fp32, {CONNECTIONS} connections/replica, "
          f"round = {INNER_STEPS} inner steps x {STEP_S} s on {GPU} (${MODAL_USD_PER_HOUR[GPU]}/h) + exchange")
    print(f"{'N':>5} {'topology':>12} {'prefixes':>8} {'req/rep':>8} {'req max':>8} {'PUT/s/pfx':>10} "
          f"{'GET/s/pfx':>10} {'bytes/bound':>11} {'round s':>8} {'req $':>8} {'req/GPU':>8}")
    for s in sim:
        print(f"{s['n']:>5} {s['topology']:>12} {s['spread_prefixes']:>8} {s['reqs_per_replica_mean']:>8.0f} "
              f"{s['reqs_per_replica_max']:>8} {s['peak_put_per_prefix_s']:>10.0f} {s['peak_get_per_prefix_s']:>10.0f} "
              f"{s['bytes_per_replica_mean_vs_bound']:>11.3f} {s['round_s']:>8.2f} {s['request_usd']:>8.3f} "
              f"{s['request_share_of_gpu']:>8.3%}")
    by = {(s["n"], s["topology"]): s for s in sim}
    targets = {
        "no_prefix_over_limit_at_1024": all(
            by[(1024, t)]["peak_put_per_prefix_s"] <= st.put_rate and by[(1024, t)]["peak_get_per_prefix_s"]
            <= st.get_rate for t in ("flat", "hierarchical")
        ),
        "flat_bytes_within_1.10_of_bound_at_1024": by[(1024, "flat")]["bytes_per_replica_mean_vs_bound"] <= 1.10,
        "hier_requests_1024_over_8": by[(1024, "hierarchical")]["reqs_per_replica_mean"]
        / by[(8, "hierarchical")]["reqs_per_replica_mean"],
        "request_spend_under_2pct_of_gpu_at_1024": {
            t: by[(1024, t)]["request_share_of_gpu"] < 0.02 for t in ("flat", "hierarchical")
        },
        "auto_hierarchical_from": AUTO_HIERARCHICAL_FROM,
    }
    print("targets:", json.dumps(targets))
    real = []
    sizes = (2, 4, 8) if args.quick else (2, 4, 8, 16, 32)
    numel = (1 << 20) // 4  # 1 MB fp32
    print("\nReal run: ObjectStoreAllReduce, N threads in one process, file://, 1 MB fp32, 1 timed round")
    print(f"{'N':>5} {'topology':>12} {'wall s':>8} {'bytes/bound':>11} {'naive/bound':>11}")
    for n in sizes:
        for t in ("flat", "hierarchical", "auto"):
            if t == "auto" and n != 2:
                continue
            with tempfile.TemporaryDirectory() as d:
                row = real_round(Path(d).as_uri(), n, t, numel)
            real.append(row)
            print(f"{n:>5} {t + (' (direct)' if t == 'auto' else ''):>12} {row['wall_s']:>8.3f} "
                  f"{row['bytes_per_replica_vs_bound']:>11.3f} {row['naive_bytes_vs_bound']:>11.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        "preset": st.to_json(), "params": args.params, "assumptions": {
            "gpu": GPU, "gpu_usd_per_hour": MODAL_USD_PER_HOUR[GPU], "inner_steps": INNER_STEPS, "step_s": STEP_S,
            "connections": CONNECTIONS, "header_bytes": HEADER_BYTES},
        "simulation": sim, "targets": targets, "real": real,
    }, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
