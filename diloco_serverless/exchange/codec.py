"""Tensors <-> bytes for the exchange: safetensors objects with a verified header, and the
pseudo-gradient codecs ``fp32``, ``bf16`` and ``int8`` (blockwise absmax scales).

Every exchange object is a safetensors file (https://github.com/huggingface/safetensors): a JSON
header then raw little-endian tensor bytes, so nothing is ever unpickled. Its ``__metadata__``
carries a :class:`ShardHeader` (run id, round, shard, kind, rank, codec, dtype, shape, element
count) and a SHA-256 checksum over the header and every tensor's bytes. :func:`decode_shard`
verifies all of it and raises :class:`CorruptObjectError` naming the key when anything is off:
truncated bytes, a flipped bit, an object from another run, round, shard or rank.

Codecs compress a flat fp32 vector; reduction always happens in fp32 on the decoded values.
``int8`` is blockwise absmax quantisation (one fp32 scale per block of :data:`INT8_BLOCK` values,
round-to-nearest), as in 8-bit optimizers (Dettmers et al., arXiv 2110.02861): about 0.266x the
bytes of fp32. Its error is at most ``absmax(block) / 254`` per element; the exchange can feed it
back into the next round (error feedback, Seide et al. 2014; Karimireddy et al., arXiv 1901.09847).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

import torch

from diloco_serverless.config import Codec
from diloco_serverless.exchange.errors import CorruptObjectError

__all__ = [
    "CODECS",
    "FORMAT",
    "INT8_BLOCK",
    "ShardHeader",
    "decode_shard",
    "decode_values",
    "encode_shard",
    "encode_values",
    "pack",
    "roundtrip",
    "unpack",
    "validate_codec",
]

FORMAT = "diloco-exchange/1"
CODECS: tuple[str, ...] = get_args(Codec)
INT8_BLOCK = 256

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
}


def validate_codec(codec: str) -> str:
    """Return ``codec`` if it is known, else raise ``ValueError`` listing the choices."""
    if codec not in CODECS:
        raise ValueError(f"unknown exchange codec {codec!r}; choose one of {', '.join(CODECS)}")
    return codec


# --------------------------------------------------------------------------- codecs


def encode_values(values: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    """Compress a flat fp32 CPU vector with ``codec``; returns the tensors to store.

    Raises ``ValueError`` for an unknown codec, and for ``int8`` when the input holds inf/NaN
    (a scale cannot represent them; fix the diverging replica or use fp32/bf16).
    """
    validate_codec(codec)
    values = values.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    if codec == "fp32":
        return {"values": values.contiguous()}
    if codec == "bf16":
        return {"values": values.to(torch.bfloat16).contiguous()}
    return _int8_encode(values)


def _int8_encode(values: torch.Tensor) -> dict[str, torch.Tensor]:
    n = values.numel()
    pad = (-n) % INT8_BLOCK
    blocks = (torch.nn.functional.pad(values, (0, pad)) if pad else values).view(-1, INT8_BLOCK)
    absmax = blocks.abs().amax(dim=1)
    if not bool(torch.isfinite(absmax).all()):  # amax propagates NaN and inf
        raise ValueError("int8 codec got inf/NaN values; they cannot be quantised — check the replica's loss")
    inv = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    q = torch.mul(blocks, inv[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return {"q": q.reshape(-1)[:n].contiguous(), "scales": absmax / 127.0}


def decode_values(tensors: Mapping[str, torch.Tensor], codec: str, numel: int) -> torch.Tensor:
    """Inverse of :func:`encode_values`: a flat fp32 vector of ``numel`` elements.

    Raises ``ValueError`` when the tensors do not have the layout ``codec`` produces.
    """
    validate_codec(codec)
    if codec in ("fp32", "bf16"):
        want = torch.float32 if codec == "fp32" else torch.bfloat16
        v = tensors.get("values")
        if v is None or v.dtype != want or v.numel() != numel:
            raise ValueError(f"{codec} object must hold 'values' ({want}, {numel} elements)")
        return v.reshape(-1).to(torch.float32)
    q, scales = tensors.get("q"), tensors.get("scales")
    nblocks = -(-numel // INT8_BLOCK)
    if q is None or scales is None or q.dtype != torch.int8 or q.numel() != numel or scales.numel() != nblocks:
        raise ValueError(f"int8 object must hold 'q' (int8, {numel}) and 'scales' (fp32, {nblocks})")
    pad = (-numel) % INT8_BLOCK
    blocks = torch.nn.functional.pad(q.reshape(-1).to(torch.float32), (0, pad)).view(-1, INT8_BLOCK)
    return (blocks * scales.to(torch.float32)[:, None]).reshape(-1)[:numel].contiguous()


def roundtrip(values: torch.Tensor, codec: str) -> torch.Tensor:
    """``decode(encode(values))``: what the other replicas will see of ``values``."""
    flat = values.detach().reshape(-1).to(torch.float32)
    return decode_values(encode_values(flat, codec), codec, flat.numel())


# --------------------------------------------------------------------------- safetensors


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().data.cast("B")


def _checksum(header_json: str, names: list[str], buffers: Mapping[str, memoryview]) -> str:
    h = hashlib.sha256()
    h.update(FORMAT.encode())
    h.update(header_json.encode())
    for name in names:
        h.update(name.encode())
        h.update(buffers[name])
    return "sha256:" + h.hexdigest()


def pack(tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any]) -> bytes:
    """Serialise ``tensors`` as safetensors with ``header`` (JSON-able) and a checksum.

    The file is written directly (one copy of the data) and is readable by any safetensors reader.
    """
    names = sorted(tensors)
    bufs = {n: _tensor_bytes(tensors[n]) for n in names}
    header_json = json.dumps(dict(header), sort_keys=True, separators=(",", ":"))
    meta = {"format": FORMAT, "header": header_json, "checksum": _checksum(header_json, names, bufs)}
    st_header: dict[str, Any] = {"__metadata__": meta}
    layout = sorted(names, key=lambda n: -tensors[n].element_size())  # keep every tensor aligned
    offset = 0
    for n in layout:
        t = tensors[n]
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"cannot store tensor {n!r} of dtype {t.dtype} in an exchange object")
        st_header[n] = {
            "dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(bufs[n])],
        }
        offset += len(bufs[n])
    hb = json.dumps(st_header, separators=(",", ":")).encode()
    hb += b" " * ((-len(hb)) % 8)
    return b"".join([struct.pack("<Q", len(hb)), hb, *(bufs[n] for n in layout)])  # one copy of the data


def unpack(data: bytes, *, key: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Parse and verify an object written by :func:`pack`; returns ``(tensors, header)``.

    Tensors are read-only views of ``data`` (no copy). Raises :class:`CorruptObjectError` naming
    ``key`` when the bytes are truncated, not safetensors, not an exchange object, or fail the
    checksum; the object is then never used (re-run the round, or delete the stray object).
    """
    try:
        meta, tensors = _parse_safetensors(memoryview(data).cast("B"))
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise CorruptObjectError(
            f"exchange object {key!r} is truncated or not safetensors ({len(data)} bytes): {e}"
        ) from e
    if meta.get("format") != FORMAT or "header" not in meta or "checksum" not in meta:
        raise CorruptObjectError(f"object {key!r} is safetensors but not a {FORMAT} exchange object; refusing it")
    names = sorted(tensors)
    got = _checksum(meta["header"], names, {n: _tensor_bytes(tensors[n]) for n in names})
    if got != meta["checksum"]:
        raise CorruptObjectError(
            f"exchange object {key!r} failed its checksum "
            f"(stored {str(meta['checksum'])[:20]}..., computed {got[:20]}...); "
            "it was corrupted in transit or at rest and is not averaged in"
        )
    try:
        header = json.loads(meta["header"])
    except json.JSONDecodeError as e:  # pragma: no cover - checksum covers the header text
        raise CorruptObjectError(f"exchange object {key!r} has an unreadable header: {e}") from e
    return tensors, header


_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}


def _parse_safetensors(buf: memoryview) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Strict safetensors parser (same rules as the reference: the tensors tile the data section
    exactly). Raises ValueError/KeyError/TypeError on any violation."""
    (hlen,) = struct.unpack("<Q", buf[:8])
    if 8 + hlen > len(buf):
        raise ValueError(f"header length {hlen} runs past the end of the object")
    header = json.loads(bytes(buf[8 : 8 + hlen]))
    meta = header.pop("__metadata__", None) or {}
    body = buf[8 + hlen :]
    tensors: dict[str, torch.Tensor] = {}
    end = 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = _FROM_ST[info["dtype"]]
        a, b = (int(v) for v in info["data_offsets"])
        count = math.prod(int(d) for d in info["shape"])
        if a != end or b - a != count * dtype.itemsize:
            raise ValueError(f"tensor {name!r} has inconsistent offsets {a}..{b}")
        end = b
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write into it
            t = (
                torch.frombuffer(body, dtype=torch.uint8, count=b - a, offset=a)
                if b > a
                else torch.empty(0, dtype=torch.uint8)
            )
        tensors[name] = t.view(dtype).reshape([int(d) for d in info["shape"]])
    if end != len(body):
        raise ValueError(f"data section has {len(body)} bytes but the tensors cover {end}")
    return meta, tensors


# --------------------------------------------------------------------------- shards


@dataclass(frozen=True)
class ShardHeader:
    """Identity of one exchange object: who wrote what part of which round of which run.

    ``dtype``/``shape`` describe the whole tensor being averaged; ``numel`` is this shard's length.
    ``rank`` is the contributor for ``kind="contrib"`` and ``None`` for ``kind="reduced"``.
    """

    run_id: str
    round: int
    shard: int
    kind: Literal["contrib", "reduced"]
    codec: str
    numel: int
    rank: int | None = None
    dtype: str = "torch.float32"
    shape: list[int] = field(default_factory=list)

    _CHECKED = ("run_id", "round", "shard", "kind", "rank", "codec", "numel")


def encode_shard(values: torch.Tensor, header: ShardHeader) -> bytes:
    """Encode a flat fp32 shard with ``header.codec`` into a verified safetensors object."""
    if values.numel() != header.numel:
        raise ValueError(f"shard {header.shard} has {values.numel()} elements but its header says {header.numel}")
    return pack(encode_values(values, header.codec), asdict(header))


def decode_shard(data: bytes, *, key: str, expect: ShardHeader) -> torch.Tensor:
    """Verify an exchange object against ``expect`` and return its values as flat fp32.

    Raises :class:`CorruptObjectError` naming ``key`` for bad bytes, and for an object whose run id,
    round, shard, kind, rank, codec or element count differ from ``expect`` (for example an object
    left by another run at the same URL). Such an object is never averaged in.
    """
    tensors, header = unpack(data, key=key)
    want = asdict(expect)
    for name in ShardHeader._CHECKED:
        if header.get(name) != want[name]:
            what = "another run" if name == "run_id" else f"a different {name}"
            raise CorruptObjectError(
                f"exchange object {key!r} belongs to {what}: {name}={header.get(name)!r}, expected {want[name]!r}; "
                "refusing it (is another run using the same store URL and run id?)"
            )
    try:
        return decode_values(tensors, expect.codec, expect.numel)
    except ValueError as e:
        raise CorruptObjectError(f"exchange object {key!r} has a bad {expect.codec} layout: {e}") from e
