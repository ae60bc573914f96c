"""Tensors <-> bytes for the exchange: safetensors objects with a verified header, and the
pseudo-gradient codecs ``fp32``, ``bf16`` and ``int8`` (blockwise absmax scales).

Every exchange object is a safetensors file (https://github.com/huggingface/safetensors): a JSON
header then raw little-endian tensor bytes, so nothing is ever unpickled. Its ``__metadata__``
carries a :class:`ShardHeader` (run id, round, shard, kind, rank, codec, dtype, shape, element
count) and a SHA-256 checksum over the header and every tensor's bytes. :func:`decode_shard`
verifies all of it and raises :class:`CorruptObjectError` naming the key when anything is off:
truncated bytes, a flipped bit, an object from another run, round, shard or rank.

The bucket is not trusted: anyone who can write to it can plant any bytes at an exchange key. The
reader therefore never trusts a length, type, offset or value it has not checked. The safetensors
header is at most :data:`MAX_HEADER_BYTES` (so an object can be no larger than
:func:`max_object_bytes`, which the exchange passes to the store's size-limited GET), its JSON
must be UTF-8 and shallow, every tensor entry must be well typed and the tensors must tile the data
section exactly; the exchange fields are checked in one place, :func:`verify_header`; and decoded
values must be finite. Any violation is a :class:`CorruptObjectError` naming the key and what is
wrong, never another exception.

Codecs compress a flat fp32 vector; reduction always happens in fp32 on the decoded values.
``int8`` is blockwise absmax quantisation (one fp32 scale per block of :data:`INT8_BLOCK` values,
round-to-nearest), as in 8-bit optimizers (Dettmers et al., arXiv 2110.02861): about 0.266x the
bytes of fp32. Its error is at most ``absmax(block) / 254`` per element; the exchange can feed it
back into the next round (error feedback, Seide et al. 2014; Karimireddy et al., arXiv 1901.09847).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

import torch

from diloco_serverless.config import Codec
from diloco_serverless.exchange import sparse
from diloco_serverless.exchange.errors import CorruptObjectError, ParticipantsChangedError
from diloco_serverless.run.integrity import mac_bytes

__all__ = [
    "CODECS",
    "FORMAT",
    "INT8_BLOCK",
    "MAX_HEADER_BYTES",
    "ShardHeader",
    "Summand",
    "decode_as_sent",
    "decode_shard",
    "decode_summand",
    "decode_summand_checked",
    "dense",
    "decode_values",
    "encode_shard",
    "encode_values",
    "max_object_bytes",
    "pack",
    "payload_bytes",
    "reduced_codec",
    "residual",
    "roundtrip",
    "unpack",
    "validate_codec",
    "verify_header",
]

FORMAT = "diloco-exchange/1"
CODECS: tuple[str, ...] = get_args(Codec)
INT8_BLOCK = 256
#: Largest safetensors header (JSON) a reader accepts. An honest header is well under 1 KiB (run ids
#: are at most 128 characters); the rest is room for later fields (a MAC) and long shapes.
MAX_HEADER_BYTES = 64 << 10
_MAX_DIMS = 64  # most dimensions a stored tensor may have
_FINITE_CHUNK = 1 << 24  # elements checked for NaN/Inf at a time (bounds the temporary mask)

#: A contribution as the exchange sums it: dense fp32 values, or a sparse codec's kept values and their
#: positions (:class:`~diloco_serverless.exchange.sparse.SparseValues`), which are summed without ever
#: being made dense (:func:`dense` makes them so where a whole vector is needed).
Summand = torch.Tensor | sparse.SparseValues

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
    """Return ``codec`` if it is known (a sparse codec by its full name, :mod:`.sparse`: ``"sparse"`` becomes
    ``sparse-64of4096-2bit``), else raise ``ValueError`` listing the choices."""
    if sparse.is_sparse(codec):
        return sparse.parse(codec).name
    if codec not in CODECS:
        raise ValueError(f"unknown exchange codec {codec!r}; choose one of {', '.join(CODECS)}")
    return codec


def reduced_codec(codec: str, *, stored: bool = True) -> str:
    """The codec a round's mean passes through: the round's own, but for a sparse round ``int8`` when it is
    stored as reduced shards (a mean of N sparse contributions is dense; int8 keeps a sharded sparse round
    within the bytes of an int8 one) and ``fp32`` (untouched) when every replica sums the contributions
    itself (direct), docs/exchange.md "Sparse pseudo-gradients"."""
    if sparse.is_sparse(codec):
        return "int8" if stored else "fp32"
    return codec


# --------------------------------------------------------------------------- codecs


def encode_values(values: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    """Compress a flat fp32 CPU vector with ``codec``; returns the tensors to store.

    Raises ``ValueError`` for an unknown codec, and for ``int8`` when the input holds inf/NaN
    (a scale cannot represent them; fix the diverging replica or use fp32/bf16).
    """
    validate_codec(codec)
    values = values.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    if sparse.is_sparse(codec):
        return sparse.encode(values, sparse.parse(codec))
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

    Raises ``ValueError`` when the tensors do not have exactly the layout ``codec`` produces
    (names, dtypes, 1-D lengths), and for ``int8`` scales that are negative, NaN or infinite.
    """
    validate_codec(codec)
    if sparse.is_sparse(codec):
        return sparse.decode(tensors, sparse.parse(codec), numel)
    if codec in ("fp32", "bf16"):
        want = torch.float32 if codec == "fp32" else torch.bfloat16
        v = tensors.get("values")
        if set(tensors) != {"values"} or v is None or v.dtype != want or tuple(v.shape) != (numel,):
            raise ValueError(
                f"{codec} object must hold exactly 'values' ({want}, {numel} elements), got {_describe(tensors)}"
            )
        return v.to(torch.float32)
    q, scales = tensors.get("q"), tensors.get("scales")
    nblocks = -(-numel // INT8_BLOCK)
    if (
        set(tensors) != {"q", "scales"} or q is None or scales is None
        or q.dtype != torch.int8 or tuple(q.shape) != (numel,)
        or scales.dtype != torch.float32 or tuple(scales.shape) != (nblocks,)
    ):
        raise ValueError(
            f"int8 object must hold exactly 'q' (int8, {numel}) and 'scales' (fp32, {nblocks}), "
            f"got {_describe(tensors)}"
        )
    bad = _count_bad(scales, allow_negative=False)
    if bad:
        raise ValueError(f"{bad} of its {nblocks} int8 scales are NaN, infinite or negative")
    pad = (-numel) % INT8_BLOCK
    blocks = torch.nn.functional.pad(q.to(torch.float32), (0, pad)).view(-1, INT8_BLOCK)
    return (blocks * scales[:, None]).reshape(-1)[:numel].contiguous()


def payload_bytes(codec: str, numel: int) -> int:
    """Bytes of tensor data in an object of ``numel`` values encoded with ``codec`` (exact)."""
    validate_codec(codec)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if sparse.is_sparse(codec):
        return sparse.payload_bytes(sparse.parse(codec), numel)
    if codec == "fp32":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    return numel + 4 * -(-numel // INT8_BLOCK)


def max_object_bytes(codec: str, numel: int) -> int:
    """Upper bound on the size of a valid exchange object of ``numel`` values in ``codec``: the
    8-byte length, a header of at most :data:`MAX_HEADER_BYTES`, and the exact payload. Anything
    larger is corrupt, so the exchange refuses it without reading it in full."""
    return 8 + MAX_HEADER_BYTES + payload_bytes(codec, numel)


def _describe(tensors: Mapping[str, torch.Tensor]) -> str:
    return "{" + ", ".join(f"{n!r}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                           for n, t in sorted(tensors.items())) + "}"


def _count_bad(values: torch.Tensor, *, allow_negative: bool = True) -> int:
    """How many of ``values`` are NaN or infinite (or negative unless ``allow_negative``),
    checked in chunks so the temporary mask stays small."""
    flat = values.reshape(-1)
    bad = 0
    for start in range(0, flat.numel(), _FINITE_CHUNK):
        chunk = flat[start : start + _FINITE_CHUNK]
        ok = torch.isfinite(chunk)
        if not allow_negative:
            ok &= chunk >= 0
        if not bool(ok.all()):
            bad += int((~ok).sum())
    return bad


def dense(values: Summand) -> torch.Tensor:
    """``values`` as a flat fp32 vector."""
    return values.to_dense() if isinstance(values, sparse.SparseValues) else values


def decode_as_sent(tensors: Mapping[str, torch.Tensor], codec: str, numel: int) -> Summand:
    """:func:`decode_values`, but a sparse codec's values as they were sent
    (:class:`~diloco_serverless.exchange.sparse.SparseValues`): a replica's own contribution is summed and
    subtracted from its error-feedback buffer (:func:`residual`) without a dense copy of it."""
    if sparse.is_sparse(codec):
        return sparse.decode_sparse(tensors, sparse.parse(validate_codec(codec)), numel)
    return decode_values(tensors, codec, numel)


def residual(flat: torch.Tensor, sent: Sequence[Summand], *, in_place: bool = False) -> torch.Tensor:
    """``flat - torch.cat([dense(s) for s in sent])``, bit for bit (the error feedback's ``e -= decode(c)``);
    with ``in_place``, into ``flat`` itself. Sparse pieces are subtracted at their kept positions only:
    ``x - 0.0`` is ``x`` for every float, ``-0.0`` included, so the other values need no arithmetic."""
    if not sent or not all(isinstance(s, sparse.SparseValues) for s in sent):
        diff = flat - torch.cat([dense(s) for s in sent]) if sent else flat.clone()
        return flat.copy_(diff) if in_place else diff
    kept = sparse.concat([s for s in sent if isinstance(s, sparse.SparseValues)])
    if kept.numel != flat.numel():
        raise ValueError(f"cannot subtract {kept.numel} sent values from a vector of {flat.numel()}")
    out = flat if in_place else flat.clone()
    out[kept.index] = out[kept.index].sub_(kept.values)
    return out


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


def _mac(run_key: bytes, checksum: str, place: str) -> str:
    """The run's HMAC of an object: over its checksum, which covers the format, header and every byte,
    bound to ``place``, the key it is stored at (:func:`~diloco_serverless.run.integrity.mac_bytes`)."""
    return mac_bytes(run_key, "exchange-object", checksum.encode("utf-8"), place=place)


def pack(tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any], run_key: bytes | None = None,
         *, place: str | None = None) -> bytes:
    """Serialise ``tensors`` as safetensors with ``header`` (JSON-able), a checksum and, with the run
    key, an HMAC (``mac``) bound to ``place`` (the key the object will be stored at; required with a
    run key) that readers holding the key require: a copy of the object at any other key is refused.

    The file is written directly (one copy of the data) and is readable by any safetensors reader.
    """
    names = sorted(tensors)
    bufs = {n: _tensor_bytes(tensors[n]) for n in names}
    header_json = json.dumps(dict(header), sort_keys=True, separators=(",", ":"))
    checksum = _checksum(header_json, names, bufs)
    meta = {"format": FORMAT, "header": header_json, "checksum": checksum}
    if run_key is not None:
        if place is None:
            raise ValueError("a signed exchange object needs its place: pass place=<the key it is written at>")
        meta["mac"] = _mac(run_key, checksum, place)
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


def unpack(
    data: bytes, *, key: str, run_key: bytes | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Parse and verify an object written by :func:`pack`; returns ``(tensors, header)``.

    Tensors are read-only views of ``data`` (no copy). Raises :class:`CorruptObjectError` naming
    ``key`` when the bytes are truncated, not safetensors, not an exchange object, or fail the
    checksum; the object is then never used (re-run the round, or delete the stray object).
    """
    meta, tensors = _parse_object(data, key=key)
    return tensors, verify_header(meta, tensors, key=key, run_key=run_key)


def verify_header(
    meta: Mapping[str, str],
    tensors: Mapping[str, torch.Tensor],
    *,
    key: str,
    expect: ShardHeader | None = None,
    run_key: bytes | None = None,
) -> dict[str, Any]:
    """The one check of an exchange object's header; returns the header (a JSON object).

    ``meta`` is the safetensors ``__metadata__`` (strings only, as :func:`_parse_safetensors`
    guarantees) and ``tensors`` the object's tensors. Checks, in order: the ``__metadata__`` fields
    (:data:`_METADATA_FIELDS`), the format, the SHA-256 checksum over the header text and every
    tensor, that the header text is a JSON object, and, with ``expect``, that it has every
    :class:`ShardHeader` field with the right type (:data:`_FIELD_RULES`) and the same run id,
    round, shard, kind, rank, codec and element count as ``expect``. With ``run_key``, the object
    must also carry the run's HMAC (``mac``) of its checksum, bound to ``key`` (where it was read).
    Raises :class:`CorruptObjectError` naming ``key`` and what is wrong.

    To add a field (say a MAC over the same bytes as the checksum): write it in :func:`pack`, add its
    name to :data:`_METADATA_FIELDS` (or, for a field of the shard header, to :class:`ShardHeader`
    and :data:`_FIELD_RULES`) and verify it here next to the checksum.
    """
    if meta.get("format") != FORMAT or any(f not in meta for f in _METADATA_FIELDS):
        raise CorruptObjectError(
            f"object {key!r} is safetensors but not a {FORMAT} exchange object "
            f"(its __metadata__ needs {', '.join(_METADATA_FIELDS)}); refusing it"
        )
    names = sorted(tensors)
    try:
        header_json = meta["header"]
        _utf8(header_json, "its header text")
        got = _checksum(header_json, names, {n: _tensor_bytes(tensors[n]) for n in names})
        if got != meta["checksum"]:
            raise CorruptObjectError(
                f"exchange object {key!r} failed its checksum "
                f"(stored {_clip(meta['checksum'], 24)}, computed {got[:20]}...); "
                "it was corrupted in transit or at rest and is not averaged in"
            )
        if run_key is not None and not hmac.compare_digest(str(meta.get("mac", "")), _mac(run_key, got, key)):
            raise CorruptObjectError(
                f"exchange object {key!r} does not carry this run's signature for this key (forged, copied from "
                "another key, or written by another launch of the same run id); refusing it. Check who can write "
                "the bucket prefix (docs/security.md)"
            )
        header = _loads(header_json, "its header text")
    except _Malformed as e:
        raise CorruptObjectError(f"exchange object {key!r} has a malformed header: {e}; refusing it") from e
    if not isinstance(header, dict):
        raise CorruptObjectError(
            f"exchange object {key!r} has a header that is a JSON {_json_type(header)}, not an object; refusing it"
        )
    if expect is not None:
        check_fields(header, key=key, expect=expect)
    return header


def check_fields(header: Mapping[str, Any], *, key: str, expect: ShardHeader) -> None:
    """Refuse (:class:`CorruptObjectError` naming ``key``) a verified header that lacks a
    :class:`ShardHeader` field, has one of the wrong type, or differs from ``expect`` in run id,
    round, shard, kind, rank, codec or element count."""
    for name, (what, ok) in _FIELD_RULES.items():
        if name not in header:
            raise CorruptObjectError(f"exchange object {key!r} has no {name!r} in its header; refusing it")
        if not ok(header[name]):
            raise CorruptObjectError(
                f"exchange object {key!r} has {name}={_clip(header[name])} in its header, expected {what}; refusing it"
            )
    want = asdict(expect)
    for name in ShardHeader._CHECKED:
        if name == "participants" and None not in (header[name], want[name]) and header[name] != want[name]:
            raise ParticipantsChangedError(
                f"exchange object {key!r} averages ranks {_clip(header[name])}, but this replica's round has the "
                f"participants {want[name]!r}: the round was decided twice (someone deleted a vote or its "
                "quorum.json while it closed); failing the round rather than mixing two participant sets. Restart "
                "the replica; check who can delete under the run's prefix (docs/security.md)"
            )
        if header[name] != want[name]:
            what = "another run" if name == "run_id" else f"a different {name}"
            raise CorruptObjectError(
                f"exchange object {key!r} belongs to {what}: {name}={_clip(header[name])}, expected {want[name]!r}; "
                "refusing it (is another run using the same store URL and run id?)"
            )


class _Malformed(CorruptObjectError):
    """The bytes break the safetensors rules; the message says how, and the caller re-raises it as a
    :class:`CorruptObjectError` naming the key."""


def _parse_object(data: bytes, *, key: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """:func:`_parse_safetensors` with every failure turned into :class:`CorruptObjectError` naming ``key``."""
    try:
        return _parse_safetensors(memoryview(data).cast("B"))
    except _Malformed as e:
        raise CorruptObjectError(
            f"exchange object {key!r} is truncated or not valid safetensors ({len(data)} bytes): {e}; refusing it"
        ) from e
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as e:
        # Safety net: the checks in _parse_safetensors are meant to leave nothing for it to catch
        # (tests/exchange/test_codec_fuzz.py asserts that fuzzed objects never reach it).
        raise CorruptObjectError(
            f"exchange object {key!r} could not be parsed ({len(data)} bytes; {type(e).__name__}: {e}); refusing it"
        ) from e


_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}
_TENSOR_FIELDS = frozenset({"dtype", "shape", "data_offsets"})


def _no_constant(name: str) -> Any:
    raise _Malformed(f"its JSON holds {name}, which is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        dup = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise _Malformed(f"its JSON repeats the key(s) {_clip(dup)}")
    return out


def _loads(text: str, what: str) -> Any:
    """Strict ``json.loads``: no NaN/Infinity, no repeated keys, no absurd nesting; errors are :class:`_Malformed`."""
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except _Malformed:
        raise
    except RecursionError as e:
        raise _Malformed(f"{what} is nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, and over-long integers
        raise _Malformed(f"{what} is not valid JSON ({e})") from e


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate escaped in the JSON ("\\ud800")
        raise _Malformed(f"{what} is not valid Unicode ({e.reason})") from e


def _is_size(v: object) -> bool:
    """A JSON integer >= 0 (``True``/``False`` are not)."""
    return type(v) is int and v >= 0


def _parse_safetensors(buf: memoryview) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Strict safetensors parser: the reference's rules (the tensors tile the data section exactly)
    plus a bounded header. Checks every length, type and offset before using it; raises
    :class:`_Malformed` saying what is wrong."""
    if len(buf) < 8:
        raise _Malformed(f"it is shorter than the 8-byte header length ({len(buf)} bytes)")
    hlen = int.from_bytes(buf[:8], "little")
    if hlen > MAX_HEADER_BYTES:
        raise _Malformed(f"its header length field says {hlen} bytes, more than the {MAX_HEADER_BYTES} allowed")
    if 8 + hlen > len(buf):
        raise _Malformed(f"its header length {hlen} runs past the end of the object (truncated?)")
    try:
        text = bytes(buf[8 : 8 + hlen]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Malformed(f"its header is not UTF-8 ({e.reason} at byte {e.start})") from e
    header = _loads(text, "its header")
    if not isinstance(header, dict):
        raise _Malformed(f"its header is a JSON {_json_type(header)}, not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _Malformed("its __metadata__ is not an object of strings")
    body = buf[8 + hlen :]
    entries = sorted(
        ((name, *_tensor_entry(name, info, len(body))) for name, info in header.items()),
        key=lambda e: (e[3], e[4]),
    )
    tensors: dict[str, torch.Tensor] = {}
    end = 0
    for name, dtype, shape, a, b in entries:
        if a != end:
            raise _Malformed(f"tensor {name!r} starts at byte {a} of the data section, expected {end} "
                             "(tensors must follow each other without gaps or overlaps)")
        end = b
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write into it
            t = (
                torch.frombuffer(body, dtype=torch.uint8, count=b - a, offset=a)
                if b > a
                else torch.empty(0, dtype=torch.uint8)
            )
        tensors[name] = t.view(dtype).reshape(shape)
    if end != len(body):
        raise _Malformed(f"its data section has {len(body)} bytes but the tensors cover {end}")
    return meta, tensors


def _tensor_entry(name: str, info: object, body_len: int) -> tuple[torch.dtype, list[int], int, int]:
    """Check one tensor entry of the header; returns (dtype, shape, start, end) in the data section."""
    _utf8(name, f"tensor name {name!r}")
    if not isinstance(info, dict) or set(info) != _TENSOR_FIELDS:
        raise _Malformed(f"tensor {name!r} is not an object with exactly {sorted(_TENSOR_FIELDS)}")
    st_dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(st_dtype, str) or st_dtype not in _FROM_ST:
        raise _Malformed(f"tensor {name!r} has dtype {st_dtype!r}; expected one of {sorted(_FROM_ST)}")
    # A dimension larger than the data section could only come with a zero-sized tensor: refuse it too.
    if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
            or not all(_is_size(d) and d <= body_len for d in shape)):
        raise _Malformed(f"tensor {name!r} has shape {_clip(shape)}; expected a list of at most {_MAX_DIMS} "
                         f"integers in [0, {body_len}]")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(o) for o in offsets)
            and offsets[0] <= offsets[1] <= body_len):
        raise _Malformed(f"tensor {name!r} has data_offsets {_clip(offsets)}; expected [start, end] with "
                         f"0 <= start <= end <= {body_len}")
    dtype = _FROM_ST[st_dtype]
    a, b = offsets
    if b - a != math.prod(shape) * dtype.itemsize:
        raise _Malformed(f"tensor {name!r} of shape {shape} ({st_dtype}) needs "
                         f"{math.prod(shape) * dtype.itemsize} bytes but its offsets span {b - a}")
    return dtype, shape, a, b


def _json_type(v: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(v), "null")


def _clip(v: object, n: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


# --------------------------------------------------------------------------- shards


@dataclass(frozen=True)
class ShardHeader:
    """Identity of one exchange object: who wrote what part of which round of which run.

    ``dtype``/``shape`` describe the whole tensor being averaged; ``numel`` is this shard's length.
    ``rank`` is the contributor for ``kind="contrib"``, the group for ``kind="partial"`` (a hierarchical
    group's sum, always fp32) and ``None`` for ``kind="reduced"``. ``participants`` are the ranks a
    reduced shard averages (``None`` for the other kinds): a reader whose round has other participants
    refuses it, so a replica never applies a mean over another set than its own (a deleted vote or
    ``quorum.json`` can fail a round, never mix two sets; docs/security.md).
    """

    run_id: str
    round: int
    shard: int
    kind: Literal["contrib", "reduced", "partial"]
    codec: str
    numel: int
    rank: int | None = None
    dtype: str = "torch.float32"
    shape: list[int] = field(default_factory=list)
    participants: list[int] | None = None

    _CHECKED = ("run_id", "round", "shard", "kind", "rank", "codec", "numel", "participants")


#: The ``__metadata__`` fields of every exchange object (all strings), checked by :func:`verify_header`.
_METADATA_FIELDS = ("format", "header", "checksum")

#: Every :class:`ShardHeader` field: what a valid value is, and its test (JSON types, ``bool`` is not an int).
_FIELD_RULES: dict[str, tuple[str, Callable[[object], bool]]] = {
    "run_id": ("a string", lambda v: isinstance(v, str)),
    "round": ("an integer >= 0", _is_size),
    "shard": ("an integer >= 0", _is_size),
    "kind": ('"contrib", "reduced" or "partial"', lambda v: v in ("contrib", "reduced", "partial")),
    "codec": ("a string", lambda v: isinstance(v, str)),
    "numel": ("an integer >= 0", _is_size),
    "rank": ("an integer >= 0 or null", lambda v: v is None or _is_size(v)),
    "dtype": ("a string", lambda v: isinstance(v, str)),
    "shape": ("a list of integers >= 0", lambda v: isinstance(v, list) and all(_is_size(d) for d in v)),
    "participants": ("a list of ranks or null",
                     lambda v: v is None or (isinstance(v, list) and all(_is_size(d) for d in v))),
}


def encode_shard(values: torch.Tensor, header: ShardHeader, run_key: bytes | None = None,
                 *, place: str | None = None) -> bytes:
    """Encode a flat fp32 shard with ``header.codec`` into a verified (and, with the run key, signed for
    ``place``, the key it is written at) safetensors object."""
    if values.numel() != header.numel:
        raise ValueError(f"shard {header.shard} has {values.numel()} elements but its header says {header.numel}")
    return pack(encode_values(values, header.codec), asdict(header), run_key, place=place)


def decode_shard(data: bytes, *, key: str, expect: ShardHeader, run_key: bytes | None = None) -> torch.Tensor:
    """Verify an exchange object against ``expect`` and return its values as flat fp32.

    Raises :class:`CorruptObjectError` naming ``key`` for bad bytes (see :func:`verify_header`),
    for an object whose run id, round, shard, kind, rank, codec or element count differ from
    ``expect`` (for example an object left by another run at the same URL), for a payload laid out
    differently from what ``expect.codec`` writes, and for NaN or infinite values (including int8
    scales): nothing non-finite ever leaves the store. Such an object is never averaged in.
    """
    meta, tensors = _parse_object(data, key=key)
    verify_header(meta, tensors, key=key, expect=expect, run_key=run_key)
    return decode_checked(tensors, key=key, expect=expect)


def decode_summand(data: bytes, *, key: str, expect: ShardHeader, run_key: bytes | None = None) -> Summand:
    """:func:`decode_shard`, but a sparse codec's values come back as they were sent
    (:class:`~diloco_serverless.exchange.sparse.SparseValues`), for summing: the same checks, the same
    errors."""
    meta, tensors = _parse_object(data, key=key)
    verify_header(meta, tensors, key=key, expect=expect, run_key=run_key)
    return decode_summand_checked(tensors, key=key, expect=expect)


def decode_summand_checked(tensors: Mapping[str, torch.Tensor], *, key: str, expect: ShardHeader) -> Summand:
    """:func:`decode_checked`, but a sparse codec's values as they were sent (see :func:`decode_summand`)."""
    if not sparse.is_sparse(expect.codec):
        return decode_checked(tensors, key=key, expect=expect)
    try:
        kept = sparse.decode_sparse(tensors, sparse.parse(validate_codec(expect.codec)), expect.numel)
    except ValueError as e:
        raise CorruptObjectError(f"exchange object {key!r} has a bad {expect.codec} layout: {e}; refusing it") from e
    bad = _count_bad(kept.values)
    if bad:
        raise CorruptObjectError(
            f"exchange object {key!r} holds {bad} NaN/Inf values (of {expect.numel}); refusing it — replicas "
            "never write non-finite values, so it was forged or corrupted before its checksum was computed"
        )
    return kept


def decode_checked(tensors: Mapping[str, torch.Tensor], *, key: str, expect: ShardHeader) -> torch.Tensor:
    """The values of an object whose header already passed :func:`verify_header` against ``expect``
    (or :func:`unpack` and :func:`check_fields`), as flat fp32; :class:`CorruptObjectError` naming
    ``key`` for a payload laid out differently from what ``expect.codec`` writes, or for NaN/Inf."""
    try:
        values = decode_values(tensors, expect.codec, expect.numel)
    except ValueError as e:
        raise CorruptObjectError(f"exchange object {key!r} has a bad {expect.codec} layout: {e}; refusing it") from e
    bad = _count_bad(values)
    if bad:
        raise CorruptObjectError(
            f"exchange object {key!r} holds {bad} NaN/Inf values (of {expect.numel}); refusing it — replicas "
            "never write non-finite values, so it was forged or corrupted before its checksum was computed"
        )
    return values
