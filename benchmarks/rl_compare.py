"""DiLoCo-GRPO against synchronous GRPO on the toy letter task, through the same emulated store (issue 34).

Run (from the repo root, venv active; ``python benchmarks/rl.py --compare ...`` runs the same):

    python benchmarks/rl_compare.py                      # N=4, H=8, T=64 inner steps, s3-standard emulation
    python benchmarks/rl_compare.py --steps 96           # a longer budget
    python benchmarks/rl_compare.py --backend file --replicas 2 --steps 4 --sync-every 2   # smoke run

Prints a table and writes benchmarks/results/rl_compare.json.

Both arms run ``examples/grpo_toy.toml`` (the tiny random Qwen2, prompts ``"bbbbb"``, reward
``letter_fraction``, 4 prompts x G=8 completions of at most 8 tokens per inner step, AdamW at the example's
inner lr) on N replicas for T inner steps each, so they sample the same number of rollouts; every replica
reads its own shard of the prompts and samples from its current parameters (on-policy):

  (a) sync GRPO   N spawned processes, in this file; every inner step each samples and scores its rollouts
                  and computes its GRPO gradient (the product's ``RLSteps`` and ``compose_loss``), then the
                  gradient is averaged through the store with the product's exchange primitive used once per
                  step (``ObjectStoreAllReduce.allreduce``, as benchmarks/time_to_loss.py's sync DP arm does),
                  clipped, and AdamW steps: every replica holds the same parameters at every step.
  (b) DiLoCo-GRPO the product: ``launch()`` on the local executor (N replica processes, the real
                  ``ReplicaTrainer``), H inner GRPO steps per round then the pseudo-gradient exchange and the
                  outer step with the product's defaults for N and H (``config.outer_defaults``).

Both evaluate the global model every H steps on rank 0, inside the timed loop, with the product's RL
evaluation (``RLSteps.eval_losses``: G completions of each held-out prompt, sampled with fixed seeds; the
eval reward is minus the eval loss). Wall time counts from the first inner step (process start, model build
excluded), as in time_to_loss.py. Reported per arm: the eval-reward curve (per round) and the training
reward curve (the mean reward of the rollouts, per inner step for (a), per round for (b), averaged over the
replicas), the wall time to (a)'s final eval reward (the threshold), exchange bytes (up + down, all replicas),
and the split of each replica's time into generation (sampling + rewards + batching), training
(forward/backward/optimizer, evaluation included) and exchange (blocked on the store).

(b) trains ``--diloco-factor`` K x T inner steps (default 2; the inner lr is constant after the warmup, so
its first T steps are the equal-rollout run), so that the table also says when it reaches (a)'s final reward
when that takes more than T steps; every equal-rollout number of (b) (bytes, time split, reward gain) is read
from its first T steps.

Targets: each arm's mean reward rises from its initial value by at least half of the possible gain (the best
reward is 1.0) within the budget, and (b) reaches (a)'s final eval reward in <= 0.7x (a)'s wall time.
Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from time_to_loss import (  # noqa: E402  (benchmarks/ on the path, as when run as a script)
    ROUND_TRIPS,
    RUN_ENV,
    StoreSite,
    _compute_share,
    _digest,
    _environ,
    open_site,
)

from support.store_presets import PRESETS, preset  # noqa: E402  (tests/ on the path through time_to_loss)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "grpo_toy.toml"
DATA = REPO / "examples" / "grpo_toy.jsonl"
RESULTS = Path(__file__).with_name("results") / "rl_compare.json"
BEST_REWARD = 1.0  # letter_fraction's maximum
OTHER_THRESHOLDS = (0.5, 0.9)  # eval rewards also reported (0.5: half the possible gain)


@dataclass(frozen=True)
class Setup:
    replicas: int = 4
    steps: int = 64  # T: inner steps per replica, both arms
    sync_every: int = 8  # H of (b); both arms evaluate every H steps
    poll_interval_s: float = 0.05
    extra: tuple[str, ...] = ()  # --set overrides for both arms
    diloco_factor: int = 2  # (b) trains diloco_factor x T steps; its equal-rollout results are read at step T

    def overrides(self, steps: int | None = None) -> list[str]:
        """RunConfig overrides on top of examples/grpo_toy.toml (both arms read the same config); ``steps``
        sets the run's length in inner steps (default T)."""
        steps = self.steps if steps is None else steps
        return [f"replicas={self.replicas}", "seed=0", f"data.source={json.dumps(str(DATA))}",
                f"inner.sync_every={self.sync_every}", f"rounds={steps // self.sync_every}", "eval_every=1",
                "checkpoint_every=0", f"exchange.poll_interval_s={self.poll_interval_s}",
                "exchange.straggler_timeout_s=600", "exchange.round_timeout_s=1200", "exchange.keep_rounds=2",
                *self.extra]  # fmt: skip


def load_config(setup: Setup) -> Any:
    from diloco_serverless.config import RunConfig

    return RunConfig.load(EXAMPLE, setup.overrides())


# ------------------------------------------------------------------------------------ (a) sync GRPO
@dataclass
class SyncResult:
    rank: int
    eval_curve: list[tuple[float, int, float]] = field(default_factory=list)  # (s, step, eval reward), rank 0
    train_rewards: list[float] = field(default_factory=list)  # the rollouts' mean reward, per inner step
    wall_s: float = 0.0
    generation_s: float = 0.0  # next_batch: prompts, sampling, rewards, advantages
    train_s: float = 0.0  # forward/backward, clip, AdamW step, evaluation
    exchange_s: float = 0.0  # blocked in allreduce
    bytes_up: int = 0
    bytes_down: int = 0
    init_digest: str = ""
    error: str | None = None


def sync_worker(rank: int, setup: Setup, url: str, run_id: str, barrier: Any, queue: Any) -> None:
    """One synchronous GRPO replica: every step its GRPO gradient is averaged through the store."""
    out = SyncResult(rank)
    try:
        import torch

        from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
        from diloco_serverless.loss import compose_loss
        from diloco_serverless.trainer.model import build_model
        from diloco_serverless.trainer.steps import make_steps
        from support.store_emulator import client_options

        torch.set_num_threads(1)
        cfg = load_config(setup)
        model, tok = build_model(cfg.model, cfg.seed)
        out.init_digest = _digest(model.named_parameters())
        steps = make_steps(cfg, tok, model, rank=rank, ref_model=None, device=torch.device("cpu"),
                           storage_options=None)  # fmt: skip
        params = [p for p in model.parameters() if p.requires_grad]
        inner = cfg.inner
        opt = torch.optim.AdamW(params, lr=inner.lr, betas=inner.betas, weight_decay=inner.weight_decay, fused=True)
        kwargs = {**cfg.loss.compose_kwargs(), **steps.loss_kwargs()}
        options = client_options(rank) if url.startswith("s3://") else None  # the emulator's per-replica NIC
        ar = ObjectStoreAllReduce(url, rank, setup.replicas, run_id=run_id, keep_rounds=2, storage_options=options,
                                  poll_interval_s=setup.poll_interval_s, straggler_timeout_s=600, timeout_s=1200,
                                  topology=cfg.exchange.topology)  # fmt: skip
        model.train()
        barrier.wait()
        t0 = time.monotonic()
        for step in range(setup.steps):
            for group in opt.param_groups:
                group["lr"] = inner.lr_at(step, setup.steps)
            t = time.monotonic()
            batch = steps.next_batch()
            t_gen = time.monotonic()
            out.generation_s += t_gen - t
            opt.zero_grad(set_to_none=True)
            comps = compose_loss(model, batch, **kwargs)
            comps.total.backward()  # type: ignore[no-untyped-call]
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
            t_ex = time.monotonic()
            mean = ar.allreduce(flat)
            t_done = time.monotonic()
            out.exchange_s += t_done - t_ex
            stats = ar.last_stats
            if stats is not None:
                out.bytes_up += stats.bytes_up
                out.bytes_down += stats.bytes_down
            offset = 0
            for p in params:
                p.grad.copy_(mean[offset : offset + p.numel()].view_as(p))  # type: ignore[union-attr]
                offset += p.numel()
            if inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, inner.grad_clip, foreach=True)
            opt.step()
            steps.after_step(comps)
            out.train_rewards.append(steps.round_metrics(1.0).get("reward_mean", float("nan")))
            if rank == 0 and (step + 1) % setup.sync_every == 0:
                model.eval()
                with torch.no_grad():
                    losses = list(steps.eval_losses(model))
                model.train()
                out.eval_curve.append((time.monotonic() - t0, step + 1, -sum(losses) / max(1, len(losses))))
            out.train_s += (time.monotonic() - t_gen) - (t_done - t_ex)
        out.wall_s = time.monotonic() - t0
        ar.close()
        steps.data.close()
    except BaseException as exc:  # reported to the parent, which says which rank failed and why
        out.error = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):
            barrier.abort()
    queue.put(asdict(out))


def run_sync(setup: Setup, site: StoreSite) -> dict[str, Any]:
    """(a): N spawned processes; rank 0's eval curve, the replicas' mean training reward per step, summed bytes."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(setup.replicas), ctx.Queue()
    run_id = f"sync-grpo-{uuid.uuid4().hex[:6]}"
    site.reset()
    with _environ({**RUN_ENV, **site.env}):
        procs = [ctx.Process(target=sync_worker, args=(r, setup, site.url, run_id, barrier, queue))
                 for r in range(setup.replicas)]  # fmt: skip
        for p in procs:
            p.start()
        results = [queue.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    failed = [r for r in results if r["error"]]
    if failed:
        raise RuntimeError("sync GRPO failed: " + "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed))
    results.sort(key=lambda r: r["rank"])
    n = len(results)
    per_step = [sum(r["train_rewards"][i] for r in results) / n for i in range(setup.steps)]
    return {"eval_curve": [tuple(c) for c in results[0]["eval_curve"]], "train_reward_per_step": per_step,
            "train_reward_per_round": _per_round(per_step, setup.sync_every),
            "wall_s": max(r["wall_s"] for r in results), "steps": setup.steps, "exchanges": setup.steps,
            "bytes_up": sum(r["bytes_up"] for r in results), "bytes_down": sum(r["bytes_down"] for r in results),
            "split_s": {k: sum(r[k] for r in results) / n for k in ("generation_s", "train_s", "exchange_s")},
            "init_digests": sorted({r["init_digest"] for r in results}), "store": site.snapshot()}  # fmt: skip


def _per_round(values: list[float], h: int) -> list[float]:
    return [sum(values[i : i + h]) / len(values[i : i + h]) for i in range(0, len(values), h)]


# ------------------------------------------------------------------------------------ (b) DiLoCo-GRPO
def run_diloco(setup: Setup, site: StoreSite, work: Path) -> dict[str, Any]:
    """(b): the product, ``launch()`` of the example config on the local executor; curves from the run's metrics."""
    from safetensors.torch import load as st_load

    from diloco_serverless.launcher.api import launch
    from diloco_serverless.store.objectstore import ObjectStore
    from diloco_serverless.trainer.checkpoint import INITIAL_KEY

    run_id = f"diloco-grpo-{uuid.uuid4().hex[:6]}"
    site.reset()
    env = {**RUN_ENV, **site.env, "XDG_CACHE_HOME": str(work / "xdg-cache")}
    with _environ(env):
        steps = setup.steps * setup.diloco_factor
        run = launch(EXAMPLE, "local", overrides=setup.overrides(steps), store=site.url, run_id=run_id)
        try:
            status = run.wait(poll_interval_s=1.0, timeout_s=3600)
        except BaseException:
            with contextlib.suppress(Exception):
                run.cancel()
            raise
        metrics = run.metrics()
        initial = st_load(ObjectStore(run.url).get(INITIAL_KEY))
    store = site.snapshot()
    # each replica's first inner step: its round-0 record's time less the round's wall time (as time_to_loss.py)
    starts = [recs[0]["time"] - recs[0]["wall_s"] for rank, recs in metrics.items() if rank != 0 and recs]
    start = min(starts or [metrics[0][0]["time"] - metrics[0][0]["wall_s"]])
    eval_curve = [(m["time"] - start, (m["round"] + 1) * setup.sync_every, -float(m["eval_loss"]))
                  for m in metrics.get(0, []) if "eval_loss" in m]  # fmt: skip
    recs = [m for ms in metrics.values() for m in ms]
    rounds = steps // setup.sync_every
    per_round = []
    for r in range(rounds):
        vals = [m["reward_mean"] for m in recs if m["round"] == r and "reward_mean" in m]
        per_round.append(sum(vals) / len(vals) if vals else float("nan"))
    n = max(1, len(metrics))
    equal = [m for m in recs if m["round"] < setup.steps // setup.sync_every]  # the first T steps: equal rollouts
    gen = sum(m.get("generation_s", 0.0) + m.get("reward_s", 0.0) for m in equal) / n
    inner = sum(m.get("inner_s", 0.0) for m in equal) / n
    wall = max(m["time"] for m in equal) - start
    outer = load_config(setup).outer.model_dump()  # the product's outer step for N and H (config.outer_defaults)
    return {"eval_curve": eval_curve, "train_reward_per_round": per_round, "wall_s": wall, "state": str(status.state),
            "wall_s_all": max(m["time"] for m in recs) - start, "steps_run": steps, "steps": setup.steps,
            "exchanges": setup.steps // setup.sync_every, "overrides": setup.overrides(steps),
            "outer": {k: v for k, v in outer.items() if k in ("lr", "momentum", "nesterov")},
            "bytes_up": sum(m.get("bytes_up", 0) for m in equal),
            "bytes_down": sum(m.get("bytes_down", 0) for m in equal),
            "split_s": {"generation_s": gen, "train_s": inner - gen,
                        "exchange_s": sum(m.get("wait_s", 0.0) for m in equal) / n},
            **_compute_share(metrics), "init_digests": [_digest(initial.items())], "store": store}  # fmt: skip


# ------------------------------------------------------------------------------------ analysis and report
def time_to(curve: list[tuple[float, int, float]], target: float) -> tuple[float, int] | None:
    """(seconds, steps) of the first evaluation at or above ``target`` reward; None if never."""
    for t, step, reward in curve:
        if reward >= target - 1e-9:
            return t, step
    return None


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    a, b = res["arms"]["a_sync_grpo"], res["arms"]["b_diloco_grpo"]
    target = a["eval_curve"][-1][2]
    a_hit, b_hit = time_to(a["eval_curve"], target), time_to(b["eval_curve"], target)
    ratio = b_hit[0] / a_hit[0] if a_hit and b_hit else None
    out: dict[str, Any] = {"threshold": target, "a_time_to": a_hit, "b_time_to": b_hit, "b_over_a_wall": ratio,
                           "target_wall": {"max": 0.7, "met": ratio is not None and ratio <= 0.7}}  # fmt: skip
    # (a)'s floor: its steps at (b)'s compute per inner step plus ROUND_TRIPS sequential first bytes each, i.e. a
    # store and proxy that take no CPU from the replicas (on 2 cores they do) and an exchange at its latency floor
    per_step = None
    if res["preset"] is not None:
        per_step = b["compute_s_per_step"] + ROUND_TRIPS * res["preset"]["first_byte_ms"] / 1000 / res["scale"]
        out["a_floor_s_per_step"] = per_step
    out["b_over_a_floor"] = b_hit[0] / (a_hit[1] * per_step) if per_step and a_hit and b_hit else None
    # (a)'s final reward can be the task's maximum, where one eval's noise decides; lower thresholds too
    out["other_thresholds"] = []
    for level in OTHER_THRESHOLDS:
        a_at, b_at = time_to(a["eval_curve"], level), time_to(b["eval_curve"], level)
        out["other_thresholds"].append({"threshold": level, "a_time_to": a_at, "b_time_to": b_at,
                                        "b_over_a_wall": b_at[0] / a_at[0] if a_at and b_at else None,
                                        "b_over_a_floor": b_at[0] / (a_at[1] * per_step)
                                        if per_step and a_at and b_at else None})  # fmt: skip
    rounds_t = res["setup"]["steps"] // res["setup"]["sync_every"]
    for key, arm in (("a", a), ("b", b)):
        rewards = arm["train_reward_per_round"][:rounds_t]  # (b) at equal rollouts: its first T steps
        first, best_late = rewards[0], max(rewards[-2:])  # the last two rounds: one round is 32 prompts per rank
        gain = (rewards[-1] - first) / (BEST_REWARD - first)
        evals = [c[2] for c in arm["eval_curve"][:rounds_t]]
        out[f"{key}_reward_gain"] = {"first_round": first, "last_round": rewards[-1], "last_two_max": best_late,
                                     "share_of_possible_gain": gain, "met": gain >= 0.5,
                                     "eval_first": evals[0], "eval_last": evals[-1]}  # fmt: skip
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def print_table(res: dict[str, Any]) -> None:
    s, summ = res["setup"], res["summary"]
    a, b = res["arms"]["a_sync_grpo"], res["arms"]["b_diloco_grpo"]
    where = res["backend"] if res["preset"] is None else f"{res['preset']['name']} emulation (scale {res['scale']})"
    print(f"\nDiLoCo-GRPO vs synchronous GRPO: examples/grpo_toy.toml, tiny Qwen2 ({res['params']:,} params), "
          f"N={s['replicas']}, T={s['steps']} inner steps x 4 prompts x G=8 per replica (both arms), "
          f"H={s['sync_every']}, outer {b['outer']}, store: {where}")
    if b["steps_run"] > s["steps"]:
        print(f"(b) ran {b['steps_run']} steps ({b['steps_run'] // s['steps']}x T) to see when it reaches (a)'s final "
              f"reward; its equal-rollout results (MB, seconds, reward gain) are its first T steps")
    print(f"same init: {res['same_init']}; load average before/after: {res['machine']['load_avg']} / "
          f"{res['machine']['load_avg_after']}")
    print("\nreward per round (training rollouts, mean over replicas) and eval reward (global model, rank 0)")
    rounds = len(b["train_reward_per_round"])
    print(f"{'round':<10}" + "".join(f"{r:>7}" for r in range(rounds)))
    for label, arm in (("(a)", a), ("(b)", b)):
        print(f"{label + ' train':<10}" + "".join(f"{v:>7.3f}" for v in arm["train_reward_per_round"]))
        print(f"{label + ' eval':<10}" + "".join(f"{c[2]:>7.3f}" for c in arm["eval_curve"]))
        print(f"{label + ' at s':<10}" + "".join(f"{c[0]:>7.1f}" for c in arm["eval_curve"]))
    print(f"\nto (a)'s final eval reward {summ['threshold']:.3f}")
    print(f"{'arm':<16}{'wall s':>8}{'steps':>7}{'T-step s':>9}{'MB moved':>10}{'gen s':>8}{'train s':>9}"
          f"{'exch s':>8}{'gen %':>7}")
    for label, arm, hit in (("(a) sync GRPO", a, summ["a_time_to"]), ("(b) DiLoCo-GRPO", b, summ["b_time_to"])):
        sp = arm["split_s"]
        busy = sum(sp.values())
        hit_s = "-" if hit is None else f"{hit[0]:.1f}"
        hit_n = "-" if hit is None else str(hit[1])
        print(f"{label:<16}{hit_s:>8}{hit_n:>7}{arm['wall_s']:>9.1f}{_mb(arm['bytes_up'] + arm['bytes_down']):>10}"
              f"{sp['generation_s']:>8.1f}{sp['train_s']:>9.1f}{sp['exchange_s']:>8.1f}"
              f"{100 * sp['generation_s'] / busy:>6.1f}%")
    print(f"{'eval reward':<16}{'(a) wall s':>11}{'(a) steps':>10}{'(b) wall s':>11}{'(b) steps':>10}{'(b)/(a)':>9}"
          f"{'(b)/floor':>11}")  # fmt: skip
    rows = [{"threshold": summ["threshold"], "a_time_to": summ["a_time_to"], "b_time_to": summ["b_time_to"],
             "b_over_a_wall": summ["b_over_a_wall"], "b_over_a_floor": summ["b_over_a_floor"]},
            *summ["other_thresholds"]]  # fmt: skip
    for k, row in enumerate(rows):
        a_at, b_at, r, fl = row["a_time_to"], row["b_time_to"], row["b_over_a_wall"], row["b_over_a_floor"]
        name = f"{row['threshold']:.3f}" + (" (a) final" if k == 0 else "")
        print(f"{name:<16}{'-' if a_at is None else f'{a_at[0]:.1f}':>11}{'-' if a_at is None else a_at[1]:>10}"
              f"{'-' if b_at is None else f'{b_at[0]:.1f}':>11}{'-' if b_at is None else b_at[1]:>10}"
              f"{'-' if r is None else f'{r:.3f}x':>9}{'-' if fl is None else f'{fl:.3f}x':>11}")  # fmt: skip
    if summ.get("a_floor_s_per_step"):
        print(f"(a) floor: (a)'s steps to the threshold x {summ['a_floor_s_per_step']:.3f} s ((b)'s compute per inner "
              f"step + {ROUND_TRIPS} sequential first bytes): a store that costs the replicas no CPU")  # fmt: skip
    ratio = summ["b_over_a_wall"]
    print("(wall s/steps: to the threshold; T-step s, MB moved (up + down, all replicas) and gen/train/exch s (per "
          "replica; exch = blocked on the store): the first T steps)")
    print(f"target: (b) reaches (a)'s final eval reward in <= 0.7x (a)'s wall time: "
          f"{'-' if ratio is None else f'{ratio:.3f}x'} ({'met' if summ['target_wall']['met'] else 'NOT met'})")
    for key, label in (("a", "(a)"), ("b", "(b)")):
        g = summ[f"{key}_reward_gain"]
        print(f"target: {label} training reward rises by >= half the possible gain: round 0 {g['first_round']:.3f} -> "
              f"last round {g['last_round']:.3f} = {g['share_of_possible_gain']:.2f} of {BEST_REWARD:.0f} - "
              f"{g['first_round']:.3f} ({'met' if g['met'] else 'NOT met'}); eval {g['eval_first']:.3f} -> "
              f"{g['eval_last']:.3f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=Setup.replicas, help="N (default 4)")
    parser.add_argument("--steps", type=int, default=Setup.steps, help="T, inner steps per replica (a multiple of H)")
    parser.add_argument("--sync-every", type=int, default=Setup.sync_every, help="H of DiLoCo (default 8)")
    parser.add_argument("--backend", choices=("s3", "file"), default="s3")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="s3-standard")
    parser.add_argument("--scale", type=float, default=1.0, help="emulator time scale (1 = real time)")
    parser.add_argument("--arms", default="ab", help="a (sync GRPO), b (DiLoCo-GRPO) or ab")
    parser.add_argument("--set", action="append", default=[], metavar="K=V", dest="overrides",
                        help="RunConfig override for both arms, e.g. inner.lr=1e-3 (repeatable)")  # fmt: skip
    parser.add_argument("--diloco-factor", type=int, default=Setup.diloco_factor, metavar="K",
                        help="(b) trains K x T steps (constant inner lr after the warmup, so its first T steps are the "
                             "equal-rollout run) to see when it reaches (a)'s final reward (default 2)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.steps % args.sync_every:
        parser.error(f"--steps {args.steps} must be a multiple of --sync-every {args.sync_every}")
    args.setup = Setup(args.replicas, args.steps, args.sync_every, extra=tuple(args.overrides),
                       diloco_factor=args.diloco_factor)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup: Setup = args.setup
    from diloco_serverless.trainer.model import build_model, count_parameters

    store_preset = preset(args.preset)
    res: dict[str, Any] = {"setup": asdict(setup), "backend": args.backend, "scale": args.scale,
                           "preset": store_preset.to_json() if args.backend == "s3" else None,
                           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                       "load_avg": os.getloadavg()}, "arms": {}}  # fmt: skip
    cfg = load_config(setup)
    if setup.diloco_factor > 1 and cfg.inner.schedule != "constant":
        raise SystemExit(f"--diloco-factor {setup.diloco_factor} reads (b) at T steps from a longer run, which is the "
                         f"equal-rollout run only with inner.schedule = \"constant\" (got {cfg.inner.schedule!r}); "
                         "pass --diloco-factor 1")  # fmt: skip
    res["params"] = count_parameters(build_model(cfg.model, 0)[0])
    with tempfile.TemporaryDirectory(prefix="rl-compare-") as tmp, \
            open_site(args.backend, Path(tmp), store_preset, args.scale, 0) as site:  # fmt: skip
        if "a" in args.arms:
            res["arms"]["a_sync_grpo"] = run_sync(setup, site)
            print(f"a_sync_grpo: {json.dumps(res['arms']['a_sync_grpo'])}", flush=True)
        if "b" in args.arms:
            res["arms"]["b_diloco_grpo"] = run_diloco(setup, site, Path(tmp))
            print(f"b_diloco_grpo: {json.dumps(res['arms']['b_diloco_grpo'])}", flush=True)
    res["machine"]["load_avg_after"] = os.getloadavg()
    if len(res["arms"]) == 2:
        res["same_init"] = len({d for arm in res["arms"].values() for d in arm["init_digests"]}) == 1
        res["summary"] = summarize(res)
        print_table(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
