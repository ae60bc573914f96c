"""Real multi-process exchanges: N=4 replica processes over file:// and moto S3, with SIGKILLed replicas."""

from __future__ import annotations

import json
import multiprocessing
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from support.allreduce_worker import make_input
from support.allreduce_worker import run as worker_run

NUMEL = 1 << 20  # 4 MB of fp32 per replica
FAST: dict[str, Any] = dict(timeout_s=90.0, straggler_timeout_s=1.5, takeover_timeout_s=1.5, poll_interval_s=0.05)

pytestmark = pytest.mark.slow


def _context() -> Any:
    """A forkserver that imports torch and the exchange once; each replica is a fresh fork of it."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "s3fs", "diloco_serverless.exchange.allreduce", "diloco_serverless.store", "support.allreduce_worker"]
    )
    return ctx


def launch(
    url: str,
    out: Path,
    env: dict[str, str],
    *,
    world: int = 4,
    die: dict[int, str] | None = None,
    numel: int = NUMEL,
    **kw: Any,
) -> dict[int, int]:
    """Run ``world`` replica processes to completion; returns each rank's exit code."""
    out.mkdir(parents=True, exist_ok=True)
    procs = {}
    for r in range(world):
        spec = {
            "url": url,
            "rank": r,
            "world_size": world,
            "run_id": "mp",
            "numel": numel,
            "seed": 7,
            "out_dir": str(out),
            "die": (die or {}).get(r, ""),
            "env": env,
            **FAST,
            **kw,
        }
        procs[r] = _context().Process(target=worker_run, args=(spec,), name=f"replica-{r}")
        procs[r].start()
    codes = {}
    for r, p in procs.items():
        p.join(timeout=150)
        if p.exitcode is None:
            p.kill()
            pytest.fail(f"replica {r} did not finish within 150 s")
        codes[r] = p.exitcode
    return codes


def _assert_ok(out: Path, codes: dict[int, int]) -> None:
    for r, code in codes.items():
        err = out / f"rank-{r}.error"
        assert code in (0, -signal.SIGKILL), f"rank {r} exited {code}: {err.read_text() if err.exists() else ''}"


def results(out: Path, ranks: list[int]) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, list[dict[str, Any]]]]:
    tensors = {r: load_file(str(out / f"rank-{r}.safetensors")) for r in ranks}
    stats = {r: json.loads((out / f"rank-{r}.json").read_text()) for r in ranks}
    return tensors, stats


def check(
    out: Path, survivors: list[int], averaged: list[int], rounds: int = 1, numel: int = NUMEL
) -> dict[int, list[dict[str, Any]]]:
    tensors, stats = results(out, survivors)
    for k in range(rounds):
        expected = torch.stack([make_input(7, r, numel) * (k + 1) for r in averaged]).mean(0)
        first = tensors[survivors[0]][f"round-{k}"]
        torch.testing.assert_close(first, expected, atol=1e-6 * (k + 1), rtol=1e-6)
        for r in survivors:
            assert torch.equal(tensors[r][f"round-{k}"], first), f"rank {r} not bit-identical in round {k}"
    for r in survivors:
        assert stats[r][-1]["participants"] == averaged
    return stats


def test_four_processes_over_file(file_store_url: str, tmp_path: Path) -> None:
    codes = launch(file_store_url, tmp_path / "out", {}, rounds=2)
    _assert_ok(tmp_path / "out", codes)
    assert set(codes.values()) == {0}
    stats = check(tmp_path / "out", [0, 1, 2, 3], [0, 1, 2, 3], rounds=2)
    p = 4 * NUMEL
    for s in stats.values():  # per replica: P + P/N up, 2P(N-1)/N down (+ small JSON)
        assert s[-1]["bytes_up"] == pytest.approx(p * 1.25, rel=0.01)
        assert s[-1]["bytes_down"] == pytest.approx(p * 1.5, rel=0.01)


def test_four_processes_over_moto_s3(s3_store_url: str, s3_env: dict[str, str], tmp_path: Path) -> None:
    codes = launch(s3_store_url, tmp_path / "out", s3_env, rounds=2)
    _assert_ok(tmp_path / "out", codes)
    assert set(codes.values()) == {0}
    check(tmp_path / "out", [0, 1, 2, 3], [0, 1, 2, 3], rounds=2)


def test_replica_killed_before_contributing_is_left_out(file_store_url: str, tmp_path: Path) -> None:
    codes = launch(file_store_url, tmp_path / "out", {}, die={3: "before-contrib"}, min_replicas=3)
    _assert_ok(tmp_path / "out", codes)
    assert codes[3] == -signal.SIGKILL and [codes[r] for r in range(3)] == [0, 0, 0]
    check(tmp_path / "out", [0, 1, 2], [0, 1, 2])


def test_owner_killed_after_contributing_is_taken_over_s3(
    s3_store_url: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    numel = 1 << 18
    codes = launch(s3_store_url, tmp_path / "out", s3_env, die={2: "after-ready"}, numel=numel)
    _assert_ok(tmp_path / "out", codes)
    assert codes[2] == -signal.SIGKILL
    stats = check(tmp_path / "out", [0, 1, 3], [0, 1, 2, 3], numel=numel)
    assert any(2 in s[-1]["takeovers"] for s in stats.values())  # rank 2 owned shard 2


def test_foreign_object_refused_by_every_process(file_store_url: str, tmp_path: Path) -> None:
    from diloco_serverless.exchange.codec import ShardHeader, encode_shard
    from diloco_serverless.run.layout import reduced_key
    from diloco_serverless.store.objectstore import ObjectStore

    numel = 4096
    foreign = ShardHeader("someone-else", 0, 1, "reduced", "fp32", numel // 4, None, "torch.float32", [numel])
    ObjectStore(file_store_url).child("mp").put(reduced_key(0, 1), encode_shard(torch.zeros(numel // 4), foreign))
    codes = launch(file_store_url, tmp_path / "out", {}, numel=numel)
    assert codes == {0: 1, 1: 1, 2: 1, 3: 1}
    for r in range(4):
        msg = (tmp_path / "out" / f"rank-{r}.error").read_text()
        assert msg.startswith("CorruptObjectError") and "another run" in msg and "reduced/0001" in msg
        assert not (tmp_path / "out" / f"rank-{r}.safetensors").exists()
