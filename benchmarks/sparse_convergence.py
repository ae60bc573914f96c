"""Convergence at equal tokens: dense fp32 DiLoCo against SparseLoCo-style sparse pseudo-gradients at
several densities x bits (N = 4 or 8, H = 30), on the tiny model or a wider one, with convergence.py's machinery.

Run (from the repo root, venv active; about ten minutes on a shared 2-core machine):

    python benchmarks/sparse_convergence.py                 # warm start W=100, T=240 inner steps, H=30
    python benchmarks/sparse_convergence.py --steps 120 --settings 64of4096-2bit   # one sparse arm, shorter
    python benchmarks/sparse_convergence.py --no-dp --steps 600 --replicas 8      # N = 8, 20 rounds
    python benchmarks/sparse_convergence.py --no-dp --steps 90 --warm-start-steps 20 --hidden 320 --layers 8 \
        --settings int8,64of4096-2bit --schedule "[[2, 0.65]]" --schedule-also   # 12.4M params (outer_sweep.py's)
    python benchmarks/sparse_convergence.py --merge a.json b.json   # one table of parallel runs' arms (--out)

Every arm starts from the same warm-start checkpoint (W steps of sync data parallel from random init, as
convergence.py's warm table) with the same data, and runs T inner steps on each of N = 4 replicas (the real
replica code in threads over a file:// store): the same tokens. Arms:

  sync DP           every step averages the 4 workers' gradients
  DiLoCo fp32       H = 30, outer Nesterov SGD (lr 0.7, momentum 0.9): the dense baseline
  sparse k of c, b  exchange.codec = "sparse" with k of every c values at b bits, error feedback with decay
                    0.95, outer SGD lr 1 without momentum (examples/sparseloco.toml)
  DiLoCo int8+EF    ``--settings int8``: the dense int8 codec with error feedback, the fp32 arm's outer step
  ... +sched        ``--schedule``: the sparse arm with ``outer.lr_schedule`` (e.g. Covenant's 1 then 0.65);
                    ``--schedule-also`` runs each sparse arm without and with it. ``--sparse-set`` adds
                    overrides to the sparse arms only (e.g. exchange.feedback_decay=0.99).

``--replicas`` sets N; ``--hidden``/``--layers`` resize the tiny Qwen2 preset for this process as
outer_sweep.py does (``--hidden 320 --layers 8``: 12.4M parameters). "DiLoCo fp32" has no outer.*
override: the product's measured default for (N, H) (config.OUTER_DEFAULTS).

Eval loss is the final global model's mean lm_ce on the held-out batches; bytes are the replicas' own
exchange counters (sum over replicas and rounds). Prints a table and writes
benchmarks/results/sparse_convergence.json. Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import convergence as conv  # noqa: E402
from outer_sweep import resize_tiny_preset  # noqa: E402

from diloco_serverless.trainer.model import build_model, count_parameters  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "sparse_convergence.json"
SPARSELOCO = ["exchange.codec=sparse", "exchange.error_feedback=true", "exchange.feedback_decay=0.95",
              "outer.lr=1.0", "outer.momentum=0.0", "outer.nesterov=false"]
DEFAULT_SETTINGS = "16of4096-2bit,64of4096-2bit,256of4096-2bit,16of4096-4bit,64of4096-4bit,256of4096-4bit"
INT8 = ['exchange.codec="int8"', "exchange.error_feedback=true"]  # dense int8 (+ error feedback), dense outer step


def _sparse(setting: str) -> list[str]:
    if setting == "int8":
        return list(INT8)
    k, rest = setting.split("of")
    chunk, bits = rest.split("-")
    return [*SPARSELOCO, f"exchange.sparse.k={int(k)}", f"exchange.sparse.chunk={int(chunk)}",
            f"exchange.sparse.bits={int(bits.removesuffix('bit'))}"]


def merge(paths: list[Path]) -> int:
    """Print one table of the arms of several runs' JSON (same setup and warm start: the processes of one
    measurement run in parallel), ratios against the first file's "DiLoCo fp32"."""
    runs = [json.loads(p.read_text()) for p in paths]
    keys = ("N", "T", "H", "W", "hidden", "layers", "warm_threads")
    if any({k: r["setup"].get(k) for k in keys} != {k: runs[0]["setup"].get(k) for k in keys} for r in runs):
        raise SystemExit(f"--merge: the runs' setups differ in one of {keys}; merge runs of one measurement only")
    if len({r["warm_start"]["eval_loss"] for r in runs}) != 1:
        raise SystemExit("--merge: the runs' warm starts differ (eval loss); they did not start from the same model")
    arms: dict[str, Any] = {}
    for p, r in zip(paths, runs):
        for k, v in r["arms"].items():
            arms[k if k not in arms else f"{k} ({p.stem})"] = v  # a name twice: which run is which
    if "DiLoCo fp32" not in arms:
        raise SystemExit("--merge: no run has the 'DiLoCo fp32' arm the ratios need")
    base, s = arms["DiLoCo fp32"], runs[0]["setup"]
    print(f"N={s['N']}, H={s['H']}, T={s['T']} inner steps from a {s['W']}-step warm start (eval "
          f"{runs[0]['warm_start']['eval_loss']:.4f}), {runs[0]['params']:,} parameters; {len(runs)} processes")
    print(f"{'arm':32} {'eval loss':>9} {'vs fp32 DiLoCo':>14} {'MB moved':>9} {'vs fp32 bytes':>13} {'wall s':>7}")
    for name, r in arms.items():
        print(f"{name:32} {r['eval_loss']:>9.4f} {r['eval_loss'] / base['eval_loss']:>13.4f}x "
              f"{r['bytes_moved'] / 2**20:>9.2f} {r['bytes_moved'] / base['bytes_moved']:>12.4f}x {r['wall_s']:>7.1f}")
    print("load average at start -> end: " + "; ".join(
        f"{p.name} {r['setup']['load_avg_start'][0]:.1f} -> {r['setup'].get('load_avg_end', [math.nan])[0]:.1f}"
        for p, r in zip(paths, runs)))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=240, help="T: inner steps of every arm")
    ap.add_argument("--sync-every", type=int, default=30, help="H")
    ap.add_argument("--warm-start-steps", type=int, default=100, help="W")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS, help="sparse arms: kofchunk-bbit, comma-separated")
    ap.add_argument("--no-dp", action="store_true", help="skip the sync DP arm")
    ap.add_argument("--replicas", type=int, default=4, help="N (replicas of every DiLoCo arm, workers of sync DP)")
    ap.add_argument("--hidden", type=int, default=None,
                    help="a wider member of the tiny Qwen2 family (as outer_sweep.py): hidden size (intermediate 4x)")
    ap.add_argument("--layers", type=int, default=None, help="layers of that model (default: the tiny preset's 4)")
    ap.add_argument("--schedule", default=None,
                    help="outer.lr_schedule for every sparse arm, e.g. '[[0, 1.0], [10, 0.65]]' "
                         "(rounds from which each lr applies); 'both' style comparisons: --schedule-also")
    ap.add_argument("--schedule-also", action="store_true",
                    help="run every sparse arm twice: without and with --schedule")
    ap.add_argument("--sparse-set", action="append", default=[],
                    help="extra RunConfig override for the sparse arms only (repeatable), e.g. "
                         "exchange.feedback_decay=0.99")
    ap.add_argument("--warm-threads", type=int, default=1,
                    help="torch threads of the (single-process) warm start; the arms run one per replica")
    ap.add_argument("--no-fp32", action="store_true", help="skip the dense fp32 DiLoCo arm (ratios need it)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                    help="run nothing: print one table of these runs' arms (parallel processes of one setup)")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge)
    conv.N = args.replicas  # convergence.py's module-level N: read at call time by every run it makes
    resize_tiny_preset(args.hidden, args.layers)  # the tiny preset, resized as outer_sweep.py does
    torch.set_num_threads(1)
    setup = replace(conv.QUICK, steps=args.steps, sync_every=args.sync_every, warm_steps=args.warm_start_steps)
    rounds = setup.steps // setup.sync_every
    res: dict[str, Any] = {"setup": {"N": conv.N, "T": setup.steps, "H": setup.sync_every, "W": setup.warm_steps,
                                     "batch": setup.batch, "seq_len": setup.seq_len, "hidden": args.hidden,
                                     "layers": args.layers, "schedule": args.schedule,
                                     "sparse_set": args.sparse_set, "warm_threads": args.warm_threads,
                                     "load_avg_start": os.getloadavg()},
                           "params": count_parameters(build_model(conv._config(setup, []).model, 0)[0]),
                           "arms": {}}
    t0 = time.monotonic()
    torch.set_num_threads(args.warm_threads)
    start, loss, wall = conv.warm_start(setup)
    torch.set_num_threads(1)
    res["warm_start"] = {"eval_loss": loss, "wall_s": wall}
    print(f"warm start ({setup.warm_steps} sync DP steps): eval {loss:.4f}", flush=True)
    arms: list[tuple[str, Any]] = []
    if not args.no_dp:
        arms.append(("sync DP", lambda: conv.run_sync_dp(setup, conv.N, start)))
    with tempfile.TemporaryDirectory(prefix="diloco-sparse-conv-") as tmp:
        root = Path(tmp)
        if not args.no_fp32:
            arms.append(("DiLoCo fp32", lambda: conv.run_diloco(setup, setup.sync_every, rounds, [], root, "dense",
                                                                start)))
        variants: list[tuple[str, list[str]]] = [("", [])] if args.schedule is None or args.schedule_also else []
        if args.schedule is not None:
            variants.append((" +sched", [f"outer.lr_schedule={args.schedule}"]))
        for i, s in enumerate(x for x in args.settings.split(",") if x):
            for j, (tag, over) in enumerate(variants):
                extra = _sparse(s) if s == "int8" else [*_sparse(s), *over, *args.sparse_set]
                if s == "int8" and j:
                    continue  # the dense int8 arm keeps the dense outer step: no schedule variant
                label = "DiLoCo int8+EF" if s == "int8" else f"sparse {s}{tag}" + "".join(
                    f" {o.split('=', 1)[0].rsplit('.', 1)[-1]}={o.split('=', 1)[-1]}" for o in args.sparse_set)
                arms.append((label, lambda extra=extra, i=i, j=j: conv.run_diloco(
                    setup, setup.sync_every, rounds, extra, root, f"arm{i}-{j}", start)))
        for name, job in arms:
            res["arms"][name] = job()
            print(f"{name}: {json.dumps(res['arms'][name])}", flush=True)
    res["setup"]["load_avg_end"] = os.getloadavg()
    base = res["arms"].get("DiLoCo fp32", {"eval_loss": math.nan, "bytes_moved": math.nan})
    print(f"\nN={conv.N}, H={setup.sync_every}, T={setup.steps} inner steps from a {setup.warm_steps}-step warm "
          f"start, {res['params']:,} parameters (shared 2-core machine, load average "
          f"{res['setup']['load_avg_start'][0]:.1f} at start, {res['setup']['load_avg_end'][0]:.1f} at end; "
          f"total {time.monotonic() - t0:.0f} s)")
    print(f"{'arm':32} {'eval loss':>9} {'vs fp32 DiLoCo':>14} {'MB moved':>9} {'vs fp32 bytes':>13} {'wall s':>7}")
    for name, r in res["arms"].items():
        print(f"{name:32} {r['eval_loss']:>9.4f} {r['eval_loss'] / base['eval_loss']:>13.4f}x "
              f"{r['bytes_moved'] / 2**20:>9.2f} {r['bytes_moved'] / base['bytes_moved']:>12.4f}x {r['wall_s']:>7.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
