"""Bytes and wall time of ObjectStoreAllReduce vs the naive exchange, over file://, moto S3 and moto
behind the real-store emulator.

Run (from the repo root, venv active):

    python benchmarks/allreduce.py --quick      # subset: P=16 MB, fp32 + int8, N in {4, 8}  (~2-4 min)
    python benchmarks/allreduce.py              # full: N in {2,4,8}, P in {16,64} MB (+256 MB on file://),
                                                #       codecs fp32/bf16/int8, both back ends
    python benchmarks/allreduce.py --backends s3 --preset s3-standard --scale 0.005 --ns 8 --sizes 64,256 \
        --codecs fp32 --repeat 1                # moto S3 and moto behind tests/support/store_emulator.py

``--preset NAME`` (``s3-standard``, ``gcs-standard``, ``r2``: tests/support/store_presets.py) adds a
back end: moto behind the shaping proxy, which applies the preset's first-byte latency, per-connection
and per-client bandwidth and per-prefix request rates, all multiplied by ``--scale`` (latencies divided).
Its rows also show the **physical limit**: the lower-bound bytes of a replica over the per-client cap,
plus four first-byte medians (publish, quorum, reduce, gather), at the same scale.

Prints a table and writes benchmarks/results/allreduce.json.

Every replica is a separate OS process (forked from a forkserver that imported torch once), so
replicas really run concurrently and are counted separately; on a 2-core machine N=8 processes
time-share the CPUs, so wall times include that contention for both methods alike. Bytes are
counted BY THE BENCHMARK, never by the code under test:

* file://  — each replica process's ``rchar``/``wchar`` from ``/proc/self/io`` around the round
  (bytes passed to read(2)/write(2): object bodies plus tiny JSON markers; listings are not reads);
* s3://    — a WSGI middleware in front of moto's server counts HTTP request bodies (up) and
  response bodies (down) per replica, identified by a per-replica ``User-Agent`` suffix; this
  includes LIST/HEAD/404 responses, i.e. every byte of HTTP payload.

Wall times are noisy on a shared machine: each (sharded, naive) pair runs ``--repeat`` times
(default 2), interleaved, and the table shows each method's fastest run (all runs are in the
JSON). moto keeps objects in RAM (``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``; by default it spills
every object over 5 MB to a temp file, which made PUTs 2x slower than on any real server), and
only create-only PUTs are serialised (moto's If-None-Match check is not atomic on its own).

Lower bound for averaging P bytes over N replicas with whole-object PUT/GET: P up + 2P(N-1)/N down,
with P the payload size under the codec (fp32: 4 bytes/element; bf16: 2; int8: 1 + 4/256 for the
block scales). The naive baseline is the seed's design: each replica PUTs its whole encoded tensor
and GETs the other N-1 (concurrently, with the exchange's own fetcher; in batches of at most
256 MB to bound memory), then averages
in rank order — (N-1)P down per replica. Both methods use the same ObjectStore, codec and objects
format, start from a shared barrier, and are timed until the replica has the mean.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import platform
import queue as queue_module
import re
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.store_emulator import StoreEmulator  # noqa: E402
from support.store_presets import PRESETS, StorePreset  # noqa: E402

MB = 1 << 20
#: Deadline of one store operation in the benchmark: a slowed-down preset moves big objects slowly.
STORE_TIMEOUT_S = 1800.0
#: Round trips no exchange design avoids: publish, quorum, reduce, gather.
ROUND_TRIPS = 4
INT8_BYTES_PER_ELEM = 1 + 4 / 256
#: sparse (the default 64 of 4,096 at 2 bits): 64 x (12 + 2) bits and one fp32 scale per 4,096 values
SPARSE_BYTES_PER_ELEM = (64 * 14 / 8 + 4) / 4096
CODEC_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": INT8_BYTES_PER_ELEM, "sparse": SPARSE_BYTES_PER_ELEM}
#: A sparse round under ``--topology auto`` is direct: publish, GET the others' votes, list them once to confirm.
SPARSE_ROUND_TRIPS = 3
RESULTS = Path(__file__).with_name("results") / "allreduce.json"
#: How often the driver checks that every replica process is alive while it waits for them (ReplicaWatch).
LIVENESS_POLL_S = 2.0
#: A replica's peak resident memory per MB of its payload's fp32 size, about: the tensor, its mean, the
#: encoded and decoded shards and the prefetched contributions (2.2 GB per replica at P = 256 MB, int8,
#: N = 8, in the kernel's OOM report of the run killed 2026-12-06; 1.9-2.0 GB measured by ps mid-round).
PEAK_RSS_PER_P = 8.6


@dataclass(frozen=True)
class Case:
    backend: str
    n: int
    p_mb: int
    codec: str
    method: str  # "sharded" | "naive"


# --------------------------------------------------------------------------- byte counting


class CountingWSGI:
    """WSGI middleware counting request/response body bytes per ``bench-rank-<r>`` user agent."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.counts: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])  # up, down, requests

    def reset(self) -> None:
        with self.lock:
            self.counts.clear()

    def snapshot(self) -> dict[int, list[int]]:
        with self.lock:
            return {k: list(v) for k, v in self.counts.items()}

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        m = re.search(r"bench-rank-(\d+)", environ.get("HTTP_USER_AGENT", ""))
        who = int(m.group(1)) if m else -1
        up = int(environ.get("CONTENT_LENGTH") or 0)
        with self.lock:
            c = self.counts[who]
            c[0] += up
            c[2] += 1
        return self._count_body(who, self.app(environ, start_response))

    def _count_body(self, who: int, body: Any) -> Any:
        try:
            for chunk in body:
                with self.lock:
                    self.counts[who][1] += len(chunk)
                yield chunk
        finally:
            if hasattr(body, "close"):
                body.close()


def start_moto() -> tuple[str, CountingWSGI, Any]:
    """moto's S3 server on 127.0.0.1 behind :class:`CountingWSGI`; returns (endpoint, counter, server)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from moto.s3.responses import S3Response
    from werkzeug.serving import make_server

    original, lock = S3Response.put_object, threading.Lock()

    def put_object(self: Any) -> Any:
        # Real S3 evaluates If-None-Match atomically; moto checks then stores without a lock, so
        # conditional (create-only) PUTs are serialised here. Plain PUTs run concurrently, as on S3.
        if not self.headers.get("If-None-Match"):
            return original(self)
        with lock:
            return original(self)

    S3Response.put_object = put_object  # type: ignore[method-assign]
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    counter = CountingWSGI(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, counter, threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", counter, server


def proc_io() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


# --------------------------------------------------------------------------- replicas


def naive_allreduce(store: Any, rank: int, n: int, prefix: str, x: torch.Tensor, codec: str,
                    poll_interval_s: float) -> torch.Tensor:
    """The seed's exchange: PUT the whole tensor, GET all N, average in rank order (fp32)."""
    from diloco_serverless.exchange._io import CountingStore
    from diloco_serverless.exchange.codec import decode_values, encode_values, pack, unpack
    from diloco_serverless.exchange.polling import Backoff

    fetch = CountingStore(store)  # same concurrent single-GET fetcher as the sharded exchange

    enc = encode_values(x, codec)
    store.put(f"{prefix}/rank-{rank}", pack(enc, {"rank": rank}))
    keys = [f"{prefix}/rank-{r}" for r in range(n)]
    backoff = Backoff(poll_interval_s)  # same polling schedule as the exchange
    while len(set(store.list(prefix)) & set(keys)) < n:
        time.sleep(backoff.next())
    per_batch = max(1, (256 * MB) // max(1, int(x.numel() * CODEC_BYTES[codec])))
    others = [r for r in range(n) if r != rank]
    decoded: dict[int, torch.Tensor] = {rank: decode_values(enc, codec, x.numel())}
    acc = torch.zeros(x.numel(), dtype=torch.float32)
    nxt = 0
    for i in range(0, len(others), per_batch):
        blobs = fetch.get_many([keys[r] for r in others[i : i + per_batch]])
        for r in others[i : i + per_batch]:
            decoded[r] = decode_values(unpack(blobs.pop(keys[r]), key=keys[r])[0], codec, x.numel())
        while nxt in decoded:  # rank order, releasing memory as we go
            acc += decoded.pop(nxt)
            nxt += 1
    fetch.close()
    return acc / n


def replica_main(
    rank: int, n: int, url: str, options: dict[str, Any], cases: list[Case], barrier: Any, queue: Any,
    part: tuple[float, int] | None = None,
    polls: tuple[float, float] = (0.02, 0.2),
) -> None:
    """One replica process: runs every case in lockstep with the others (barriers). ``polls``: the
    exchange's first and longest sleep between polls (see ``--polls``)."""
    import diloco_serverless.exchange.polling as polling
    from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
    from diloco_serverless.store.objectstore import ObjectStore
    from diloco_serverless.store.retry import RetryPolicy

    torch.set_num_threads(1)
    polling.FIRST_POLL_S, poll_interval_s = polls  # this process's exchanges (and the naive method) only
    polling.WAITED_SHARE = float(os.environ.get("BENCH_WAITED_SHARE", polling.WAITED_SHARE))
    if os.environ.get("BENCH_SPLIT") == "off":  # A/B: multipart shards (S = N) instead of part-sized ones
        import diloco_serverless.exchange.allreduce as exchange_module

        exchange_module.split_for = lambda *args, **kwargs: 1  # type: ignore[assignment]
    opts = (
        {**options, "config_kwargs": {**options.get("config_kwargs", {}), "user_agent_extra": f"bench-rank-{rank}"}}
        if url.startswith("s3")
        else dict(options)
    )
    from diloco_serverless.store.objectstore import TransferPolicy

    hedge = os.environ.get("BENCH_HEDGE", "default")  # A/B: a quantile, or "off"
    transfer = TransferPolicy.from_mb(*part) if part else TransferPolicy()  # the exchange uses this store's policy
    if hedge != "default":
        transfer = dataclasses.replace(transfer, hedge_quantile=None if hedge == "off" else float(hedge))
    store = ObjectStore(url, opts or None, retry=RetryPolicy(timeout_s=STORE_TIMEOUT_S), transfer=transfer)
    # One untimed small exchange before the first case (the parent resets its counters after it): both
    # methods then start with open connections and the hedge's latency history. Without it the first case,
    # always a sharded one, was the only cold one.
    naive_allreduce(store, rank, n, "bench-warmup", torch.zeros(1024), "fp32", poll_interval_s)
    for i, case in enumerate(cases):
        x = torch.randn(case.p_mb * MB // 4, generator=torch.Generator().manual_seed(1000 * case.p_mb + rank))
        ar = ObjectStoreAllReduce(
            store,
            rank,
            n,
            run_id=f"bench-{i}",
            codec=case.codec,
            keep_rounds=None,
            timeout_s=900.0,
            straggler_timeout_s=600.0,
            takeover_timeout_s=600.0,
            poll_interval_s=poll_interval_s,
            topology=os.environ.get("BENCH_TOPOLOGY", "flat"),
        )
        if case.method == "sharded" and os.environ.get("BENCH_ROUND", "steady") == "steady":
            # Time a round after one this exchange finished, as every round of training but the first after
            # a (re)start is: such a round skips the read of its own vote or quorum before publishing
            # (docs/exchange.md, "Round trips"). The untimed round 0 averages 1,024 zeros.
            ar.allreduce(torch.zeros(1024))
        barrier.wait()  # parent resets counters
        barrier.wait()  # go
        io0, t0, c0, m0 = proc_io(), time.perf_counter(), time.process_time(), time.monotonic()
        h0 = (store.hedger.reads, store.hedger.backups, store.hedger.wins)
        if case.method == "sharded":
            y = ar.allreduce(x)
        else:
            y = naive_allreduce(store, rank, n, f"bench-{i}/naive", x, case.codec, poll_interval_s)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        io1 = proc_io()
        stats = asdict(ar.last_stats) if (case.method == "sharded" and ar.last_stats) else {}
        digest = hashlib.sha256(y.numpy().tobytes()).hexdigest()[:16]
        queue.put(
            {
                "case": i,
                "rank": rank,
                "wall_s": dt,
                "monotonic_s": [m0, time.monotonic()],  # the round on the emulator's clock (--trace)
                "cpu_s": cpu,
                "rchar": io1[0] - io0[0],
                "wchar": io1[1] - io0[1],
                "code_bytes_up": stats.get("bytes_up"),
                "code_bytes_down": stats.get("bytes_down"),
                "digest": digest,
                "phases_s": stats.get("phases_s", {}),
                "hedge": [store.hedger.reads - h0[0], store.hedger.backups - h0[1], store.hedger.wins - h0[2]],
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # the process's so far
            }
        )
        del x, y
        barrier.wait()  # done; parent collects and cleans up


# --------------------------------------------------------------------------- driver


class ReplicaDied(RuntimeError):
    """A replica process ended before the driver was done with it."""


class ReplicaWatch:
    """The driver's waits on its replica processes (barriers, results), ended as soon as one of them dies.

    Without it, a replica killed mid-round (the kernel's OOM killer sends SIGKILL: no traceback) left the
    driver waiting 30 minutes for its result and the other replicas idle at a barrier or waiting for it in
    the round: the "stall" of the int8 round at P = 256 MB, N = 8 on a shared 23 GiB machine (benchmarks/
    README.md, "Issue 35, second pass"). A thread checks the processes every ``poll_s`` seconds; on a death
    it breaks the barrier and wakes the result queue, and the driver raises :class:`ReplicaDied` naming the
    replica, its exit code and what to do.
    """

    def __init__(self, procs: list[Any], barrier: Any, queue: Any, *, what: str, poll_s: float = LIVENESS_POLL_S,
                 peak_rss_mb: float | None = None) -> None:
        self.procs, self.barrier, self.queue, self.what, self.poll_s = procs, barrier, queue, what, poll_s
        self.peak_rss_mb = peak_rss_mb
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-replica-watch", daemon=True)

    def start(self) -> ReplicaWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def dead(self) -> list[tuple[int, int | None, int]]:
        """``(rank, pid, exit code)`` of every replica process that has ended with a failure."""
        return [(r, p.pid, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode not in (None, 0)]

    def barrier_wait(self, timeout: float, step: str) -> None:
        try:
            self.barrier.wait(timeout=timeout)
        except threading.BrokenBarrierError:
            if self.dead():
                raise self.error(step) from None
            raise

    def get(self, timeout: float, step: str) -> dict[str, Any]:
        """The next replica's result; :class:`ReplicaDied` if a replica died first."""
        try:
            item = self.queue.get(timeout=timeout)
        except queue_module.Empty:
            raise TimeoutError(f"{self.what}, {step}: no replica result in {timeout:.0f} s; the replicas are alive "
                               "but stuck (py-spy dump --pid <replica pid> shows where)") from None
        if item is None:  # the watch's wake-up
            raise self.error(step)
        return item  # type: ignore[no-any-return]

    def error(self, step: str) -> ReplicaDied:
        lines = []
        for rank, pid, code in self.dead():
            how = f"exit code {code}"
            if code < 0:
                how = f"killed by {signal.Signals(-code).name}"
            lines.append(f"replica rank {rank} (pid {pid}) {how}")
        text = f"{self.what}, {step}: " + "; ".join(lines) + "; stopping the others (they would wait for it)."
        if any(code == -signal.SIGKILL for _, _, code in self.dead()):
            text += (" A SIGKILL without a traceback is, on Linux, most often the kernel's OOM killer: check "
                     "`dmesg | grep -i 'killed process'`.")
            if self.peak_rss_mb is not None:
                text += (f" Each replica needs about {self.peak_rss_mb:,.0f} MB at this payload size; free memory "
                         "(other jobs on the machine) or run fewer replicas (--ns) or smaller payloads (--sizes).")
        return ReplicaDied(text)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.dead():
                self.barrier.abort()
                self.queue.put(None)
                return


def memory_check(n: int, p_mb: int) -> float:
    """The estimated peak memory of one replica at payload ``p_mb`` (MB); warns on stderr when N of them (plus
    the in-RAM store's copy of their payloads) exceed the machine's available memory."""
    per = PEAK_RSS_PER_P * p_mb
    try:
        with open("/proc/meminfo") as f:
            avail_mb = next(int(line.split()[1]) / 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return per
    need = n * per + 2 * n * p_mb
    if need > avail_mb:
        print(f"warning: N={n} replicas at P={p_mb} MB need about {need:,.0f} MB (each ~{per:,.0f} MB at its peak, "
              f"plus the store's copies), {avail_mb:,.0f} MB is available: the kernel may kill a replica",
              file=sys.stderr, flush=True)
    return per


def run_group(
    backend: str,
    n: int,
    cases: list[Case],
    url: str,
    options: dict[str, Any],
    counter: CountingWSGI | None,
    cleanup: Any,
    part: tuple[float, int] | None = None,
    polls: tuple[float, float] = (0.02, 0.2),
) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "s3fs", "diloco_serverless.exchange.allreduce", "diloco_serverless.store"])
    barrier, queue = ctx.Barrier(n + 1), ctx.Queue()
    procs = [ctx.Process(target=replica_main, args=(r, n, url, options, cases, barrier, queue, part, polls))
             for r in range(n)]
    peak = memory_check(n, max(c.p_mb for c in cases))
    for p in procs:
        p.start()
    watch = ReplicaWatch(procs, barrier, queue, what=f"{backend}, N={n}", peak_rss_mb=peak).start()
    rows = []
    finished = False
    try:
        for i, case in enumerate(cases):
            step = f"case {i} ({case.p_mb} MB {case.codec} {case.method})"
            watch.barrier_wait(1800, step)
            if counter is not None:
                counter.reset()
            watch.barrier_wait(60, step)
            c0 = time.process_time()
            per_rank = [watch.get(1800, step) for _ in range(n)]
            server = counter.snapshot() if counter is not None else {}
            server_cpu = time.process_time() - c0
            watch.barrier_wait(60, step)
            rows.append(summarise(case, per_rank, server))
            # hedged reads of all replicas: reads, backups sent, backups that answered first
            rows[-1]["hedge_reads_backups_wins"] = [sum(r["hedge"][k] for r in per_rank) for k in range(3)]
            rows[-1]["server_cpu_s"] = server_cpu if counter is not None else None
            print_row(rows[-1], flush=True)
            cleanup(f"bench-{i}")
        finished = True
    finally:
        watch.stop()
        for p in procs:
            p.join(timeout=30 if finished else 0)
            if p.exitcode is None:
                p.kill()
    return rows


def summarise(case: Case, per_rank: list[dict[str, Any]], server: dict[int, list[int]]) -> dict[str, Any]:
    if case.backend != "file":
        ups = [server.get(d["rank"], [0, 0, 0])[0] for d in per_rank]
        downs = [server.get(d["rank"], [0, 0, 0])[1] for d in per_rank]
        requests = [server.get(d["rank"], [0, 0, 0])[2] for d in per_rank]
    else:
        ups, downs, requests = [d["wchar"] for d in per_rank], [d["rchar"] for d in per_rank], []
    payload = case.p_mb * MB / 4 * CODEC_BYTES[case.codec]
    # a sparse (direct) round's own bytes: its object up, the N - 1 others down
    lower = payload * case.n if case.codec == "sparse" else payload + 2 * payload * (case.n - 1) / case.n
    up, down = max(ups), max(downs)
    return {
        **asdict(case),
        "up_mb": up / MB,
        "down_mb": down / MB,
        "total_mb": (up + down) / MB,
        "lower_bound_mb": lower / MB,
        "ratio": (up + down) / lower,
        "wall_s": max(d["wall_s"] for d in per_rank),
        "replica_cpu_s_mean": sum(d["cpu_s"] for d in per_rank) / len(per_rank),
        # the largest resident memory any replica process reached so far (this case or an earlier one)
        "replica_peak_rss_mb_max": max(d.get("peak_rss_mb", 0.0) for d in per_rank),
        "requests_per_replica": max(requests) if requests else None,
        "identical_across_ranks": len({d["digest"] for d in per_rank}) == 1,
        "digest": per_rank[0]["digest"],
        "monotonic_s": {d["rank"]: d["monotonic_s"] for d in per_rank},
        "phases_s_per_rank": {d["rank"]: d["phases_s"] for d in per_rank},
        "phases_s_max": {k: max(d["phases_s"].get(k, 0.0) for d in per_rank) for k in per_rank[0]["phases_s"]},
        "code_counted_up_mb": (per_rank[0]["code_bytes_up"] or 0) / MB,
        "code_counted_down_mb": (per_rank[0]["code_bytes_down"] or 0) / MB,
    }


HEADER = (
    f"{'backend':12} {'N':>2} {'P MB':>5} {'codec':5} {'method':7} {'up MB':>8} {'down MB':>8} "
    f"{'LB MB':>8} {'ratio':>6} {'wall s':>7} {'same':>4}"
)


def print_row(r: dict[str, Any], flush: bool = False) -> None:
    print(
        f"{r['backend']:12} {r['n']:>2} {r['p_mb']:>5} {r['codec']:5} {r['method']:7} "
        f"{r['up_mb']:>8.1f} {r['down_mb']:>8.1f} {r['lower_bound_mb']:>8.1f} {r['ratio']:>6.3f} "
        f"{r['wall_s']:>7.2f} {'yes' if r['identical_across_ranks'] else 'NO':>4}",
        flush=flush,
    )


def physical_limit_s(preset: StorePreset, scale: float, lower_bound_bytes: float, trips: int = ROUND_TRIPS) -> float:
    """What no exchange can beat on ``preset`` (at ``scale``): a replica's lower-bound bytes through its
    per-client cap, plus ``trips`` first-byte medians (:data:`ROUND_TRIPS`; a sparse round
    :data:`SPARSE_ROUND_TRIPS`)."""
    return lower_bound_bytes / (preset.client_mb_s * 1e6 * scale) + trips * preset.first_byte_ms / 1000 / scale


def plan(quick: bool, backends: list[str], repeat: int, ns_: list[int] | None = None,
         sizes_: list[int] | None = None, codecs_: list[str] | None = None,
         methods: tuple[str, ...] = ("sharded", "naive")) -> list[Case]:
    """Cases in run order; each (sharded, naive) pair is repeated ``repeat`` times, interleaved.
    ``ns_``, ``sizes_``, ``codecs_`` replace the defaults when given; ``methods`` keeps a subset."""
    cases = []
    for backend in backends:
        ns = [4, 8] if quick else ([8] if backend in PRESETS else [2, 4, 8])
        sizes = [16] if quick else ([16, 64, 256] if backend == "file" else [64, 256] if backend in PRESETS
                                    else [16, 64])
        codecs = ["fp32", "int8"] if quick else (["fp32"] if backend in PRESETS else ["fp32", "bf16", "int8"])
        ns, sizes, codecs = ns_ or ns, sizes_ or sizes, codecs_ or codecs
        for n in ns:
            for p in sizes:
                for c in codecs:
                    for _ in range(repeat):
                        cases += [Case(backend, n, p, c, m) for m in ("sharded", "naive") if m in methods]
    return cases


def merge_repeats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case: the best (minimum) wall time of its repeats, all walls kept; bytes from
    the repeat with the best wall (they are the same up to a few polling requests)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["backend"], r["n"], r["p_mb"], r["codec"], r["method"])].append(r)
    out = []
    for reps in groups.values():
        best = dict(min(reps, key=lambda r: r["wall_s"]))
        best["wall_s_repeats"] = [round(r["wall_s"], 3) for r in reps]
        best["identical_across_ranks"] = all(r["identical_across_ranks"] for r in reps)
        best["ratio_max_over_repeats"] = max(r["ratio"] for r in reps)
        out.append(best)
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Targets of issue 2, evaluated on the measured rows."""
    out: dict[str, Any] = {
        "ratio_n4_max": None,
        "ratio_n8_max": None,
        "int8_over_fp32_max": None,
        "speedup_s3_n8_min": None,
    }
    sh = [r for r in rows if r["method"] == "sharded"]
    for n in (4, 8):
        vals = [r.get("ratio_max_over_repeats", r["ratio"]) for r in sh if r["n"] == n]
        out[f"ratio_n{n}_max"] = max(vals) if vals else None
    key = lambda r: (r["backend"], r["n"], r["p_mb"], r["method"])  # noqa: E731
    fp32 = {key(r): r["total_mb"] for r in sh if r["codec"] == "fp32"}
    int8 = [r["total_mb"] / fp32[key(r)] for r in sh if r["codec"] == "int8" and key(r) in fp32]
    out["int8_over_fp32_max"] = max(int8) if int8 else None
    naive = {(r["backend"], r["n"], r["p_mb"], r["codec"]): r["wall_s"] for r in rows if r["method"] == "naive"}
    speed = [
        naive[(r["backend"], r["n"], r["p_mb"], r["codec"])] / r["wall_s"]
        for r in sh
        if r["backend"] == "s3" and r["n"] == 8 and (r["backend"], r["n"], r["p_mb"], r["codec"]) in naive
    ]
    out["speedup_s3_n8_min"] = min(speed) if speed else None
    out["speedups_s3_n8"] = speed
    for r in sh:  # issue 15: against the emulated store's physical limit, and against naive
        if r["backend"] in PRESETS and (r["backend"], r["n"], r["p_mb"], r["codec"]) in naive:
            tag = f"{r['backend']}_n{r['n']}_{r['p_mb']}mb_{r['codec']}"
            out[f"{tag}_wall_over_limit"] = r["wall_s"] / r["physical_limit_s"]
            out[f"{tag}_speedup"] = naive[(r["backend"], r["n"], r["p_mb"], r["codec"])] / r["wall_s"]
    out["fp32_sharded_equals_naive"] = all(
        r["digest"] == n["digest"]
        for r in sh
        if r["codec"] == "fp32"
        for n in rows
        if n["method"] == "naive"
        and (n["backend"], n["n"], n["p_mb"], n["codec"]) == (r["backend"], r["n"], r["p_mb"], "fp32")
    )
    return out


def poll_schedule(polls: str, scale: float) -> tuple[float, float]:
    """(first, longest) sleep between a replica's polls for ``--polls`` on a store slowed by ``scale``."""
    from diloco_serverless.config import POLL_INTERVAL_S
    from diloco_serverless.exchange.polling import FIRST_POLL_S

    return (FIRST_POLL_S / scale, POLL_INTERVAL_S / scale) if polls == "real" else (0.02, 0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="subset: P=16 MB, fp32+int8, N in {4,8}")
    ap.add_argument("--backends", default="file,s3", help="comma-separated subset of file,s3 ('' for none)")
    ap.add_argument("--preset", action="append", default=[], choices=sorted(PRESETS),
                    help="also run on moto behind the store emulator with this preset (repeatable)")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="emulator speed factor: latencies / scale, bandwidths and request rates * scale")
    ap.add_argument("--part-size-mb", type=float, default=None,
                    help="TransferPolicy part size of the replicas' store (MiB; default: the store's, 16)")
    ap.add_argument("--part-concurrency", type=int, default=8, help="parts of one object in flight (default 8)")
    ap.add_argument("--ns", default="", help="comma-separated replica counts (default per back end)")
    ap.add_argument("--sizes", default="", help="comma-separated payload sizes in MB (default per back end)")
    ap.add_argument("--codecs", default="", help="comma-separated codecs (default per back end)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--methods", default="sharded,naive",
                    help="comma-separated subset of sharded,naive (one alone: no speedup column)")
    ap.add_argument("--split", choices=("auto", "off"), default="auto",
                    help="off: the exchange keeps S = N shards and uploads large ones as multipart (an A/B of "
                         "part-sized shards, docs/exchange.md 'Round trips')")
    ap.add_argument("--topology", choices=("flat", "direct", "auto"), default="flat",
                    help="exchange.topology of the sharded method (default flat; auto picks direct for small "
                         "tensors, docs/exchange.md 'Hierarchical exchange')")
    ap.add_argument("--hedge", default="default",
                    help="hedged reads of the replicas' store (both methods): a quantile, 'off', or 'default' "
                         "(the store's, 0.75; docs/exchange.md 'Transfers')")
    ap.add_argument("--round", choices=("steady", "first"), default="steady",
                    help="which round of its exchange the sharded method times: 'steady' (default) a round after "
                         "an untimed small one, as in training; 'first' the exchange's first round, which first "
                         "reads the store for a vote or quorum of its own (as after a restart)")
    ap.add_argument("--trace", default=None, metavar="PATH",
                    help="write every request the emulator served (client, method, key, arrival, body in, "
                         "answer, body out; monotonic seconds) to this JSON file, for a round's timeline")
    ap.add_argument("--polls", choices=("real", "fast"), default="real",
                    help="the replicas' sleeps between polls: 'real' (default) the exchange's defaults (first "
                         "20 ms, longest 0.5 s) divided by --scale on an emulated store, as its latencies are, so "
                         "a poll costs what it would on the real store; 'fast' 20 ms to 0.2 s, not scaled (the "
                         "setting of the measurements before stop 32, 2026-12-03)")
    ap.add_argument("--waited-share", type=float, default=None,
                    help="A/B: a sleep between polls is at most this share of the time waited (default: the "
                         "exchange's, 0.1); 'inf' leaves growth alone, the schedule before stop 32 (2026-12-03)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per case; the table shows the fastest (default 2)")
    args = ap.parse_args()
    if args.hedge not in ("default", "off"):
        from diloco_serverless.store.objectstore import TransferPolicy

        try:
            TransferPolicy(hedge_quantile=float(args.hedge))
        except ValueError as e:
            ap.error(f"--hedge: {e}")
    if not args.scale > 0:
        ap.error(f"--scale must be > 0, got {args.scale}")
    backends = [b for b in args.backends.split(",") if b] + list(dict.fromkeys(args.preset))
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    os.environ["BENCH_SPLIT"] = args.split  # read by the replica processes (started after this)
    os.environ["BENCH_TOPOLOGY"] = args.topology
    os.environ["BENCH_HEDGE"] = args.hedge
    os.environ["BENCH_ROUND"] = args.round
    if args.waited_share is not None:
        os.environ["BENCH_WAITED_SHARE"] = str(args.waited_share)
    methods = tuple(m for m in args.methods.split(",") if m)
    if not methods or set(methods) - {"sharded", "naive"}:
        ap.error(f"--methods must name sharded and/or naive, got {args.methods!r}")
    cases = plan(args.quick, backends, args.repeat, ints(args.ns), ints(args.sizes),
                 [c for c in args.codecs.split(",") if c], methods)
    moto: tuple[str, CountingWSGI, Any] | None = None
    emulators: list[StoreEmulator] = []
    rows: list[dict[str, Any]] = []
    print(HEADER, flush=True)
    for backend in backends:
        if backend == "file":
            root = tempfile.mkdtemp(prefix="diloco-bench-")
            url, options, counter = Path(root).as_uri(), {}, None
            cleanup = lambda run, root=root: shutil.rmtree(os.path.join(root, run), ignore_errors=True)  # noqa: E731
        else:
            import boto3

            os.environ.setdefault(
                "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(1 << 30)
            )  # keep objects in RAM, like a real server's cache
            if moto is None:
                moto = start_moto()
                os.environ.update(
                    AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
                )
            endpoint, counter, _server = moto
            s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            bucket = "bench" if backend == "s3" else f"bench-{backend}"
            s3.create_bucket(Bucket=bucket)
            url = f"s3://{bucket}"
            target = endpoint
            if backend in PRESETS:  # the replicas talk to the emulator; cleanup goes to moto directly
                emulators.append(StoreEmulator(endpoint, PRESETS[backend], scale=args.scale, seed=1,
                                                trace=args.trace is not None).start())
                target = emulators[-1].url
            options = {
                "endpoint_url": target,
                "key": "testing",
                "secret": "testing",
                "client_kwargs": {"region_name": "us-east-1"},
                "config_kwargs": {"read_timeout": STORE_TIMEOUT_S},
            }
            cleanup = lambda run, s3=s3, b=bucket: _s3_delete_prefix(s3, b, run + "/")  # noqa: E731
        for n in sorted({c.n for c in cases if c.backend == backend}):
            rows += run_group(
                backend, n, [c for c in cases if c.backend == backend and c.n == n], url, options, counter, cleanup,
                (args.part_size_mb, args.part_concurrency) if args.part_size_mb else None,
                poll_schedule(args.polls, args.scale if backend in PRESETS else 1.0),
            )
    for emu in emulators:
        emu.stop()
    if args.trace:
        Path(args.trace).write_text(json.dumps([
            {"backend": emu.preset.name, "client": r.client, "method": r.method, "key": r.key, "range": r.range,
             "status": r.status, "arrived": r.arrived, "body_in": body_in, "answered": r.answered, "sent": sent}
            for emu in emulators if emu.trace is not None for r, body_in, sent in emu.trace
        ]))
    rows = merge_repeats(rows)
    for r in rows:
        if r["backend"] in PRESETS:
            r["scale"] = args.scale
            r["physical_limit_s"] = physical_limit_s(PRESETS[r["backend"]], args.scale, r["lower_bound_mb"] * MB,
                                                     SPARSE_ROUND_TRIPS if r["codec"] == "sparse" else ROUND_TRIPS)
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "quick": args.quick,
        "scale": args.scale,
        "part_size_mb": args.part_size_mb,
        "part_concurrency": args.part_concurrency,
        "split": args.split,
        "topology": args.topology,
        "hedge": args.hedge,
        "round": args.round,
        "polls": args.polls,
        "waited_share": args.waited_share,
        "presets": {name: PRESETS[name].to_json() for name in dict.fromkeys(args.preset)},
        "replicas": "processes (forkserver), one per replica",
        "rows": rows,
        "summary": summary(rows),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(rows, result["summary"])
    print(f"wrote {args.out}")
    return 0


def _s3_delete_prefix(s3: Any, bucket: str, prefix: str) -> None:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objs:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": objs})


def print_table(rows: list[dict[str, Any]], summ: dict[str, Any]) -> None:
    print("\nsharded vs naive (bytes per replica, max over replicas; wall = slowest replica)")
    print(
        f"{'backend':12} {'N':>2} {'P MB':>5} {'codec':5} | "
        f"{'up MB':>7} {'down MB':>7} {'LB MB':>7} {'ratio':>6} {'wall s':>7} | "
        f"{'naive up':>8} {'naive dn':>8} {'ratio':>6} {'wall s':>7} | {'speedup':>7} {'same':>4}"
        + (f" | {'limit s':>7} {'wall/limit':>6}" if any(r.get("physical_limit_s") for r in rows) else "")
    )
    naive = {(r["backend"], r["n"], r["p_mb"], r["codec"]): r for r in rows if r["method"] == "naive"}
    for r in rows:
        if r["method"] != "sharded":
            continue
        nv = naive.get((r["backend"], r["n"], r["p_mb"], r["codec"]))
        nvs = (
            f"{nv['up_mb']:>8.1f} {nv['down_mb']:>8.1f} {nv['ratio']:>6.2f} {nv['wall_s']:>7.2f} | "
            f"{nv['wall_s'] / r['wall_s']:>6.2f}x"
            if nv
            else f"{'-':>8} {'-':>8} {'-':>6} {'-':>7} | {'-':>7}"
        )
        limit = r.get("physical_limit_s")
        lims = f" | {limit:>7.2f} {r['wall_s'] / limit:>5.2f}x" if limit else ""
        print(
            f"{r['backend']:12} {r['n']:>2} {r['p_mb']:>5} {r['codec']:5} | "
            f"{r['up_mb']:>7.1f} {r['down_mb']:>7.1f} {r['lower_bound_mb']:>7.1f} "
            f"{r['ratio']:>6.3f} {r['wall_s']:>7.2f} | {nvs} {'yes' if r['identical_across_ranks'] else 'NO':>4}{lims}"
        )
    print(
        "\ntargets:",
        json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in summ.items() if k != "speedups_s3_n8"}),
    )


if __name__ == "__main__":
    sys.exit(main())
