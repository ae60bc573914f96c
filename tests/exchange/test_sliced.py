"""SlicedAllReduce: G slices of each replica's exchange on a real file:// store, one quorum per round."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from diloco_serverless.exchange._io import shard_bounds
from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.sliced import SlicedAllReduce

P = 100_000  # elements of the whole (unsliced) tensor (object headers are then <1% of a slice)


def _data(replicas: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {r: torch.randn(P, generator=gen) for r in range(replicas)}


def _run(store: str, replicas: int, slices: int, *, delay: dict[tuple[int, int], float] | None = None,
         **opts: object) -> dict[tuple[int, int], tuple[torch.Tensor, ObjectStoreAllReduce]]:
    """Every (rank, slice) in its own thread, one round; returns (reduced slice, exchange) per pair."""
    data, out, errors = _data(replicas), {}, []

    def one(rank: int, g: int) -> None:
        try:
            ex = SlicedAllReduce(store, rank, replicas, slice_index=g, slices=slices, run_id="run", timeout_s=60,
                                 poll_interval_s=0.02, **opts)  # type: ignore[arg-type]
            a, b = shard_bounds(P, slices)[g]
            time.sleep((delay or {}).get((rank, g), 0.0))
            out[(rank, g)] = (ex.allreduce(data[rank][a:b], round=0), ex)
            ex.close()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r, g)) for r in range(replicas) for g in range(slices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return out


def _quorum(root: Path, g: int) -> list[int]:
    return json.loads((root / f"run/slices/{g:02d}/rounds/00000000/quorum.json").read_text())["participants"]


def test_slices_reassemble_the_exact_mean_with_one_quorum(tmp_path: Path) -> None:
    out = _run(f"file://{tmp_path}", 3, 2)
    data = _data(3)
    # the reduction sums in rank order in fp32, exactly as the reference below
    want = (data[0] + data[1] + data[2]) / 3
    for r in range(3):
        whole = torch.cat([out[(r, g)][0] for g in range(2)])
        assert torch.equal(whole, want)
    assert _quorum(tmp_path, 0) == _quorum(tmp_path, 1) == [0, 1, 2]


def test_bytes_per_slice_are_one_over_g(tmp_path: Path) -> None:
    sliced = _run(f"file://{tmp_path}/g2", 3, 2)
    whole: dict[int, int] = {}

    def plain(rank: int) -> None:
        ex = ObjectStoreAllReduce(f"file://{tmp_path}/g1", rank, 3, run_id="run", timeout_s=60, poll_interval_s=0.02)
        ex.allreduce(_data(3)[rank], round=0)
        assert ex.last_stats is not None
        whole[rank] = ex.last_stats.bytes_up
        ex.close()

    threads = [threading.Thread(target=plain, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # counted outside the exchange: the sizes of the objects each (rank, slice) wrote
    for r in range(3):
        full = sum(p.stat().st_size for p in (tmp_path / "g1/run/rounds/00000000/contrib").glob(f"*/rank-{r}"))
        for g in range(2):
            part = sum(p.stat().st_size for p in
                       (tmp_path / f"g2/run/slices/{g:02d}/rounds/00000000/contrib").glob(f"*/rank-{r}"))
            assert abs(part - full / 2) < 0.05 * full, (part, full)
            stats = sliced[(r, g)][1].last_stats
            assert stats is not None and stats.bytes_up < 0.6 * whole[r]


def test_a_replica_is_in_a_round_with_all_slices_or_none(tmp_path: Path) -> None:
    """Replica 2's slice 1 publishes after the straggler deadline: its slice 0 (published in time)
    must not make it a participant, so the quorum of both slices is [0, 1] and replica 2 receives
    the others' mean in both slices (late), never a mix."""
    out = _run(f"file://{tmp_path}", 3, 2, delay={(2, 1): 2.5}, min_replicas=2, straggler_timeout_s=0.5)
    data = _data(3)
    want = (data[0] + data[1]) / 2
    assert _quorum(tmp_path, 0) == _quorum(tmp_path, 1) == [0, 1]
    for r in range(3):
        assert torch.equal(torch.cat([out[(r, g)][0] for g in range(2)]), want)
        for g in range(2):
            stats = out[(r, g)][1].last_stats
            assert stats is not None and stats.late == (r == 2), (r, g)


def test_slice_outside_the_replica_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"slice_index must satisfy 0 <= slice_index < slices=2, got 2.*LOCAL_RANK"):
        SlicedAllReduce(f"file://{tmp_path}", 0, 2, slice_index=2, slices=2)


def test_sparse_slices_compress_each_its_own_slice_with_error_feedback(tmp_path: Path) -> None:
    """parallel.devices > 1 with the sparse codec: each slice is chunked and compressed on its own, keeps its
    own error-feedback buffer, and the reassembled mean is the rank-order mean of the decoded slices."""
    from diloco_serverless.exchange import sparse

    codec = "sparse-8of256-2bit"
    spec = sparse.parse(codec)
    out = _run(f"file://{tmp_path}", 3, 2, codec=codec, error_feedback=True, feedback_decay=0.95, topology="auto")
    data = _data(3)
    for g, (a, b) in enumerate(shard_bounds(P, 2)):
        parts = [sparse.decode(sparse.encode(data[r][a:b], spec), spec, b - a) for r in range(3)]
        want = (parts[0] + parts[1] + parts[2]) / 3
        for r in range(3):
            got, ex = out[(r, g)]
            assert torch.equal(got, want)
            assert torch.equal(ex.residuals()["default"], data[r][a:b] - parts[r])  # this slice's buffer
