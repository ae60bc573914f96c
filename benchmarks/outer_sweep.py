"""Outer-step sweep: the outer lr and momentum that minimise loss at equal tokens, by (N, H) (issue 36, part 3).

Run (from the repo root, venv active):

    python benchmarks/outer_sweep.py                        # N in {2,4,8} x H in {16,32} x 5 outer settings
    python benchmarks/outer_sweep.py --replicas 4 --sync-every 16 32 --delay 0 1 --factor 2
    python benchmarks/outer_sweep.py --replicas 2 --sync-every 8 --grid 1.0,0 0.7,0.9n --steps 48   # smoke
    python benchmarks/outer_sweep.py --replicas 1 2 4 8 --sync-every 30 --steps 90 --grid 1.0,0 --hidden 256
        # the scaling-law table (DP against DiLoCo M = 1..8 at H = 30, equal tokens) on a wider Qwen2

Prints a table and writes benchmarks/results/outer_sweep.json.

Losses only, no store and no clock: DiLoCo's arithmetic in one process, replica after replica, on what
``benchmarks/time_to_loss.py`` trains (the tiny Qwen2 from seed 0, replica r reads rank r's shard of the
stdlib corpus through the product's ``BatchBuilder``, batch 4 x 96 tokens, LM loss only, the run's inner
AdamW, lr schedule and clipping). Each replica trains H inner steps from its start, its pseudo-gradient is
``start - local``, the mean over replicas goes through ``torch.optim.SGD(lr, momentum, nesterov)`` on fp32
global parameters, and every replica starts the next round from the new global parameters, as the product
does (``fragment_update_alpha = 0``). ``--delay 1`` is ``outer.delay = 1`` with ``outer.eager = true``
(trainer/overlap.py): round r's mean is applied at the end of round r+1 (the last one after the last round)
and each replica starts from the global parameters plus its own progress of the round before.

Sync DP at the same tokens is the reference: the gradient of N batches (one per rank's shard) averaged every
step, the same AdamW, clipped after averaging (as ``time_to_loss.py``'s arm a). The global model is
evaluated on the held-out batches every H steps; the table shows the loss at T steps per replica (equal
tokens), its gap to DP's, and the steps to reach DP's final loss (``--factor K`` lets DiLoCo train K x T).
Deterministic: the same numbers every run (CPU, one thread).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

RESULTS = Path(__file__).with_name("results") / "outer_sweep.json"
#: (outer lr, momentum, nesterov): plain averaging, larger steps, and damped Nesterov
DEFAULT_GRID = ("1.0,0", "1.3,0", "1.6,0", "0.8,0.5n", "1.0,0.5n")


@dataclass(frozen=True)
class Outer:
    lr: float
    momentum: float
    nesterov: bool

    @classmethod
    def parse(cls, text: str) -> Outer:
        lr, mom = text.split(",")
        nesterov = mom.endswith("n")
        return cls(float(lr), float(mom.rstrip("n")), nesterov)

    def __str__(self) -> str:
        return f"{self.lr:g},{self.momentum:g}{'n' if self.nesterov else ''}"


class Sim:
    """The model, tokenizer, data and loss of a run config, for N replicas in one process."""

    def __init__(self, replicas: int, sync_every: int, steps: int) -> None:
        from diloco_serverless.config import RunConfig
        from diloco_serverless.data.builder import BatchBuilder
        from diloco_serverless.loss import compose_loss
        from diloco_serverless.trainer.model import build_model

        self.cfg = RunConfig.load(None, [f"replicas={replicas}", "seed=0", "loss.alpha_sdpo=0", "loss.beta_replay=0",
                                         "data.batch_size=4", "data.seq_len=96", "data.eval_batches=6",
                                         f"inner.sync_every={sync_every}", f"rounds={max(1, steps // sync_every)}"])
        self.build_model, self.compose_loss, self.BatchBuilder = build_model, compose_loss, BatchBuilder
        self.base, self.tok = build_model(self.cfg.model, self.cfg.seed)
        self.kwargs = self.cfg.loss.compose_kwargs()
        self.eval_data = BatchBuilder.from_config(self.cfg, self.tok, rank=0)
        self.eval_batches = list(self.eval_data.eval_batches())

    def fresh(self, rank: int) -> tuple[Any, Any, Any]:
        import copy

        model = copy.deepcopy(self.base)
        opt = torch.optim.AdamW(model.parameters(), lr=self.cfg.inner.lr, betas=self.cfg.inner.betas,
                                weight_decay=self.cfg.inner.weight_decay, fused=True)
        return model, opt, self.BatchBuilder.from_config(self.cfg, self.tok, rank=rank)

    def loss_grad(self, model: Any, data: Any) -> None:
        self.compose_loss(model, data.next_batch(), **self.kwargs).total.backward()

    @torch.no_grad()
    def evaluate(self, model: Any) -> float:
        model.eval()
        losses = [float(self.compose_loss(model, b).lm_ce) for b in self.eval_batches]
        model.train()
        return sum(losses) / len(losses)


def run_dp(sim: Sim, replicas: int, steps: int, every: int) -> list[tuple[int, float]]:
    model, opt, _ = sim.fresh(0)
    datas = [sim.fresh(r)[2] for r in range(replicas)]
    params = [p for p in model.parameters() if p.requires_grad]
    curve = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = sim.cfg.inner.lr_at(step, steps)
        opt.zero_grad(set_to_none=True)
        grads = []
        for data in datas:
            opt.zero_grad(set_to_none=True)
            sim.loss_grad(model, data)
            grads.append([p.grad.detach().clone() for p in params])  # type: ignore[union-attr]
        for i, p in enumerate(params):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        torch.nn.utils.clip_grad_norm_(params, sim.cfg.inner.grad_clip, foreach=True)
        opt.step()
        if (step + 1) % every == 0:
            curve.append((step + 1, sim.evaluate(model)))
    return curve


def run_diloco(sim: Sim, replicas: int, h: int, steps: int, outer: Outer, delay: int, *,
               stop_below: float | None = None, min_steps: int = 0, eager: float = 1.0, tau: int = 0,
               merge: str = "replace") -> list[tuple[int, float]]:
    """The global model's eval curve; stops early once past ``min_steps`` at or below ``stop_below``.

    ``tau > 0`` is ``exchange.fragment_sync_delay = tau`` with one fragment: the pseudo-gradient is taken after
    ``H - tau`` steps (``global - local`` then) and the exchange overlaps the round's last ``tau`` steps; at the
    sync the replica becomes the new global parameters (``merge = "replace"``: the tau steps are discarded, as
    torchft with ``fragment_update_alpha = 0``) or the new global plus its own progress of those tau steps
    (``merge = "eager"``: ``exchange.fragment_merge = "eager"``, trainer/fragment_merge.py).
    """
    reps = [sim.fresh(r) for r in range(replicas)]
    names = [n for n, p in reps[0][0].named_parameters() if p.requires_grad]
    glob = {n: p.detach().to(torch.float32).clone().requires_grad_(True)
            for n, p in reps[0][0].named_parameters() if p.requires_grad}
    opt_outer = torch.optim.SGD(list(glob.values()), lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)
    starts = [{n: glob[n].detach().clone() for n in names} for _ in reps]
    previous = {n: torch.zeros_like(t) for n, t in glob.items()}
    evaluator = sim.fresh(0)[0]
    curve = []

    def outer_step(avg: dict[str, torch.Tensor]) -> None:
        for n, t in glob.items():
            t.grad = avg[n].clone()
        opt_outer.step()
        opt_outer.zero_grad()

    def evaluate() -> float:
        with torch.no_grad():
            for n, p in evaluator.named_parameters():
                p.copy_(glob[n])
        return sim.evaluate(evaluator)

    for r in range(steps // h):
        progress: list[dict[str, torch.Tensor]] = []
        offsets: list[dict[str, torch.Tensor]] = []
        for (model, opt, data), start in zip(reps, starts):
            params = dict(model.named_parameters())
            snap: dict[str, torch.Tensor] = {}
            for i in range(h):
                if tau and i == h - tau:  # prepare: the pseudo-gradient against the global parameters
                    progress.append({n: glob[n].detach() - params[n].detach().float() for n in names})
                    snap = {n: params[n].detach().clone() for n in names}
                step = r * h + i
                for g in opt.param_groups:
                    g["lr"] = sim.cfg.inner.lr_at(step, steps)
                opt.zero_grad(set_to_none=True)
                sim.loss_grad(model, data)
                torch.nn.utils.clip_grad_norm_(model.parameters(), sim.cfg.inner.grad_clip, foreach=True)
                opt.step()
            if tau:
                offsets.append({n: params[n].detach() - snap[n] for n in names})
            else:
                progress.append({n: start[n] - params[n].detach().float() for n in names})
        mean = {n: torch.stack([pg[n] for pg in progress]).mean(0) for n in names}
        if delay:
            outer_step(previous)
            previous = mean
        else:
            outer_step(mean)
        if tau:
            for (model, _, _), start, off in zip(reps, starts, offsets):
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(glob[n])
                        if merge == "eager":
                            p.add_(off[n])
                        start[n] = glob[n].detach().clone()
        for (model, _, _), start, pg in zip(reps, starts, [] if tau else progress):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(glob[n] - eager * pg[n] if delay else glob[n])
                    start[n] = p.detach().float().clone()
        if delay and r == steps // h - 1:
            outer_step(previous)  # the last round's mean, after the last round
        curve.append(((r + 1) * h, evaluate()))
        if stop_below is not None and curve[-1][0] >= min_steps and curve[-1][1] <= stop_below + 1e-9:
            break
    return curve


def steps_to(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((s for s, loss in curve if loss <= target + 1e-9), None)



def resize_tiny_preset(hidden: int | None, layers: int | None) -> None:
    """The tiny Qwen2 preset widened (``--hidden``: width, 4x MLP, a head per 32) and deepened
    (``--layers``) for this process only; shared by the benchmarks that take those flags."""
    from diloco_serverless.trainer import model as model_module

    if hidden:
        model_module.TINY_PRESET.update(hidden_size=hidden, intermediate_size=4 * hidden,
                                        num_attention_heads=max(1, hidden // 32),
                                        num_key_value_heads=max(1, hidden // 64))
    if layers:
        model_module.TINY_PRESET.update(num_hidden_layers=layers)

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--sync-every", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--steps", type=int, default=96, help="T: inner steps per replica at equal tokens")
    parser.add_argument("--factor", type=int, default=1, help="DiLoCo trains factor x T steps")
    parser.add_argument("--grid", nargs="+", default=list(DEFAULT_GRID),
                        help="outer settings 'lr,momentum' with an 'n' suffix for Nesterov, e.g. 0.7,0.9n")
    parser.add_argument("--delay", type=int, nargs="+", default=[0], choices=(0, 1))
    parser.add_argument("--eager", type=float, default=1.0,
                        help="with --delay 1: the weight of the replica's own progress in its next start "
                             "(1: outer.eager = true, 0: false)")
    parser.add_argument("--tau", type=int, nargs="+", default=[0],
                        help="exchange.fragment_sync_delay values (one fragment; with --delay 0 only)")
    parser.add_argument("--merge", nargs="+", default=["replace"], choices=("replace", "eager"),
                        help="with --tau > 0: exchange.fragment_merge (replace discards the tau steps, "
                             "eager keeps them)")
    parser.add_argument("--dp-from", type=Path, default=None,
                        help="reuse the DP curves of an earlier run's JSON (same --steps; DP does not depend on H)")
    parser.add_argument("--hidden", type=int, default=None,
                        help="a wider member of the tiny Qwen2 family: hidden size (intermediate 4x, heads hidden/32)")
    parser.add_argument("--layers", type=int, default=None, help="layers of that model (default: the tiny preset's 4)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    resize_tiny_preset(args.hidden, args.layers)
    earlier: dict[int, list[tuple[int, float]]] = {}
    if args.dp_from is not None:
        old = json.loads(args.dp_from.read_text())
        if old["steps"] == args.steps:
            earlier = {row["replicas"]: [tuple(c) for c in row["dp_curve"]] for row in old["rows"]}
    torch.set_num_threads(1)
    grid = [Outer.parse(g) for g in args.grid]
    rows: list[dict[str, Any]] = []
    print(f"{'N':>2} {'H':>3} {'outer':>9} {'delay':>5} {'loss@T':>8} {'DP@T':>8} {'gap %':>7} "
          f"{'steps to DP':>11} {'x DP':>6} {'s':>6}", flush=True)
    for n in args.replicas:
        dp_sim = Sim(n, min(args.sync_every), args.steps)
        if n == args.replicas[0]:
            from diloco_serverless.trainer.model import count_parameters

            print(f"model: {count_parameters(dp_sim.base):,} parameters", flush=True)
        t0 = time.monotonic()
        dp = earlier.get(n) or run_dp(dp_sim, n, args.steps, min(args.sync_every))
        dp_final = dp[-1][1]
        print(f"{n:>2}  DP {'':>9} {'':>5} {dp_final:>8.4f} ({time.monotonic() - t0:.0f} s)", flush=True)
        for h in args.sync_every:
            sim = Sim(n, h, args.steps * args.factor)
            arms = [(d, 0, "replace") for d in args.delay if d or 0 in args.tau]
            arms += [(0, t, m) for t in args.tau if 0 < t < h for m in args.merge]
            for delay, tau, merge in arms:
                for outer in grid:
                    t0 = time.monotonic()
                    curve = run_diloco(sim, n, h, args.steps * args.factor, outer, delay, stop_below=dp_final,
                                       min_steps=args.steps, eager=args.eager, tau=tau, merge=merge)
                    at_t = next(loss for s, loss in curve if s == args.steps)
                    hit = steps_to(curve, dp_final)
                    row = {"replicas": n, "sync_every": h, "outer": str(outer), "delay": delay,
                           "eager": args.eager if delay else None, "tau": tau, "merge": merge if tau else None,
                           "loss_at_T": at_t,
                           "dp_loss_at_T": dp_final, "gap_pct": 100 * (at_t / dp_final - 1), "steps_to_dp": hit,
                           "tokens_vs_dp": None if hit is None else hit / args.steps, "curve": curve, "dp_curve": dp,
                           "seconds": time.monotonic() - t0}
                    rows.append(row)
                    x = "-" if hit is None else f"{hit / args.steps:.2f}"
                    label = f"t{tau}{merge[0]}" if tau else str(delay)
                    print(f"{n:>2} {h:>3} {str(outer):>9} {label:>5} {at_t:>8.4f} {dp_final:>8.4f} "
                          f"{row['gap_pct']:>+7.2f} {hit or '-':>11} {x:>6} {row['seconds']:>6.0f}", flush=True)
    best: dict[str, Any] = {}
    for row in rows:
        key = f"N={row['replicas']} H={row['sync_every']} delay={row['delay']}"
        if row.get("tau"):
            key += f" tau={row['tau']} {row['merge']}"
        if key not in best or row["loss_at_T"] < best[key]["loss_at_T"]:
            best[key] = row
    print("\nbest outer setting at equal tokens:")
    for key, row in best.items():
        print(f"  {key}: {row['outer']} (loss {row['loss_at_T']:.4f}, {row['gap_pct']:+.2f}% vs DP)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "factor": args.factor, "rows": rows,
                                    "best": {k: v["outer"] for k, v in best.items()}}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
