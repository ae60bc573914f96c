"""A stand-in replica for executor tests: ``python -m support.fake_replica [options]`` (tests/ on PYTHONPATH).

Behaviour is chosen by flags so one module covers every case:
  --sleep-s S            sleep before exiting (default 0)
  --exit-code N          exit with N (default 0)
  --fail-rank R          only rank R uses --exit-code; other ranks exit 0
  --crash-attempts K     exit 3 while DILOCO_ATTEMPT < K (a crash that a restart heals)
  --heartbeat-dir D      write D/rank-<r>.json {"rank", "attempt", "pid"} at start
  --spawn-child          start a grandchild (sleep) and write its pid into the heartbeat (tree-kill tests)
Every run prints ``fake replica rank=<r> attempt=<a>`` and ``env DILOCO_RUN_URL=...`` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep-s", type=float, default=0.0)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--crash-attempts", type=int, default=0)
    parser.add_argument("--heartbeat-dir", type=Path, default=None)
    parser.add_argument("--spawn-child", action="store_true")
    parser.add_argument("--run-url", default=None)
    args = parser.parse_args()
    rank = int(os.environ["REPLICA_RANK"])
    attempt = int(os.environ.get("DILOCO_ATTEMPT", "0"))
    print(f"fake replica rank={rank} attempt={attempt}", flush=True)
    print(f"env DILOCO_RUN_URL={os.environ.get('DILOCO_RUN_URL', '')}", flush=True)
    print(f"env FAKE_SECRET_SET={'FAKE_SECRET' in os.environ}", flush=True)
    heartbeat = {"rank": rank, "attempt": attempt, "pid": os.getpid()}
    if args.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        heartbeat["child_pid"] = child.pid
    if args.heartbeat_dir is not None:
        args.heartbeat_dir.mkdir(parents=True, exist_ok=True)
        tmp = args.heartbeat_dir / f".rank-{rank}.tmp"
        tmp.write_text(json.dumps(heartbeat))
        os.replace(tmp, args.heartbeat_dir / f"rank-{rank}.json")
    if attempt < args.crash_attempts:
        print(f"rank {rank} crashing on attempt {attempt}", file=sys.stderr, flush=True)
        return 3
    time.sleep(args.sleep_s)
    if args.exit_code and (args.fail_rank is None or args.fail_rank == rank):
        print(f"rank {rank} fails with boom (exit {args.exit_code})", file=sys.stderr, flush=True)
        return args.exit_code
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
