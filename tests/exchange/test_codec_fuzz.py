"""Adversarial exchange objects: whatever bytes sit at a key, ``decode_shard`` returns a valid shard or
raises ``CorruptObjectError`` naming the key, and nothing else (diloco_serverless.exchange.codec).

The attacker can write any object into the bucket, including ones with a correct checksum (it is not
a secret), so the mutations below re-sign what they change where the checksum would stop them early.
Property tests use hypothesis (small ``max_examples``, no example database: a few seconds in all).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, fields
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_serverless.exchange.codec import (
    _FIELD_RULES,
    FORMAT,
    MAX_HEADER_BYTES,
    ShardHeader,
    decode_shard,
    encode_shard,
    max_object_bytes,
    pack,
    payload_bytes,
)
from diloco_serverless.exchange.errors import CorruptObjectError

KEY = "rounds/00000003/contrib/0001/rank-2"
FUZZ = settings(max_examples=150, deadline=2000, database=None, suppress_health_check=[HealthCheck.too_slow])


def _expect(codec: str = "fp32", numel: int = 300) -> ShardHeader:
    return ShardHeader("run-a", 3, 1, "contrib", codec, numel, 2, "torch.float32", [numel * 2])


def _valid(codec: str = "fp32", numel: int = 300) -> bytes:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    return encode_shard(x, _expect(codec, numel))


def check(data: bytes, expect: ShardHeader) -> torch.Tensor | None:
    """The property: a finite fp32 vector of ``expect.numel`` values, or CorruptObjectError naming
    the key and reached by an explicit check (not the parser's safety net). Anything else fails."""
    try:
        out = decode_shard(data, key=KEY, expect=expect)
    except CorruptObjectError as e:
        assert KEY in str(e)
        assert "could not be parsed" not in str(e), f"only the safety net caught it: {e}"
        return None
    assert out.dtype == torch.float32 and tuple(out.shape) == (expect.numel,)
    assert bool(torch.isfinite(out).all())
    return out


# --------------------------------------------------------------------------- forging helpers


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(safetensors header as JSON, data section) of a valid object."""
    (hlen,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + hlen]), data[8 + hlen :]


def join(st_header: Any, body: bytes) -> bytes:
    """An object with this header (any JSON value, NaN allowed) and data section."""
    hb = json.dumps(st_header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(hb)) + hb + body


def raw(header: bytes, body: bytes = b"") -> bytes:
    """An object whose header is exactly these bytes."""
    return struct.pack("<Q", len(header)) + header + body


def resign(st_header: dict[str, Any], body: bytes, header_text: str) -> dict[str, Any]:
    """``st_header`` with ``header_text`` as the exchange header and a correct checksum for it."""
    h = hashlib.sha256(FORMAT.encode() + header_text.encode("utf-8", "surrogatepass"))
    for name in sorted(k for k in st_header if k != "__metadata__"):
        a, b = st_header[name]["data_offsets"]
        h.update(name.encode() + body[a:b])
    out = dict(st_header)
    out["__metadata__"] = {**st_header["__metadata__"], "header": header_text, "checksum": "sha256:" + h.hexdigest()}
    return out


def set_path(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A deep copy of ``obj`` with ``value`` at ``path`` (a missing last key is added)."""
    obj = json.loads(json.dumps(obj))
    if not path:
        return value
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return obj


junk = st.recursive(
    st.none() | st.booleans() | st.floats() | st.text(max_size=6)
    | st.integers(-(2**70), 2**70) | st.sampled_from([-1, 0, 1, 2**31, 2**63, 2**64, 10**30]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5,
)


# --------------------------------------------------------------------------- bytes


@FUZZ
@given(data=st.binary(max_size=1024))
def test_random_bytes(data: bytes) -> None:
    assert check(data, _expect()) is None


@FUZZ
@given(hlen=st.integers(0, 2**64 - 1) | st.integers(0, 300), rest=st.binary(max_size=600))
def test_random_bytes_after_any_header_length(hlen: int, rest: bytes) -> None:
    assert check(struct.pack("<Q", hlen) + rest, _expect()) is None


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_every_truncation_and_extension_is_refused(codec: str) -> None:
    data = _valid(codec, 40)
    assert check(data, _expect(codec, 40)) is not None
    for n in range(len(data)):
        assert check(data[:n], _expect(codec, 40)) is None, n
    for extra in (b"\0", b"\0" * 8, data):
        assert check(data + extra, _expect(codec, 40)) is None


@FUZZ
@given(pos=st.integers(0, 10_000), flip=st.integers(1, 255))
def test_any_flipped_byte_is_refused(pos: int, flip: int) -> None:
    data = bytearray(_valid("int8", 300))
    data[pos % len(data)] ^= flip
    # a flipped space of the header padding can still be valid JSON whitespace: then the values are intact
    out = check(bytes(data), _expect("int8", 300))
    assert out is None or torch.equal(out, decode_shard(_valid("int8", 300), key=KEY, expect=_expect("int8", 300)))


# --------------------------------------------------------------------------- the safetensors header

_ST_PATHS: list[tuple[Any, ...]] = [
    (), ("__metadata__",), ("__metadata__", "format"), ("__metadata__", "header"), ("__metadata__", "checksum"),
    ("__metadata__", "extra"), ("q",), ("q", "dtype"), ("q", "shape"), ("q", "shape", 0), ("q", "data_offsets"),
    ("q", "data_offsets", 0), ("q", "data_offsets", 1), ("q", "extra"), ("scales", "shape"),
    ("scales", "data_offsets", 1), ("other",),
]


@FUZZ
@given(path=st.sampled_from(_ST_PATHS), value=junk)
def test_wrong_types_anywhere_in_the_safetensors_header(path: tuple[Any, ...], value: Any) -> None:
    st_header, body = split(_valid("int8", 300))
    check(join(set_path(st_header, path, value), body), _expect("int8", 300))


@FUZZ
@given(
    shapes=st.lists(st.lists(st.integers(-(2**64), 2**64) | st.integers(-3, 400), max_size=4), min_size=2, max_size=2),
    offsets=st.lists(st.lists(st.integers(-(2**64), 2**64) | st.integers(-8, 700), min_size=2, max_size=2),
                     min_size=2, max_size=2),
)
def test_forged_shapes_and_offsets(shapes: list[list[int]], offsets: list[list[int]]) -> None:
    """Huge, negative, overlapping, out-of-range, re-signed: parsed only if they tile the data exactly."""
    st_header, body = split(_valid("int8", 300))
    for name, shape, offs in zip(("q", "scales"), shapes, offsets):
        st_header[name] = {**st_header[name], "shape": shape, "data_offsets": offs}
    check(join(resign(st_header, body, st_header["__metadata__"]["header"]), body), _expect("int8", 300))


def test_overlapping_tensors_are_refused() -> None:
    st_header, body = split(_valid("int8", 256))  # q: [4, 260), scales: [0, 4)
    st_header["q"]["data_offsets"] = [0, 256]
    st_header["scales"]["data_offsets"] = [0, 4]
    with pytest.raises(CorruptObjectError, match="gaps or overlaps"):
        decode_shard(join(resign(st_header, body, st_header["__metadata__"]["header"]), body), key=KEY,
                     expect=_expect("int8", 256))


# --------------------------------------------------------------------------- the exchange header (re-signed)

_FIELDS = [f.name for f in fields(ShardHeader)]


def test_every_header_field_has_a_rule() -> None:
    assert list(_FIELD_RULES) == _FIELDS


@FUZZ
@given(field=st.sampled_from(_FIELDS + ["extra"]), value=junk, drop=st.booleans())
def test_wrong_types_in_the_exchange_header_with_a_valid_checksum(field: str, value: Any, drop: bool) -> None:
    st_header, body = split(_valid("fp32", 300))
    header = json.loads(st_header["__metadata__"]["header"])
    if drop:
        header.pop(field, None)
    else:
        header[field] = value
    out = check(join(resign(st_header, body, json.dumps(header)), body), _expect("fp32", 300))
    if out is not None:  # only if the forged header still identifies the expected object
        want = asdict(_expect("fp32", 300))
        assert all(header[k] == want[k] for k in ShardHeader._CHECKED)


@FUZZ
@given(value=junk)
def test_exchange_header_of_any_json_type(value: Any) -> None:
    st_header, body = split(_valid("fp32", 300))
    check(join(resign(st_header, body, json.dumps(value)), body), _expect("fp32", 300))


@FUZZ
@given(text=st.text(max_size=40))
def test_exchange_header_text_of_any_string(text: str) -> None:
    st_header, body = split(_valid("fp32", 300))
    assert check(join(resign(st_header, body, text), body), _expect("fp32", 300)) is None


# --------------------------------------------------------------------------- named regressions


def _resigned(header_text: str, codec: str = "fp32", numel: int = 300) -> bytes:
    st_header, body = split(_valid(codec, numel))
    return join(resign(st_header, body, header_text), body)


def _header_text(**changes: Any) -> str:
    return json.dumps({**asdict(_expect()), **changes})


@pytest.mark.parametrize(
    ("data", "match"),
    [
        pytest.param(join("hello", b""), "header is a JSON string, not an object", id="string-header"),
        pytest.param(join([1, 2], b""), "header is a JSON array", id="list-header"),
        pytest.param(join(None, b""), "header is a JSON null", id="null-header"),
        pytest.param(join({"__metadata__": [1]}, b""), "__metadata__ is not an object of strings", id="list-meta"),
        pytest.param(join({"__metadata__": {"format": 1}}, b""), "__metadata__ is not an object of strings",
                     id="number-in-meta"),
        pytest.param(join({"x": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}, b"\0" * 16),
                     "has shape", id="negative-shape"),
        pytest.param(join({"x": {"dtype": "F32", "shape": [2**62, 0], "data_offsets": [0, 0]}}, b""),
                     "has shape", id="huge-zero-sized-shape"),
        pytest.param(join({"x": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 2**82]}}, b"\0" * 16),
                     "has shape", id="huge-shape"),
        pytest.param(join({"x": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4),
                     "has shape", id="bool-shape"),
        pytest.param(join({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}}, b"\0" * 4),
                     "data_offsets", id="float-offset"),
        pytest.param(join({"x": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, b"\0" * 4),
                     "data_offsets", id="negative-offset"),
        pytest.param(join({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 4),
                     "data_offsets", id="offset-past-end"),
        pytest.param(join({"x": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
                     "dtype", id="unknown-dtype"),
        pytest.param(join({"x": [1, 2]}, b""), "not an object with exactly", id="list-tensor"),
        pytest.param(b"[" * 30_000 + b"]" * 30_000, "header length field", id="length-field-is-json"),
        pytest.param(raw(b"[" * 20_000 + b"]" * 20_000), "nested too deeply", id="deep-list"),
        pytest.param(raw(b'{"__metadata__":{"a":' + b"[" * 20_000 + b"]" * 20_000 + b"}}"), "nested too deeply",
                     id="deep-metadata"),
        pytest.param(raw(b'{"a":' * 10_000 + b"1" + b"}" * 10_000), "nested too deeply", id="deep-object"),
        pytest.param(raw(b'{"\xff":1}'), "not UTF-8", id="non-utf8"),
        pytest.param(raw("{}".encode("utf-16")), "not UTF-8", id="utf16-with-bom"),
        pytest.param(struct.pack("<Q", 100) + b"{}", "runs past the end", id="length-past-end"),
        pytest.param(struct.pack("<Q", 2**64 - 1) + b"{}", "more than the", id="length-2**64-1"),
        pytest.param(struct.pack("<Q", MAX_HEADER_BYTES + 8) + b" " * (MAX_HEADER_BYTES + 8), "more than the",
                     id="header-too-large"),
        pytest.param(b"\x02\0\0", "shorter than the 8-byte", id="shorter-than-length"),
        pytest.param(raw(b'{"a":1,"a":2}'), "repeats the key", id="duplicate-keys"),
        pytest.param(join({"x": {"dtype": "F32", "shape": [float("nan")], "data_offsets": [0, 4]}}, b"\0" * 4),
                     "NaN, which is not valid JSON", id="nan-constant"),
        pytest.param(join({"\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
                     "not valid Unicode", id="surrogate-tensor-name"),
        pytest.param(_resigned('"a string"'), "header that is a JSON string", id="string-exchange-header"),
        pytest.param(_resigned("[1, 2]"), "header that is a JSON array", id="list-exchange-header"),
        pytest.param(_resigned("7"), "header that is a JSON number", id="number-exchange-header"),
        pytest.param(_resigned("null"), "header that is a JSON null", id="null-exchange-header"),
        pytest.param(_resigned("[" * 5000 + "]" * 5000), "nested too deeply", id="deep-exchange-header"),
        pytest.param(_resigned("\ud800"), "not valid Unicode", id="surrogate-exchange-header"),
        pytest.param(_resigned(_header_text(numel=-300)), "numel=-300 in its header", id="negative-numel"),
        pytest.param(_resigned(_header_text(numel=10**30)), "numel=", id="huge-numel"),
        pytest.param(_resigned(_header_text(shard=True)), "shard=True", id="bool-shard"),  # True == 1 in Python
        pytest.param(_resigned(_header_text(run_id=["run-a"])), "run_id=", id="list-run-id"),
        pytest.param(_resigned(_header_text(shape=[-1])), "shape=", id="negative-shape-field"),
        pytest.param(_resigned(json.dumps({k: v for k, v in asdict(_expect()).items() if k != "kind"})),
                     "no 'kind' in its header", id="missing-field"),
    ],
)
def test_malformed_objects_raise_corrupt_object_error_saying_what(data: bytes, match: str) -> None:
    with pytest.raises(CorruptObjectError, match=match) as info:
        decode_shard(data, key=KEY, expect=_expect())
    assert KEY in str(info.value) and "could not be parsed" not in str(info.value)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_max_object_bytes_bounds_every_valid_object(codec: str) -> None:
    for n in (0, 1, 255, 256, 257, 1000):
        data = _valid(codec, n)
        st_header, body = split(data)
        assert len(body) == payload_bytes(codec, n)
        assert len(data) <= max_object_bytes(codec, n) == 8 + MAX_HEADER_BYTES + len(body)


def test_a_long_run_id_and_shape_fit_the_header_bound() -> None:
    expect = ShardHeader("r" * 128, 99_999_999, 9999, "reduced", "int8", 10, None, "torch.bfloat16", [2**40] * 64)
    data = encode_shard(torch.ones(10), expect)
    assert len(split(data)[0]["__metadata__"]["header"]) < MAX_HEADER_BYTES // 8
    assert torch.equal(decode_shard(data, key=KEY, expect=expect), torch.ones(10))


# --------------------------------------------------------------------------- non-finite payloads


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_non_finite_values_with_a_valid_checksum_are_refused(codec: str, bad: float) -> None:
    x = torch.ones(300)
    x[17] = bad
    data = pack({"values": x.to(torch.float32 if codec == "fp32" else torch.bfloat16)}, asdict(_expect(codec)))
    with pytest.raises(CorruptObjectError, match=f"{KEY}.*1 NaN/Inf values"):
        decode_shard(data, key=KEY, expect=_expect(codec))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, 3e38])
def test_bad_int8_scales_with_a_valid_checksum_are_refused(scale: float) -> None:
    q = torch.ones(300, dtype=torch.int8) * 127
    scales = torch.tensor([1.0, scale])
    data = pack({"q": q, "scales": scales}, asdict(_expect("int8")))
    with pytest.raises(CorruptObjectError, match=KEY) as info:
        decode_shard(data, key=KEY, expect=_expect("int8"))
    assert ("scales" in str(info.value)) or ("NaN/Inf" in str(info.value))  # 3e38 * 127 overflows to inf


def test_extra_tensors_are_refused() -> None:
    x = torch.ones(300)
    data = pack({"values": x, "junk": torch.zeros(10**4, dtype=torch.uint8)}, asdict(_expect()))
    with pytest.raises(CorruptObjectError, match="exactly 'values'"):
        decode_shard(data, key=KEY, expect=_expect())
