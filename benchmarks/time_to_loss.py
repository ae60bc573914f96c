"""Time to loss: DiLoCo against synchronous data parallel through the same object store (issue 15, part 5).

Run (from the repo root, venv active):

    python benchmarks/time_to_loss.py --quick            # N=4, T=96 steps, H=16, s3-standard emulation (~6 min)
    python benchmarks/time_to_loss.py                    # N=4, T=192 steps, H=16 (~12 min)
    python benchmarks/time_to_loss.py --quick --sync-every 32 --diloco-factor 3   # the README's table (~8 min)
    python benchmarks/time_to_loss.py --quick --replicas 2 --sync-every 24 --diloco-factor 3 \
        --set exchange.fragment_sync_delay=6      # one core per replica, exchange overlapped (~3.5 min)
    python benchmarks/time_to_loss.py --preset r2 --sync-every 8 --set outer.lr=0.5
    python benchmarks/time_to_loss.py --backend file --replicas 2 --steps 4 --sync-every 2   # smoke run

Prints a table and writes benchmarks/results/time_to_loss.json.

Replicas without a network between them can only do data parallel (DP) by all-reducing gradients
through the object store every step. Both arms train the tiny Qwen2 (random init, seed 0: the same
initial parameters, checked) on N replicas, the same data (replica r reads rank r's shard of the stdlib
corpus, batch b x seq_len tokens per step) and the same number of tokens (T steps per replica), with
the LM loss only (``compose_loss`` with alpha_sdpo = beta_replay = 0), the same inner AdamW and lr
schedule (``inner.lr_at``), through the same store:

  (a) sync DP   the simplest honest loop, in this file: N processes; every step each computes its
                gradient on its own batch, all-reduces it (mean) through the store with the product's
                exchange primitive used standalone (``ObjectStoreAllReduce.allreduce`` on the flat
                gradient, one round per step, exactly as the manager calls it for DiLoCo), clips the
                mean gradient and steps AdamW.
  (b) DiLoCo    the product: ``launch()`` on the local executor (N replica processes, the real
                ``ReplicaTrainer``), H inner steps then the pseudo-gradient exchange and the outer
                step; eval losses read from the run's metrics (``Run.metrics()``).

(b)'s outer step here is plain averaging (``outer.lr=1.0 outer.momentum=0 outer.nesterov=false``: Local
SGD / FedAvg, the special case of DiLoCo's outer SGD), not the product's default (the DiLoCo paper's
Nesterov, lr 0.7, momentum 0.9). The paper's setting is tuned for thousands of outer steps from a
pretrained model; this benchmark has 3-9 outer steps from random init, where momentum never settles:
Nesterov's first step is lr x (1 + momentum) = 1.33x the averaged pseudo-gradient and the effective step
grows toward lr / (1 - momentum) = 7x, overshooting the cold model. Measured on the file backend (N=4,
T=96, H=32, loss against inner steps, a sweep of outer lr, momentum, H and inner lr): (a) reaches 2.356 at 96 steps;
(b) with the paper's setting is at 2.788 after 96 steps and needs 288 (3.0x the tokens), with averaging
2.577 and 192 (2.0x; between the evals at 160 and 192, about 1.8x). Higher outer lr (1.2, 1.4), Nesterov
momentum 0.1-0.6 and heavy-ball momentum 0.3 were no better. ``--set outer.lr=0.7 --set outer.momentum=0.9
--set outer.nesterov=true`` runs the paper's setting (the three together: a ``--set`` wins field by field).

  (c) overlap   ``--arms abc``: the product with ``outer.delay = 1`` (trainer/overlap.py), no outer.* override (the
                measured default for N and H, config.OUTER_DEFAULTS) and H from the rule of trainer/sync_every.py
                on (b)'s measured compute per inner step and exchange time (``--c-sync-every`` fixes it).
  (d) small H   ``--arms abd``: the product without delay, no outer.* override, H = ``--d-sync-every`` (8).
  (e) auto H    ``--arms abe``: the product's ``inner.sync_every = "auto"`` (rank 0 decides each round's H at run
                time, trainer/round_plan.py; the first rounds run H = 8), no delay, no outer.* override: what a
                user gets with "auto". The run is T x factor inner steps, as the other arms; rank 0 evaluates
                every ``--sync-every`` inner steps, as in arm b (``eval_every`` counts rounds of the first H).
  (f) auto H + overlap  ``--arms abf``: (e) with ``outer.delay = 1``.
  (g) in-round overlap, replace  ``--arms abg``: no delay, H = ``--g-sync-every`` (8), ``exchange.fragment_sync_delay
                = tau`` with one fragment (the exchange runs during the round's last tau steps; torchft then sets
                the replica to the new global: those steps are discarded); tau = ``--g-tau``, or (auto) the
                fewest steps whose compute covers 1.25x (b)'s measured exchange, at most H - 1.
  (h) in-round overlap, eager  ``--arms abh``: (g) with ``exchange.fragment_merge = "eager"``
                (trainer/fragment_merge.py: the replica keeps its tau steps' progress on top of the new global).
  (i) auto H + in-round overlap  ``--arms abi``: (e) with ``exchange.fragment_sync_delay = --i-tau`` (the first
                rounds' tau, 4) and the eager merge: rank 0 picks each round's H and tau (trainer/sync_every.py).
  (s) sparse    ``--arms abs``: (b) with SparseLoCo's sparse pseudo-gradients (examples/sparseloco.toml, issue 35):
                ``exchange.codec = "sparse"`` (top 64 of every 4,096 values, 2-bit), error feedback with decay 0.95 in
                place of outer momentum, outer SGD lr 1 without momentum (the same outer step as (b)), H as (b).

The last table gives every DiLoCo arm's wall time and tokens (steps) to (a)'s final loss as a share of
(a)'s, and the replicas' compute share of their wall time (inner steps over the span from the first step to
the last record, ranks other than 0).

Both evaluate the global model on the same held-out batches (``data.eval_batches()``, identical on
every rank) every H steps, on rank 0, inside the timed loop (the other replicas wait for it at the next
exchange in both arms). Wall time is counted from the first training step (process start, model
build and data opening excluded in both arms); for DiLoCo from the replicas' own round-0 metrics
(``time - wall_s`` of the ranks that do not evaluate).

The store: moto (127.0.0.1) behind the shaping proxy of ``tests/support/store_emulator.py`` with the
``--preset`` (default ``s3-standard``: first-byte latency, per-connection and per-client bandwidth,
per-prefix request rates), at ``--scale`` (1 = real time). The emulator counts requests and bytes;
spend = requests at the preset's list prices (PUT/POST/LIST at the PUT price, GET/HEAD at the GET
price, DELETE free) + bytes downloaded x the preset's egress price (charged only when replicas run
outside the store's cloud; the table shows both). Only exchange traffic (keys under ``rounds/``) is
priced per arm, since DiLoCo's heartbeats, metrics, run.json and final/ have no DP counterpart; the
JSON has all of it. ``--backend file`` runs both arms on a local folder (no emulation, no prices).

Results: for each arm the eval-loss curve against wall time; the time (and exchange spend) each needs
to reach (a)'s final eval loss (``-`` when it does not within the token budget); and, since DiLoCo
usually ends above (a)'s final loss at equal tokens on a cold start, the time each needs to reach the
*higher* of the two final losses and the loss (a) had reached when (b) finished its T steps.
``--diloco-factor K`` lets (b) train K x T steps (same data stream; the inner lr is constant after the
warmup, so its first T steps are the equal-token run) to measure when it reaches (a)'s final loss.
(a)'s **floor** is what (a) would take if each exchange cost only four first-byte medians (publish,
quorum, reduce, gather) on top of its measured compute: a store and proxy with no CPU cost of their own.
Target: DiLoCo reaches (a)'s eval loss in <= 0.2x (a)'s wall time. Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.store_presets import PRESETS, StorePreset, preset  # noqa: E402

RESULTS = Path(__file__).with_name("results") / "time_to_loss.json"
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
RUN_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
PUT_CLASS = ("PUT", "POST", "LIST", "COPY")  # S3 bills LIST and POST (multipart) like PUT
GET_CLASS = ("GET", "HEAD")
#: First-byte waits one exchange round cannot avoid: publish, quorum, reduce, gather (the phases of
#: docs/architecture.md; the physical limit of benchmarks/allreduce.py counts the same four). The protocol
#: really makes about six sequential requests (contributions, ready marker, the LIST that sees every marker,
#: quorum.json, the reduced shard, the reduced GETs), so the floor below flatters (a).
ROUND_TRIPS = 4


@dataclass(frozen=True)
class Setup:
    """The shape shared by both arms."""

    replicas: int = 4
    steps: int = 96  # T: inner steps (= tokens / (batch * seq_len)) per replica, both arms
    sync_every: int = 16  # H of DiLoCo; also how often both arms evaluate
    batch: int = 4
    seq_len: int = 96
    eval_batches: int = 6
    poll_interval_s: float = 0.05
    diloco_factor: int = 1  # (b) trains diloco_factor x T steps; its equal-token result is read at step T
    #: (b)'s outer step: plain model averaging (see the module docstring); (a) reads no outer.* field
    diloco_outer: tuple[str, ...] = ("outer.lr=1.0", "outer.momentum=0", "outer.nesterov=false")
    extra: tuple[str, ...] = ()  # --set overrides for both arms (after diloco_outer: a --set outer.* wins)

    @property
    def diloco_steps(self) -> int:
        return self.steps * self.diloco_factor

    def overrides(self, steps: int | None = None) -> list[str]:
        """RunConfig overrides of both arms (DP reads inner.*, data.*, loss.*, model.* from the same config);
        ``steps`` sets the run's length in inner steps (default T)."""
        steps = self.steps if steps is None else steps
        return [f"replicas={self.replicas}", "seed=0", "loss.alpha_sdpo=0", "loss.beta_replay=0",
                f"data.batch_size={self.batch}", f"data.seq_len={self.seq_len}",
                f"data.eval_batches={self.eval_batches}", f"inner.sync_every={self.sync_every}",
                f"rounds={steps // self.sync_every}", "eval_every=1", "checkpoint_every=0",
                f"exchange.poll_interval_s={self.poll_interval_s}", "exchange.straggler_timeout_s=600",
                "exchange.round_timeout_s=1200", "exchange.keep_rounds=2", *self.diloco_outer, *self.extra]


QUICK = Setup(steps=96)
FULL = Setup(steps=192)


# ------------------------------------------------------------------------------------ the store
@dataclass
class StoreSite:
    """Where both arms' runs live: a store URL, the environment replicas need, and request counters."""

    url: str
    env: dict[str, str]
    preset: StorePreset | None = None
    scale: float = 1.0
    counter: EmulatorCounts | None = None  # the emulator's counters, None for file://

    def reset(self) -> None:
        """Zero the counters (before each arm)."""
        if self.counter is not None:
            self.counter.reset()

    def snapshot(self) -> dict[str, Any]:
        """Requests by method since :meth:`reset`, split into exchange traffic (``rounds/``) and the rest."""
        if self.counter is None:
            return {}
        return self.counter.snapshot()


@contextlib.contextmanager
def open_site(backend: str, root: Path, store_preset: StorePreset, scale: float, seed: int) -> Iterator[StoreSite]:
    """A ``file://`` folder, or moto behind the store emulator with ``store_preset`` at ``scale``."""
    if backend == "file":
        yield StoreSite(f"file://{root / 'store'}", {})
        return
    from support.chaos import moto_server

    with moto_server() as moto, _shaping_proxy(moto, store_preset, scale, seed) as (endpoint, counter):
        import boto3

        bucket = f"ttl-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=moto, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=bucket)
        yield StoreSite(f"s3://{bucket}", {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}, store_preset, scale, counter)


class EmulatorCounts:
    """Reads the emulator's counters: requests by method, split into exchange traffic (keys under
    ``rounds/``) and the rest, and body bytes moved (all clients). :meth:`reset` before each arm."""

    def __init__(self, emulator: Any) -> None:
        self.emulator = emulator

    def reset(self) -> None:
        self.emulator.reset()

    def snapshot(self) -> dict[str, Any]:
        requests: dict[str, dict[str, int]] = {"exchange": {}, "other": {}}
        for req in self.emulator.requests():
            key, method = req.key, req.method
            if not key:  # a bucket-level request: a listing (billed like a PUT) names its prefix
                key = urllib.parse.parse_qs(req.query).get("prefix", [""])[0]
                method = "LIST" if method == "GET" else method
            if method == "POST" and "delete" in req.query:
                method = "DELETE"  # DeleteObjects: deletes are free
            where = requests["exchange" if "/rounds/" in f"/{key}" else "other"]
            where[method] = where.get(method, 0) + 1
        moved = self.emulator.bytes_by_client()
        return {"requests": requests, "bytes_up": sum(u for u, _ in moved.values()),
                "bytes_down": sum(d for _, d in moved.values()), "slowdowns": self.emulator.slowdowns,
                "clients": sorted(moved)}


@contextlib.contextmanager
def _shaping_proxy(upstream: str, store_preset: StorePreset, scale: float,
                   seed: int) -> Iterator[tuple[str, EmulatorCounts]]:
    from support.store_emulator import StoreEmulator

    with StoreEmulator(upstream, store_preset, scale=scale, seed=seed, keep_events=2_000_000) as emu:
        yield emu.url, EmulatorCounts(emu)


# ------------------------------------------------------------------------------------ (a) sync DP
@dataclass
class DPResult:
    rank: int
    curve: list[tuple[float, int, float]] = field(default_factory=list)  # (s since start, step, eval loss)
    wall_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    exchange_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)  # the exchange's phases, summed over steps
    init_digest: str = ""
    error: str | None = None


def _digest(named: Any) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(named):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def dp_worker(rank: int, setup: Setup, url: str, run_id: str, barrier: Any, queue: Any) -> None:
    """One DP replica: every step, its gradient is averaged through the store, then AdamW steps."""
    out = DPResult(rank)
    try:
        import torch

        from diloco_serverless.config import RunConfig
        from diloco_serverless.data.builder import BatchBuilder
        from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
        from diloco_serverless.loss import compose_loss
        from diloco_serverless.trainer.model import build_model
        from support.store_emulator import client_options

        torch.set_num_threads(1)
        cfg = RunConfig.load(None, setup.overrides())
        model, tok = build_model(cfg.model, cfg.seed)
        out.init_digest = _digest(model.named_parameters())
        data = BatchBuilder.from_config(cfg, tok, rank=rank)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.inner.lr, betas=cfg.inner.betas, weight_decay=cfg.inner.weight_decay,
                                fused=True)
        kwargs = cfg.loss.compose_kwargs()
        options = client_options(rank) if url.startswith("s3://") else None  # the emulator's per-replica NIC
        ar = ObjectStoreAllReduce(url, rank, setup.replicas, run_id=run_id, keep_rounds=2, storage_options=options,
                                  poll_interval_s=setup.poll_interval_s, straggler_timeout_s=600, timeout_s=1200,
                                  topology=cfg.exchange.topology)  # the protocol (b) uses: same config
        barrier.wait()
        t0 = time.monotonic()
        for step in range(setup.steps):
            for group in opt.param_groups:
                group["lr"] = cfg.inner.lr_at(step, setup.steps)
            batch = data.next_batch()
            opt.zero_grad(set_to_none=True)
            compose_loss(model, batch, **kwargs).total.backward()  # type: ignore[no-untyped-call]
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
            t = time.monotonic()
            mean = ar.allreduce(flat)
            out.exchange_s += time.monotonic() - t
            stats = ar.last_stats
            if stats is not None:
                out.bytes_up += stats.bytes_up
                out.bytes_down += stats.bytes_down
                for phase, sec in stats.phases_s.items():
                    out.phases_s[phase] = out.phases_s.get(phase, 0.0) + sec
            offset = 0
            for p in params:
                p.grad.copy_(mean[offset:offset + p.numel()].view_as(p))  # type: ignore[union-attr]
                offset += p.numel()
            torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip, foreach=True)
            opt.step()
            if rank == 0 and (step + 1) % setup.sync_every == 0:
                out.curve.append((time.monotonic() - t0, step + 1, _eval(model, data, compose_loss)))
        out.wall_s = time.monotonic() - t0
        ar.close()
        data.close()
    except BaseException as exc:  # reported to the parent, which says which rank failed and why
        out.error = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):
            barrier.abort()
    queue.put(asdict(out))


def _eval(model: Any, data: Any, compose_loss: Any) -> float:
    """Mean lm_ce on the held-out batches, as ``ReplicaTrainer.evaluate`` computes it."""
    import torch

    model.eval()
    with torch.no_grad():
        losses = [float(compose_loss(model, b).lm_ce) for b in data.eval_batches()]
    model.train()
    return sum(losses) / max(1, len(losses))


def run_dp(setup: Setup, site: StoreSite) -> dict[str, Any]:
    """(a): N spawned processes (same environment as the DiLoCo replicas); rank 0's curve, summed bytes."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(setup.replicas), ctx.Queue()
    run_id = f"dp-{uuid.uuid4().hex[:6]}"
    site.reset()
    with _environ({**RUN_ENV, **site.env}):
        procs = [ctx.Process(target=dp_worker, args=(r, setup, site.url, run_id, barrier, queue))
                 for r in range(setup.replicas)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    failed = [r for r in results if r["error"]]
    if failed:
        raise RuntimeError("sync DP failed: " + "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed))
    r0 = next(r for r in results if r["rank"] == 0)
    return {"curve": [tuple(c) for c in r0["curve"]], "wall_s": max(r["wall_s"] for r in results),
            "steps": setup.steps, "exchanges": setup.steps, "bytes_up": sum(r["bytes_up"] for r in results),
            "bytes_down": sum(r["bytes_down"] for r in results),
            "exchange_s_mean": sum(r["exchange_s"] for r in results) / len(results) / setup.steps,
            "compute_s_per_step": sum(r["wall_s"] - r["exchange_s"] for r in results) / len(results) / setup.steps,
            "phases_s_mean": {k: sum(r["phases_s"].get(k, 0.0) for r in results) / len(results) / setup.steps
                              for k in results[0]["phases_s"]},
            "init_digests": sorted({r["init_digest"] for r in results}), "store": site.snapshot()}


# ------------------------------------------------------------------------------------ (b) DiLoCo
def run_diloco(setup: Setup, site: StoreSite, work: Path) -> dict[str, Any]:
    """(b): the product, ``launch()`` on the local executor; the curve from the run's metrics."""
    from safetensors.torch import load as st_load

    from diloco_serverless.launcher.api import launch
    from diloco_serverless.store.objectstore import ObjectStore
    from diloco_serverless.trainer.checkpoint import INITIAL_KEY

    run_id = f"diloco-{uuid.uuid4().hex[:6]}"
    site.reset()
    env = {**RUN_ENV, **site.env, "XDG_CACHE_HOME": str(work / "xdg-cache")}
    with _environ(env):
        t_launch = time.monotonic()
        run = launch(None, "local", overrides=setup.overrides(setup.diloco_steps), store=site.url, run_id=run_id)
        try:
            status = run.wait(poll_interval_s=1.0, timeout_s=3600)
        except BaseException:
            with contextlib.suppress(Exception):
                run.cancel()
            raise
        total = time.monotonic() - t_launch
        metrics = run.metrics()
        initial = st_load(ObjectStore(run.url).get(INITIAL_KEY))
    store = site.snapshot()
    # each replica's first inner step: its round-0 record's time less the round's wall time (rank 0 also
    # evaluated before writing it, so only the other ranks tell exactly; rank 0 starts no earlier than the
    # first of them, since it writes the initial parameters the others wait for)
    starts = [recs[0]["time"] - recs[0]["wall_s"] for rank, recs in metrics.items() if rank != 0 and recs]
    start = min(starts or [metrics[0][0]["time"] - metrics[0][0]["wall_s"]])  # conservative: the first one
    # the inner steps done at each eval (inner.sync_every = "auto": the rounds' H differ)
    curve = [(m["time"] - start, int(m.get("inner_step_total", (m["round"] + 1) * setup.sync_every)),
              float(m["eval_loss"])) for m in metrics.get(0, []) if "eval_loss" in m]
    recs = [m for ms in metrics.values() for m in ms]
    last = max(m["time"] for m in recs)
    return {"curve": curve, "wall_s": last - start, "launch_to_done_s": total, "state": str(status.state),
            "sync_every": setup.sync_every, "overrides": setup.overrides(setup.diloco_steps), **_compute_share(metrics),
            "start_stagger_s": max(starts) - min(starts) if starts else 0.0,
            "steps": setup.diloco_steps, "exchanges": len(metrics.get(0, [])),
            "h_per_round": [f"{m['sync_every']}t{m['sync_every_tau']}" if m.get("sync_every_tau")
                            else m.get("sync_every") for m in metrics.get(0, [])],
            "h_reasons": [m.get("sync_every_reason") for m in metrics.get(0, []) if m.get("sync_every_reason")],
            "bytes_up": sum(m.get("bytes_up", 0) for m in recs),
            "bytes_down": sum(m.get("bytes_down", 0) for m in recs),
            "exchange_s_mean": sum(m.get("exchange_s", 0.0) for m in recs) / max(1, len(recs)),
            **_between_rounds(metrics), "init_digests": [_digest(initial.items())], "store": store}


def _compute_share(metrics: dict[int, list[dict[str, Any]]]) -> dict[str, float]:
    """The replicas' compute share of their wall time: inner-step seconds (``inner_s``: a round's wall time
    less its time blocked on the exchange) over the span from the first step to the last record, on the ranks
    that do not evaluate (rank 0 also evaluates); and the mean compute seconds per inner step and exchange
    seconds per round (inputs of the H rule, diloco_serverless/trainer/sync_every.py)."""
    shares, waits, per_step, exchange = [], [], [], []
    for rank, recs in metrics.items():
        if not recs:
            continue
        span = recs[-1]["time"] - (recs[0]["time"] - recs[0]["wall_s"])
        if rank != 0 and span > 0:
            shares.append(sum(r.get("inner_s", 0.0) for r in recs) / span)
            waits.append(sum(r.get("wait_s", 0.0) for r in recs) / span)
        per_step += [r["inner_s"] / r["inner_steps"] for r in recs if r.get("inner_steps")]
        exchange += [r["exchange_s"] for r in recs if r.get("exchange_s")]
    return {"compute_share": sum(shares) / len(shares) if shares else 0.0,
            # blocked on the exchange inside rounds; the rest of the span is between rounds (gap_s, eval_s)
            "wait_share": sum(waits) / len(waits) if waits else 0.0,
            "compute_s_per_step": sorted(per_step)[len(per_step) // 2] if per_step else 0.0,
            "exchange_s_median": sorted(exchange)[len(exchange) // 2] if exchange else 0.0}


def _between_rounds(metrics: dict[int, list[dict[str, Any]]]) -> dict[str, float]:
    """Where (b)'s time goes outside its rounds, from the metrics records (each stamped when built, right
    after its round ended; rank 0 builds it after evaluating). ``gap_s``: the mean time from a round's
    record to the next round's first step (``time - wall_s``) on the ranks that do not evaluate: the
    healing probe, the heartbeats, checkpoints. ``eval_s``: how much later than the others' rank 0's
    record of the same round is, when it evaluated (the replicas end a round together, at the exchange)."""
    gaps = [(b["time"] - b["wall_s"]) - a["time"] for rank, recs in metrics.items() if rank != 0
            for a, b in zip(recs, recs[1:])]
    others: dict[int, list[float]] = {}
    for rank, recs in metrics.items():
        for rec in recs:
            if rank != 0:
                others.setdefault(rec["round"], []).append(rec["time"])
    evals = [rec["time"] - sum(others[rec["round"]]) / len(others[rec["round"]])
             for rec in metrics.get(0, []) if "eval_loss" in rec and rec["round"] in others]
    return {"gap_s": sum(gaps) / len(gaps) if gaps else 0.0, "eval_s": sum(evals) / len(evals) if evals else 0.0}


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------------------------ analysis
def time_to(curve: list[tuple[float, int, float]], target: float) -> tuple[float, int] | None:
    """(seconds, steps) of the first evaluation at or below ``target``; None if never."""
    for t, step, loss in curve:
        if loss <= target + 1e-9:
            return t, step
    return None


def loss_at(curve: list[tuple[float, int, float]], t: float) -> float | None:
    """The last evaluated loss at or before ``t`` seconds (None before the first evaluation)."""
    seen = [loss for s, _, loss in curve if s <= t + 1e-9]
    return seen[-1] if seen else None


def spend_usd(requests: dict[str, int], bytes_down: float, p: StorePreset) -> dict[str, float]:
    """Store spend of ``requests`` (by method) and ``bytes_down`` at ``p``'s list prices."""
    puts = sum(n for m, n in requests.items() if m in PUT_CLASS)
    gets = sum(n for m, n in requests.items() if m in GET_CLASS)
    req = puts / 1000 * p.usd_per_1k_put + gets / 1000 * p.usd_per_1k_get
    return {"requests_usd": req, "egress_usd": bytes_down / 1e9 * p.usd_per_gb_egress, "put_class": puts,
            "get_class": gets}


def summarize(res: dict[str, Any], site_preset: StorePreset | None) -> dict[str, Any]:
    """Times to loss, losses at equal time, exchange spend per arm (all from the measured curves)."""
    a, b = res["arms"]["a_sync_dp"], res["arms"]["b_diloco"]
    steps = res["setup"]["steps"]
    b_equal = [c for c in b["curve"] if c[1] <= steps]  # (b) at equal tokens: its first T steps
    a_final, b_final = a["curve"][-1][2], b_equal[-1][2]
    out: dict[str, Any] = {"a_final_loss": a_final, "b_final_loss": b_final, "b_steps_run": b["steps"],
                           "b_wall_equal_tokens_s": b_equal[-1][0]}
    targets = [("a_final", a_final), ("common", max(a_final, b_final))]
    if b["steps"] > steps:  # (b) trained longer: also where it ended
        targets.append(("b_run_final", max(a_final, b["curve"][-1][2])))
    for name, target in targets:
        row = {"target_loss": target}
        for key, arm in (("a", a), ("b", b)):
            hit = time_to(arm["curve"], target)
            row[key] = None if hit is None else {"wall_s": hit[0], "steps": hit[1],
                                                 **_spend_share(arm, hit[1], site_preset)}
        row["b_over_a_wall"] = (row["b"]["wall_s"] / row["a"]["wall_s"]
                                if row["a"] and row["b"] else None)
        row["b_over_a_tokens"] = row["b"]["steps"] / row["a"]["steps"] if row["a"] and row["b"] else None
        out[name] = row
    out["a_loss_when_b_done"] = loss_at(a["curve"], b_equal[-1][0])
    a_step, b_step = a["wall_s"] / a["steps"], b["wall_s"] / b["steps"]
    out["s_per_step"] = {"a": a_step, "b": b_step, "b_over_a": b_step / a_step}
    out["b_loss_when_b_done"] = b_final
    if site_preset is not None:  # what (a) would take if each exchange cost only its sequential first bytes
        per_step = a["compute_s_per_step"] + ROUND_TRIPS * site_preset.first_byte_ms / 1000 / res["scale"]
        floor = res["setup"]["steps"] * per_step
        b_hit = out["a_final"]["b"]
        out["a_floor"] = {"round_trips": ROUND_TRIPS, "s_per_step": per_step, "wall_s": floor,
                          "b_over_a_floor": b_hit["wall_s"] / floor if b_hit else None}
    ratio = out["a_final"]["b_over_a_wall"]
    out["target"] = {"b_over_a_wall_max": 0.2, "b_over_a_wall": ratio, "met": ratio is not None and ratio <= 0.2}
    return out


def summarize_arm(res: dict[str, Any], key: str) -> dict[str, Any]:
    """Another DiLoCo arm against (a): wall time and tokens to (a)'s final loss, its loss at T steps."""
    a, arm = res["arms"]["a_sync_dp"], res["arms"][key]
    steps, target = res["setup"]["steps"], a["curve"][-1][2]
    a_hit, hit = time_to(a["curve"], target), time_to(arm["curve"], target)
    at_t = [c for c in arm["curve"] if c[1] <= steps]
    return {"target_loss": target, "sync_every": arm["sync_every"], "loss_at_T": at_t[-1][2] if at_t else None,
            "wall_s": None if hit is None else hit[0], "steps": None if hit is None else hit[1],
            "over_a_wall": None if hit is None or a_hit is None else hit[0] / a_hit[0],
            "over_a_tokens": None if hit is None or a_hit is None else hit[1] / a_hit[1],
            "compute_share": arm.get("compute_share"), "s_per_step": arm["wall_s"] / arm["steps"]}


def _spend_share(arm: dict[str, Any], steps: int, p: StorePreset | None) -> dict[str, Any]:
    """Exchange requests, bytes and spend of ``arm`` up to ``steps`` (exchange traffic is the same every round)."""
    frac = steps / arm["steps"]
    ex = (arm.get("store") or {}).get("requests", {}).get("exchange", {})
    requests = {m: n * frac for m, n in ex.items()}
    moved = (arm["bytes_up"] + arm["bytes_down"]) * frac
    out: dict[str, Any] = {"requests": sum(requests.values()) if ex else None, "bytes": moved}
    if p is not None and ex:
        out.update(spend_usd(requests, arm["bytes_down"] * frac, p))
    return out


# ------------------------------------------------------------------------------------ report
def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


def _usd(row: dict[str, Any] | None, key: str) -> str:
    return "-" if not row or key not in row else f"{row[key]:.4f}"


def print_table(res: dict[str, Any]) -> None:
    s, summ = res["setup"], res["summary"]
    where = res["backend"] if res["preset"] is None else f"{res['preset']['name']} emulation (scale {res['scale']})"
    print(f"\nTime to loss: tiny Qwen2 ({res['params']:,} params), N={s['replicas']}, T={s['steps']} steps x "
          f"{s['batch']}x{s['seq_len']} tokens per replica (both arms), H={s['sync_every']}, store: {where}")
    if s["diloco_factor"] > 1:
        print(f"(b) ran {s['diloco_factor']}x T = {summ['b_steps_run']} steps; its equal-token results are its first T")
    print(f"same init: {res['same_init']}")
    labels = (("a_final", "to (a)'s final loss"), ("common", "to the higher final loss at T steps"),
              ("b_run_final", f"to the higher final loss, (b) after {summ['b_steps_run']} steps"))
    for name, label in labels:
        if name not in summ:
            continue
        row = summ[name]
        print(f"\n{label} {row['target_loss']:.4f}")
        print(f"{'arm':<16}{'wall s':>9}{'steps':>7}{'requests':>10}{'MB moved':>10}{'req $':>9}{'egress $':>10}")
        for key, arm_label in (("a", "(a) sync DP"), ("b", "(b) DiLoCo")):
            r = row[key]
            if r is None:
                print(f"{arm_label:<16}  not reached in {res['arms']['b_diloco']['steps']} steps")
                continue
            req = "-" if r["requests"] is None else f"{r['requests']:.0f}"
            print(f"{arm_label:<16}{r['wall_s']:>9.1f}{r['steps']:>7}{req:>10}{_mb(r['bytes']):>10}"
                  f"{_usd(r, 'requests_usd'):>9}{_usd(r, 'egress_usd'):>10}")
        ratio, tokens = row["b_over_a_wall"], row.get("b_over_a_tokens")
        print(f"(b)/(a) wall: {'-' if ratio is None else f'{ratio:.3f}x'}      "
              f"tokens: {'-' if tokens is None else f'{tokens:.2f}x'}")
    a, b = res["arms"]["a_sync_dp"], res["arms"]["b_diloco"]
    a_then = summ["a_loss_when_b_done"]
    print(f"\nequal wall time ({summ['b_wall_equal_tokens_s']:.1f} s, (b) at T steps): (a) at "
          f"{'no eval yet' if a_then is None else f'{a_then:.4f}'}, (b) at {summ['b_loss_when_b_done']:.4f}")
    sps = summ["s_per_step"]
    print(f"wall time per step (all replicas, evals and exchanges included): (a) {sps['a']:.3f} s, "
          f"(b) {sps['b']:.3f} s, (b)/(a) {sps['b_over_a']:.3f}x")
    floor = summ.get("a_floor")
    if floor:
        ratio = "-" if floor["b_over_a_floor"] is None else f"{floor['b_over_a_floor']:.3f}x"
        print(f"(a) floor: {floor['wall_s']:.1f} s = T x ({a['compute_s_per_step'] * 1e3:.0f} ms compute + "
              f"{floor['round_trips']} sequential first bytes) per step; (b) to (a)'s final loss / floor: {ratio}")
    phases = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in a["phases_s_mean"].items())
    print(f"full runs: (a) {a['wall_s']:.1f} s, {a['exchange_s_mean'] * 1e3:.0f} ms/exchange ({phases} ms) "
          f"x {a['exchanges']}; "
          f"(b) {b['wall_s']:.1f} s ({b['launch_to_done_s']:.1f} s launch to done), "
          f"{b['exchange_s_mean'] * 1e3:.0f} ms/exchange x {b['exchanges']}, "
          f"{b.get('gap_s', 0.0) * 1e3:.0f} ms from a round's end to the next one's first step, "
          f"{b.get('eval_s', 0.0) * 1e3:.0f} ms evaluating (rank 0)")
    for key, label in (("a_sync_dp", "(a)"), ("b_diloco", "(b)")):
        print(f"{label} eval curve (s, step, loss): "
              + ", ".join(f"({t:.1f}, {st}, {lo:.3f})" for t, st, lo in res["arms"][key]["curve"]))
    arms = [k for k in res["arms"] if k not in ("a_sync_dp",)]
    print(f"\nevery DiLoCo arm to (a)'s final loss {summ['a_final']['target_loss']:.4f} "
          f"((a): {summ['a_final']['a']['wall_s']:.1f} s, {summ['a_final']['a']['steps']} steps)")
    print(f"{'arm':<34}{'H':>4}{'loss@T':>8}{'wall s':>8}{'steps':>7}{'wall/(a)':>9}{'tokens/(a)':>11}"
          f"{'compute %':>10}")
    for key in arms:
        r = summ["arms"][key]
        f = (lambda v, spec: "-" if v is None else format(v, spec))  # noqa: E731
        print(f"{ARM_LABELS.get(key, key):<34}{r['sync_every']:>4}{f(r['loss_at_T'], '.4f'):>8}"
              f"{f(r['wall_s'], '.1f'):>8}{f(r['steps'], 'd'):>7}{f(r['over_a_wall'], '.3f'):>9}"
              f"{f(r['over_a_tokens'], '.2f'):>11}{f(100 * r['compute_share'], '.1f'):>10}")
    print("\nwhere the replicas' time goes (ranks other than 0; share of the span from first step to last record)")
    for key in arms:
        arm = res["arms"][key]
        other = 1.0 - arm["compute_share"] - arm.get("wait_share", 0.0)
        print(f"{ARM_LABELS.get(key, key):<40} compute {100 * arm['compute_share']:5.1f} %  blocked on exchange "
              f"{100 * arm.get('wait_share', 0.0):5.1f} %  between rounds {100 * other:5.1f} % "
              f"(gap {arm.get('gap_s', 0.0) * 1e3:.0f} ms/round, rank 0 eval {arm.get('eval_s', 0.0) * 1e3:.0f} ms); "
              f"H per round {arm.get('h_per_round')}")
    print(f"load average (1, 5, 15 min): start {res['machine']['load_avg']}, end {res.get('load_avg_end')}")
    t = summ["target"]
    verdict = "-" if t["b_over_a_wall"] is None else f"{t['b_over_a_wall']:.3f}x"
    print(f"target: (b) reaches (a)'s final eval loss in <= 0.2x (a)'s wall time: {verdict} "
          f"({'met' if t['met'] else 'NOT met'})")


ARM_LABELS = {"b_diloco": "(b) DiLoCo (--set, baseline outer)", "c_overlap": "(c) overlap, H rule, product outer",
              "d_small_h": "(d) no overlap, small H, product outer", "e_auto": "(e) auto H, product outer",
              "f_auto_overlap": "(f) auto H + overlap, product outer",
              "g_tau_replace": "(g) tau overlap, replace", "h_tau_eager": "(h) tau overlap, eager merge",
              "i_auto_tau": "(i) auto H + tau, eager merge"}


def run_tau_arm(setup: Setup, site: StoreSite, work: Path, h: int, tau: int, merge: str) -> dict[str, Any]:
    """(g) and (h): the product without delay at ``h`` inner steps per round, the exchange overlapping the
    round's last ``tau`` steps (``exchange.fragment_sync_delay``), ``exchange.fragment_merge = merge``."""
    t_setup = replace(setup, sync_every=h, diloco_outer=(),
                      extra=(f"exchange.fragment_sync_delay={tau}", f"exchange.fragment_merge={merge}",
                             *setup.extra))
    out = run_diloco(t_setup, site, work)
    out["tau"], out["sync_every"] = tau, f"{h}t{tau}"
    return out


def overlap_tau(args: argparse.Namespace, res: dict[str, Any], h: int) -> int:
    """``--g-tau``, or the fewest inner steps whose compute covers 1.25x (b)'s measured exchange (at most H - 1)."""
    if args.g_tau != "auto":
        return int(args.g_tau)
    b = res["arms"].get("b_diloco")
    if not b or not b.get("compute_s_per_step") or not b.get("exchange_s_median"):
        raise SystemExit("--g-tau auto needs arm b's timings: run --arms abg, or give --g-tau TAU")
    return int(max(1, min(h - 1, math.ceil(1.25 * b["exchange_s_median"] / b["compute_s_per_step"]))))


ARM_LABELS["s_sparse"] = "(s) sparse 64of4096-2bit + EF 0.95"
#: arm (s): SparseLoCo as examples/sparseloco.toml sets it (the outer step is (b)'s: SGD lr 1, no momentum)
SPARSE_ARM = ("exchange.codec=sparse", "exchange.error_feedback=true", "exchange.feedback_decay=0.95")


def run_product_arm(setup: Setup, site: StoreSite, work: Path, h: int, delay: int) -> dict[str, Any]:
    """(c) and (d): the product with what a user gets by default for the outer step (no outer.* override but
    ``--set``'s: the measured default for N and H) and ``outer.delay = delay`` at ``h`` inner steps per round."""
    c_setup = replace(setup, sync_every=h, diloco_outer=(), extra=(f"outer.delay={delay}", *setup.extra))
    return run_diloco(c_setup, site, work)


def run_auto_arm(setup: Setup, site: StoreSite, work: Path, delay: int, tau: int = 0) -> dict[str, Any]:
    """(e) and (f): the product's ``inner.sync_every = "auto"`` (first rounds at H = 8, the run T x factor inner
    steps), the product's outer defaults, ``outer.delay = delay``."""
    from diloco_serverless.config import AUTO_SYNC_INITIAL

    # evaluate every sync_every (H of arm b) inner steps, as arm b does: eval_every counts rounds of the first H
    every = max(1, setup.sync_every // AUTO_SYNC_INITIAL)
    a_setup = replace(setup, sync_every=AUTO_SYNC_INITIAL, diloco_outer=(),
                      extra=("inner.auto_sync=true", f"outer.delay={delay}", f"eval_every={every}",
                             *((f"exchange.fragment_sync_delay={tau}", "exchange.fragment_merge=eager") if tau else ()),
                             *setup.extra))
    out = run_diloco(a_setup, site, work)
    out["sync_every"] = "auto"
    return out


def run_sparse_arm(setup: Setup, site: StoreSite, work: Path) -> dict[str, Any]:
    """(s): (b) with the sparse codec and SparseLoCo's error feedback (``SPARSE_ARM``), same H and outer step."""
    s_setup = replace(setup, diloco_outer=("outer.lr=1.0", "outer.momentum=0", "outer.nesterov=false"),
                      extra=(*SPARSE_ARM, *setup.extra))
    return run_diloco(s_setup, site, work)


def overlap_h(args: argparse.Namespace, res: dict[str, Any]) -> int:
    """``--c-sync-every``, or the H rule (trainer/sync_every.py, overlap) on (b)'s measured compute per inner
    step and exchange time."""
    from diloco_serverless.trainer.sync_every import choose_sync_every

    if args.c_sync_every != "auto":
        return int(args.c_sync_every)
    b = res["arms"].get("b_diloco")
    if not b or not b.get("compute_s_per_step") or not b.get("exchange_s_median"):
        raise SystemExit("--c-sync-every auto needs arm b's timings: run --arms abc, or give --c-sync-every H")
    return choose_sync_every(b["compute_s_per_step"], b["exchange_s_median"], overlap=True,
                             divides=args.setup.steps)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"T={QUICK.steps} (default T={FULL.steps})")
    parser.add_argument("--replicas", type=int, default=None, help="N (default 4)")
    parser.add_argument("--steps", type=int, default=None, help="T, inner steps per replica (a multiple of H)")
    parser.add_argument("--sync-every", type=int, default=None, help="H (default 16)")
    parser.add_argument("--backend", choices=("s3", "file"), default="s3")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="s3-standard")
    parser.add_argument("--scale", type=float, default=1.0, help="emulator time scale (1 = real time)")
    parser.add_argument("--arms", default="ab",
                        help="which arms to run: a, b, c (DiLoCo with outer.delay = 1, the product's outer "
                             "defaults and H from the rule), d (no delay, the product's outer defaults, "
                             "--d-sync-every), s (sparse pseudo-gradients, SparseLoCo) or any combination, "
                             "e.g. abcd")
    parser.add_argument("--c-sync-every", default="auto", metavar="H|auto",
                        help="H of arm c; auto: the H rule on arm b's measured compute and exchange times")
    parser.add_argument("--d-sync-every", type=int, default=8, metavar="H",
                        help="H of arm d (no overlap; default 8: the fewest tokens to (a)'s loss in "
                             "benchmarks/outer_sweep.py at N = 4)")
    parser.add_argument("--g-sync-every", type=int, default=8, metavar="H", help="H of arms g and h (default 8)")
    parser.add_argument("--g-tau", default="auto", metavar="TAU|auto",
                        help="exchange.fragment_sync_delay of arms g and h; auto: from arm b's compute and exchange")
    parser.add_argument("--i-tau", type=int, default=4, metavar="TAU",
                        help="arm i: the first rounds' tau (exchange.fragment_sync_delay; rank 0 decides later ones)")
    parser.add_argument("--diloco-factor", type=int, default=None, metavar="K",
                        help="(b) trains K x T steps (same data stream, constant lr), to measure when it reaches "
                             "(a)'s final loss; its equal-token results are read at step T (default 1)")
    parser.add_argument("--set", action="append", default=[], metavar="K=V", dest="overrides",
                        help="RunConfig override for both arms, e.g. inner.lr=1e-3 (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    for name, value in (("replicas", args.replicas), ("steps", args.steps), ("sync_every", args.sync_every),
                        ("diloco_factor", args.diloco_factor)):
        if value is not None:
            setup = replace(setup, **{name: value})
    if args.overrides:
        setup = replace(setup, extra=tuple(args.overrides))
    if setup.steps % setup.sync_every:
        parser.error(f"--steps {setup.steps} must be a multiple of H={setup.sync_every} (both arms train T steps)")
    args.setup = setup
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    setup: Setup = args.setup
    from diloco_serverless.config import RunConfig
    from diloco_serverless.trainer.model import build_model, count_parameters

    store_preset = preset(args.preset)
    res: dict[str, Any] = {"setup": asdict(setup), "backend": args.backend, "scale": args.scale,
                           "preset": store_preset.to_json() if args.backend == "s3" else None,
                           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                       "load_avg": os.getloadavg()}, "arms": {}}
    cfg = RunConfig.load(None, setup.overrides())
    if setup.diloco_factor > 1 and cfg.inner.schedule != "constant":
        raise SystemExit(f"--diloco-factor {setup.diloco_factor} reads (b) at T steps from a longer run, which is the "
                         f"equal-token run only with inner.schedule = \"constant\" (got {cfg.inner.schedule!r}); "
                         "drop --diloco-factor or the schedule override")
    res["params"] = count_parameters(build_model(cfg.model, 0)[0])
    with tempfile.TemporaryDirectory(prefix="ttl-bench-") as tmp, \
            open_site(args.backend, Path(tmp), store_preset, args.scale, 0) as site:
        if "a" in args.arms:
            res["arms"]["a_sync_dp"] = run_dp(setup, site)
            print(f"a_sync_dp: {json.dumps(res['arms']['a_sync_dp'])}", flush=True)
        if "b" in args.arms:
            res["arms"]["b_diloco"] = run_diloco(setup, site, Path(tmp))
            print(f"b_diloco: {json.dumps(res['arms']['b_diloco'])}", flush=True)
        if "c" in args.arms:
            h = overlap_h(args, res)
            print(f"arm c: H = {h}", flush=True)
            res["arms"]["c_overlap"] = run_product_arm(setup, site, Path(tmp), h, delay=1)
            print(f"c_overlap: {json.dumps(res['arms']['c_overlap'])}", flush=True)
        if "d" in args.arms:
            res["arms"]["d_small_h"] = run_product_arm(setup, site, Path(tmp), args.d_sync_every, delay=0)
            print(f"d_small_h: {json.dumps(res['arms']['d_small_h'])}", flush=True)
        for arm, key, delay in (("e", "e_auto", 0), ("f", "f_auto_overlap", 1)):
            if arm in args.arms:
                res["arms"][key] = run_auto_arm(setup, site, Path(tmp), delay)
                print(f"{key}: {json.dumps(res['arms'][key])}", flush=True)
        for arm, key, merge in (("g", "g_tau_replace", "replace"), ("h", "h_tau_eager", "eager")):
            if arm in args.arms:
                tau = overlap_tau(args, res, args.g_sync_every)
                print(f"arm {arm}: H = {args.g_sync_every}, tau = {tau}", flush=True)
                res["arms"][key] = run_tau_arm(setup, site, Path(tmp), args.g_sync_every, tau, merge)
                print(f"{key}: {json.dumps(res['arms'][key])}", flush=True)
        if "i" in args.arms:
            res["arms"]["i_auto_tau"] = run_auto_arm(setup, site, Path(tmp), 0, tau=args.i_tau)
            print(f"i_auto_tau: {json.dumps(res['arms']['i_auto_tau'])}", flush=True)
        if "s" in args.arms:
            res["arms"]["s_sparse"] = run_sparse_arm(setup, site, Path(tmp))
            print(f"s_sparse: {json.dumps(res['arms']['s_sparse'])}", flush=True)
    res["load_avg_end"] = os.getloadavg()
    if "a_sync_dp" in res["arms"] and "b_diloco" in res["arms"]:
        digests = {d for arm in res["arms"].values() for d in arm["init_digests"]}
        res["same_init"] = len(digests) == 1
        res["summary"] = summarize(res, store_preset if args.backend == "s3" else None)
        res["summary"]["arms"] = {k: summarize_arm(res, k) for k in res["arms"] if k != "a_sync_dp"}
        print_table(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
