"""DiLoCo against sync DP at equal tokens, round by round, on a wider Qwen2 (issue 36, item 4).

Run (from the repo root, venv active; losses only, deterministic, CPU, one thread per process):

    # sync DP at equal tokens (evaluated every 30 steps; the JSON is rewritten after every evaluation)
    python benchmarks/scaling_rounds.py --replicas 4 --steps 300 --hidden 320 --layers 8 --arm dp \\
        --out benchmarks/results/scaling12m_T300_dp.json
    # more outer settings at H = 30 (one JSON per arm; arms can run in parallel processes)
    python benchmarks/scaling_rounds.py --replicas 4 --steps 300 --hidden 320 --layers 8 \\
        --arm h30:0.7,0.9n --out benchmarks/results/scaling12m_T300_nesterov.json
    # the product's auto H with overlap (outer.delay = 1), fed a stated compute / exchange time
    python benchmarks/scaling_rounds.py --replicas 4 --steps 300 --hidden 320 --layers 8 \\
        --arm auto:1.0,0 --delay 1 --compute-ms 74 --exchange-ms 663 --out benchmarks/results/scaling12m_T300_auto.json
    # the round-by-round table of everything above against the DP curve
    python benchmarks/scaling_rounds.py --report benchmarks/results/scaling12m_T300_dp.json \\
        benchmarks/results/scaling12m_T300_nesterov.json benchmarks/results/scaling12m_T300_auto.json

The arithmetic is ``outer_sweep.py``'s (its ``Sim``, ``run_dp`` and ``run_diloco``: the same model, data,
inner AdamW and lr schedule, outer SGD on fp32 global parameters). What this script adds:

* ``--arm auto:<outer>``: the H sequence the product's ``inner.sync_every = "auto"`` would train when every
  round measures the same compute per inner step and exchange time (``--compute-ms``, ``--exchange-ms``):
  rank 0's rule (``trainer.sync_every.AutoSyncEvery``, bounds 4..128) with the product's timing of
  decisions (``trainer/round_plan.py``): the first rounds train the first H (8, as ``"auto"``), round
  r + 2's H is decided at the end of round r from the timings measured so far, and with ``--delay 1`` a
  round's exchange is measured one round later (round 0 has none). The last round is cut at T.
* ``--arm dp``: ``outer_sweep.run_dp``'s loop, and every arm's JSON is rewritten after each evaluation, so
  a run stopped early keeps the rounds it reached (with a constant inner lr after the warmup, the product
  default, they are the first rounds of any longer run).
* ``--report``: the loss of every arm at each round boundary that is also a DP eval step, next to DP's,
  and the gap, so the trend with the number of rounds shows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import outer_sweep as sweep  # noqa: E402  (benchmark-local module next to this one)

FIRST_H = 8  # inner.sync_every = "auto" starts with H = 8 (config.AUTO_SYNC_INITIAL)


def auto_plan(steps: int, compute_s: float, exchange_s: float, *, overlap: bool, first: int = FIRST_H,
              lo: int = 4, hi: int = 128) -> list[tuple[int, str]]:
    """(H, reason) of every round the product's auto rule would run over ``steps`` inner steps when each
    round measures ``compute_s`` per inner step and an exchange of ``exchange_s``."""
    from diloco_serverless.trainer.sync_every import AutoSyncEvery

    rule = AutoSyncEvery(overlap=overlap, lo=lo, hi=hi)
    plans: list[tuple[int, str]] = []
    timed_at_end: list[bool] = []  # whether any round's timings were known at the end of round r
    done, r, measured, current = 0, 0, False, first
    while done < steps:
        if r < 2:
            h, reason = first, "initial"
        elif timed_at_end[r - 2]:  # decided at the end of round r - 2 from the timings measured by then
            h, reason = rule.decide(current, measured_before=measured)
            measured = True
        else:
            h, reason = current, "kept"
        current = h
        plans.append((min(h, steps - done), reason))
        done += plans[-1][0]
        # the end of round r: its own exchange (no overlap) or round r - 1's (overlap; round 0 has none)
        if not overlap or r >= 1:
            rule.observe(compute_s, exchange_s)
        timed_at_end.append(rule.timings() is not None)
        r += 1
    return plans


def run_diloco_plan(sim: sweep.Sim, replicas: int, plan: list[int], outer: sweep.Outer, delay: int, *,
                    eager: float = 1.0, on_eval: Callable[[list[tuple[int, float]]], None] | None = None,
                    ) -> list[tuple[int, float]]:
    """``outer_sweep.run_diloco`` with round r training ``plan[r]`` inner steps (variable H); the global
    model's loss at every round boundary (``on_eval`` gets the curve so far after each)."""
    steps = sum(plan)
    reps = [sim.fresh(r) for r in range(replicas)]
    names = [n for n, p in reps[0][0].named_parameters() if p.requires_grad]
    glob = {n: p.detach().to(torch.float32).clone().requires_grad_(True)
            for n, p in reps[0][0].named_parameters() if p.requires_grad}
    opt_outer = torch.optim.SGD(list(glob.values()), lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)
    starts = [{n: glob[n].detach().clone() for n in names} for _ in reps]
    previous = {n: torch.zeros_like(t) for n, t in glob.items()}
    evaluator = sim.fresh(0)[0]
    curve: list[tuple[int, float]] = []

    def outer_step(avg: dict[str, torch.Tensor]) -> None:
        for n, t in glob.items():
            t.grad = avg[n].clone()
        opt_outer.step()
        opt_outer.zero_grad()

    done = 0
    for r, h in enumerate(plan):
        progress = []
        for (model, opt, data), start in zip(reps, starts):
            params = dict(model.named_parameters())
            for i in range(h):
                for g in opt.param_groups:
                    g["lr"] = sim.cfg.inner.lr_at(done + i, steps)
                opt.zero_grad(set_to_none=True)
                sim.loss_grad(model, data)
                torch.nn.utils.clip_grad_norm_(model.parameters(), sim.cfg.inner.grad_clip, foreach=True)
                opt.step()
            progress.append({n: start[n] - params[n].detach().float() for n in names})
        done += h
        mean = {n: torch.stack([pg[n] for pg in progress]).mean(0) for n in names}
        if delay:
            outer_step(previous)
            previous = mean
        else:
            outer_step(mean)
        for (model, _, _), start, pg in zip(reps, starts, progress):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(glob[n] - eager * pg[n] if delay else glob[n])
                    start[n] = p.detach().float().clone()
        if delay and r == len(plan) - 1:
            outer_step(previous)
        with torch.no_grad():
            for n, p in evaluator.named_parameters():
                p.copy_(glob[n])
        curve.append((done, sim.evaluate(evaluator)))
        print(f"  round {r:>3}  H {h:>3}  step {done:>4}  loss {curve[-1][1]:.4f}", flush=True)
        if on_eval is not None:
            on_eval(curve)
    return curve


def run_dp_rounds(sim: sweep.Sim, replicas: int, steps: int, every: int, *,
                  on_eval: Callable[[list[tuple[int, float]]], None] | None = None) -> list[tuple[int, float]]:
    """``outer_sweep.run_dp`` (sync DP: the gradients of ``replicas`` batches averaged every step), calling
    ``on_eval`` with the curve so far after each evaluation (every ``every`` steps)."""
    model, opt, _ = sim.fresh(0)
    datas = [sim.fresh(r)[2] for r in range(replicas)]
    params = [p for p in model.parameters() if p.requires_grad]
    curve: list[tuple[int, float]] = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = sim.cfg.inner.lr_at(step, steps)
        grads = []
        for data in datas:
            opt.zero_grad(set_to_none=True)
            sim.loss_grad(model, data)
            grads.append([p.grad.detach().clone() for p in params])
        for i, p in enumerate(params):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        torch.nn.utils.clip_grad_norm_(params, sim.cfg.inner.grad_clip, foreach=True)
        opt.step()
        if (step + 1) % every == 0:
            curve.append((step + 1, sim.evaluate(model)))
            print(f"  DP step {step + 1:>4}  loss {curve[-1][1]:.4f}", flush=True)
            if on_eval is not None:
                on_eval(curve)
    return curve


def run_arm(args: argparse.Namespace) -> int:
    kind, _, outer_text = args.arm.partition(":")
    outer = sweep.Outer.parse(outer_text) if kind != "dp" else None
    sweep.resize_tiny_preset(args.hidden, args.layers)
    torch.set_num_threads(1)
    t0 = time.monotonic()
    plans: list[tuple[int, str]] = []
    if kind == "auto":
        plans = auto_plan(args.steps, args.compute_ms / 1000, args.exchange_ms / 1000, overlap=bool(args.delay))
        plan = [h for h, _ in plans]
        print(f"auto H plan (compute {args.compute_ms} ms/step, exchange {args.exchange_ms} ms, "
              f"overlap {bool(args.delay)}): {plans}", flush=True)
    elif kind == "dp" or (kind.startswith("h") and kind[1:].isdigit()):
        h = args.eval_every if kind == "dp" else int(kind[1:])
        if args.steps % h:
            raise SystemExit(f"--steps {args.steps} is not a multiple of {h}; pick T = k x {h}")
        plan = [h] * (args.steps // h)
    else:
        raise SystemExit(f"--arm {args.arm!r}: expected 'dp', 'auto:<lr,momentum[n]>' or 'h<H>:<lr,momentum[n]>'")
    sim = sweep.Sim(args.replicas, plan[0], args.steps)
    from diloco_serverless.trainer.model import count_parameters

    params = count_parameters(sim.base)
    print(f"model: {params:,} parameters; arm {args.arm}, delay {args.delay}, N {args.replicas}, T {args.steps}; "
          f"inner lr {sim.cfg.inner.lr:g}, warmup {sim.cfg.inner.warmup_steps}, schedule {sim.cfg.inner.schedule}",
          flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(curve: list[tuple[int, float]]) -> None:  # after every evaluation: a stopped run keeps its rounds
        out = {"replicas": args.replicas, "steps": args.steps, "parameters": params, "arm": args.arm,
               "outer": None if outer is None else str(outer), "delay": args.delay,
               "eager": args.eager if args.delay else None, "plan": plan, "reasons": [r for _, r in plans],
               "compute_ms": args.compute_ms if kind == "auto" else None,
               "exchange_ms": args.exchange_ms if kind == "auto" else None,
               "inner": {"lr": sim.cfg.inner.lr, "warmup_steps": sim.cfg.inner.warmup_steps,
                         "schedule": sim.cfg.inner.schedule},
               "curve": curve, "seconds": time.monotonic() - t0}
        args.out.write_text(json.dumps(out, indent=1) + "\n")

    if outer is None:
        run_dp_rounds(sim, args.replicas, args.steps, plan[0], on_eval=save)
    else:
        run_diloco_plan(sim, args.replicas, plan, outer, args.delay, eager=args.eager, on_eval=save)
    print(f"wrote {args.out} ({time.monotonic() - t0:.0f} s)")
    return 0


def report(paths: list[Path], replicas: int) -> int:
    """The round-by-round table: every arm's loss at the DP eval steps, and its gap to DP."""
    dp: list[tuple[int, float]] | None = None
    arms: list[tuple[str, dict[int, float], list[int]]] = []
    for path in paths:
        data = json.loads(path.read_text())
        if "rows" in data:  # an outer_sweep.py JSON: its DP curve and its arms
            for row in (r for r in data["rows"] if r["replicas"] == replicas):
                dp = dp or [(int(s), float(v)) for s, v in row["dp_curve"]]
                label = f"H{row['sync_every']} {row['outer']}" + (" d1" if row["delay"] else "")
                arms.append((label, {int(s): float(v) for s, v in row["curve"]},
                             [row["sync_every"]] * (data["steps"] // row["sync_every"])))
        elif data["replicas"] != replicas:
            continue
        elif data["arm"] == "dp":
            dp = [(int(st), float(v)) for st, v in data["curve"]]
        else:
            kind = data["arm"].partition(":")[0]
            label = f"{'auto' if kind == 'auto' else 'H' + kind[1:]} {data['outer']}" + \
                (" d1" if data["delay"] else "")
            arms.append((label, {int(s): float(v) for s, v in data["curve"]}, data["plan"]))
    if dp is None:
        raise SystemExit("--report needs an outer_sweep.py JSON (the DP curve) among its files")
    width = max(12, *(len(a[0]) for a in arms))
    print(f"{'step':>5} {'DP':>7}  " + "  ".join(f"{a[0]:>{width}}" for a in arms))
    for step, dp_loss in dp:
        cells = []
        for _, curve, _ in arms:
            cells.append(f"{curve[step]:.4f} {100 * (curve[step] / dp_loss - 1):+6.2f}%" if step in curve else "-")
        print(f"{step:>5} {dp_loss:>7.4f}  " + "  ".join(f"{c:>{width}}" for c in cells))
    for label, _, plan in arms:
        print(f"{label}: H per round {plan}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--report", type=Path, nargs="+", default=None,
                        help="print the round-by-round table of these JSONs at --replicas (one holding a DP curve: "
                             "a 'dp' arm or an outer_sweep.py JSON) and exit")
    parser.add_argument("--arm", default="h30:1.0,0",
                        help="'dp' (sync DP), 'h<H>:<outer>' (fixed H) or 'auto:<outer>' (the product's auto H); "
                             "outer as 'lr,momentum' with an 'n' suffix for Nesterov, e.g. h30:0.7,0.9n")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=30, help="dp: evaluate every this many steps")
    parser.add_argument("--steps", type=int, default=300, help="T: inner steps per replica (equal tokens)")
    parser.add_argument("--delay", type=int, default=0, choices=(0, 1), help="1: outer.delay = 1 (overlap)")
    parser.add_argument("--eager", type=float, default=1.0, help="with --delay 1: as outer_sweep.py --eager")
    parser.add_argument("--compute-ms", type=float, default=74.0,
                        help="auto: compute per inner step each round measures (ms)")
    parser.add_argument("--exchange-ms", type=float, default=663.0, help="auto: exchange time each round measures (ms)")
    parser.add_argument("--hidden", type=int, default=None, help="as outer_sweep.py --hidden")
    parser.add_argument("--layers", type=int, default=None, help="as outer_sweep.py --layers")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results") / "scaling_rounds.json")
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report, args.replicas)
    return run_arm(args)


if __name__ == "__main__":
    sys.exit(main())
