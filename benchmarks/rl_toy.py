"""The toy letter task in one process: GRPO's reward curve, policy entropy and zero-advantage groups (issue 34).

Run (from the repo root, venv active; ~30 s per 80 steps on an idle core):

    python benchmarks/rl_toy.py                            # the example's settings: bare prompts, lr 2e-3
    python benchmarks/rl_toy.py --prompts prefix --lr 1e-2 # the first toy task: stalls at 0.25
    python benchmarks/rl_toy.py --lr 1e-2 --seed 1 --steps 60

One replica, no store: the product's ``RLSteps`` (rollouts from the current parameters, the toy reward,
group advantages) and ``compose_loss`` (GRPO, dapo), AdamW (betas 0.9/0.95, no weight decay, constant lr,
grad clip 1), 4 prompts x G completions of at most 8 tokens per step at temperature T. Prompts: ``bare``
(``toy_rows``: ``"bbbbb"``) or ``prefix`` (the first version: ``"Say b again and again (7): bbb"``).
Prints, every 5 steps, the step's mean reward, the policy's entropy (nats, on the sampled tokens), the
share of groups whose advantages are all zero (no signal) and a sampled completion per prompt; then the
mean reward per 10 steps. Writes benchmarks/results/rl_toy.json. Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from diloco_serverless.config import RunConfig
from diloco_serverless.data.prompts import PromptBatcher
from diloco_serverless.loss import compose_loss
from diloco_serverless.rl.toy import toy_rows
from diloco_serverless.trainer.model import build_model
from diloco_serverless.trainer.steps import RLSteps

RESULTS = Path(__file__).with_name("results") / "rl_toy.json"


def prefix_rows(n: int = 64) -> list[dict[str, Any]]:
    """The first toy prompts: the letter behind a text prefix every prompt shares."""
    return [{"prompt": f"Say {r['answer']} again and again ({i}): {r['answer'] * 3}", "answer": r["answer"]}
            for i, r in enumerate(toy_rows(n))]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", choices=("bare", "prefix"), default="bare")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sets = {"data.source": '"toy.jsonl"', "data.format": '"prompt"', "loss.channel1": '"grpo"', "loss.alpha_sdpo": 0,
            "loss.beta_replay": 0, "rl.reward_funcs": '["diloco_serverless.rl.toy:letter_fraction"]',
            "data.batch_size": 4, "rl.num_generations": args.generations, "rl.max_completion_length": 8,
            "data.seq_len": 64, "replicas": 1, "rl.temperature": args.temperature, "seed": args.seed,
            "inner.lr": args.lr}  # fmt: skip
    cfg = RunConfig.load(None, [f"{k}={v}" for k, v in sets.items()])
    model, tok = build_model(cfg.model, args.seed)
    rows = toy_rows(64) if args.prompts == "bare" else prefix_rows(64)
    steps = RLSteps(cfg, PromptBatcher.from_config(cfg, tok, rank=0, rows=rows), model, tok, rank=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    t0 = time.perf_counter()
    curve: list[dict[str, float]] = []
    for step in range(args.steps):
        batch = steps.next_batch()
        out = compose_loss(model, batch, alpha_sdpo=0.0, beta_replay=0.0, **steps.loss_kwargs())
        opt.zero_grad()
        out.total.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps.after_step(out)
        m = steps.round_metrics(1.0)
        groups = batch["advantages"].view(-1, args.generations)
        zero = float((groups.abs().sum(-1) == 0).float().mean())
        curve.append({"reward": m["reward_mean"], "entropy": m.get("rl_entropy", float("nan")), "zero_adv": zero})
        if step % 5 == 0 or step == args.steps - 1:
            shown = [c for c in steps._current.completions[:: args.generations]] if steps._current else []
            print(f"step {step:3d}  reward {m['reward_mean']:.3f}  entropy {curve[-1]['entropy']:.2f}  "
                  f"zero-advantage groups {zero:.2f}  {time.perf_counter() - t0:5.0f} s  {shown!r}", flush=True)
    per10 = [sum(c["reward"] for c in curve[i : i + 10]) / len(curve[i : i + 10]) for i in range(0, len(curve), 10)]
    print(f"\n{args.prompts} prompts, lr {args.lr}, G={args.generations}, T={args.temperature}, seed {args.seed}: "
          f"mean reward per 10 steps: " + " ".join(f"{v:.2f}" for v in per10))  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "curve": curve,
                                    "per_10_steps": per10}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
