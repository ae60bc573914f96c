"""A signature says where its object belongs: a genuine object copied to any key it was not made for is
refused, whatever its kind (docs/security.md, "Every signature binds its place").

The property test signs each object kind at a generated place (round, rank, shard, slice, tree level,
start token, spread form, copy index) and verifies it at another generated place, through the one helper
every writer and reader uses (:mod:`diloco_serverless.run.integrity`, and the exchange codec on top of it).
The other tests replay the review's findings 2, 3 and 9 through the real readers.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_serverless.exchange._io import CountingStore, shard_bounds
from diloco_serverless.exchange.codec import ShardHeader, decode_shard, encode_shard, pack, unpack
from diloco_serverless.exchange.errors import CorruptObjectError
from diloco_serverless.exchange.quorum import (
    Fetched,
    ReadyMarker,
    _read_abstention,
    check_signature,
    collect_markers,
    marker_tag,
    signed_json,
    write_abstention,
)
from diloco_serverless.exchange.sliced import SlicedAllReduce
from diloco_serverless.run.integrity import mac_json, new_run_key, parse_run_key, scoped_key, verify_json
from diloco_serverless.run.layout import (
    abstain_key,
    checkpoint_prefix,
    contrib_key,
    partial_key,
    quorum_copy_key,
    quorum_key,
    ready_key,
    reduced_copy_key,
    reduced_key,
    slice_prefix,
    start_key,
    vote_key,
)
from diloco_serverless.store.objectstore import ObjectStore

KEY = parse_run_key(new_run_key(), source="test")


@dataclass(frozen=True)
class Where:
    """Everything a key may name. ``spread``/``copy`` pick among the keys that hold the *same* object (a
    spread prefix, a copy of a quorum or reduced shard), so they never make a copy a different object."""

    round: int
    rank: int
    shard: int
    slice: int
    level: int
    token: str
    spread: int
    copy: int


def _ready(w: Where) -> str:
    return ready_key(w.round, w.rank, "ab12", w.spread)


def _quorum(w: Where) -> str:
    return quorum_key(w.round) if w.spread == 1 else quorum_copy_key(w.round, w.copy, w.spread)


def _reduced(w: Where) -> str:
    return reduced_key(w.round, w.shard, w.spread) if w.spread == 1 or w.copy == 0 else \
        reduced_copy_key(w.round, w.shard, w.copy, w.spread)


#: kind -> (its key at a place, the fields of the place that make it another object, exchange object?)
KINDS: dict[str, tuple[Callable[[Where], str], tuple[str, ...], bool]] = {
    "ready": (_ready, ("slice", "round", "rank"), False),
    "abstain": (lambda w: abstain_key(w.round, w.rank, w.spread), ("slice", "round", "rank"), False),
    "quorum": (_quorum, ("slice", "round"), False),
    "vote": (lambda w: vote_key(w.round, w.rank), ("slice", "round", "rank"), True),
    "contrib": (lambda w: contrib_key(w.round, w.shard, w.rank, w.spread), ("slice", "round", "shard", "rank"), True),
    "reduced": (_reduced, ("slice", "round", "shard"), True),
    "partial": (lambda w: partial_key(w.round, w.rank, w.shard, w.spread, level=w.level),
                ("slice", "round", "rank", "shard", "level"), True),
    "start": (lambda w: start_key(w.rank, 1_700_000_000_000 + w.round, w.token), ("round", "rank", "token"), False),
    "checkpoint-manifest": (lambda w: f"{checkpoint_prefix(w.round)}/manifest.json", ("round",), False),
    "checkpoint-shard": (lambda w: f"{checkpoint_prefix(w.round)}/shard-{w.shard:04d}.json", ("round", "shard"),
                         False),
    "data-state": (lambda w: f"{checkpoint_prefix(w.round)}/data/rank-{w.rank}.json", ("round", "rank"), False),
    "run.json": (lambda w: "run.json", (), False),
}

wheres = st.builds(
    Where,
    round=st.integers(0, 3), rank=st.integers(0, 3), shard=st.integers(0, 2), slice=st.integers(0, 2),
    level=st.integers(1, 3), token=st.sampled_from(["aa", "bb"]), spread=st.sampled_from([1, 4]),
    copy=st.integers(0, 3),
)


def _signer(kind: str, w: Where) -> bytes:
    """The key an object of ``kind`` is signed with at ``w``: the exchange's objects per slice."""
    return scoped_key(KEY, slice_prefix(w.slice)) if "slice" in KINDS[kind][1] else KEY


def _accepted(kind: str, src: Where, dst: Where) -> bool:
    """Sign an object of ``kind`` for ``src``, store it at ``dst``'s key: does ``dst``'s reader take it?"""
    key_of, _, exchange = KINDS[kind]
    doc = {"run_id": "t", "round": src.round, "rank": src.rank}
    if exchange:
        blob = pack({"values": torch.ones(2)}, doc, _signer(kind, src), place=key_of(src))
        try:
            unpack(blob, key=key_of(dst), run_key=_signer(kind, dst))
        except CorruptObjectError:
            return False
        return True
    signed = mac_json(_signer(kind, src), kind, doc, place=key_of(src))
    return verify_json(_signer(kind, dst), kind, signed, place=key_of(dst))


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(sorted(KINDS)), src=wheres, dst=wheres)
def test_every_copy_to_another_place_is_refused(kind: str, src: Where, dst: Where) -> None:
    fields = KINDS[kind][1]
    same_object = all(getattr(src, f) == getattr(dst, f) for f in fields)
    assert _accepted(kind, src, dst) == same_object, (kind, src, dst)


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from(sorted(KINDS)), src=wheres, field=st.sampled_from(
    ["round", "rank", "shard", "slice", "level", "token"]))
def test_changing_any_field_of_the_place_is_refused(kind: str, src: Where, field: str) -> None:
    """The generator above finds mismatches by chance; this one moves one field at a time."""
    if field not in KINDS[kind][1]:
        return
    moved: object = ("cc" if src.token != "cc" else "dd") if field == "token" else (getattr(src, field) % 3) + 1
    dst = replace(src, **{field: moved})  # type: ignore[arg-type]
    assert getattr(dst, field) != getattr(src, field)
    assert not _accepted(kind, src, dst)
    assert _accepted(kind, src, src)


# ---------------------------------------------------------------- the findings, through the real readers


def _marker(rank: int, round: int = 0) -> ReadyMarker:
    return ReadyMarker("t", round, rank, 3, 8, "torch.float32", [8], "fp32", "flat")


def test_finding_9_a_genuine_abstention_copied_to_another_rank_does_not_drop_it(tmp_path: Path) -> None:
    io = CountingStore(ObjectStore(f"file://{tmp_path}"))
    write_abstention(io, _marker(0), "loss was NaN", KEY)
    assert _read_abstention(io, _marker(1), 0, KEY) == "loss was NaN"  # read at its own key: it counts
    io.store.put(abstain_key(0, 2), io.store.get(abstain_key(0, 0)))  # the co-tenant copies it to rank 2's key
    assert _read_abstention(io, _marker(1), 2, KEY) is None  # rank 2 is not dropped from the quorum


def test_finding_9_a_genuine_ready_marker_copied_to_another_rank_is_refused(tmp_path: Path) -> None:
    io = CountingStore(ObjectStore(f"file://{tmp_path}"))
    own = ready_key(0, 0, marker_tag(_marker(0), KEY))
    io.put(own, signed_json(KEY, "ready", asdict(_marker(0)), own))
    stolen = ready_key(0, 2, marker_tag(_marker(2), KEY))  # named like rank 2's own would be
    io.store.put(stolen, io.store.get(own))
    fetched: Fetched = {2: (stolen, io.get_async(stolen, control=True))}
    with pytest.raises(CorruptObjectError, match="signature for this key"):
        collect_markers(fetched, [2], KEY)


def test_finding_3_a_level_1_partial_copied_under_a_level_2_key_is_refused() -> None:
    header = ShardHeader("t", 0, 1, "partial", "fp32", 4, 0, "torch.float32", [8])
    level1, level2 = partial_key(0, 0, 1, 4, level=1), partial_key(0, 0, 1, 4, level=2)
    blob = encode_shard(torch.arange(4.0), header, KEY, place=level1)
    assert torch.equal(decode_shard(blob, key=level1, expect=header, run_key=KEY), torch.arange(4.0))
    with pytest.raises(CorruptObjectError, match="signature for this key"):
        decode_shard(blob, key=level2, expect=header, run_key=KEY)  # the same header: only the place differs


def test_a_quorum_copy_and_a_reduced_copy_verify_as_their_original() -> None:
    """The keys that hold the same object share its place, so copies written by the exchange still verify."""
    signed = json.loads(signed_json(KEY, "quorum", {"round": 5}, quorum_key(5)))
    check_signature(KEY, "quorum", signed, quorum_copy_key(5, 3, 8))
    with pytest.raises(CorruptObjectError):
        check_signature(KEY, "quorum", signed, quorum_copy_key(6, 3, 8))
    header = ShardHeader("t", 5, 2, "reduced", "fp32", 4, None, "torch.float32", [8])
    blob = encode_shard(torch.ones(4), header, KEY, place=reduced_key(5, 2, 8))
    decode_shard(blob, key=reduced_copy_key(5, 2, 1, 8), expect=header, run_key=KEY)


def test_signing_without_a_place_is_refused() -> None:
    with pytest.raises(ValueError, match="place"):
        pack({"values": torch.ones(2)}, {"run_id": "t"}, KEY)


P = 4_000


def _sliced_round(store: str) -> tuple[dict[tuple[int, int], torch.Tensor], list[Exception]]:
    """Two replicas x two slices of one round, with the run key; returns each (rank, slice)'s result."""
    gen = torch.Generator().manual_seed(0)
    data = {r: torch.randn(P, generator=gen) for r in range(2)}
    out: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[Exception] = []

    def one(rank: int, g: int) -> None:
        try:
            with SlicedAllReduce(store, rank, 2, slice_index=g, slices=2, run_id="run", timeout_s=30,
                                 poll_interval_s=0.02, run_key=KEY) as ex:
                a, b = shard_bounds(P, 2)[g]
                out[(rank, g)] = ex.allreduce(data[rank][a:b], round=0)
        except Exception as exc:  # noqa: BLE001 - the test looks at them
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r, g)) for r in range(2) for g in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out, errors


def test_finding_2_slice_0s_reduced_shard_is_not_accepted_as_slice_1s(tmp_path: Path) -> None:
    """Finding 2: the same run, round and shard under ``slices/00`` and ``slices/01`` have identical
    headers; a genuine slice-0 reduced shard planted at slice 1's key must be refused, not averaged."""
    good, errors = _sliced_round(f"file://{tmp_path}/a")
    assert not errors, errors
    planted = tmp_path / "b/run/slices/01/rounds/00000000/reduced"
    planted.mkdir(parents=True)
    shutil.copy(tmp_path / "a/run/slices/00/rounds/00000000/reduced/0000", planted / "0000")
    out, errors = _sliced_round(f"file://{tmp_path}/b")
    assert all(torch.equal(out[(r, 0)], good[(r, 0)]) for r in range(2) if (r, 0) in out)  # slice 0 unharmed
    assert not any((r, 1) in out and not torch.equal(out[(r, 1)], good[(r, 1)]) for r in range(2)), \
        "a slice-1 replica applied slice 0's values"
    assert errors and all(isinstance(e, CorruptObjectError) and "signature for this key" in str(e) for e in errors)
