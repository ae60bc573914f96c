"""The sparse encoder's fast top-k (diloco_serverless.exchange.sparse._top_k, blocked magnitudes) writes the
same bytes as the straightforward encoder it replaced: ``torch.topk`` of every chunk's magnitudes, kept
here as the reference; random inputs, ties at the boundary, zero chunks and a short last chunk."""

from __future__ import annotations

import pytest
import torch

from diloco_serverless.exchange import codec, sparse
from diloco_serverless.exchange.sparse import SparseSpec

SPECS = [SparseSpec(), SparseSpec(8, 16, 4), SparseSpec(64, 4096, 8), SparseSpec(16, 16, 2), SparseSpec(3, 32, 2),
         SparseSpec(4, 256, 2), SparseSpec(1, 64, 4), SparseSpec(16, 1024, 2)]


def reference_encode(values: torch.Tensor, spec: SparseSpec) -> dict[str, torch.Tensor]:
    """The encoder before the fast path (one ``topk`` over every chunk's magnitudes), verbatim in effect."""
    values = values.reshape(-1).float()
    n = values.numel()
    chunks = -(-n // spec.chunk)
    last = min(spec.k, n - (chunks - 1) * spec.chunk)
    magnitude = values.abs()
    full = n // spec.chunk
    idx_parts, val_parts = [], []
    if full:
        blocks = values[: full * spec.chunk].view(full, spec.chunk)
        idx = magnitude[: full * spec.chunk].view(full, spec.chunk).topk(spec.k, dim=1, sorted=False).indices
        idx = idx.sort(dim=1).values
        idx_parts.append(idx)
        val_parts.append(blocks.gather(1, idx))
    if full < chunks:
        tail = values[full * spec.chunk :]
        idx = magnitude[full * spec.chunk :].topk(last, sorted=False).indices.sort().values
        idx_parts.append(idx.view(1, -1))
        val_parts.append(tail[idx].view(1, -1))
    scales = torch.cat([v.abs().amax(dim=1) for v in val_parts])
    levels = 1 << (spec.bits - 1)
    codes, row = [], 0
    for v in val_parts:
        s = scales[row : row + v.shape[0], None]
        mag = torch.where(s > 0, v.abs() / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(v))
        m = (mag * levels).round_().sub_(1).clamp_(0, levels - 1).to(torch.int64)
        codes.append(((v < 0).to(torch.int64) << (spec.bits - 1)) | m)
        row += v.shape[0]
    fields = torch.cat([((i.to(torch.int64) << spec.bits) | c).reshape(-1) for i, c in zip(idx_parts, codes)])
    return {"packed": sparse._pack_bits(fields, spec.field_bits), "scales": scales.contiguous()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
        and bytes(a[n].contiguous().view(torch.uint8).numpy()) == bytes(b[n].contiguous().view(torch.uint8).numpy())
        for n in a
    )


def inputs(spec: SparseSpec, seed: int) -> list[torch.Tensor]:
    """Vectors that exercise the fast path's every branch: continuous values, a short last chunk, values
    drawn from a few levels (ties at the k-th largest in most chunks), zero chunks, -0.0, one chunk only."""
    g = torch.Generator().manual_seed(seed)
    c = spec.chunk
    n = 5 * c + c // 3 + 1
    cont = torch.randn(n, generator=g)
    few = torch.randint(-3, 4, (n,), generator=g).float() * 0.5  # ties everywhere
    mixed = torch.randn(n, generator=g)
    mixed[c : 2 * c] = 0.0  # a zero chunk
    mixed[2 * c : 3 * c] = -0.0
    mixed[3 * c : 3 * c + c // 2] = mixed[3 * c]  # half a chunk equal
    spiky = torch.zeros(n)
    spiky[torch.randint(0, n, (n // 50,), generator=g)] = torch.randn(n // 50, generator=g)  # fewer than k non-zeros
    tiny = torch.randn(3 * c, generator=g) * 1e-30
    return [cont, cont[: 4 * c], few, mixed, spiky, cont[: c // 2 + 1], cont[:1], tiny]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_encoder_writes_the_reference_bytes(spec: SparseSpec, seed: int) -> None:
    for x in inputs(spec, seed):
        assert same(sparse.encode(x, spec), reference_encode(x, spec)), (spec.name, x.numel())


def test_blocks_smaller_than_the_vector_write_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SparseSpec()
    x = torch.randn(7 * spec.chunk + 100, generator=torch.Generator().manual_seed(5))
    x[3 * spec.chunk : 4 * spec.chunk] = torch.randint(0, 3, (spec.chunk,)).float()  # a tied chunk in block 2
    want = reference_encode(x, spec)
    monkeypatch.setattr(sparse, "_BLOCK_VALUES", 2 * spec.chunk)  # 4 blocks of 2 chunks
    assert same(sparse.encode(x, spec), want)


def test_the_fast_path_is_taken_where_it_looks_at_fewer_values() -> None:
    assert sparse._group_size(4096, 64) == 8  # 512 maxima + 520 candidates of 4,096
    assert sparse._group_size(4096, 1024) == 1  # dense enough: plain topk
    assert sparse._group_size(16, 8) == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused_in_any_block(bad: float, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SparseSpec()
    monkeypatch.setattr(sparse, "_BLOCK_VALUES", spec.chunk)
    for pos in (0, 3 * spec.chunk + 7, 4 * spec.chunk + 5):  # first block, a later block, the short last chunk
        x = torch.randn(4 * spec.chunk + 10)
        x[pos] = bad
        with pytest.raises(ValueError, match="inf/NaN"):
            sparse.encode(x, spec)


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.int32).numpy())


@pytest.mark.parametrize("in_place", [False, True])
def test_the_residual_of_sparse_values_as_sent_has_the_dense_subtractions_bits(in_place: bool) -> None:
    """Error feedback's ``e -= decode(c)`` from the sent values: the same bits as subtracting the dense
    decode (-0.0 in the input and a forged -0.0 kept value included), pieces joined in order."""
    spec = SparseSpec()
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(3 * spec.chunk + 77, generator=g)
    flat[:50] = -0.0
    flat[spec.chunk : 2 * spec.chunk] = 0.0  # a zero chunk: its kept values decode to 0 * scale
    cut = 2 * spec.chunk
    sent = []
    for a, b in ((0, cut), (cut, flat.numel())):
        enc = sparse.encode(flat[a:b], spec)
        sent.append(codec.decode_as_sent(enc, spec.name, b - a))
    assert all(isinstance(s, sparse.SparseValues) for s in sent)
    sent[0].values[0] = -0.0  # as a forged payload could decode
    want = flat - torch.cat([s.to_dense() for s in sent if isinstance(s, sparse.SparseValues)])
    x = flat.clone()
    got = codec.residual(x, sent, in_place=in_place)
    assert bits(got) == bits(want)
    assert (got.data_ptr() == x.data_ptr()) == in_place
    if not in_place:
        assert bits(x) == bits(flat)  # the input untouched


def test_the_residual_of_dense_values_is_the_plain_subtraction() -> None:
    flat = torch.randn(1000)
    enc = codec.encode_values(flat, "int8")
    sent = [codec.decode_as_sent(enc, "int8", 1000)]
    assert isinstance(sent[0], torch.Tensor)
    assert bits(codec.residual(flat, sent)) == bits(flat - sent[0])
    with pytest.raises(ValueError, match="cannot subtract"):
        codec.residual(torch.zeros(10), [sparse.decode_sparse(sparse.encode(torch.ones(20), SparseSpec()),
                                                               SparseSpec(), 20)])
