"""Codecs and verified exchange objects (diloco_serverless.exchange.codec)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diloco_serverless.exchange.codec import (
    CODECS,
    INT8_BLOCK,
    ShardHeader,
    decode_shard,
    decode_values,
    encode_shard,
    encode_values,
    pack,
    roundtrip,
    unpack,
)
from diloco_serverless.exchange.errors import CorruptObjectError


def _header(codec: str = "fp32", numel: int = 1000, **kw: object) -> ShardHeader:
    base: dict[str, object] = dict(run_id="run-a", round=3, shard=1, kind="contrib", codec=codec, numel=numel, rank=2,
                                   dtype="torch.float32", shape=[numel * 4])
    base.update(kw)
    return ShardHeader(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 10_007])
@pytest.mark.parametrize("codec", CODECS)
def test_roundtrip_shapes_and_error_bounds(codec: str, n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    y = decode_values(encode_values(x, codec), codec, n)
    assert y.dtype == torch.float32 and y.shape == (n,)
    if codec == "fp32":
        assert torch.equal(x, y)
    elif codec == "bf16":
        assert torch.equal(y, x.to(torch.bfloat16).float())
    elif codec == "int8" and n:
        pad = (-n) % INT8_BLOCK
        blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, INT8_BLOCK)
        bound = (blocks.abs().amax(1) / 254.0).repeat_interleave(INT8_BLOCK)[:n]
        assert bool(((x - y).abs() <= bound * (1 + 1e-5) + 1e-12).all())


def test_int8_zero_blocks_and_extremes_are_exact() -> None:
    x = torch.zeros(3 * INT8_BLOCK)
    x[INT8_BLOCK] = -5.0
    x[2 * INT8_BLOCK + 7] = 1e30
    y = roundtrip(x, "int8")
    assert torch.equal(y[:INT8_BLOCK], torch.zeros(INT8_BLOCK))
    assert y[INT8_BLOCK].item() == -5.0 and y[2 * INT8_BLOCK + 7].item() == pytest.approx(1e30, rel=1e-6)


def test_int8_refuses_non_finite() -> None:
    with pytest.raises(ValueError, match="inf/NaN"):
        encode_values(torch.tensor([1.0, float("nan")]), "int8")


def test_unknown_codec() -> None:
    with pytest.raises(ValueError, match="fp32, bf16, int8"):
        encode_values(torch.ones(3), "fp8")


def test_object_sizes_int8_is_about_a_quarter_of_fp32() -> None:
    x = torch.randn(1 << 20)
    sizes = {c: len(encode_shard(x, _header(c, x.numel()))) for c in CODECS}
    assert sizes["fp32"] >= 4 * x.numel()
    assert sizes["bf16"] / sizes["fp32"] <= 0.501
    assert sizes["int8"] / sizes["fp32"] <= 0.27


@pytest.mark.parametrize("codec", CODECS)
def test_objects_are_plain_safetensors_with_metadata(codec: str) -> None:
    x = torch.randn(1000)
    data = encode_shard(x, _header(codec))
    tensors = st_load(data)  # any safetensors reader can read it
    assert set(tensors) == {"int8": {"q", "scales"}, "sparse": {"packed", "scales"}}.get(codec, {"values"})
    (hlen,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + hlen])["__metadata__"]
    header = json.loads(meta["header"])
    assert header["run_id"] == "run-a" and header["round"] == 3 and header["shard"] == 1
    assert header["numel"] == 1000 and header["shape"] == [4000] and header["codec"] == codec
    assert meta["checksum"].startswith("sha256:")
    assert encode_shard(x, _header(codec)) == data  # deterministic bytes
    assert torch.equal(decode_shard(data, key="k", expect=_header(codec)), roundtrip(x, codec))


def test_flipped_byte_is_refused_naming_the_key() -> None:
    data = bytearray(encode_shard(torch.randn(1000), _header()))
    data[-10] ^= 0x01
    with pytest.raises(CorruptObjectError, match="rounds/00000003/contrib/0001/rank-2.*checksum"):
        decode_shard(bytes(data), key="rounds/00000003/contrib/0001/rank-2", expect=_header())


@pytest.mark.parametrize("cut", [0, 5, 8, 100, -1])
def test_truncated_object_is_refused_naming_the_key(cut: int) -> None:
    data = encode_shard(torch.randn(1000), _header())
    with pytest.raises(CorruptObjectError, match="the/key"):
        decode_shard(data[:cut], key="the/key", expect=_header())


def test_foreign_safetensors_and_garbage_are_refused() -> None:
    with pytest.raises(CorruptObjectError, match="not a diloco-exchange"):
        unpack(st_save({"values": torch.ones(3)}), key="x/y")
    with pytest.raises(CorruptObjectError, match="x/y"):
        unpack(b"hello world, not an object", key="x/y")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("run_id", "run-b", "another run"), ("round", 4, "round"), ("shard", 0, "shard"), ("rank", 1, "rank"),
     ("kind", "reduced", "kind"), ("codec", "bf16", "codec"), ("numel", 999, "numel")],
)
def test_object_from_another_run_round_or_shard_is_refused(field: str, value: object, match: str) -> None:
    data = encode_shard(torch.randn(1000), _header())
    expect = _header(**{field: value}) if field not in ("codec", "numel") else _header(
        **({"codec": value} if field == "codec" else {"numel": value}))
    with pytest.raises(CorruptObjectError, match=match) as info:
        decode_shard(data, key="some/key", expect=expect)
    assert "some/key" in str(info.value)


def test_tampered_header_fails_checksum() -> None:
    data = encode_shard(torch.randn(10), _header(numel=10))
    tampered = data.replace(b'\\"run_id\\":\\"run-a\\"', b'\\"run_id\\":\\"run-b\\"')
    assert tampered != data
    with pytest.raises(CorruptObjectError, match="checksum"):
        unpack(tampered, key="k")


def test_pack_roundtrips_arbitrary_tensors() -> None:
    t = {"a": torch.arange(6, dtype=torch.int64).view(2, 3), "b": torch.randn(4).to(torch.bfloat16)}
    got, header = unpack(pack(t, {"hello": [1, 2]}), key="k")
    assert header == {"hello": [1, 2]}
    assert torch.equal(got["a"], t["a"]) and torch.equal(got["b"], t["b"])


def test_encode_shard_checks_length() -> None:
    with pytest.raises(ValueError, match="1000"):
        encode_shard(torch.randn(5), _header())
