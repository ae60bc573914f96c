"""One replica of a multi-process exchange test: ``python tests/support/allreduce_worker.py '<json spec>'``,
or :func:`run` as the target of a ``multiprocessing`` forkserver process (what the tests do: the
forkserver imports torch once, then every replica is a real, separately killable process).

Spec keys: url, rank, world_size, run_id, numel, seed, out_dir, rounds (default 1), die
("" | "before-contrib" | "after-ready": SIGKILL itself at that point), env (variables to set
first, e.g. the moto endpoint), plus any
ObjectStoreAllReduce keyword (codec, min_replicas, timeouts). The input of rank r is
``randn(numel)`` seeded with ``seed * 1000 + r`` (see :func:`make_input`), times the round + 1.
Writes ``<out_dir>/rank-<r>.safetensors`` (outputs ``round-<k>``) and ``rank-<r>.json`` (stats);
on an exception writes ``rank-<r>.error`` with its type and message and exits 1.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

_ARGS = ("url", "rank", "world_size", "run_id", "numel", "seed", "out_dir", "rounds", "die", "env")


def make_input(seed: int, rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1000 + rank))


def _install_death(die: str) -> None:
    """SIGKILL this process before its first contribution, or right after its ready marker (in a round
    without a quorum: right after its vote)."""
    from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
    from diloco_serverless.exchange.votes import VotedRound

    def dying(original: Any) -> Any:
        def publish(self: Any, *args: Any, **kwargs: Any) -> Any:
            if die == "before-contrib":
                os.kill(os.getpid(), signal.SIGKILL)
            out = original(self, *args, **kwargs)
            if die == "after-ready":
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        return publish

    ObjectStoreAllReduce._publish = dying(ObjectStoreAllReduce._publish)  # type: ignore[method-assign]
    VotedRound.publish = dying(VotedRound.publish)  # type: ignore[method-assign]


def main(spec: dict[str, Any]) -> int:
    from safetensors.torch import save_file

    from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce

    os.environ.update(spec.get("env") or {})
    torch.set_num_threads(1)
    out = Path(spec["out_dir"])
    rank = int(spec["rank"])
    if spec.get("die"):
        _install_death(spec["die"])
    kwargs = {k: v for k, v in spec.items() if k not in _ARGS}
    x = make_input(int(spec["seed"]), rank, int(spec["numel"]))
    results: dict[str, torch.Tensor] = {}
    stats: list[dict[str, Any]] = []
    try:
        with ObjectStoreAllReduce(spec["url"], rank, int(spec["world_size"]), run_id=spec["run_id"], **kwargs) as ar:
            for k in range(int(spec.get("rounds", 1))):
                results[f"round-{k}"] = ar.allreduce(x * (k + 1))
                stats.append(asdict(ar.last_stats) if ar.last_stats else {})
    except Exception as e:
        (out / f"rank-{rank}.error").write_text(f"{type(e).__name__}: {e}")
        return 1
    save_file(results, str(out / f"rank-{rank}.safetensors"))
    (out / f"rank-{rank}.json").write_text(json.dumps(stats))
    return 0


def run(spec: dict[str, Any]) -> None:
    """Process target: :func:`main`, its return value as the exit code."""
    sys.exit(main(spec))


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
