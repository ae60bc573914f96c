"""Sparse pseudo-gradients (exchange.codec = "sparse"): bits per parameter, and the bytes a replica moves
per round, counted at the store, against fp32 and int8 sharded rounds.

Run (from the repo root, venv active; a few minutes on a shared 2-core machine):

    python benchmarks/sparse.py                 # bits, real rounds at N in {4, 8, 32}, the simulation to 1,024
    python benchmarks/sparse.py --params 262144 --ns 4,8   # smaller and faster

Part 1, bits per parameter: each (k of chunk, bits) setting's exact payload (``exchange.codec.payload_bytes``)
and one real object's size with its signed header, for a 64M-parameter tensor.

Part 2, real rounds: N replicas as threads, each its own ``ObjectStoreAllReduce`` on a ``memory://`` store
wrapped in a store that counts the bytes of every GET and PUT it serves (outside the code under test),
``--params`` fp32 values per replica; one untimed round, then the counted one. fp32 and int8 use the
sharded (flat) round; sparse uses ``--topology auto``, which picks its direct all-gather.

Part 3, the simulation (no data moved): per-replica bytes of one round at N up to 1,024 for a 100M-parameter
pseudo-gradient, from benchmarks/scale.py's request schedule of the flat and hierarchical rounds (object
sizes rescaled per codec: contributions in the round's codec, reduced shards int8 for a sparse round, group
partials fp32) and, for a direct sparse round, one object up and N - 1 down. ``auto`` is what
``exchange.topology.resolve`` picks for each codec.

Prints tables and writes benchmarks/results/sparse.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce  # noqa: E402
from diloco_serverless.exchange.codec import ShardHeader, encode_shard, payload_bytes  # noqa: E402
from diloco_serverless.exchange.topology import resolve, sharded_round_bytes  # noqa: E402
from support.recording_store import RecordingStore  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "sparse.json"
MB = 1 << 20
SETTINGS = [(16, 4096, 2), (64, 4096, 2), (256, 4096, 2), (64, 4096, 4), (64, 4096, 8), (16, 1024, 2)]


class ByteStore(RecordingStore):  # type: ignore[misc]
    """Counts the bytes of every GET answered and every PUT sent through it and the stores derived from it
    (which copy its attributes: the counter is one shared list, ``[up, down]``)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.moved = [0, 0]
        self._bytes_lock = threading.Lock()

    @property
    def up(self) -> int:
        return self.moved[0]

    @property
    def down(self) -> int:
        return self.moved[1]

    def _count(self, i: int, nbytes: int) -> None:
        with self._bytes_lock:
            self.moved[i] += nbytes

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        data: bytes = super().get(key, max_bytes=max_bytes)
        self._count(1, len(data))
        return data

    def put(self, key: str, data: bytes) -> None:
        self._count(0, len(data))
        super().put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._count(0, len(data))  # a create-only PUT sends its body whether or not it wins
        created: bool = super().put_if_absent(key, data)
        return created


# --------------------------------------------------------------------------- part 1


def bits_table(numel: int) -> list[dict[str, Any]]:
    rows = []
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    for codec in ["fp32", "int8"] + [f"sparse-{k}of{c}-{b}bit" for k, c, b in SETTINGS]:
        obj = len(encode_shard(x, ShardHeader("run", 0, 0, "contrib", codec, numel, 0, "torch.float32", [numel])))
        rows.append({"codec": codec, "payload_bytes": payload_bytes(codec, numel), "object_bytes": obj,
                     "bits_per_param": 8 * payload_bytes(codec, numel) / numel,
                     "object_bits_per_param": 8 * obj / numel,
                     "vs_fp32": payload_bytes("fp32", numel) / payload_bytes(codec, numel)})
    return rows


# --------------------------------------------------------------------------- part 2


def real_round(n: int, codec: str, topology: str, numel: int) -> dict[str, Any]:
    url = f"memory://sparse-bench-{uuid.uuid4().hex[:8]}"
    stores = [ByteStore(url) for _ in range(n)]
    counted: dict[int, tuple[int, int]] = {}
    errors: list[BaseException] = []
    wall: dict[int, float] = {}
    protocol: dict[int, str] = {}
    barrier = threading.Barrier(n)

    def one(r: int) -> None:
        try:
            x = torch.randn(numel, generator=torch.Generator().manual_seed(r))
            with ObjectStoreAllReduce(stores[r], r, n, run_id="bench", codec=codec, topology=topology,
                                      keep_rounds=None, timeout_s=600, straggler_timeout_s=300,
                                      takeover_timeout_s=300, poll_interval_s=0.05) as ar:
                ar.allreduce(x)  # untimed: the next round is a steady-state one
                barrier.wait()
                up0, down0, t0 = stores[r].up, stores[r].down, time.perf_counter()
                ar.allreduce(x)
                wall[r] = time.perf_counter() - t0
                counted[r] = (stores[r].up - up0, stores[r].down - down0)
                protocol[r] = ar.protocol
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    up = sum(u for u, _ in counted.values()) / n
    down = sum(d for _, d in counted.values()) / n
    return {"n": n, "codec": codec, "protocol": protocol[0], "numel": numel, "up_bytes": up, "down_bytes": down,
            "total_bytes": up + down, "bits_up_per_param": 8 * up / numel, "wall_s": max(wall.values())}


# --------------------------------------------------------------------------- part 3


def simulated_bytes(n: int, codec: str, numel: int) -> dict[str, Any]:
    """Per-replica (mean) bytes of one round of ``codec`` under ``auto`` at N = ``n`` (see the docstring)."""
    import scale

    sparse = codec.startswith("sparse")
    compressed = (payload_bytes(codec, numel), payload_bytes("int8", numel)) if sparse else None
    protocol = resolve("auto", n, payload_bytes(codec, numel), compressed=compressed)
    if protocol == "direct":
        obj = payload_bytes(codec, numel) + scale.HEADER_BYTES
        return {"n": n, "codec": codec, "protocol": protocol, "up_bytes": obj, "down_bytes": (n - 1) * obj}
    per_elem = payload_bytes(codec, numel) / numel
    int8_elem = payload_bytes("int8", numel) / numel
    up = down = 0.0
    for phase in scale.schedule(n, protocol, 4 * numel):
        for reqs in phase.reqs.values():
            for req in reqs:
                body = max(0, req.nbytes - scale.HEADER_BYTES)
                if "/contrib/" in req.key:
                    size = body * per_elem / 4 + scale.HEADER_BYTES
                elif "/reduced" in req.key:
                    size = body * (int8_elem if sparse else per_elem) / 4 + scale.HEADER_BYTES
                else:  # partials (fp32) and control objects
                    size = req.nbytes
                if req.op == "PUT":
                    up += size
                elif req.op == "GET":
                    down += size
    return {"n": n, "codec": codec, "protocol": protocol, "up_bytes": up / n, "down_bytes": down / n}


# --------------------------------------------------------------------------- driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=1 << 20, help="fp32 values per replica in the real rounds")
    ap.add_argument("--ns", default="4,8,32", help="replica counts of the real rounds")
    ap.add_argument("--sim-params", type=float, default=100e6, help="values of the simulated pseudo-gradient")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    ns = [int(x) for x in args.ns.split(",") if x]
    torch.set_num_threads(1)

    print("Part 1: bits per parameter (64M-parameter tensor)")
    bits = bits_table(64 << 20)
    print(f"{'codec':24} {'payload MB':>10} {'object MB':>10} {'bits/param':>10} {'obj bits':>9} {'x fewer':>8}")
    for r in bits:
        print(f"{r['codec']:24} {r['payload_bytes'] / MB:>10.3f} {r['object_bytes'] / MB:>10.3f} "
              f"{r['bits_per_param']:>10.4f} {r['object_bits_per_param']:>9.4f} {r['vs_fp32']:>7.1f}x")

    print(f"\nPart 2: real rounds, {args.params:,} fp32 values per replica, bytes per replica per round counted at "
          "the store (mean over replicas)")
    real = []
    print(f"{'N':>3} {'codec':8} {'protocol':8} {'up MB':>8} {'down MB':>8} {'total MB':>9} {'up bits/p':>9} "
          f"{'int8 up / this':>14} {'int8 total / this':>17} {'wall s':>7}")
    for n in ns:
        by_codec = {}
        for codec, topology in (("fp32", "flat"), ("int8", "flat"), ("sparse", "auto")):
            row = real_round(n, codec, topology, args.params)
            by_codec[codec] = row
            real.append(row)
        for codec, row in by_codec.items():
            i8 = by_codec["int8"]
            print(f"{n:>3} {codec:8} {row['protocol']:8} {row['up_bytes'] / MB:>8.3f} {row['down_bytes'] / MB:>8.3f} "
                  f"{row['total_bytes'] / MB:>9.3f} {row['bits_up_per_param']:>9.4f} "
                  f"{i8['up_bytes'] / row['up_bytes']:>13.1f}x {i8['total_bytes'] / row['total_bytes']:>16.2f}x "
                  f"{row['wall_s']:>7.2f}", flush=True)

    numel = int(args.sim_params)
    print(f"\nPart 3: simulated round, {numel:,} parameters, bytes per replica under auto")
    sim = []
    print(f"{'N':>5} {'int8 protocol':13} {'int8 MB':>9} {'sparse protocol':15} {'sparse up MB':>12} "
          f"{'sparse MB':>10} {'int8 / sparse':>13} {'flat int8 bound MB':>18}")
    for n in (2, 4, 8, 16, 32, 64, 100, 107, 108, 128, 256, 512, 1024):
        i8, sp = simulated_bytes(n, "int8", numel), simulated_bytes(n, "sparse", numel)
        t8, ts = i8["up_bytes"] + i8["down_bytes"], sp["up_bytes"] + sp["down_bytes"]
        bound = sharded_round_bytes(payload_bytes("int8", numel), n)
        sim.append({"n": n, "int8": i8, "sparse": sp, "int8_flat_bound_bytes": bound})
        print(f"{n:>5} {i8['protocol']:13} {t8 / MB:>9.1f} {sp['protocol']:15} {sp['up_bytes'] / MB:>12.2f} "
              f"{ts / MB:>10.1f} {t8 / ts:>12.2f}x {bound / MB:>18.1f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform(),
                                           "torch": torch.__version__},
                               "bits": bits, "real": real, "simulated": sim}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
