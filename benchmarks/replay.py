"""Teacher replay throughput against a rate-limited OpenAI-compatible server, and the budget ceiling
(issue 37).

Run (from the repo root, venv active):

    python benchmarks/replay.py                    # concurrency 16, 50 ms answers, 600 calls x 3 repeats
    python benchmarks/replay.py --states 100 --repeats 2 --latency-ms 100

The server is tests/support/fake_openai.py on 127.0.0.1, in its own process (so that its CPU does not
compete with the client's for one interpreter), serving at most ``--concurrency`` requests at once and
answering each after ``--latency-ms``: its own limit is concurrency / latency calls per second (320/s
at 16 and 50 ms). Arms, interleaved per repeat, each over the same ``--states`` states
x 3 teachers:

* ``baseline``: a plain asyncio client (``httpx.AsyncClient``, ``--concurrency`` workers POSTing the
  same requests; no budget, cache, retries or parsing beyond ``resp.json()``);
* ``replay``: ``replay_trace`` with ``concurrency = --concurrency`` and no cache;
* ``replay+cache``: the same with a fresh local answer cache (each answer written create-only);
* ``replay (ceiling)``: ``replay_trace`` with a ceiling of a third of the calls' cost (stops early).

``cpu ms`` is the client process's CPU time per call: on a loaded machine the client's share of a
core, not the server, bounds the rate, and this column compares the arms' cost regardless of load.
Every replay run has a ceiling, and the server counts what it billed (the ``usage.cost`` of each
answer sent): the table's ``billed <= ceiling`` column checks it. Prints a table and writes
benchmarks/results/replay.json. Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from diloco_serverless.replay import Action, State, Teacher, replay_trace  # noqa: E402
from diloco_serverless.replay.replay import build_request  # noqa: E402

SERVER = Path(__file__).resolve().parents[1] / "tests" / "support" / "fake_openai.py"

RESULTS = Path(__file__).resolve().parent / "results" / "replay.json"
COST = 0.001  # usage.cost of each answer
KEY_ENV = "DILOCO_BENCH_TEACHER_KEY"


def states(n: int) -> list[State]:
    return [State(f"s{i}", ({"role": "system", "content": "You are an agent."},
                            {"role": "user", "content": f"task {i}: what next?"}),
                  Action(f"student {i}")) for i in range(n)]


def teachers(url: str) -> list[Teacher]:
    # worst case per call: ~80 prompt tokens x $10/M + 64 x $20/M ~= $0.0021 >= the billed $0.001
    return [Teacher(name=m, model=m, base_url=url, api_key_env=KEY_ENV, usd_per_m_input=10.0,
                    usd_per_m_output=20.0, max_tokens=64, timeout_s=30.0) for m in ("a", "b", "c")]


async def baseline(url: str, reqs: list[dict[str, Any]], concurrency: int) -> float:
    import httpx

    queue = list(reversed(reqs))
    headers = {"Authorization": f"Bearer {os.environ[KEY_ENV]}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=30.0) as client:
        async def worker() -> None:
            while queue:
                body = queue.pop()
                resp = await client.post(f"{url}/chat/completions", json=body, headers=headers)
                resp.json()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--states", type=int, default=200, help="states per run (x 3 teachers = calls)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault(KEY_ENV, "sk-bench-not-a-real-key")
    latency = args.latency_ms / 1000

    trace = states(args.states)
    limit = args.concurrency / latency
    rows: list[dict[str, Any]] = []
    proc = subprocess.Popen([sys.executable, str(SERVER), "--latency-ms", str(args.latency_ms), "--max-concurrency",
                             str(args.concurrency), "--cost", str(COST)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()

        def stats(reset: bool = False) -> dict[str, Any]:
            req = urllib.request.Request(f"{url}/_stats", data=b"" if reset else None,
                                         method="POST" if reset else "GET")
            with urllib.request.urlopen(req, timeout=10) as resp:
                return dict(json.loads(resp.read()))

        ts = teachers(url)
        reqs = [build_request(s, t) for s in trace for t in ts]
        calls = len(reqs)
        asyncio.run(baseline(url, reqs[: args.concurrency * 2], args.concurrency))  # warm-up

        def replay_arm(name: str, ceiling: float, cache: str | None) -> None:
            stats(reset=True)
            start, cpu = time.perf_counter(), time.process_time()
            result = asyncio.run(replay_trace(trace, ts, max_total_usd=ceiling, concurrency=args.concurrency,
                                              cache=cache))
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            asked = sum(r.status == "ok" for r in result.records)
            s = stats()
            rows.append({"arm": name, "repeat": rep, "calls": asked, "wall_s": wall, "calls_per_s": asked / wall,
                         "cpu_ms_per_call": 1000 * cpu / max(1, asked),
                         "vs_limit": asked / wall / limit, "ceiling_usd": ceiling, "billed_usd": s["billed"],
                         "spent_usd": result.spent_usd, "ceiling_held": s["billed"] <= ceiling + 1e-12,
                         "not_replayed": len(result.not_replayed), "peak_in_flight": s["peak_in_flight"]})

        for rep in range(args.repeats):
            stats(reset=True)
            cpu = time.process_time()
            wall = asyncio.run(baseline(url, reqs, args.concurrency))
            cpu = time.process_time() - cpu
            s = stats()
            rows.append({"arm": "baseline", "repeat": rep, "calls": calls, "wall_s": wall, "calls_per_s": calls / wall,
                         "cpu_ms_per_call": 1000 * cpu / calls,
                         "vs_limit": calls / wall / limit, "ceiling_usd": None, "billed_usd": s["billed"],
                         "spent_usd": None, "ceiling_held": None, "not_replayed": 0,
                         "peak_in_flight": s["peak_in_flight"]})
            replay_arm("replay", calls * COST * 1.5, None)
            with tempfile.TemporaryDirectory() as tmp:
                replay_arm("replay+cache", calls * COST * 1.5, tmp)
            replay_arm("replay (ceiling)", calls * COST / 3, None)
    finally:
        proc.terminate()
        proc.wait(10)

    print(f"server limit: {args.concurrency} concurrent x {args.latency_ms:.0f} ms = {limit:.0f} calls/s; "
          f"{calls} calls per run (ceiling run: fewer)")
    print(f"{'arm':<18}{'rep':>4}{'calls':>7}{'wall s':>8}{'calls/s':>9}{'x limit':>9}{'x base':>8}{'cpu ms':>8}"
          f"{'ceiling $':>11}{'billed $':>10}{'held':>6}{'not repl':>9}{'peak':>6}")
    base = {r["repeat"]: r["calls_per_s"] for r in rows if r["arm"] == "baseline"}
    for r in rows:
        r["vs_baseline"] = r["calls_per_s"] / base[r["repeat"]]
        ceiling = "-" if r["ceiling_usd"] is None else f"{r['ceiling_usd']:.3f}"
        held = "-" if r["ceiling_held"] is None else ("yes" if r["ceiling_held"] else "NO")
        print(f"{r['arm']:<18}{r['repeat']:>4}{r['calls']:>7}{r['wall_s']:>8.3f}{r['calls_per_s']:>9.1f}"
              f"{r['vs_limit']:>9.3f}{r['vs_baseline']:>8.3f}{r['cpu_ms_per_call']:>8.2f}{ceiling:>11}{r['billed_usd']:>10.3f}{held:>6}"
              f"{r['not_replayed']:>9}{r['peak_in_flight']:>6}")
    summary = {}
    for arm in ("baseline", "replay", "replay+cache"):
        sel = [r for r in rows if r["arm"] == arm]
        summary[arm] = {"mean_calls_per_s": sum(r["calls_per_s"] for r in sel) / len(sel),
                        "best_vs_limit": max(r["vs_limit"] for r in sel),
                        "mean_cpu_ms_per_call": sum(r["cpu_ms_per_call"] for r in sel) / len(sel),
                        "mean_vs_limit": sum(r["vs_limit"] for r in sel) / len(sel),
                        "mean_vs_baseline": sum(r["vs_baseline"] for r in sel) / len(sel)}
        m = summary[arm]
        print(f"{arm}: {m['mean_calls_per_s']:.1f} calls/s = {m['mean_vs_limit']:.3f}x the server's limit (best run "
              f"{m['best_vs_limit']:.3f}x), {m['mean_vs_baseline']:.3f}x the plain client, "
              f"{m['mean_cpu_ms_per_call']:.2f} client CPU ms per call (target >= 0.9x the limit)")
    held = all(r["ceiling_held"] for r in rows if r["ceiling_held"] is not None)
    print(f"budget ceiling held in every replay run: {'yes' if held else 'NO'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "server_limit_calls_per_s": limit, "rows": rows,
                                   "summary": summary, "ceiling_held_every_run": held}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
