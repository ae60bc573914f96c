"""The sparse codec (diloco_serverless.exchange.sparse): chunked top-k, 2/4/8-bit codes, packed indices,
in the signed safetensors envelope; its strict decoder against forged payloads (hypothesis, a few seconds)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_serverless.exchange import sparse
from diloco_serverless.exchange.codec import (
    ShardHeader,
    decode_shard,
    decode_summand,
    encode_shard,
    max_object_bytes,
    pack,
    payload_bytes,
    reduced_codec,
    validate_codec,
)
from diloco_serverless.exchange.errors import CorruptObjectError
from diloco_serverless.exchange.robust import guarded_sum
from diloco_serverless.exchange.sparse import SparseSpec, SparseValues

KEY = "rounds/00000003/contrib/0001/rank-2"
FUZZ = settings(max_examples=120, deadline=3000, database=None, suppress_health_check=[HealthCheck.too_slow])
SPECS = [SparseSpec(), SparseSpec(8, 16, 4), SparseSpec(64, 4096, 8), SparseSpec(16, 16, 2), SparseSpec(3, 32, 2)]


def _expect(codec: str, numel: int) -> ShardHeader:
    return ShardHeader("run-a", 3, 1, "contrib", codec, numel, 2, "torch.float32", [numel])


def check(data: bytes, expect: ShardHeader) -> torch.Tensor | None:
    """A finite vector of ``expect.numel`` values, or a CorruptObjectError naming the key from an explicit check."""
    try:
        out = decode_shard(data, key=KEY, expect=expect)
    except CorruptObjectError as e:
        assert KEY in str(e)
        assert "could not be parsed" not in str(e), f"only the safety net caught it: {e}"
        with pytest.raises(CorruptObjectError) as sparse_error:  # the sparse decoding refuses it alike
            decode_summand(data, key=KEY, expect=expect)
        assert str(sparse_error.value) == str(e)
        return None
    assert out.dtype == torch.float32 and tuple(out.shape) == (expect.numel,)
    assert bool(torch.isfinite(out).all())
    kept = decode_summand(data, key=KEY, expect=expect)
    assert isinstance(kept, SparseValues) and same_bits(kept.to_dense(), out)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` takes ``-0.0`` for ``0.0``)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def reference_pack(fields: list[int], width: int) -> bytes:
    """Independent bit packer: a string of bits, least significant first, cut into bytes."""
    bits = "".join(format(f, f"0{width}b")[::-1] for f in fields)
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i : i + 8][::-1], 2) for i in range(0, len(bits), 8))


# --------------------------------------------------------------------------- names and sizes


def test_codec_names_fix_the_layout() -> None:
    assert validate_codec("sparse") == "sparse-64of4096-2bit"
    assert validate_codec("sparse-8of16-4bit") == "sparse-8of16-4bit"
    assert sparse.parse("sparse-8of16-4bit") == SparseSpec(8, 16, 4)
    assert reduced_codec("sparse-8of16-4bit") == "int8" and reduced_codec("bf16") == "bf16"
    for bad, what in [("sparse-64of4000-2bit", "power of two"), ("sparse-65of32-2bit", "between 1"),
                      ("sparse-4of16-3bit", "bits must be one of 2, 4, 8"), ("sparse-x", "of the form")]:
        with pytest.raises(ValueError, match=what):
            validate_codec(bad)


def test_default_is_under_a_quarter_bit_per_parameter() -> None:
    n = 1 << 22
    x = torch.randn(n)
    data = encode_shard(x, _expect("sparse", n))
    assert payload_bytes("sparse", n) == (64 * (12 + 2) // 8 + 4) * (n // 4096)
    assert sparse.bits_per_value(sparse.DEFAULT, n) == pytest.approx((64 * 14 + 32) / 4096)
    assert sparse.bits_per_value(sparse.DEFAULT, n) <= 0.25
    assert len(data) <= max_object_bytes("sparse", n)
    assert 8 * len(data) / n <= 0.25  # header included
    assert len(encode_shard(x, _expect("fp32", n))) / len(data) > 140


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 100, 4096, 4097, 10_007])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_round_trip_keeps_the_top_k_of_every_chunk(spec: SparseSpec, n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    enc = sparse.encode(x, spec)
    assert sum(t.numel() * t.element_size() for t in enc.values()) == sparse.payload_bytes(spec, n)
    y = sparse.decode(enc, spec, n)
    assert y.shape == (n,) and y.dtype == torch.float32
    levels = 1 << (spec.bits - 1)
    for a in range(0, n, spec.chunk):
        xc, yc = x[a : a + spec.chunk], y[a : a + spec.chunk]
        k = min(spec.k, xc.numel())
        top = set(xc.abs().topk(k).indices.tolist())
        assert set(torch.nonzero(yc).flatten().tolist()) == top  # random values: no ties, no zeros
        s = xc.abs().max()
        kept = torch.tensor(sorted(top))
        assert torch.equal(torch.sign(yc[kept]), torch.sign(xc[kept]))
        assert bool(((yc[kept] - xc[kept]).abs() <= s / levels * (1 + 1e-6)).all())
        assert yc.abs().max() == pytest.approx(float(s), rel=1e-6)  # the largest is exact


def test_full_density_eight_bits_is_close_and_zero_chunks_decode_to_zero() -> None:
    spec = SparseSpec(16, 16, 8)
    x = torch.randn(160)
    x[16:32] = 0.0
    y = sparse.decode(sparse.encode(x, spec), spec, 160)
    assert torch.equal(y[16:32], torch.zeros(16))
    assert float((x - y).abs().max()) <= float(x.abs().max()) / 128


def test_packing_matches_an_independent_bit_packer() -> None:
    spec = SparseSpec(4, 16, 4)
    x = torch.tensor([0.0, 5.0, 0.0, -1.0, 0.1, 0.0, 0.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.2,
                      0.0, 0.0, 3.0])  # a full chunk and a last chunk of 3 values (one non-zero)
    enc = sparse.encode(x, spec)
    # chunk 0: scale 5; kept 1 (5), 3 (-1), 7 (2.5), 15 (-0.2); codes: sign<<3 | round(|v|/5*8)-1
    # chunk 1: scale 3; kept all 3 values (0, 1, 2): 0 -> magnitude 0 (lowest level), 3 -> 7
    fields = [(1 << 4) | 7, (3 << 4) | 8 | 1, (7 << 4) | 3, (15 << 4) | 8 | 0,
              (0 << 4) | 0, (1 << 4) | 0, (2 << 4) | 7]
    assert bytes(enc["packed"].tolist()) == reference_pack(fields, 8)
    assert enc["scales"].tolist() == [5.0, 3.0]
    spec12 = SparseSpec(64, 4096, 2)
    rng = torch.Generator().manual_seed(1)
    fields12 = torch.randint(0, 1 << 14, (1000,), generator=rng)
    assert bytes(sparse._pack_bits(fields12, 14).tolist()) == reference_pack(fields12.tolist(), 14)
    assert torch.equal(sparse._unpack_bits(sparse._pack_bits(fields12, 14), 14, 1000), fields12)
    assert spec12.field_bits == 14


@pytest.mark.parametrize("width", range(6, 25))
def test_packing_matches_a_reference_at_every_field_width(width: int) -> None:
    # index bits 4..16 plus 2, 4 or 8 value bits: every width a layout can have, every bit offset mod 8
    fields = torch.randint(0, 1 << width, (37,), generator=torch.Generator().manual_seed(width))
    packed = sparse._pack_bits(fields, width)
    assert bytes(packed.tolist()) == reference_pack(fields.tolist(), width)
    assert torch.equal(sparse._unpack_bits(packed, width, 37), fields)


def test_large_vectors_round_trip() -> None:
    spec = SparseSpec(64, 256, 2)
    n = 256 * 4099 + 17
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    y = sparse.decode(sparse.encode(x, spec), spec, n)
    assert int((y != 0).sum()) == 64 * (n // 256) + 17


def test_encoder_refuses_non_finite() -> None:
    with pytest.raises(ValueError, match="inf/NaN"):
        sparse.encode(torch.tensor([1.0, float("nan")]), sparse.DEFAULT)


# --------------------------------------------------------------------------- the strict decoder


def _forged(packed: torch.Tensor, scales: torch.Tensor, codec: str, numel: int) -> bytes:
    """An object with a valid checksum around any payload (the checksum is no secret)."""
    return pack({"packed": packed, "scales": scales}, asdict(_expect(codec, numel)))


def _layout(spec: SparseSpec, n: int) -> tuple[int, int]:
    chunks, entries, _ = sparse._entries(spec, n)
    return -(-entries * spec.field_bits // 8), chunks


@pytest.mark.parametrize("spec", SPECS[:3], ids=lambda s: s.name)
def test_every_truncation_and_extension_is_refused(spec: SparseSpec) -> None:
    n = 100
    data = encode_shard(torch.randn(n), _expect(spec.name, n))
    assert check(data, _expect(spec.name, n)) is not None
    for cut in range(len(data)):
        assert check(data[:cut], _expect(spec.name, n)) is None, cut
    assert check(data + b"\0", _expect(spec.name, n)) is None


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 200), spec=st.sampled_from(SPECS),
       scales=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=0, max_size=20))
def test_any_payload_with_a_valid_checksum_decodes_or_is_refused(
    seed: int, n: int, spec: SparseSpec, scales: list[float]
) -> None:
    nbytes, chunks = _layout(spec, n)
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    s = torch.tensor((scales + [1.0] * chunks)[:chunks], dtype=torch.float32)
    out = check(_forged(packed, s, spec.name, n), _expect(spec.name, n))
    if out is not None:  # accepted: at most k values per chunk, none larger than the chunk's scale
        for c in range(chunks):
            part = out[c * spec.chunk : (c + 1) * spec.chunk]
            assert int((part != 0).sum()) <= spec.k
            assert float(part.abs().max()) <= float(s[c])


@FUZZ
@given(pos=st.integers(0, 10**6), bit=st.integers(0, 7), spec=st.sampled_from(SPECS))
def test_any_flipped_payload_bit_decodes_or_is_refused(pos: int, bit: int, spec: SparseSpec) -> None:
    n = 300
    enc = sparse.encode(torch.randn(n, generator=torch.Generator().manual_seed(pos)), spec)
    packed = enc["packed"].clone()
    packed[pos % packed.numel()] ^= 1 << bit
    check(_forged(packed, enc["scales"], spec.name, n), _expect(spec.name, n))


def _fields_object(spec: SparseSpec, n: int, fields: list[int], scales: list[float]) -> bytes:
    packed = torch.tensor(list(reference_pack(fields, spec.field_bits)), dtype=torch.uint8)
    return _forged(packed, torch.tensor(scales), spec.name, n)


@pytest.mark.parametrize("fields, scales, match", [
    ([(1 << 2), (1 << 2), (3 << 2), (4 << 2), (0 << 2)], [1.0, 1.0], "strictly increasing"),
    ([(3 << 2), (1 << 2), (5 << 2), (6 << 2), (0 << 2)], [1.0, 1.0], "strictly increasing"),
    ([(1 << 2), (2 << 2), (3 << 2), (4 << 2), (1 << 2)], [1.0, 1.0], "past the end of its chunk"),
    ([(1 << 2), (2 << 2), (3 << 2), (4 << 2), (0 << 2)], [1.0, -1.0], "scales are NaN, infinite or negative"),
    ([(1 << 2), (2 << 2), (3 << 2), (4 << 2), (0 << 2)], [float("nan"), 1.0], "scales are NaN"),
])
def test_malformed_payloads_name_what_is_wrong(fields: list[int], scales: list[float], match: str) -> None:
    spec, n = SparseSpec(4, 16, 2), 17  # a chunk of 16 (4 entries) and a last chunk of 1 (1 entry)
    with pytest.raises(CorruptObjectError, match=f"{KEY}.*{match}"):
        decode_shard(_fields_object(spec, n, fields, scales), key=KEY, expect=_expect(spec.name, n))


def test_padding_bits_and_wrong_lengths_are_refused() -> None:
    spec, n = SparseSpec(4, 16, 2), 17
    good = [(1 << 2), (2 << 2), (3 << 2), (4 << 2), (0 << 2)]  # 5 fields of 6 bits: 30 bits, 2 padding
    data = _fields_object(spec, n, good, [1.0, 1.0])
    assert check(data, _expect(spec.name, n)) is not None
    packed = torch.tensor(list(reference_pack(good, 6)), dtype=torch.uint8)
    packed[-1] |= 0x80
    with pytest.raises(CorruptObjectError, match="padding bits"):
        decode_shard(_forged(packed, torch.ones(2), spec.name, n), key=KEY, expect=_expect(spec.name, n))
    for p, s in [(packed[:-1], torch.ones(2)), (packed, torch.ones(3)), (packed.to(torch.int8), torch.ones(2))]:
        with pytest.raises(CorruptObjectError, match="must hold exactly 'packed'"):
            decode_shard(_forged(p, s, spec.name, n), key=KEY, expect=_expect(spec.name, n))
    other = SparseSpec(4, 16, 4)  # another layout's payload under this codec's name: refused by its length
    enc = sparse.encode(torch.randn(n), other)
    with pytest.raises(CorruptObjectError, match="must hold exactly"):
        decode_shard(_forged(enc["packed"], enc["scales"], spec.name, n), key=KEY, expect=_expect(spec.name, n))


# --------------------------------------------------------------------------- summing as sent


def _negative_zeros(spec: SparseSpec, n: int, seed: int) -> dict[str, torch.Tensor]:
    """A valid payload with a zero-scale chunk whose codes carry the sign bit: it decodes to ``-0.0``s."""
    enc = sparse.encode(torch.randn(n, generator=torch.Generator().manual_seed(seed)), spec)
    _, entries, _ = sparse._entries(spec, n)
    fields = sparse._unpack_bits(enc["packed"], spec.field_bits, entries)
    fields[: spec.k] |= 1 << (spec.bits - 1)  # chunk 0: every code negative ...
    scales = enc["scales"].clone()
    scales[0] = 0.0  # ... of a zero scale
    return {"packed": sparse._pack_bits(fields, spec.field_bits), "scales": scales}


@pytest.mark.parametrize("spec", [SparseSpec(8, 64, 2), SparseSpec(3, 32, 8)], ids=lambda s: s.name)
def test_summing_sparse_values_gives_the_dense_sums_bits(spec: SparseSpec) -> None:
    """The exchange adds each contribution's kept values at their positions into one accumulator; that is
    bit for bit the rank-order sum of the dense decoded vectors, with the guard scaling one of them, with
    ``-0.0`` values, with a last short chunk."""
    n = 64 * 37 + 5
    payloads = [_negative_zeros(spec, n, seed) for seed in range(5)]
    payloads.append(sparse.encode(1e6 * torch.randn(n, generator=torch.Generator().manual_seed(9)), spec))
    kept = [sparse.decode_sparse(p, spec, n) for p in payloads]
    dense = [sparse.decode(p, spec, n) for p in payloads]
    assert bool((dense[0].view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any())  # -0.0s are there
    reference = torch.zeros(n)
    for d in dense:  # the dense sum in rank order, as the exchange did before
        reference += d
    unguarded = torch.zeros(n)
    for k in kept[:5]:
        k.add_to(unguarded)
    reference5 = torch.zeros(n)
    for d in dense[:5]:
        reference5 += d
    assert same_bits(unguarded, reference5)
    contributions = list(enumerate(kept))
    guarded = guarded_sum(contributions, what="test")
    assert same_bits(guarded, guarded_sum(list(enumerate(dense)), what="test"))
    assert not same_bits(guarded, reference)  # the 1e6x contribution was scaled by the guard


def test_sparse_pieces_join_as_the_dense_vector() -> None:
    spec = SparseSpec(4, 16, 4)
    xs = [torch.randn(m, generator=torch.Generator().manual_seed(m)) for m in (40, 16, 7)]
    pieces = [sparse.decode_sparse(sparse.encode(x, spec), spec, x.numel()) for x in xs]
    joined = sparse.concat(pieces)
    assert joined.numel == 63
    assert same_bits(joined.to_dense(), torch.cat([p.to_dense() for p in pieces]))
    with pytest.raises(ValueError, match="accumulator of 5"):
        joined.add_to(torch.zeros(5))
