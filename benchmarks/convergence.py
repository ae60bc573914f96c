"""Convergence of DiLoCo through the object store against synchronous data parallel (issue 4).

Run (from the repo root, venv active):

    python benchmarks/convergence.py --quick     # T=250 inner steps, H=50 (< 5 min on 2 idle cores)
    python benchmarks/convergence.py             # T=1000 inner steps, H=50 (about 15-30 min on 2 cores)

Prints two tables and writes benchmarks/results/convergence.json.

Same tiny Qwen2 (random init, seed 0), same stdlib corpus and held-out split, same inner AdamW
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
waiting for the slowest replica. Benchmarks never assert.
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

from diloco_serverless.config import RunConfig
from diloco_serverless.data import BatchBuilder
from diloco_serverless.loss import compose_loss
from diloco_serverless.model import build_model, count_parameters
from diloco_serverless.run import create_run, read_metrics
from diloco_serverless.store import ObjectStore
from diloco_serverless.train import ReplicaTrainer

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

    def overrides(self) -> list[str]:
        return [f"replicas={N}", "seed=0", "loss.alpha_sdpo=0", "loss.beta_replay=0", f"data.batch_size={self.batch}",
                f"data.seq_len={self.seq_len}", f"data.eval_batches={self.eval_batches}", "eval_every=0",
                "checkpoint_every=0", "exchange.poll_interval_s=0.02", "exchange.straggler_timeout_s=600",
                "exchange.round_timeout_s=1200", "exchange.keep_rounds=2"]


QUICK = Setup(steps=250, sync_every=50, batch=4, seq_len=96, eval_batches=12, util_rounds=2, util_delay=25)
FULL = Setup(steps=1000, sync_every=50, batch=4, seq_len=96, eval_batches=24, util_rounds=3, util_delay=25)


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


def run_sync_dp(setup: Setup, workers: int) -> dict[str, Any]:
    """(a) with workers=N (gradients averaged every step) or (d) with workers=1 (rank 0's shard)."""
    cfg = _config(setup, [])
    model, tok = build_model(cfg.model, cfg.seed)
    builders = [BatchBuilder.from_config(cfg, tok, rank=r, world_size=N) for r in range(workers)]
    opt = _inner(cfg, model)
    start = time.monotonic()
    for step in range(setup.steps):
        _set_lr(cfg, opt, step)
        opt.zero_grad(set_to_none=True)
        for b in builders:
            (compose_loss(model, b.next_batch()).lm_ce / workers).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        opt.step()
    wall = time.monotonic() - start
    p_bytes = 4 * count_parameters(model)
    per_step = N * (p_bytes + p_bytes / N + 2 * p_bytes * (N - 1) / N) if workers > 1 else 0.0
    return {"eval_loss": eval_loss(model, builders[0]), "exchanges": setup.steps if workers > 1 else 0,
            "bytes_moved": per_step * setup.steps, "bytes_measured": False, "wall_s": wall}


def run_diloco(setup: Setup, sync_every: int, rounds: int, extra: list[str], root: Path, name: str) -> dict[str, Any]:
    """N replicas of the real replica code in threads over a file:// store; returns eval, bytes, timings."""
    cfg = _config(setup, [f"run_id={name}", f"rounds={rounds}", f"inner.sync_every={sync_every}", *extra])
    store, _ = create_run(f"file://{root}", cfg)
    trainers = [ReplicaTrainer.from_run(store.url, r) for r in range(N)]
    errors: list[BaseException] = []

    def work(t: ReplicaTrainer) -> None:
        try:
            t.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
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


def print_tables(res: dict[str, Any]) -> None:
    s = res["setup"]
    print(f"\nConvergence: tiny Qwen2 ({res['params']:,} params), N={N}, T={s['steps']} inner steps, "
          f"global batch {N * s['batch']}x{s['seq_len']} tokens/step, H={s['sync_every']}")
    print(f"{'config':<24}{'eval loss':>10}{'vs (a)':>9}{'exchanges':>11}{'bytes moved':>14}{'wall s':>9}")
    base = res["runs"]["a_sync_dp"]["eval_loss"]
    for key, label in (("a_sync_dp", "(a) sync DP"), ("b_diloco_fp32", "(b) DiLoCo fp32"),
                       ("c_diloco_int8", "(c) DiLoCo int8+EF"), ("d_single_quarter", "(d) 1 replica, b/4")):
        r = res["runs"][key]
        star = "" if r["bytes_measured"] else "*"
        print(f"{label:<24}{r['eval_loss']:>10.4f}{r['eval_loss'] / base:>8.4f}x{r['exchanges']:>11}"
              f"{_fmt_bytes(r['bytes_moved']) + star:>14}{r['wall_s']:>9.1f}")
    print("* (a): bytes the store exchange would move if it ran every step (analytic); (b), (c): measured")
    print(f"\nUtilization (share of replica wall time in inner steps), H=100, N={N}, fp32, "
          f"{s['util_rounds']} rounds:")
    print(f"{'fragment_sync_delay':<22}{'utilization':>12}{'wait s/round':>14}{'exchange s':>12}")
    for key in ("util_no_delay", "util_delay"):
        u = res["utilization"][key]
        print(f"{u['delay']:<22}{u['utilization'] * 100:>11.1f}%{u['mean_wait_s_per_round']:>14.3f}"
              f"{u['mean_exchange_s']:>12.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small T (< 5 min on 2 idle cores)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    rounds = setup.steps // setup.sync_every
    res: dict[str, Any] = {"mode": "quick" if args.quick else "full", "setup": asdict(setup), "runs": {},
                           "utilization": {}, "torch_threads": torch.get_num_threads()}
    res["params"] = count_parameters(build_model(_config(setup, []).model, 0)[0])
    with tempfile.TemporaryDirectory(prefix="diloco-conv-") as tmp:
        root = Path(tmp)
        jobs = {
            "a_sync_dp": lambda: run_sync_dp(setup, N),
            "d_single_quarter": lambda: run_sync_dp(setup, 1),
            "b_diloco_fp32": lambda: run_diloco(setup, setup.sync_every, rounds, [], root, "b"),
            "c_diloco_int8": lambda: run_diloco(setup, setup.sync_every, rounds,
                                                ['exchange.codec="int8"', "exchange.error_feedback=true"], root, "c"),
        }
        for key, job in jobs.items():
            res["runs"][key] = job()
            print(f"{key}: {json.dumps(res['runs'][key])}", flush=True)
        for key, delay in (("util_no_delay", 0), ("util_delay", setup.util_delay)):
            u = run_diloco(setup, 100, setup.util_rounds, [f"exchange.fragment_sync_delay={delay}"], root, key)
            res["utilization"][key] = {"delay": delay, **u}
            print(f"{key}: {json.dumps(res['utilization'][key])}", flush=True)
    print_tables(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
