"""How the exchange's requests, bytes and time scale to N = 1,024 replicas, flat vs hierarchical.

Run (from the repo root, venv active):
    python benchmarks/scale.py            # simulation N in {8, 64, 256, 1024} + real run N in {2..32}
    python benchmarks/scale.py --quick    # simulation + real run N in {2, 4, 8}
    python benchmarks/scale.py --sim-only --params 1e6   # the simulation alone, for a 4 MB pseudo-gradient
    python benchmarks/scale.py --processes  # real run: one spawned process per replica, N in {8, 16, 32}
                                            # (writes results/scale_processes.json; ~3 min on 2 cores)

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
prefix's requests exceed its rate limit (what a store's 503 SlowDown + retry does). Waiting costs
what the real code's polls cost when each wait sees one empty poll: the quorum, for ranks below 16,
two LISTs of the ready markers and, for all but its writer, two GETs of quorum.json; above 16 replicas
the other ranks two GETs of their copy of it, which the writer puts after its create (a phase of its
own, exchange/quorum.py); a flat gather one LIST (unspread)
or one GET of a missing shard; a hierarchical wait one GET of one missing object (exchange/hierarchical.py polls
one object, then fetches the rest). Shards larger than the part size are split (docs/exchange.md,
"Round trips"), as the real code does on S3.

Cross-check: the real ObjectStoreAllReduce with N threads and 1,024-element tensors on file://,
through a store that counts every request, against the schedule at the same N (3 levels forced at
N = 27 and 64). The real count is higher where threads on 2 cores arrive spread out and poll more.

Part 2, real run: ObjectStoreAllReduce itself, N replicas as threads in one process, or with
``--processes`` one spawned process per replica (N in {8, 16, 32}), on file://, 1 MB fp32 tensors,
one warm-up round then one timed round: wall time, bytes per replica (the exchange's own counters)
vs the bound, requests per replica, for flat, hierarchical and auto (direct at N = 2), plus the
naive exchange's bytes (N-1)P down at the same N.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from diloco_serverless.exchange import topology as topology_module  # noqa: E402
from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce  # noqa: E402
from diloco_serverless.exchange.hierarchical import reduced_copies  # noqa: E402
from diloco_serverless.exchange.quorum import ReadyMarker, copy_to_read, quorum_copies  # noqa: E402
from diloco_serverless.exchange.topology import AUTO_HIERARCHICAL_FROM, branching, levels, split_for  # noqa: E402
from diloco_serverless.launcher.pricing import MODAL_USD_PER_HOUR  # noqa: E402
from diloco_serverless.run.layout import (  # noqa: E402
    contrib_key,
    control_spread,
    partial_key,
    quorum_copy_key,
    quorum_key,
    ready_key,
    ready_prefixes,
    reduced_copy_key,
    reduced_key,
    spread_count,
    vote_key,
)
from support.recording_store import RecordingStore  # noqa: E402
from support.store_presets import StorePreset, preset  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "scale.json"
RUN_ID = "run-0123abcd"  # a run folder directly under the bucket: s3://bucket/<run_id>/...
CONNECTIONS = 16  # concurrent requests per replica (the exchange's pools)
HEADER_BYTES = 900  # safetensors header + MAC of one exchange object (measured: ~0.9 KB)
PART_SIZE = 16 << 20  # the store's multipart part size (TransferPolicy's default): larger shards are split
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
    """One steady-state round's requests per replica, phase by phase (all N take part; nobody dies;
    the replicas finished the previous round, so none reads ``quorum.json`` or its own vote before
    publishing; a flat round at N <= 16 votes instead of forming a quorum), as
    ObjectStoreAllReduce issues them (cross-checked against the real code by ``--check``)."""
    spread = spread_count(n)
    hier = topology == "hierarchical"
    split = split_for(p // 4, n, topology, lambda k: 4 * k + HEADER_BYTES, PART_SIZE)
    s = branching(n) if hier else n * split
    size = _bounds(p, s)
    obj = [b + HEADER_BYTES for b in size]
    pub, quo, cop = Phase("publish"), Phase("quorum"), Phase("copies")
    pages = max(1, math.ceil(n / control_spread(n) / 1000))  # per ready prefix
    voted = spread == 1 and not hier  # N <= 16: a flat round votes instead of forming a quorum (exchange/votes.py)
    for q in range(n):
        pub.reqs[q] += [Req("PUT", contrib_key(0, j, q, spread), obj[j]) for j in range(s)]
        if voted:
            pub.reqs[q].append(Req("PUT", vote_key(0, q), 600))  # create-only, after the shards
            # two polls of the vote prefix, and each other vote read as it appears
            quo.reqs[q] += [Req("LIST", vote_key(0, q).rsplit("/", 1)[0]) for _ in range(2)]
            quo.reqs[q] += [Req("GET", vote_key(0, o), 600) for o in range(n) if o != q]
            continue
        pub.reqs[q].append(Req("PUT", ready_key(0, q, spread=control_spread(n)), 300))
        copy = copy_to_read(ReadyMarker(RUN_ID, 0, q, n, p // 4, "torch.float32", [p // 4], "fp32"))
        if copy is not None:  # a reader (N > 16, rank >= 16): polls its copy of the quorum (one miss, one hit)
            quo.reqs[q].append(Req("GET", copy))
            cop.reqs[q].append(Req("GET", copy, 300 * n))
            continue
        # a lister, two polls: LIST the ready markers (one page per 1,000); once all are ready the writer
        # (rank 0) creates quorum.json (the markers' names carry their MACs: it reads none) and the
        # other listers GET it (one miss, one hit)
        quo.reqs[q] += [Req("LIST", pfx) for pfx in ready_prefixes(0, control_spread(n)) for _ in range(2 * pages)]
        if q:
            quo.reqs[q] += [Req("GET", quorum_key(0)), Req("GET", quorum_key(0), 300 * n)]
    if not voted:
        quo.reqs[0].append(Req("PUT", quorum_key(0), 300 * n))
        # then its copies for the readers (exchange/quorum.py, put_copies)
        for c in range(quorum_copies(n)):
            cop.reqs[0].append(Req("PUT", quorum_copy_key(0, c, spread), 300 * n))
    phases = [pub, quo] + ([cop] if cop.reqs else [])
    if not hier:
        red, gat = Phase("reduce"), Phase("gather")
        for q in range(n):
            mine = range(q, s, n)  # shard j is reduced by Q[j mod N]
            red.reqs[q] += [Req("GET", contrib_key(0, j, o, spread), obj[j]) for j in mine for o in range(n) if o != q]
            red.reqs[q] += [Req("PUT", reduced_key(0, j, spread), obj[j]) for j in mine]
            others = [j for j in range(s) if j % n != q]
            if spread == 1:  # one LIST per poll says which exist
                gat.reqs[q].append(Req("LIST", "rounds/00000000/reduced"))
            gat.reqs[q] += [Req("GET", reduced_key(0, j, spread), obj[j]) for j in others]
            gat.reqs[q].append(Req("GET", reduced_key(0, others[0], spread)))  # one poll that missed
        return phases + [red, gat]
    return phases + _tree_phases(n, s, size, spread)


def _tree_phases(n: int, s: int, size: list[int], spread: int) -> list[Phase]:
    """The hierarchical round's phases (exchange/hierarchical.py): one per level, then the gather.
    A replica waiting for objects GETs one of them (rotated by rank) until it appears, then the rest:
    one missed poll per wait."""
    depth, c = levels(n), branching(n)
    copies = reduced_copies(n, max(size) + HEADER_BYTES)
    members: dict[tuple[int, int], list[int]] = defaultdict(list)
    for q in range(n):
        for lv in range(1, depth + 1):
            members[(lv, q // c**lv)].append(q)

    def owner(lv: int, k: int, j: int) -> int:
        m = members[(lv, k)]
        return m[j % len(m)] if lv == 1 else m[(len(m) - 1 - j) % len(m)]

    def key(lv: int, k: int, j: int) -> str:
        return reduced_key(0, j, spread) if lv == depth else partial_key(0, k, j, spread, level=lv)

    held: dict[int, set[tuple[int, int, int]]] = defaultdict(set)
    phases = []
    for lv in range(1, depth + 1):
        ph = Phase("reduce" if lv == depth else f"partial{lv}" if depth > 2 else "partial")
        for k in sorted({g for (lev, g) in members if lev == lv}):
            for j in range(s):
                o = owner(lv, k, j)
                if lv == 1:
                    ph.reqs[o] += [Req("GET", contrib_key(0, j, q, spread), size[j] + HEADER_BYTES)
                                   for q in members[(1, k)] if q != o]
                else:
                    kids = sorted({q // c ** (lv - 1) for q in members[(lv, k)]})
                    need = [i for i in kids if (lv - 1, i, j) not in held[o]]
                    if need:
                        ph.reqs[o].append(Req("GET", key(lv - 1, need[o % len(need)], j)))  # the missed poll
                    ph.reqs[o] += [Req("GET", key(lv - 1, i, j), size[j] + HEADER_BYTES) for i in need]
                ph.reqs[o].append(Req("PUT", key(lv, k, j), size[j] + HEADER_BYTES))
                if lv == depth:  # and the copies of a small reduced shard (exchange/hierarchical.py)
                    ph.reqs[o] += [Req("PUT", reduced_copy_key(0, j, cp, spread), size[j] + HEADER_BYTES)
                                   for cp in range(copies)]
                held[o].add((lv, k, j))
        phases.append(ph)
    gat = Phase("gather")
    def read(j: int, q: int) -> str:  # a reader reads its copy (rank mod copies) of a small reduced shard
        return reduced_copy_key(0, j, q % copies, spread) if copies else key(depth, 0, j)

    for q in range(n):
        need = [j for j in range(s) if (depth, 0, j) not in held[q]]
        if need:
            gat.reqs[q].append(Req("GET", read(need[q % len(need)], q)))  # the missed poll
        gat.reqs[q] += [Req("GET", read(j, q), size[j] + HEADER_BYTES) for j in need]
    return phases + [gat]


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
    hot: dict[str, str] = {"PUT": "-", "GET": "-"}  # the phase and prefix of each peak
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
        for (op, pfx), c in per_prefix.items():
            rate = c / t_client if t_client > 0 else 0.0  # offered rate, before shaping
            if rate > peak[op]:
                peak[op], hot[op] = rate, f"{ph.name} {pfx.split('/', 1)[-1]}"
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
        "levels": levels(n) if topology == "hierarchical" else None,
        "spread_prefixes": spread_count(n),
        "reqs_per_replica_mean": mean_reqs,
        "reqs_per_replica_max": max(reqs.values()),
        "peak_put_per_prefix_s": peak["PUT"],
        "peak_get_per_prefix_s": peak["GET"],
        "peak_put_at": hot["PUT"],
        "peak_get_at": hot["GET"],
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


def _replica(
    url: str, r: int, n: int, topology: str, numel: int, rounds: int, three_from: int
) -> tuple[float, int, int]:
    """One replica: ``rounds`` rounds of ObjectStoreAllReduce (the last one timed); returns
    (wall s of the last round, its bytes, its requests without deletes)."""
    topology_module.THREE_LEVELS_FROM = three_from  # a spawned process starts from the module default
    x = torch.randn(numel, generator=torch.Generator().manual_seed(r))
    store = RecordingStore(url)
    with ObjectStoreAllReduce(store, r, n, run_id="scale", topology=topology, poll_interval_s=0.05,
                              straggler_timeout_s=60, takeover_timeout_s=60, timeout_s=300) as ar:
        for _ in range(rounds):
            before = sum(v for k, v in store.counts.items() if k != "DELETE")
            t = time.perf_counter()
            ar.allreduce(x)
            wall = time.perf_counter() - t
        assert ar.last_stats is not None
        reqs = sum(v for k, v in store.counts.items() if k != "DELETE") - before
        return wall, ar.last_stats.bytes_up + ar.last_stats.bytes_down, reqs


def real_round(url: str, n: int, topology: str, numel: int, *, processes: bool = False, rounds: int = 2,
               three_from: int | None = None) -> dict[str, Any]:
    """``rounds`` rounds of ObjectStoreAllReduce with N replicas (threads, or spawned processes) on
    ``url``; wall time, bytes vs the bound and requests of the last round."""
    three = topology_module.THREE_LEVELS_FROM if three_from is None else three_from
    args = [(url, r, n, topology, numel, rounds, three) for r in range(n)]
    if processes:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(n) as pool:
            res = pool.starmap(_replica, args)
    else:
        from concurrent.futures import ThreadPoolExecutor

        saved = topology_module.THREE_LEVELS_FROM
        try:
            with ThreadPoolExecutor(n) as ex:
                res = list(ex.map(lambda a: _replica(*a), args))
        finally:
            topology_module.THREE_LEVELS_FROM = saved
    p = numel * 4
    bound = p + 2 * p * (n - 1) / n
    return {
        "n": n,
        "topology": topology,
        "levels": levels(n) if topology == "hierarchical" else None,
        "processes": processes,
        "wall_s": max(w for w, _, _ in res),
        "bytes_per_replica_vs_bound": sum(b for _, b, _ in res) / n / bound,
        "bytes_per_replica_max_vs_bound": max(b for _, b, _ in res) / bound,
        "reqs_per_replica_mean": sum(q for _, _, q in res) / n,
        "naive_bytes_vs_bound": (p + (n - 1) * p) / bound,
    }


def cross_check(n: int, topology: str, three_from: int) -> dict[str, Any]:
    """Requests per replica of one round: the real code (threads, tiny tensors, counting store) vs the schedule."""
    saved = topology_module.THREE_LEVELS_FROM
    topology_module.THREE_LEVELS_FROM = three_from
    try:
        sim = schedule(n, topology, 4096)
        sim_reqs = sum(len(rs) for ph in sim for rs in ph.reqs.values()) / n
        depth = levels(n)
    finally:
        topology_module.THREE_LEVELS_FROM = saved
    with tempfile.TemporaryDirectory() as d:
        real = real_round(Path(d).as_uri(), n, topology, 1024, rounds=2, three_from=three_from)  # steady state
    return {"n": n, "topology": topology, "levels": depth if topology == "hierarchical" else None,
            "real_reqs_per_replica": real["reqs_per_replica_mean"], "sim_reqs_per_replica": sim_reqs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="real run only at N in {2, 4, 8}")
    ap.add_argument("--processes", action="store_true",
                    help="real run with one spawned process per replica, N in {8, 16, 32} (instead of threads)")
    ap.add_argument("--preset", default="s3-standard", help="store preset (tests/support/store_presets.py)")
    ap.add_argument("--params", type=float, default=100e6, help="simulated pseudo-gradient size (fp32 elements)")
    ap.add_argument("--sim-only", action="store_true",
                    help="the simulation alone (no cross-check, no real run); writes results/scale_sim.json")
    args = ap.parse_args()
    st = preset(args.preset)
    p = int(args.params * 4)
    sim = [simulate(n, t, p, st) for n in (8, 64, 256, 1024) for t in ("flat", "hierarchical")]
    print(f"Simulation: preset {st.name}, P = {p / 1e6:.0f} MB fp32, {CONNECTIONS} connections/replica, "
          f"round = {INNER_STEPS} inner steps x {STEP_S} s on {GPU} (${MODAL_USD_PER_HOUR[GPU]}/h) + exchange")
    print(f"{'N':>5} {'topology':>12} {'lv':>2} {'prefixes':>8} {'req/rep':>8} {'req max':>8} {'PUT/s/pfx':>10} "
          f"{'GET/s/pfx':>10} {'bytes/bound':>11} {'round s':>8} {'req $':>8} {'req/GPU':>8}")
    for s in sim:
        print(f"{s['n']:>5} {s['topology']:>12} {s['levels'] or '-':>2} {s['spread_prefixes']:>8} "
              f"{s['reqs_per_replica_mean']:>8.0f} "
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
        "hier_requests_1024_over_hier_8": by[(1024, "hierarchical")]["reqs_per_replica_mean"]
        / by[(8, "hierarchical")]["reqs_per_replica_mean"],
        "hier_requests_1024_over_auto_8_flat": by[(1024, "hierarchical")]["reqs_per_replica_mean"]
        / by[(8, "flat")]["reqs_per_replica_mean"],
        "request_spend_under_2pct_of_gpu_at_1024": {
            t: by[(1024, t)]["request_share_of_gpu"] < 0.02 for t in ("flat", "hierarchical")
        },
        "auto_hierarchical_from": AUTO_HIERARCHICAL_FROM,
    }
    print("targets:", json.dumps(targets))
    print("peaks at (phase, prefix):", json.dumps({f"{s['n']} {s['topology']}": [s["peak_put_at"], s["peak_get_at"]]
                                                   for s in sim if s["n"] == 1024}))
    if args.sim_only:
        out = RESULTS.with_name("scale_sim.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"preset": st.to_json(), "params": args.params, "simulation": sim,
                                   "targets": targets}, indent=2))
        print(f"wrote {out}")
        return
    print("\nCross-check: requests per replica of one round, the real code (threads, 1,024-element tensors,")
    print("counting store on file://) vs the simulated schedule; 3 levels forced from N = 8 where marked")
    print(f"{'N':>5} {'topology':>12} {'levels':>6} {'real':>8} {'sim':>8}")
    checks = [cross_check(n, t, th) for n, t, th in
              ((8, "flat", 128), (8, "hierarchical", 128), (16, "hierarchical", 128), (27, "hierarchical", 8),
               (64, "hierarchical", 8))]
    for c in checks:
        print(f"{c['n']:>5} {c['topology']:>12} {c['levels'] or '-':>6} {c['real_reqs_per_replica']:>8.1f} "
              f"{c['sim_reqs_per_replica']:>8.1f}")
    real = []
    sizes = (8, 16, 32) if args.processes else (2, 4, 8) if args.quick else (2, 4, 8, 16, 32)
    numel = (1 << 20) // 4  # 1 MB fp32
    how = "one spawned process per replica" if args.processes else "N threads in one process"
    print(f"\nReal run: ObjectStoreAllReduce, {how}, file://, 1 MB fp32, warm-up + 1 timed round")
    print(f"{'N':>5} {'topology':>12} {'wall s':>8} {'bytes/bound':>11} {'max/bound':>9} {'req/rep':>8} "
          f"{'naive/bound':>11}")
    for n in sizes:
        for t in ("flat", "hierarchical", "auto"):
            if t == "auto" and n != 2:
                continue
            with tempfile.TemporaryDirectory() as d:
                row = real_round(Path(d).as_uri(), n, t, numel, processes=args.processes)
            real.append(row)
            print(f"{n:>5} {t + (' (direct)' if t == 'auto' else ''):>12} {row['wall_s']:>8.3f} "
                  f"{row['bytes_per_replica_vs_bound']:>11.3f} {row['bytes_per_replica_max_vs_bound']:>9.3f} "
                  f"{row['reqs_per_replica_mean']:>8.1f} {row['naive_bytes_vs_bound']:>11.3f}")
    out = RESULTS.with_name("scale_processes.json") if args.processes else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        "preset": st.to_json(), "params": args.params, "assumptions": {
            "gpu": GPU, "gpu_usd_per_hour": MODAL_USD_PER_HOUR[GPU], "inner_steps": INNER_STEPS, "step_s": STEP_S,
            "connections": CONNECTIONS, "header_bytes": HEADER_BYTES},
        "simulation": sim, "targets": targets, "cross_check": checks,
        "real_mode": "processes" if args.processes else "threads", "real": real,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
