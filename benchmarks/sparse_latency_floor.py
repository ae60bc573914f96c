"""The latency floor of a direct sparse round on an emulated store, by Monte Carlo (issue 35): no CPU at
all, only the preset's first-byte latency and transfer times, to tell the protocol's floor from the
machine's CPU contention in `allreduce.py`'s wall times.

    python benchmarks/sparse_latency_floor.py            # s3-standard at scale 0.01, N = 8, P = 256 MB

The round is three sequential steps (docs/exchange.md): every replica PUTs its vote (its contribution),
reads each other vote by a GET that finds it (modelled as sent the moment the vote lands: the floor),
then lists the votes once to confirm. First-byte latency is lognormal (the preset's median and p99,
times 1/scale); a hedged read is the first answer of the request and a backup sent at the 0.75 quantile
(``diloco_serverless.store.hedge``'s default). Prints the median and mean wall of the slowest replica.
"""

from __future__ import annotations

import argparse

import numpy as np


def floor(n: int, payload_mb: float, median_s: float, p99_s: float, conn_mb_s: float, client_mb_s: float,
          runs: int, hedge_put: bool, hedge_reads: bool, seed: int = 0) -> np.ndarray:
    """Wall seconds of the slowest replica in each of ``runs`` simulated rounds."""
    rng = np.random.default_rng(seed)
    sigma = np.log(p99_s / median_s) / 2.326
    q75 = median_s * np.exp(sigma * 0.674)

    def latency(shape: tuple[int, ...], hedged: bool) -> np.ndarray:
        first: np.ndarray = median_s * np.exp(sigma * rng.standard_normal(shape))
        if not hedged:
            return first
        backup: np.ndarray = q75 + median_s * np.exp(sigma * rng.standard_normal(shape))
        return np.asarray(np.minimum(first, backup))

    landed = latency((runs, n), hedge_put) + payload_mb / conn_mb_s
    found = landed[:, None, :] + latency((runs, n, n), hedge_reads)  # [run, reader, writer]
    own = np.arange(n)
    found[:, own, own] = landed
    have_all = found.max(axis=2) + (n - 1) * payload_mb / client_mb_s
    return np.asarray((have_all + latency((runs, n), hedge_reads)).max(axis=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--payload-mb", type=float, default=1.81, help="one sparse vote (64M values: 1.81 MB)")
    ap.add_argument("--scale", type=float, default=0.01, help="the emulation's scale (latency / scale)")
    ap.add_argument("--limit-s", type=float, default=19.22, help="the round's physical limit (allreduce.py)")
    ap.add_argument("--runs", type=int, default=20000)
    args = ap.parse_args()
    # s3-standard (tests/support/store_presets.py): 60 ms median, 250 ms p99, 90 MB/s per connection,
    # 1,250 MB/s per client; the emulation divides rates and multiplies latencies by 1/scale
    med, p99 = 0.060 / args.scale, 0.250 / args.scale
    conn, client = 90.0 * args.scale, 1250.0 * args.scale
    print(f"s3-standard at scale {args.scale}: first byte median {med:.1f} s, p99 {p99:.1f} s; N = {args.n}")
    for name, hp, hr in (("no hedging", False, False), ("reads hedged (as the store does)", False, True),
                         ("PUT and reads hedged", True, True)):
        wall = floor(args.n, args.payload_mb, med, p99, conn, client, args.runs, hp, hr)
        print(f"{name:34s} median {np.median(wall):5.1f} s  mean {wall.mean():5.1f} s  "
              f"= {np.median(wall) / args.limit_s:.2f}x the limit")


if __name__ == "__main__":
    main()
