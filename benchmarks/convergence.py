"""Convergence of DiLoCo through the object store against synchronous data parallel (issue 4).

Run (from the repo root, venv active):

    python benchmarks/convergence.py --quick     # T=250 inner steps, H=50, warm start W=100
    python benchmarks/convergence.py             # T=1000 inner steps, H=50, warm start W=500
    python benchmarks/convergence.py --quick --tables warm --configs b --no-utilization \
        --sweep outer.lr=0.5 --sweep outer.momentum=0.0,outer.nesterov=false   # outer-lr sweep

Prints the tables and writes benchmarks/results/convergence.json.

Two starting points, each run with the same T inner steps per configuration:

  cold  random init (seed 0);
  warm  the checkpoint after W steps of (a) sync DP from that random init (``--warm-start-steps W``),
        as in the DiLoCo paper (arXiv 2311.08105, Sec. 3), which starts every configuration from a
        model pretrained with data parallelism (24k steps). Every configuration then starts from those
        parameters with a fresh inner AdamW (same warmup) and continues every rank's data stream at
        position W*b, so no configuration re-reads the warm-up data.

Same tiny Qwen2, same stdlib corpus and held-out split, same inner AdamW
(lr, warmup, weight decay, grad clip from RunConfig defaults) and the same data: replica/worker r
always reads rank r's shard of a 4-way split, batch b per step, so the global batch per step is 4b
and every configuration runs T inner steps:

  (a) sync DP     one model; every step averages the 4 workers' gradients (one exchange per step)
  (b) DiLoCo fp32 N=4 replicas, H inner steps per round, outer Nesterov SGD (lr 0.7, m 0.9) — the
                  real replica code (``ReplicaTrainer``: torchft DiLoCo + ObjectStoreManager +
                  ObjectStoreAllReduce) in 4 threads over a file:// store
  (c) DiLoCo int8 the same with the int8 codec (+ error feedback)
  (d) 1 replica   one model on rank 0's shard, batch b (a quarter of the global batch)

Eval loss = mean ``lm_ce`` of the final (global) model on the same held-out batches. The loss is
the language-modelling channel only (``compose_loss`` with alpha_sdpo = beta_replay = 0) so that
the four runs optimise the same objective as sync DP. Bytes for (b)/(c) are measured by the
exchange (sum over replicas of payload PUT + GET); for (a) they are what the same store exchange
would move if it ran every step (P + P/N up, 2P(N-1)/N down per replica, fp32).

Utilization: H=100, N=4, fp32, with and without ``fragment_sync_delay``: the share of each
replica's wall time spent in inner steps (not blocked waiting for the exchange), from the replicas'
own per-round metrics. On a 2-core machine the 4 replicas time-share the CPUs, so waiting includes
waiting for the slowest replica. ``--sweep`` adds warm (b) rows with other overrides (e.g. outer lr,
momentum, inner lr) to measure whether the defaults matter; it changes no library default.
Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from diloco_serverless.config import RunConfig
from diloco_serverless.data.builder import BatchBuilder
from diloco_serverless.loss import compose_loss
from diloco_serverless.run.members import read_metrics
from diloco_serverless.run.record import create_run
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer.checkpoint import FORMAT, INITIAL_KEY
from diloco_serverless.trainer.loop import ReplicaTrainer
from diloco_serverless.trainer.model import build_model, count_parameters

N = 4
RESULTS = Path(__file__).parent / "results" / "convergence.json"


@dataclass
class Setup:
    steps: int  # T: inner steps of every configuration
    sync_every: int  # H of (b), (c)
    batch: int  # b: sequences per replica per step (global batch = N * b)
    seq_len: int
    eval_batches: int
    util_rounds: int  # rounds of H=100 for the utilization runs
    util_delay: int  # fragment_sync_delay of the overlapped utilization run
    warm_steps: int  # W: sync-DP steps that produce the warm-start checkpoint
    extra: tuple[str, ...] = ()  # --set overrides applied to every run (warm start included)

    def overrides(self) -> list[str]:
        return [f"replicas={N}", "seed=0", "loss.alpha_sdpo=0", "loss.beta_replay=0", f"data.batch_size={self.batch}",
                f"data.seq_len={self.seq_len}", f"data.eval_batches={self.eval_batches}", "eval_every=0",
                "checkpoint_every=0", "exchange.poll_interval_s=0.02", "exchange.straggler_timeout_s=600",
                "exchange.round_timeout_s=1200", "exchange.keep_rounds=2", *self.extra]


QUICK = Setup(steps=250, sync_every=50, batch=4, seq_len=96, eval_batches=12, util_rounds=2, util_delay=25,
              warm_steps=100)
FULL = Setup(steps=1000, sync_every=50, batch=4, seq_len=96, eval_batches=24, util_rounds=3, util_delay=25,
             warm_steps=500)


def _config(setup: Setup, extra: list[str]) -> RunConfig:
    return RunConfig.load(None, [*setup.overrides(), *extra])


@torch.no_grad()
def eval_loss(model: torch.nn.Module, builder: BatchBuilder) -> float:
    """Mean lm_ce on the held-out batches (the same batches on every rank and run)."""
    was = model.training
    model.eval()
    losses = [float(compose_loss(model, b).lm_ce) for b in builder.eval_batches()]
    model.train(was)
    return sum(losses) / len(losses)


def _inner(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr, betas=cfg.inner.betas,
                             weight_decay=cfg.inner.weight_decay)


def _set_lr(cfg: RunConfig, opt: torch.optim.Optimizer, step: int) -> None:
    for group in opt.param_groups:  # the same warmup as train.py
        group["lr"] = cfg.inner.lr * min(1.0, (step + 1) / max(1, cfg.inner.warmup_steps))


@dataclass
class Start:
    """Where every configuration starts: parameters (None = random init, seed 0) and data position."""
    name: str  # "cold" or "warm"
    params: dict[str, torch.Tensor] | None = None
    position: int = 0  # examples already read on every rank's shard


def _load(model: torch.nn.Module, start: Start) -> None:
    if start.params is not None:
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(start.params[k])


def _sync_dp(setup: Setup, workers: int, steps: int, start: Start) -> tuple[torch.nn.Module, BatchBuilder, float]:
    """Train ``steps`` steps of sync DP over ``workers`` shards from ``start``; returns model, rank-0 data, wall."""
    cfg = _config(setup, [])
    model, tok = build_model(cfg.model, cfg.seed)
    _load(model, start)
    builders = [BatchBuilder.from_config(cfg, tok, rank=r, world_size=N) for r in range(workers)]
    for b in builders:
        b.position = start.position
    opt = _inner(cfg, model)
    t0 = time.monotonic()
    for step in range(steps):
        _set_lr(cfg, opt, step)
        opt.zero_grad(set_to_none=True)
        for b in builders:
            (compose_loss(model, b.next_batch()).lm_ce / workers).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        opt.step()
    return model, builders[0], time.monotonic() - t0


def warm_start(setup: Setup) -> tuple[Start, float, float]:
    """W steps of (a) sync DP from random init: the shared warm checkpoint, its eval loss and wall time."""
    model, data, wall = _sync_dp(setup, N, setup.warm_steps, Start("cold"))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return Start("warm", params, setup.warm_steps * setup.batch), eval_loss(model, data), wall


def run_sync_dp(setup: Setup, workers: int, start: Start) -> dict[str, Any]:
    """(a) with workers=N (gradients averaged every step) or (d) with workers=1 (rank 0's shard)."""
    model, data, wall = _sync_dp(setup, workers, setup.steps, start)
    p_bytes = 4 * count_parameters(model)
    per_step = N * (p_bytes + p_bytes / N + 2 * p_bytes * (N - 1) / N) if workers > 1 else 0.0
    return {"eval_loss": eval_loss(model, data), "exchanges": setup.steps if workers > 1 else 0,
            "bytes_moved": per_step * setup.steps, "bytes_measured": False, "wall_s": wall}


def run_diloco(setup: Setup, sync_every: int, rounds: int, extra: list[str], root: Path, name: str,
               start: Start) -> dict[str, Any]:
    """N replicas of the real replica code in threads over a file:// store; returns eval, bytes, timings.

    A warm ``start`` is written as the run's ``checkpoints/initial.safetensors`` before the replicas
    are built, so :func:`diloco_serverless.trainer.checkpoint.sync_initial_parameters` loads it on every rank.
    """
    cfg = _config(setup, [f"run_id={name}", f"rounds={rounds}", f"inner.sync_every={sync_every}", *extra])
    store, _ = create_run(f"file://{root}", cfg)
    if start.params is not None:
        store.put(INITIAL_KEY, st_save({k: v.contiguous() for k, v in start.params.items()},
                                        metadata={"format": str(FORMAT)}))
    trainers = [ReplicaTrainer.from_run(store.url, r) for r in range(N)]
    for t in trainers:
        t.data.position = start.position
    errors: list[BaseException] = []

    def work(t: ReplicaTrainer) -> None:
        try:
            t.run()
        except BaseException as exc:
            errors.append(exc)

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # N replicas share the cores; no intra-op oversubscription
    start = time.monotonic()
    threads = [threading.Thread(target=work, args=(t,)) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - start
    torch.set_num_threads(threads_before)
    if errors:
        raise errors[0]
    model = copy.deepcopy(trainers[0].model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, v in trainers[0].rep.global_named_parameters().items():
            params[k].copy_(v)
    metrics = read_metrics(ObjectStore(store.url))
    inner = sum(m["inner_s"] for m in metrics)
    total = sum(m["wall_s"] for m in metrics)
    return {"eval_loss": eval_loss(model, trainers[0].data), "exchanges": rounds * cfg.exchange.fragments,
            "bytes_moved": sum(m.get("bytes_up", 0) + m.get("bytes_down", 0) for m in metrics),
            "bytes_measured": True, "wall_s": wall, "utilization": inner / total if total else math.nan,
            "mean_wait_s_per_round": sum(m["wait_s"] for m in metrics) / max(1, len(metrics)),
            "mean_exchange_s": sum(m.get("exchange_s", 0.0) for m in metrics) / max(1, len(metrics))}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


LABELS = {"a": ("a_sync_dp", "(a) sync DP"), "b": ("b_diloco_fp32", "(b) DiLoCo fp32"),
          "c": ("c_diloco_int8", "(c) DiLoCo int8+EF"), "d": ("d_single_quarter", "(d) 1 replica, b/4")}


def _row(label: str, r: dict[str, Any], base: float | None) -> str:
    ratio = f"{r['eval_loss'] / base:>8.4f}x" if base else f"{'-':>9}"
    star = "" if r["bytes_measured"] else "*"
    return (f"{label:<34}{r['eval_loss']:>10.4f}{ratio}{r['exchanges']:>11}"
            f"{_fmt_bytes(r['bytes_moved']) + star:>14}{r['wall_s']:>9.1f}")


def print_tables(res: dict[str, Any]) -> None:
    s = res["setup"]
    for name, table in res["tables"].items():
        start = ("random init (seed 0)" if name == "cold" else
                 f"after W={s['warm_steps']} sync-DP steps (eval loss {res['warm_start']['eval_loss']:.4f})")
        print(f"\nConvergence [{name} start: {start}]: tiny Qwen2 ({res['params']:,} params), N={N}, "
              f"T={s['steps']} inner steps, global batch {N * s['batch']}x{s['seq_len']} tokens/step, "
              f"H={s['sync_every']}")
        print(f"{'config':<34}{'eval loss':>10}{'vs (a)':>9}{'exchanges':>11}{'bytes moved':>14}{'wall s':>9}")
        base = table["a_sync_dp"]["eval_loss"] if "a_sync_dp" in table else None
        for key, label in LABELS.values():
            if key in table:
                print(_row(label, table[key], base))
        for key, r in table.items():
            if key.startswith("sweep:"):
                print(_row(f"(b) {key[6:]}", r, base))
        print("* (a): bytes the store exchange would move if it ran every step (analytic); (b), (c): measured")
    if res["utilization"]:
        print(f"\nUtilization (share of replica wall time in inner steps), H=100, N={N}, fp32, "
              f"{s['util_rounds']} rounds:")
        print(f"{'fragment_sync_delay':<22}{'utilization':>12}{'wait s/round':>14}{'exchange s':>12}")
        for u in res["utilization"].values():
            print(f"{u['delay']:<22}{u['utilization'] * 100:>11.1f}%{u['mean_wait_s_per_round']:>14.3f}"
                  f"{u['mean_exchange_s']:>12.3f}")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="T=250, W=100 (about 9 min on the loaded 2-core dev machine; --tables warm halves it)")
    parser.add_argument("--warm-start-steps", type=int, default=None, metavar="W",
                        help="sync-DP steps before the warm table (default: 100 quick, 500 full)")
    parser.add_argument("--tables", default="cold,warm", help="which starts to run: cold, warm or cold,warm")
    parser.add_argument("--configs", default="abcd", help="subset of the configurations a, b, c, d")
    parser.add_argument("--sweep", action="append", default=[], metavar="K=V[,K=V]",
                        help="extra warm (b) run with these RunConfig overrides (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="K=V", dest="overrides",
                        help="RunConfig override for every run, e.g. inner.lr=1e-3 (repeatable)")
    parser.add_argument("--no-utilization", action="store_true", help="skip the H=100 utilization runs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def _jobs(setup: Setup, configs: str, root: Path, start: Start) -> dict[str, Any]:
    rounds = setup.steps // setup.sync_every
    n = start.name
    all_jobs = {
        "a": lambda: run_sync_dp(setup, N, start),
        "d": lambda: run_sync_dp(setup, 1, start),
        "b": lambda: run_diloco(setup, setup.sync_every, rounds, [], root, f"{n}-b", start),
        "c": lambda: run_diloco(setup, setup.sync_every, rounds,
                                ['exchange.codec="int8"', "exchange.error_feedback=true"], root, f"{n}-c", start),
    }
    return {LABELS[c][0]: job for c, job in all_jobs.items() if c in configs}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    setup = QUICK if args.quick else FULL
    if args.warm_start_steps is not None:
        setup = Setup(**{**asdict(setup), "warm_steps": args.warm_start_steps})
    if args.overrides:
        setup = Setup(**{**asdict(setup), "extra": tuple(args.overrides)})
    rounds = setup.steps // setup.sync_every
    # One intra-op thread everywhere: at ~1M parameters intra-op threads cost more than they gain, and on a
    # shared machine their spin-waiting made sync DP ~8x slower (855 s instead of ~100 s for T=250).
    torch.set_num_threads(1)
    res: dict[str, Any] = {"mode": "quick" if args.quick else "full", "setup": asdict(setup), "tables": {},
                           "warm_start": None, "utilization": {}, "torch_threads": torch.get_num_threads()}
    res["params"] = count_parameters(build_model(_config(setup, []).model, 0)[0])
    with tempfile.TemporaryDirectory(prefix="diloco-conv-") as tmp:
        root = Path(tmp)
        for name in [t.strip() for t in args.tables.split(",") if t.strip()]:
            if name == "cold":
                start = Start("cold")
            else:
                start, loss, wall = warm_start(setup)
                res["warm_start"] = {"steps": setup.warm_steps, "eval_loss": loss, "wall_s": wall}
                print(f"warm_start: {json.dumps(res['warm_start'])}", flush=True)
            table = res["tables"].setdefault(name, {})
            for key, job in _jobs(setup, args.configs, root, start).items():
                table[key] = job()
                print(f"{name} {key}: {json.dumps(table[key])}", flush=True)
            for i, spec in enumerate(args.sweep if name == "warm" else []):
                extra = [kv for kv in spec.split(",") if kv]
                table[f"sweep:{spec}"] = run_diloco(setup, setup.sync_every, rounds, extra, root, f"sweep{i}", start)
                print(f"{name} sweep {spec}: {json.dumps(table[f'sweep:{spec}'])}", flush=True)
        utils = () if args.no_utilization else (("util_no_delay", 0), ("util_delay", setup.util_delay))
        for key, delay in utils:
            u = run_diloco(setup, 100, setup.util_rounds, [f"exchange.fragment_sync_delay={delay}"], root, key,
                           Start("cold"))
            res["utilization"][key] = {"delay": delay, **u}
            print(f"{key}: {json.dumps(res['utilization'][key])}", flush=True)
    print_tables(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
