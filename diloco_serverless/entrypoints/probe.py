"""The replica of ``diloco doctor``: a few seconds of work that exercises what a platform must do for a
run, with no model and no data.

    python -m diloco_serverless.entrypoints.probe --run-url URL [--chain-rank R] [--hold-s S] [--chain-hold-s S]

Each attempt writes ``doctor/rank-<r>/attempt-<a>.json`` to the run's store, signed with the run key
(``DILOCO_RUN_KEY``, kind ``doctor-probe``): the doctor reads it back to prove that the replica ran,
reached the store with the credentials it was given, and which attempt it was. Then:

* every rank but ``--chain-rank`` (mode ``early``): prints a line per second for ``--hold-s`` seconds
  and exits 0 (a rank that ends before the others);
* rank ``--chain-rank`` (mode ``chain``): on its first attempt runs until :data:`MARGIN_S` before the
  attempt's deadline (``DILOCO_ATTEMPT_DEADLINE``, or its start + ``DILOCO_ATTEMPT_TIMEOUT_S``), then
  exits 75 as a replica does that saved its state before the platform's cap; on a later attempt it
  prints a line per second until cancelled or ``--chain-hold-s`` passed, then exits 0.

Exit code 2 (a setup error, not retried) when the run key or the run URL is missing or the store
cannot be written.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from diloco_serverless.config import RUN_KEY_ENV
from diloco_serverless.executors.base import ATTEMPT_DEADLINE_ENV, ATTEMPT_TIMEOUT_ENV, CONTINUE_EXIT_CODE
from diloco_serverless.run.integrity import mac_json, run_key_from_env
from diloco_serverless.run.layout import probe_key
from diloco_serverless.store.objectstore import ObjectStore

#: the object kind the probe's records are signed as
PROBE_KIND = "doctor-probe"
#: a chained attempt stops this long before its deadline (or at half its cap, if shorter)
MARGIN_S = 15.0


def _deadline(started: float) -> float | None:
    raw = os.environ.get(ATTEMPT_DEADLINE_ENV, "").strip()
    if raw:
        return float(raw)
    cap = os.environ.get(ATTEMPT_TIMEOUT_ENV, "").strip()
    return started + float(cap) if cap else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco_serverless.entrypoints.probe")
    parser.add_argument("--run-url", required=True)
    parser.add_argument("--chain-rank", type=int, default=1)
    parser.add_argument("--hold-s", type=float, default=5.0)
    parser.add_argument("--chain-hold-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    started = time.time()
    rank = int(os.environ.get("REPLICA_RANK", "0"))
    args.mode = "chain" if rank == args.chain_rank else "early"
    attempt = int(os.environ.get("DILOCO_ATTEMPT", "0") or 0)
    try:
        key = run_key_from_env()
    except ValueError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    if key is None:
        print(f"error: probe rank {rank}: no run key in ${RUN_KEY_ENV}", flush=True)
        return 2
    deadline = _deadline(started)
    record = {"rank": rank, "attempt": attempt, "mode": args.mode, "started": started, "deadline": deadline,
              "host": socket.gethostname(), "python": sys.version.split()[0]}
    place = probe_key(rank, attempt)
    try:
        ObjectStore(args.run_url).put_json(place, mac_json(key, PROBE_KIND, record, place=place))
    except Exception as exc:
        print(f"error: probe rank {rank} could not write to {args.run_url}: {type(exc).__name__}: {exc}", flush=True)
        return 2
    print(f"probe rank={rank} attempt={attempt} mode={args.mode} deadline={deadline} wrote {place}",
          flush=True)
    if args.mode == "chain" and attempt == 0:
        if deadline is None:
            print(f"error: probe rank {rank}: no {ATTEMPT_DEADLINE_ENV} or {ATTEMPT_TIMEOUT_ENV}: the executor set no "
                  "cap to chain across", flush=True)
            return 2
        stop = deadline - min(MARGIN_S, (deadline - started) / 2)
        while time.time() < stop:
            print(f"probe rank={rank} attempt={attempt} working, {deadline - time.time():.0f} s to the deadline",
                  flush=True)
            time.sleep(min(1.0, max(0.0, stop - time.time())))
        print(f"probe rank={rank} attempt={attempt}: stopping before the deadline (exit {CONTINUE_EXIT_CODE})",
              flush=True)
        return CONTINUE_EXIT_CODE
    end = started + (args.chain_hold_s if args.mode == "chain" else args.hold_s)
    while time.time() < end:
        print(f"probe rank={rank} attempt={attempt} working", flush=True)
        time.sleep(min(1.0, max(0.0, end - time.time())))
    print(f"probe rank={rank} attempt={attempt} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
