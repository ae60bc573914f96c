"""Chaos benchmark: many tiny real runs under store faults and SIGKILLs, each compared bit for bit with
the fault-free run.

Run (from the repo root, venv active):

    python benchmarks/chaos.py --quick     # 2 runs, N=2, 3 rounds, 8% faults, 1 kill each (~2-4 min)
    python benchmarks/chaos.py             # runs until >= 1000 injected store faults and >= 10 kills
                                           # (N=3, 8 rounds, 10% faults, 2 kills per run; ~10-20 min)

Prints a table and writes benchmarks/results/chaos.json.

Every run is tests/support/chaos.py's harness: moto on 127.0.0.1 behind the seeded fault proxy
(tests/support/fault_proxy.py), launch() through the proxy, N real replica processes
(``python -m diloco_serverless.entrypoints.replica``) with checkpoint_every=1, real SIGKILLs at
scheduled moments and restarts with DILOCO_ATTEMPT + 1, as the local executor does. Runs share one
ChaosPlan family: the same shape and fault rate, the seed varying; the seed draws the proxy's faults
and each run's kill schedule (ranks; phases before/after upload, owning a shard, checkpointing, or a
time). The fault-free reference is one run of the same shape with no fault and no kill.

A run is *lost* when it does not end with every replica exiting 0 and a complete final/
(final/DONE.json plus the model files); it *differs* when any replica's final global parameters are
not bit-identical to the reference's. Both are printed in capitals in the table and in the verdict.
Faults are counted by the proxy, never by the code under test; a kill counts when it fired.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.chaos import ChaosPlan, ChaosResult, moto_server, run_chaos  # noqa: E402
from support.fault_proxy import ALL_KINDS  # noqa: E402

RESULTS = Path(__file__).with_name("results") / "chaos.json"
#: Kill phases drawn by default. ``final`` (the replica writing final/) is left out unless
#: --with-final-kill: a killed final writer currently leaves final/ incomplete (see the README).
DEFAULT_PHASES = ("before_upload", "after_upload", "owning_shard", "checkpoint")
SHORT = {"slowdown": "503", "internal": "500", "drop_before": "drop<", "drop_after": "drop>", "delay": "delay"}


def kill_schedule(seed: int, replicas: int, rounds: int, n: int, phases: tuple[str, ...],
                  timed: tuple[float, float]) -> tuple[tuple[int, str | float], ...]:
    """``n`` kills drawn from ``seed``: a phase of a round (or, one draw in five, a time in ``timed``)."""
    rng = random.Random(seed * 7919 + 17)
    kills: list[tuple[int, str | float]] = []
    while len(kills) < n:
        rank = rng.randrange(replicas)
        if rng.random() < 0.2:
            when: str | float = round(rng.uniform(*timed), 1)
        else:
            phase = rng.choice(phases)
            when = phase if phase == "final" else f"{phase}@{rng.randrange(rounds)}"
        if all(k != (rank, when) for k in kills):
            kills.append((rank, when))
    return tuple(kills)


def make_plan(args: argparse.Namespace, seed: int) -> ChaosPlan:
    phases = (*DEFAULT_PHASES, "final") if args.with_final_kill else DEFAULT_PHASES
    kills = kill_schedule(seed, args.replicas, args.rounds, args.kills_per_run, phases, (4.0, args.timed_kill_max_s))
    return ChaosPlan(seed=seed, fault_rate=args.fault_rate, fault_kinds=tuple(args.kinds), kills=kills,
                     replicas=args.replicas, rounds=args.rounds, timeout_s=args.run_timeout_s)


HEADER = (f"{'run':>3} {'seed':>5} " + " ".join(f"{SHORT[k]:>5}" for k in ALL_KINDS)
          + f" {'faults':>6} {'kills':>5} {'crash':>5} {'outcome':>16} {'identical':>9} {'wall s':>7}  kills fired")


def row(i: int, r: ChaosResult, identical: bool) -> str:
    fired = ", ".join(f"r{k.rank}:{k.when}" for k in r.kills if k.fired) or "-"
    outcome = r.outcome if r.ok else f"LOST:{r.outcome}"
    return (f"{i:>3} {r.plan.seed:>5} " + " ".join(f"{r.faults.get(k, 0):>5}" for k in ALL_KINDS)
            + f" {sum(r.faults.get(k, 0) for k in ALL_KINDS):>6} {r.kills_fired:>5} {len(r.crashes):>5}"
            f" {outcome:>16} {'yes' if identical else 'NO':>9} {r.wall_s:>7.1f}  {fired}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 runs, N=2, 3 rounds: a smoke test of the benchmark")
    parser.add_argument("--replicas", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--fault-rate", type=float, default=None)
    parser.add_argument("--kinds", nargs="+", default=list(ALL_KINDS), choices=ALL_KINDS)
    parser.add_argument("--kills-per-run", type=int, default=None)
    parser.add_argument("--with-final-kill", action="store_true", help="also draw kills of the final/ writer")
    parser.add_argument("--min-faults", type=int, default=None, help="keep running until this many faults")
    parser.add_argument("--min-kills", type=int, default=None, help="... and this many kills fired")
    parser.add_argument("--min-runs", type=int, default=None)
    parser.add_argument("--max-runs", type=int, default=None)
    parser.add_argument("--seed0", type=int, default=100)
    parser.add_argument("--run-timeout-s", type=float, default=600.0)
    parser.add_argument("--timed-kill-max-s", type=float, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, dumps)")
    args = parser.parse_args(argv)
    quick = {"replicas": 2, "rounds": 3, "fault_rate": 0.08, "kills_per_run": 1, "min_faults": 0, "min_kills": 0,
             "min_runs": 2, "max_runs": 2, "timed_kill_max_s": 12.0}
    full = {"replicas": 3, "rounds": 8, "fault_rate": 0.10, "kills_per_run": 2, "min_faults": 1000, "min_kills": 10,
            "min_runs": 5, "max_runs": 30, "timed_kill_max_s": 30.0}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    work = Path(tempfile.mkdtemp(prefix="chaos-bench-"))
    print(f"chaos benchmark ({'quick' if args.quick else 'full'}): N={args.replicas}, {args.rounds} rounds, "
          f"fault rate {args.fault_rate:.0%} of {', '.join(args.kinds)}, {args.kills_per_run} kill(s) per run; "
          f"work folder {work}", flush=True)
    t_all = time.monotonic()
    runs: list[ChaosResult] = []
    same: list[bool] = []
    with moto_server() as moto:
        ref_plan = ChaosPlan(seed=0, replicas=args.replicas, rounds=args.rounds, timeout_s=args.run_timeout_s)
        reference = run_chaos(ref_plan, work / "reference", moto)
        print(f"reference (no faults, no kills): {reference.outcome}, digest {reference.digest}, "
              f"{reference.requests} requests, {reference.wall_s:.1f} s", flush=True)
        if not reference.ok or reference.digest is None:
            print(f"THE REFERENCE RUN FAILED: {reference.describe()}", flush=True)
            return 2
        print(HEADER, flush=True)
        i = 0
        while True:
            faults = sum(sum(r.faults.get(k, 0) for k in ALL_KINDS) for r in runs)
            kills = sum(r.kills_fired for r in runs)
            enough = faults >= args.min_faults and kills >= args.min_kills and len(runs) >= args.min_runs
            if enough or len(runs) >= args.max_runs:
                break
            plan = make_plan(args, args.seed0 + i)
            result = run_chaos(plan, work / f"run-{i:03d}", moto)
            identical = result.digest is not None and result.digest == reference.digest
            runs.append(result)
            same.append(identical)
            print(row(i, result, identical), flush=True)
            if not result.ok:
                print(f"    ^ run {i} LOST: {result.error[:400]}", flush=True)
            elif not identical:
                why = ("replicas agree with each other but not with the reference" if result.digest is not None
                       else f"replicas differ from each other: {result.digests}")
                print(f"    ^ run {i} DIFFERS: {why} (digest {result.digest} vs reference {reference.digest})",
                      flush=True)
            i += 1

    totals = {k: sum(r.faults.get(k, 0) for r in runs) for k in ALL_KINDS}
    total_faults, total_kills = sum(totals.values()), sum(r.kills_fired for r in runs)
    lost = [i for i, r in enumerate(runs) if not r.ok]
    differ = [i for i, (r, s) in enumerate(zip(runs, same)) if r.ok and not s]
    targets_met = total_faults >= args.min_faults and total_kills >= args.min_kills
    print(f"{'all':>3} {'':>5} " + " ".join(f"{totals[k]:>5}" for k in ALL_KINDS)
          + f" {total_faults:>6} {total_kills:>5} {sum(len(r.crashes) for r in runs):>5}")
    verdict = "PASS" if not lost and not differ and targets_met else "FAIL"
    print(f"\n{verdict}: {len(runs)} runs, {total_faults} injected store faults, {total_kills} replica kills; "
          f"runs lost: {len(lost)}{f' {lost}' if lost else ''}; runs not bit-identical to the reference: "
          f"{len(differ) + len(lost)}{f' {sorted(differ + lost)}' if differ or lost else ''}"
          + ("" if targets_met else f"; targets NOT met (>= {args.min_faults} faults, >= {args.min_kills} kills)")
          + f"; {time.monotonic() - t_all:.0f} s in all")

    out: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "config": {k: getattr(args, k) for k in ("replicas", "rounds", "fault_rate", "kinds", "kills_per_run",
                                                  "with_final_kill", "min_faults", "min_kills", "seed0")},
        "reference": reference.summary(),
        "runs": [{**r.summary(), "identical_to_reference": s, "kills_planned": [list(k) for k in r.plan.kills]}
                 for r, s in zip(runs, same)],
        "totals": {"runs": len(runs), "faults": totals, "faults_total": total_faults, "kills": total_kills,
                   "crashes": sum(len(r.crashes) for r in runs), "lost": lost, "differ": differ,
                   "targets_met": targets_met, "verdict": verdict},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out}")
    if args.keep or verdict != "PASS":
        print(f"logs and dumps kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
