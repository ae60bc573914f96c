"""CPU of one replica's direct sparse round, stage by stage (issue 35): what a replica computes before its
contribution's PUT and after the last vote's GET, without a store (the objects are built in memory).

    python benchmarks/sparse_round_cpu.py                 # 64M values (P = 256 MB), N = 8, one thread
    python benchmarks/sparse_round_cpu.py --mb 64 --n 4

Each stage is timed by ``time.process_time`` (CPU seconds of this process, one torch thread: the
allreduce benchmark's replicas run one thread each), the mean of ``--repeat`` passes. Prints a table and
writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from diloco_serverless.exchange.allreduce import _non_finite
from diloco_serverless.exchange.codec import Summand, residual
from diloco_serverless.exchange.quorum import ReadyMarker
from diloco_serverless.exchange.sparse import DEFAULT, encode
from diloco_serverless.exchange.votes import Entry, contribution, mean_of, read_entry, vote_keys

MB = 1 << 20
BEFORE = ("error feedback: e = beta*e + delta", "non-finite check", "contribution: encode + sign + own values")
AFTER = ("read N-1 votes: verify + decode", "sum (guard, rank order) + mean", "residual: e -= decode(c)")


def stages(numel: int, n: int, repeat: int) -> dict[str, float]:
    """Mean CPU seconds per stage of rank 0's round over ``repeat`` passes."""
    torch.set_num_threads(1)
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(1000 + r)) for r in range(n)]
    buffer = torch.randn(numel, generator=torch.Generator().manual_seed(7)) * 0.1
    run_key = b"k" * 32
    me = ReadyMarker("bench", 1, 0, n, numel, "torch.float32", [numel], "sparse", "direct", 1, None)
    blobs = {r: contribution(xs[r], replace(me, rank=r), run_key)[0] for r in range(1, n)}
    spent: dict[str, float] = {}

    def timed(name: str, f: Callable[[], Any]) -> Any:
        t = time.process_time()
        out = f()
        spent[name] = spent.get(name, 0.0) + (time.process_time() - t) / repeat
        return out

    def one_pass() -> None:
        flat = timed(BEFORE[0], lambda: torch.add(xs[0], buffer, alpha=0.95))
        timed(BEFORE[1], lambda: _non_finite(flat))
        timed("  of which encode (top-k, quantise, pack bits)", lambda: encode(flat, DEFAULT))
        _, mine = timed(BEFORE[2], lambda: contribution(flat, me, run_key))
        entries = {0: Entry(0, marker=me, values=mine)}

        def read_all() -> None:
            for r in range(1, n):
                entries[r] = read_entry(blobs[r], key=vote_keys(me)[r], run_id="bench", round=1, rank=r,
                                        run_key=run_key)

        timed(AFTER[0], read_all)
        timed(AFTER[1], lambda: mean_of(entries, me))
        own: list[Summand] = [mine]
        timed(AFTER[2], lambda: residual(flat, own, in_place=True))

    for _ in range(repeat):
        one_pass()
    spent["total before the PUT"] = sum(spent[k] for k in BEFORE)
    spent["total after the last GET"] = sum(spent[k] for k in AFTER)
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="fp32 megabytes of the pseudo-gradient (256: 64M values)")
    ap.add_argument("--n", type=int, default=8, help="replicas (the round reads N-1 votes)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/sparse_round_cpu.json")
    args = ap.parse_args()
    spent = stages(args.mb * MB // 4, args.n, args.repeat)
    print(f"P = {args.mb} MB ({args.mb * MB // 4:,} values), N = {args.n}, one thread, CPU s (mean of {args.repeat})")
    for name, s in spent.items():
        print(f"{name:52s} {s:6.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"mb": args.mb, "n": args.n, "repeat": args.repeat, "cpu_s": spent}, indent=1))


if __name__ == "__main__":
    main()
