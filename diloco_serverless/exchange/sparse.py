"""The ``sparse`` pseudo-gradient codec: chunked top-k, 2/4/8-bit values, packed indices.

SparseLoCo (arXiv 2508.15706) and Covenant-72B (arXiv 2603.08163) send, of every chunk of ``chunk``
consecutive values, only the ``k`` largest in magnitude: each as its index in the chunk
(``ceil(log2(chunk))`` bits: 12 in a 4,096 chunk) and a ``bits``-bit code (a sign bit and
``bits - 1`` magnitude bits) of one per-chunk fp32 scale. At the defaults (64 of 4,096, 2 bits) that
is ``64 * (12 + 2) + 32`` bits per 4,096 values: **0.227 bits per parameter**, 141x fewer than fp32
and 36x fewer than ``int8``. What is not sent is not lost: the replica keeps it in its
error-feedback buffer (``exchange.error_feedback``, decayed by ``exchange.sparse.feedback_decay``)
and sends it in a later round.

A codec is named by its parameters, ``sparse-<k>of<chunk>-<bits>bit`` (``"sparse"`` alone is the
default, :data:`DEFAULT`), so the name in every object's signed header and every ready marker fixes
the layout: replicas configured differently disagree before anything is summed.

The payload is two tensors, in the same signed safetensors envelope as every other codec
(:mod:`.codec`): ``packed`` (uint8, the fields of every chunk one after another, each field
``index << bits | sign << (bits - 1) | magnitude``, least significant bit first, zero-padded to a whole
byte) and ``scales`` (fp32, one per chunk: the chunk's largest magnitude). A value decodes to
``sign * (magnitude + 1) / 2**(bits - 1) * scale``. A chunk holds ``min(k, its length)`` entries
(the last chunk may be shorter than ``chunk``), their indices strictly increasing.

:func:`decode` is strict: a wrong tensor name, dtype or length, a scale that is negative or not
finite, indices that are not strictly increasing or fall outside their chunk, or non-zero padding
bits raise ``ValueError`` (the exchange turns that into a ``CorruptObjectError`` naming the key).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "DEFAULT",
    "SparseSpec",
    "SparseValues",
    "bits_per_value",
    "concat",
    "decode",
    "decode_sparse",
    "encode",
    "is_sparse",
    "parse",
    "payload_bytes",
]

#: Bits of a value code that may be chosen (``exchange.sparse.bits``).
VALUE_BITS = (2, 4, 8)
#: Chunk sizes allowed: powers of two from 16 to 65,536 (indices of 4 to 16 bits).
MIN_CHUNK, MAX_CHUNK = 16, 1 << 16
_NAME = re.compile(r"sparse-([0-9]{1,6})of([0-9]{1,6})-([0-9])bit")


@dataclass(frozen=True)
class SparseSpec:
    """``k`` of every ``chunk`` values kept, each with a ``bits``-bit code."""

    k: int = 64
    chunk: int = 4096
    bits: int = 2

    def __post_init__(self) -> None:
        if not (MIN_CHUNK <= self.chunk <= MAX_CHUNK and self.chunk & (self.chunk - 1) == 0):
            raise ValueError(f"exchange.sparse.chunk must be a power of two from {MIN_CHUNK} to {MAX_CHUNK}, "
                             f"got {self.chunk}")
        if not 1 <= self.k <= self.chunk:
            raise ValueError(f"exchange.sparse.k must be between 1 and the chunk size {self.chunk}, got {self.k}")
        if self.bits not in VALUE_BITS:
            raise ValueError(f"exchange.sparse.bits must be one of {', '.join(map(str, VALUE_BITS))}, "
                             f"got {self.bits}")

    @property
    def name(self) -> str:
        """The codec name that fixes this layout: ``sparse-<k>of<chunk>-<bits>bit``."""
        return f"sparse-{self.k}of{self.chunk}-{self.bits}bit"

    @property
    def index_bits(self) -> int:
        return int(math.log2(self.chunk))

    @property
    def field_bits(self) -> int:
        """Bits of one kept value: its index and its code."""
        return self.index_bits + self.bits

    @property
    def density(self) -> float:
        return self.k / self.chunk


DEFAULT = SparseSpec()


def is_sparse(codec: str) -> bool:
    """Whether ``codec`` names the sparse codec (``"sparse"`` or ``sparse-<k>of<chunk>-<bits>bit``)."""
    return codec == "sparse" or codec.startswith("sparse-")


def parse(codec: str) -> SparseSpec:
    """The layout a sparse codec name fixes; ``ValueError`` saying what is wrong for a malformed one."""
    if codec == "sparse":
        return DEFAULT
    m = _NAME.fullmatch(codec)
    if m is None:
        raise ValueError(f"sparse codec name {codec!r} is not of the form sparse-<k>of<chunk>-<bits>bit "
                         "(e.g. sparse-64of4096-2bit), nor 'sparse'")
    return SparseSpec(int(m.group(1)), int(m.group(2)), int(m.group(3)))


def _entries(spec: SparseSpec, numel: int) -> tuple[int, int, int]:
    """(chunks, entries kept, entries kept in the last chunk) of a vector of ``numel`` values."""
    chunks = -(-numel // spec.chunk)
    if chunks == 0:
        return 0, 0, 0
    last = min(spec.k, numel - (chunks - 1) * spec.chunk)
    return chunks, (chunks - 1) * spec.k + last, last


def payload_bytes(spec: SparseSpec, numel: int) -> int:
    """Exact bytes of tensor data in an object of ``numel`` values."""
    chunks, entries, _ = _entries(spec, numel)
    return -(-entries * spec.field_bits // 8) + 4 * chunks


def bits_per_value(spec: SparseSpec, numel: int) -> float:
    """Payload bits per value of a vector of ``numel`` values (0.227 at the defaults for large vectors)."""
    return 8 * payload_bytes(spec, numel) / max(1, numel)


# --------------------------------------------------------------------------- encode


def encode(values: torch.Tensor, spec: SparseSpec) -> dict[str, torch.Tensor]:
    """Compress a flat fp32 CPU vector: ``{"packed": uint8, "scales": fp32}``.

    Raises ``ValueError`` when the input holds inf/NaN (a scale cannot represent them).

    The full chunks are read block by block (:data:`_BLOCK_VALUES` values: their magnitudes go into one
    small buffer that stays in cache, instead of a copy of the whole vector) and their top k found by
    :func:`_top_k` (exactly the indices ``torch.topk`` keeps, about 4x less work at the defaults).
    """
    values = values.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    n = values.numel()
    chunks, _, last = _entries(spec, n)
    if chunks == 0:
        return {"packed": torch.empty(0, dtype=torch.uint8), "scales": torch.empty(0, dtype=torch.float32)}
    full = n // spec.chunk
    idx_parts, val_parts = [], []
    if full:
        rows = max(1, _BLOCK_VALUES // spec.chunk)
        blocks = values[: full * spec.chunk].view(full, spec.chunk)
        buf = torch.empty(min(rows, full), spec.chunk, dtype=torch.float32)
        for a in range(0, full, rows):
            block = blocks[a : a + rows]
            magnitude = torch.abs(block, out=buf[: block.shape[0]])
            idx = _top_k(magnitude, spec.k)
            idx_parts.append(idx)
            val_parts.append(block.gather(1, idx))
    if full < chunks:  # a last, shorter chunk
        tail = values[full * spec.chunk :]
        magnitude = tail.abs()
        _check_finite(magnitude.amax())
        idx = magnitude.topk(last, sorted=False).indices.sort().values
        idx_parts.append(idx.view(1, -1))
        val_parts.append(tail[idx].view(1, -1))
    parts = [(torch.cat(idx_parts[:-1]), torch.cat(val_parts[:-1])), (idx_parts[-1], val_parts[-1])] \
        if full < chunks and full else [(torch.cat(idx_parts), torch.cat(val_parts))]  # a short row apart
    levels = 1 << (spec.bits - 1)
    scales_parts, fields = [], []
    for i, v in parts:
        mag = v.abs()
        s = mag.amax(dim=1)
        scales_parts.append(s)
        s = s[:, None]
        q = torch.where(s > 0, mag / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(v))
        m = (q * levels).round_().sub_(1).clamp_(0, levels - 1).to(torch.int64)
        code = ((v < 0).to(torch.int64) << (spec.bits - 1)) | m
        fields.append(((i.to(torch.int64) << spec.bits) | code).reshape(-1))
    scales = torch.cat(scales_parts) if len(scales_parts) > 1 else scales_parts[0]
    packed_fields = torch.cat(fields) if len(fields) > 1 else fields[0]
    return {"packed": _pack_bits(packed_fields, spec.field_bits), "scales": scales.contiguous()}


#: Values of the full chunks ``encode`` reads at a time (1M: a 4 MB magnitude buffer).
_BLOCK_VALUES = 1 << 20


def _check_finite(amax: torch.Tensor) -> None:
    if not bool(torch.isfinite(amax)):  # amax propagates NaN and inf
        raise ValueError("sparse codec got inf/NaN values; they cannot be quantised — check the replica's loss")


def _top_k(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """The indices, ascending, of the ``k`` largest of each row of ``magnitude`` (rows, chunk; non-negative):
    ``magnitude.topk(k, sorted=False).indices.sort().values``, bit for bit, with ties (``ValueError`` for
    inf/NaN).

    Where it pays, it looks only at the candidates: the row cut into groups of ``g`` values, the ``k + 1``
    groups with the largest maxima hold the ``k + 1`` largest values of the row (any value outside them is
    at most the (k+1)-th largest group maximum, and those k+1 maxima are values in the candidates), so
    the top ``k + 1`` of the candidates are the row's top ``k + 1`` values. When the k-th of them is larger
    than the (k+1)-th, the row's top k is that set, whatever the algorithm; a row where they are equal (a
    tie at the boundary: which of the equal values ``topk`` keeps is its own choice) is given to
    ``torch.topk`` itself."""
    rows, chunk = magnitude.shape
    g = _group_size(chunk, k)
    if g == 1:
        _check_finite(magnitude.amax())
        return magnitude.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    groups = magnitude.view(rows, chunk // g, g).amax(dim=2)
    _check_finite(groups.amax())
    best = groups.topk(k + 1, dim=1, sorted=False).indices  # (rows, k+1) group numbers
    cand = (best[:, :, None] * g + torch.arange(g)).view(rows, (k + 1) * g)  # positions in the row
    top = magnitude.gather(1, cand).topk(k + 1, dim=1, sorted=True)
    idx = cand.gather(1, top.indices[:, :k]).sort(dim=1).values
    tied = (top.values[:, k - 1] == top.values[:, k]).nonzero().view(-1)
    if tied.numel():
        idx[tied] = magnitude[tied].topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    return idx


def _group_size(chunk: int, k: int) -> int:
    """The group size of :func:`_top_k`'s candidates: the power of two ``g`` that makes the values it looks
    at, ``chunk / g`` maxima and ``(k + 1) * g`` candidates, fewest; 1 (plain ``topk``) where that is not
    under half the chunk."""
    best, cost = 1, chunk
    g = 2
    while chunk // g >= k + 1:
        if chunk // g + (k + 1) * g < cost:
            best, cost = g, chunk // g + (k + 1) * g
        g *= 2
    return best if cost <= chunk // 2 else 1


def _pack_bits(fields: torch.Tensor, width: int) -> torch.Tensor:
    """``fields`` (int64, each < 2**width, width <= 25) as a bit stream, least significant bit first,
    zero-padded to a whole byte. Vectorised: each field's ``width`` low bits (of its little-endian bytes,
    unpacked to bits) one after another, packed back into bytes."""
    word = 1 if width <= 8 else 2 if width <= 16 else 4
    as_bytes = fields.numpy().astype(f"<u{word}").view(np.uint8).reshape(-1, word)
    bits = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :width]
    return torch.from_numpy(np.packbits(bits.reshape(-1), bitorder="little"))


# --------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class SparseValues:
    """A decoded sparse contribution as it was sent: ``values`` (fp32) at the strictly increasing flat
    positions ``index`` (int64) of a vector of ``numel`` values, zero everywhere else.

    The exchange sums these without ever making them dense (:meth:`add_to`): the same fp32 additions,
    in the same order, as summing :meth:`to_dense` vectors, since adding an exact zero to an accumulator
    that starts at ``+0.0`` changes nothing (such a sum is never ``-0.0``: ``x + y`` is ``-0.0`` only
    when both are)."""

    numel: int
    index: torch.Tensor
    values: torch.Tensor

    def to_dense(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32)
        out[self.index] = self.values
        return out

    def add_to(self, acc: torch.Tensor, factor: float = 1.0) -> None:
        """``acc += factor * self`` (fp32, element by element; ``acc`` flat of :attr:`numel` values)."""
        if acc.numel() != self.numel:
            raise ValueError(f"cannot add {self.numel} sparse values to an accumulator of {acc.numel()}")
        vals = self.values if factor == 1.0 else self.values * factor
        acc.index_add_(0, self.index, vals)  # acc[i] + v, once per position: the indices are unique


def concat(parts: Sequence[SparseValues]) -> SparseValues:
    """The pieces of one vector, in order, as one :class:`SparseValues`."""
    offsets, total = [], 0
    for p in parts:
        offsets.append(total)
        total += p.numel
    if not parts:
        return SparseValues(0, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32))
    return SparseValues(total, torch.cat([p.index + o for p, o in zip(parts, offsets)]),
                        torch.cat([p.values for p in parts]))


def decode(tensors: Mapping[str, torch.Tensor], spec: SparseSpec, numel: int) -> torch.Tensor:
    """Inverse of :func:`encode`: a flat fp32 vector of ``numel`` values (zero where nothing was kept).

    Raises ``ValueError`` saying what is wrong when the tensors are not exactly what :func:`encode`
    writes for ``numel`` values (see the module docstring).
    """
    return decode_sparse(tensors, spec, numel).to_dense()


def decode_sparse(tensors: Mapping[str, torch.Tensor], spec: SparseSpec, numel: int) -> SparseValues:
    """:func:`decode` without making the vector dense: the kept values and their flat positions."""
    chunks, entries, last = _entries(spec, numel)
    nbytes = -(-entries * spec.field_bits // 8)
    packed, scales = tensors.get("packed"), tensors.get("scales")
    if (
        set(tensors) != {"packed", "scales"} or packed is None or scales is None
        or packed.dtype != torch.uint8 or tuple(packed.shape) != (nbytes,)
        or scales.dtype != torch.float32 or tuple(scales.shape) != (chunks,)
    ):
        described = ", ".join(f"{n!r}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                              for n, t in sorted(tensors.items()))
        raise ValueError(f"{spec.name} object of {numel} values must hold exactly 'packed' (uint8, {nbytes}) and "
                         f"'scales' (fp32, {chunks}), got {{{described}}}")
    if chunks == 0:
        return SparseValues(numel, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float32))
    bad = int((~(torch.isfinite(scales) & (scales >= 0))).sum())
    if bad:
        raise ValueError(f"{bad} of its {chunks} chunk scales are NaN, infinite or negative")
    fields = _unpack_bits(packed, spec.field_bits, entries)
    idx = fields >> spec.bits
    code = fields & ((1 << spec.bits) - 1)
    # indices: strictly increasing inside each chunk, and inside the chunk (the last one may be shorter)
    full = numel // spec.chunk
    rows = [(idx[: full * spec.k].view(full, spec.k), spec.chunk)] if full else []
    if full < chunks:
        rows.append((idx[full * spec.k :].view(1, -1), numel - full * spec.chunk))
    for r, length in rows:
        if r.shape[1] > 1 and not bool((r[:, 1:] > r[:, :-1]).all()):
            raise ValueError("its indices are not strictly increasing inside every chunk (repeated or unsorted)")
        if bool((r[:, -1] >= length).any()):
            raise ValueError(f"an index points past the end of its chunk ({length} values)")
    levels = 1 << (spec.bits - 1)
    counts = torch.full((chunks,), spec.k, dtype=torch.int64)
    counts[-1] = last
    chunk_of = torch.repeat_interleave(torch.arange(chunks), counts)
    mag = ((code & (levels - 1)) + 1).to(torch.float32) / levels
    sign = 1.0 - 2.0 * (code >> (spec.bits - 1)).to(torch.float32)
    return SparseValues(numel, chunk_of * spec.chunk + idx, sign * mag * scales[chunk_of])


def _unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """``count`` fields of ``width`` bits from :func:`_pack_bits`'s stream (int64); ``ValueError`` when the
    padding bits after the last field are not zero. The caller checked that ``packed`` holds exactly
    ``ceil(count * width / 8)`` bytes. Field ``i`` starts at bit ``(i * width) % 8`` of byte
    ``(i * width) // 8`` and spans at most four bytes: it is read from the little-endian 32-bit word at
    that byte (an unaligned view with a stride of one byte: one gather per field)."""
    if count == 0:
        return torch.zeros(0, dtype=torch.int64)
    used = count * width - 8 * (packed.numel() - 1)  # bits of the last byte that hold a field
    if used < 8 and int(packed[-1]) >> used:
        raise ValueError("its padding bits after the last value are not zero")
    raw = np.zeros(packed.numel() + 4, dtype=np.uint8)
    raw[: packed.numel()] = packed.numpy()
    words = np.ndarray(shape=(packed.numel() + 1,), dtype="<u4", buffer=raw, strides=(1,))
    offset = np.arange(count, dtype=np.int64) * width
    word = words[offset >> 3].astype(np.int64)
    return torch.from_numpy((word >> (offset & 7)) & ((1 << width) - 1))
