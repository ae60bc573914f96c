"""RL inside a replica: generation throughput against a plain ``model.generate`` loop, and the share
of a GRPO step spent generating vs training (issue 34, "Measured").

Run (from the repo root, venv active):

    python benchmarks/rl.py              # 5 interleaved blocks per row, a few minutes on 2 CPU cores
    python benchmarks/rl.py --quick      # 2 blocks, fewer steps
    python benchmarks/rl.py --model small   # a 4-layer 256-wide random Qwen2 instead of the tiny one
    python benchmarks/rl.py --compare [options of rl_compare.py]   # DiLoCo-GRPO vs synchronous GRPO

Prints two tables and writes benchmarks/results/rl.json. One torch thread, random-init models
(nothing downloads), the toy letter prompts (diloco_serverless/rl/toy.py).

**generation**: completion tokens per second of

  plain    ``model.generate(input_ids, attention_mask, do_sample=True, temperature, top_k, top_p,
           max_new_tokens, pad/eos ids)`` on the same left-padded prompts (each repeated G times) --
           what a user would write, without log-probs
  backend  :class:`~diloco_serverless.rl.generation.TransformersBackend.generate`: the same sampling
           settings, its own seeded generator and the sampled tokens' log-probs recorded

interleaved block by block (plain, backend, plain, ...) so that load from other processes hits both
alike; times are medians over blocks of this process's CPU seconds (``time.process_time``), wall in
the JSON. ``min_new_tokens = max_new_tokens`` in both rows, so every row generates the same number of
tokens whatever it samples. Target: backend >= 0.9x plain.

**step split**: ``RLSteps.next_batch`` (prompts, generation, rewards, advantages) + ``compose_loss``
forward/backward + AdamW step, per GRPO inner step: the seconds of generation, reward scoring and
training, and generation's share.

``--compare``: DiLoCo-GRPO (N = 4, H = 8) against synchronous GRPO through the emulated store at equal
rollouts on the toy task: benchmarks/rl_compare.py (its docstring, its own options and JSON).
Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from diloco_serverless.config import RunConfig
from diloco_serverless.data.prompts import PromptBatcher
from diloco_serverless.loss import compose_loss
from diloco_serverless.rl.generation import SamplingSettings, TransformersBackend, left_pad
from diloco_serverless.rl.toy import toy_rows
from diloco_serverless.trainer.model import build_model
from diloco_serverless.trainer.steps import RLSteps

RESULTS = Path(__file__).parent / "results" / "rl.json"


def _config(args: argparse.Namespace) -> RunConfig:
    sets = {
        "data.source": '"toy.jsonl"', "data.format": '"prompt"', "loss.channel1": '"grpo"', "loss.alpha_sdpo": 0,
        "loss.beta_replay": 0, "rl.reward_funcs": '["diloco_serverless.rl.toy:letter_fraction"]',
        "data.batch_size": args.prompts, "rl.num_generations": args.generations,
        "rl.max_completion_length": args.tokens, "data.seq_len": args.tokens + 48, "replicas": 1,
        "rl.temperature": 0.9, "rl.top_k": 50, "rl.top_p": 0.95,
    }  # fmt: skip
    return RunConfig.load(None, [f"{k}={v}" for k, v in sets.items()])


def _model(cfg: RunConfig, size: str) -> tuple[Any, Any]:
    model, tok = build_model(cfg.model, 0)
    if size == "small":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        conf = Qwen2Config(
            vocab_size=model.config.vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
        )  # fmt: skip
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(conf)
    return model, tok


def _timed(fn: Any) -> tuple[float, float, Any]:
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - c0, time.perf_counter() - w0, out


def generation_table(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(args)
    model, tok = _model(cfg, args.model)
    rl = cfg.rl
    prompts = [PromptBatcher.from_config(cfg, tok, rank=0, rows=toy_rows(64)).source.train_record(i).prompt_ids
               for i in range(args.prompts)]  # fmt: skip
    pad, eos = tok.pad_token_id, tok.eos_token_id
    backend = TransformersBackend(
        SamplingSettings(rl.temperature, rl.top_p, rl.top_k, rl.max_completion_length), pad_id=pad, eos_id=None
    )  # eos_id=None: no stop, every row generates max_completion_length tokens, as min_new_tokens does below
    rows = [list(p) for p in prompts for _ in range(rl.num_generations)]
    ids, mask = left_pad(rows, pad, torch.device("cpu"))
    model.eval()

    def plain() -> int:
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=rl.temperature, top_k=rl.top_k,
            top_p=rl.top_p, max_new_tokens=rl.max_completion_length, min_new_tokens=rl.max_completion_length,
            pad_token_id=pad, eos_token_id=eos, use_cache=True,
        )  # fmt: skip
        return int(out[:, ids.shape[1] :].numel())

    def ours(seed: int) -> int:
        gen = backend.generate(model, prompts, rl.num_generations, seed=seed)
        return int(gen.completion_mask.sum())

    samples: dict[str, list[tuple[float, float, int]]] = {"plain": [], "backend": []}
    with torch.no_grad():
        plain(), ours(0)  # warm-up
        for block in range(args.blocks):
            samples["plain"].append(_timed(plain))
            samples["backend"].append(_timed(functools.partial(ours, block + 1)))
    table: dict[str, Any] = {}
    for name, runs in samples.items():
        tokens = runs[0][2]
        cpu = statistics.median(r[0] for r in runs)
        wall = statistics.median(r[1] for r in runs)
        table[name] = {"tokens": tokens, "cpu_s": cpu, "wall_s": wall, "tokens_per_cpu_s": tokens / cpu,
                       "tokens_per_wall_s": tokens / wall}  # fmt: skip
    ratio = table["backend"]["tokens_per_cpu_s"] / table["plain"]["tokens_per_cpu_s"]
    print(f"\ngeneration: {args.model} model ({sum(p.numel() for p in model.parameters()):,} parameters), "
          f"{args.prompts} prompts x G={rl.num_generations}, {rl.max_completion_length} new tokens, "
          f"T={rl.temperature} top_k={rl.top_k} top_p={rl.top_p}, median of {args.blocks} blocks")  # fmt: skip
    print(f"{'row':<10}{'tokens':>8}{'CPU s':>9}{'tok/CPU s':>11}{'wall s':>9}{'tok/wall s':>12}")
    for name, row in table.items():
        print(f"{name:<10}{row['tokens']:>8}{row['cpu_s']:>9.3f}{row['tokens_per_cpu_s']:>11.1f}"
              f"{row['wall_s']:>9.3f}{row['tokens_per_wall_s']:>12.1f}")  # fmt: skip
    print(f"backend / plain (tokens per CPU second): {ratio:.3f}x   (target >= 0.9x)")
    table["ratio_cpu"] = ratio
    table["ratio_wall"] = table["backend"]["tokens_per_wall_s"] / table["plain"]["tokens_per_wall_s"]
    return table


def step_table(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(args)
    model, tok = _model(cfg, args.model)
    steps = RLSteps(cfg, PromptBatcher.from_config(cfg, tok, rank=0, rows=toy_rows(64)), model, tok, rank=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = []
    for _ in range(args.steps):
        w0 = time.perf_counter()
        batch = steps.next_batch()
        w1 = time.perf_counter()
        out = compose_loss(model, batch, alpha_sdpo=0.0, beta_replay=0.0, **steps.loss_kwargs())
        opt.zero_grad()
        out.total.backward()  # type: ignore[no-untyped-call]
        opt.step()
        steps.after_step(out)
        w2 = time.perf_counter()
        stats = steps.round_metrics(w2 - w0)
        rows.append({"generation_s": stats["generation_s"], "reward_s": stats["reward_s"],
                     "rollout_other_s": (w1 - w0) - stats["generation_s"] - stats["reward_s"],
                     "train_s": w2 - w1, "step_s": w2 - w0})  # fmt: skip
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["generation_share"] = med["generation_s"] / med["step_s"]
    print(f"\nstep split: one GRPO inner step ({args.prompts} prompts x G={cfg.rl.num_generations}, "
          f"{cfg.rl.max_completion_length} tokens), median of {args.steps} steps, wall seconds")  # fmt: skip
    print(f"{'generation':>11}{'rewards':>9}{'batching':>10}{'training':>10}{'step':>8}{'gen share':>11}")
    print(f"{med['generation_s']:>11.3f}{med['reward_s']:>9.4f}{med['rollout_other_s']:>10.4f}"
          f"{med['train_s']:>10.3f}{med['step_s']:>8.3f}{med['generation_share']:>11.1%}")  # fmt: skip
    return {"median": med, "steps": rows}


def main() -> None:
    if "--compare" in sys.argv[1:]:
        from rl_compare import main as compare  # benchmarks/ is on the path when this file runs as a script

        sys.exit(compare([a for a in sys.argv[1:] if a != "--compare"]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 blocks, 3 steps")
    ap.add_argument("--compare", action="store_true", help="run benchmarks/rl_compare.py (DiLoCo-GRPO vs sync GRPO)")
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--model", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.steps = 2, 3
    torch.set_num_threads(1)
    out = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "generation": generation_table(args), "step_split": step_table(args)}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
