"""Run integrity: run.json, exchange objects and checkpoints carry an HMAC under a key the store never sees.

Each test plays a bucket co-tenant (anyone holding a replica credential can write under the prefix):
it forges or rewrites an object, and the reader that holds the run key refuses it, naming the key.
"""

from __future__ import annotations

import json
import stat
import threading
import uuid
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from diloco_serverless.config import RunConfig
from diloco_serverless.exchange.allreduce import ObjectStoreAllReduce
from diloco_serverless.exchange.codec import unpack
from diloco_serverless.exchange.errors import CorruptObjectError
from diloco_serverless.exchange.quorum import ReadyMarker, marker_tag
from diloco_serverless.run.integrity import (
    MAC_FIELD,
    RUN_KEY_ENV,
    load_local_key,
    mac_json,
    new_run_key,
    parse_run_key,
    save_local_key,
    verify_json,
)
from diloco_serverless.run.layout import ready_key, vote_key
from diloco_serverless.run.record import InvalidRun, create_run, load_run, record_launch
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer import checkpoint as ckpt
from diloco_serverless.trainer.checkpoint import CheckpointCorrupt
from support.allreduce import FAST, WithQuorum, randn

KEY = parse_run_key(new_run_key(), source="test")
OTHER = parse_run_key(new_run_key(), source="test")


def _cfg(tmp_path: Path, **extra: str) -> RunConfig:
    sets = [f"run_id=run-{uuid.uuid4().hex[:6]}", "replicas=2", f'store="{tmp_path / "store"}"',
            *[f"{k}={v}" for k, v in extra.items()]]
    return RunConfig.load(None, sets)


def test_hmac_binds_kind_and_content() -> None:
    at = "rounds/00000003/quorum.json"
    doc = mac_json(KEY, "quorum", {"round": 3, "participants": [0, 1]}, place=at)
    assert verify_json(KEY, "quorum", doc, place=at)
    assert not verify_json(OTHER, "quorum", doc, place=at)
    assert not verify_json(KEY, "ready", doc, place=at)  # a signed quorum does not pass for a ready marker
    assert not verify_json(KEY, "quorum", doc, place="rounds/00000004/quorum.json")  # nor at another key
    assert not verify_json(KEY, "quorum", {**doc, "participants": [0]}, place=at)
    assert not verify_json(KEY, "quorum", {k: v for k, v in doc.items() if k != MAC_FIELD}, place=at)
    assert not verify_json(KEY, "quorum", ["not", "an", "object"], place=at)
    with pytest.raises(ValueError, match="not a run key"):
        parse_run_key("abc", source="$DILOCO_RUN_KEY")


def test_the_launcher_keeps_the_key_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCO_KEYS_DIR", str(tmp_path / "keys"))
    monkeypatch.delenv(RUN_KEY_ENV, raising=False)
    key = new_run_key()
    path = save_local_key("s3://bucket/runs/run-1", key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_local_key("s3://bucket/runs/run-1") == bytes.fromhex(key)
    assert load_local_key("s3://other-bucket/runs/run-1") is None  # same run id, another store
    assert load_local_key("s3://bucket/runs/run-unknown") is None


def test_a_rewritten_run_json_is_refused(tmp_path: Path) -> None:
    run_store, record = create_run(None, _cfg(tmp_path), key=KEY)
    assert load_run(run_store.url, key=KEY)[1].run_id == record.run_id
    stored = json.loads(run_store.get("run.json"))
    assert verify_json(KEY, "run.json", stored, place="run.json")
    # the co-tenant points the replicas at its own model and data (keeping the old signature)
    stored["config"]["model"]["name"] = "attacker/model"
    stored["config"]["model"]["trust_remote_code"] = True
    run_store.put("run.json", json.dumps(stored).encode())
    with pytest.raises(InvalidRun, match=r"run\.json does not carry this run's signature"):
        load_run(run_store.url, key=KEY)
    with pytest.raises(InvalidRun, match="signature"):
        load_run(run_store.url, key=OTHER)


def test_record_launch_keeps_run_json_signed(tmp_path: Path) -> None:
    run_store, _ = create_run(None, _cfg(tmp_path), key=KEY)
    record_launch(run_store, "local", [{"kind": "local", "rank": 0}], key=KEY)
    _, record = load_run(run_store.url, key=KEY)
    assert record.launch is not None and record.launch["executor"] == "local"


def test_a_replica_refuses_a_forged_run_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco_serverless.trainer.loop import ReplicaTrainer

    run_store, _ = create_run(None, _cfg(tmp_path), key=KEY)
    stored = json.loads(run_store.get("run.json"))
    stored["config"]["inner"]["lr"] = 10.0
    run_store.put("run.json", json.dumps(stored).encode())
    monkeypatch.setenv(RUN_KEY_ENV, KEY.hex())
    with pytest.raises(InvalidRun, match="signature"):
        ReplicaTrainer.from_run(run_store.url, 0)


def test_trust_remote_code_needs_the_launchers_word(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a genuinely signed config cannot turn on remote code by itself."""
    from diloco_serverless.errors import ConfigError
    from diloco_serverless.trainer.loop import ReplicaTrainer

    run_store, _ = create_run(None, _cfg(tmp_path, **{"model.trust_remote_code": "true"}), key=KEY)
    monkeypatch.setenv(RUN_KEY_ENV, KEY.hex())
    monkeypatch.delenv("DILOCO_TRUST_REMOTE_CODE", raising=False)
    with pytest.raises(ConfigError, match="--trust-remote-code"):
        ReplicaTrainer.from_run(run_store.url, 0)


def _url() -> str:
    return f"memory://integrity-{uuid.uuid4().hex[:8]}"


def _round(url: str, run_key: bytes | None, world: int = 2, *, quorum: bool = True) -> dict[int, object]:
    """One round of ``world`` replicas; with ``quorum`` (the tests of markers and quorums) it has a quorum
    object, as at N > 16, otherwise it votes (:mod:`diloco_serverless.exchange.votes`)."""
    outs: dict[int, object] = {}

    def one(r: int) -> None:
        try:
            with (WithQuorum if quorum else ObjectStoreAllReduce)(url, r, world, run_id="t", run_key=run_key,
                                                                  **FAST) as ar:
                outs[r] = ar.allreduce(randn(300, r))
        except BaseException as e:  # reported to the test
            outs[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outs


def test_signed_exchange_objects_round_trip_and_carry_macs() -> None:
    url = _url()
    outs = _round(url, KEY)
    assert all(isinstance(o, torch.Tensor) for o in outs.values())
    store = ObjectStore(url).child("t")
    quorum = json.loads(store.get("rounds/00000000/quorum.json"))
    (key,) = [k for k in store.list("rounds/00000000/ready") if "/rank-0." in k]
    ready = json.loads(store.get(key))
    assert verify_json(KEY, "quorum", quorum, place="rounds/00000000/quorum.json")
    assert verify_json(KEY, "ready", ready, place=key)
    assert key.endswith("." + ready["mac"])  # the marker is named by its MAC
    voted = _url()
    assert all(isinstance(o, torch.Tensor) for o in _round(voted, KEY, quorum=False).values())
    vote = ObjectStore(voted).child("t").get(vote_key(0, 1))
    assert unpack(vote, key=vote_key(0, 1), run_key=KEY)[1]["marker"]["rank"] == 1  # a vote is signed too
    with pytest.raises(CorruptObjectError, match="signature"):
        unpack(vote, key=vote_key(0, 1), run_key=OTHER)


def test_a_forged_quorum_is_refused_by_every_replica() -> None:
    url = _url()
    store = ObjectStore(url).child("t")
    forged = {"run_id": "t", "round": 0, "participants": [1], "created_by": 1, "created_at": 0.0,
              "markers": {"1": {"run_id": "t", "round": 0, "rank": 1, "world_size": 2, "numel": 300,
                                "dtype": "torch.float32", "shape": [300], "codec": "fp32"}}}
    store.put("rounds/00000000/quorum.json", json.dumps(forged).encode())
    outs = _round(url, KEY)
    for o in outs.values():
        assert isinstance(o, CorruptObjectError)
        assert "rounds/00000000/quorum.json" in str(o) and "signature" in str(o)


def test_a_forged_ready_marker_is_refused() -> None:
    url = _url()
    store = ObjectStore(url).child("t")
    marker = {"run_id": "t", "round": 0, "rank": 1, "world_size": 2, "numel": 300, "dtype": "torch.float32",
              "shape": [300], "codec": "fp32"}
    store.put("rounds/00000000/ready/rank-1",
              json.dumps(mac_json(OTHER, "ready", marker, place="rounds/00000000/ready/rank-1")).encode())
    with WithQuorum(url, 0, 2, run_id="t", run_key=KEY, **{**FAST, "timeout_s": 5.0}) as ar:
        with pytest.raises(CorruptObjectError, match=r"ready/rank-1.*signature"):
            ar.allreduce(randn(300, 0))


def test_a_ready_marker_named_without_the_run_key_is_read_and_refused() -> None:
    """Only a holder of the run key can name a marker so that the quorum's writer takes it unread: a tag
    anyone can compute (the keyless SHA-256) is not that, so the object is read, and its signature fails."""
    url = _url()
    store = ObjectStore(url).child("t")
    marker = ReadyMarker("t", 0, 1, 2, 300, "torch.float32", [300], "fp32", "direct")
    forged = mac_json(OTHER, "ready", asdict(marker), place=ready_key(0, 1))
    store.put(ready_key(0, 1, marker_tag(marker, None)), json.dumps(forged).encode())
    with WithQuorum(url, 0, 2, run_id="t", run_key=KEY, **{**FAST, "timeout_s": 5.0}) as ar:
        with pytest.raises(CorruptObjectError, match=r"ready/rank-1\..*signature"):
            ar.allreduce(randn(300, 0))


def test_an_unsigned_abstention_does_not_count() -> None:
    """A forged ``abstain-1`` must not let the round close without rank 1 (or fail it)."""
    url = _url()
    store = ObjectStore(url).child("t")
    store.put("rounds/00000000/ready/abstain-1", json.dumps({"run_id": "t", "round": 0, "rank": 1,
                                                              "reason": "forged"}).encode())
    with WithQuorum(url, 0, 2, run_id="t", run_key=KEY, min_replicas=1,
                              **{**FAST, "straggler_timeout_s": 30.0, "timeout_s": 2.0}) as ar:
        with pytest.raises(TimeoutError, match=r"ranks \[1\] never became ready"):
            ar.allreduce(randn(300, 0))


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_forged_initial_parameters_are_refused(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path / "run"))
    from safetensors.torch import save as st_save

    evil = {n: torch.full_like(p, 7.0) for n, p in _tiny_model().named_parameters()}
    store.put(ckpt.INITIAL_KEY, st_save({n: t.contiguous() for n, t in evil.items()}, metadata={"format": "1"}))
    with pytest.raises(CheckpointCorrupt, match=r"initial\.safetensors does not carry this run's signature"):
        ckpt.sync_initial_parameters(store, _tiny_model(), KEY)


def test_signed_initial_parameters_are_shared(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path / "run"))
    first, second = _tiny_model(), _tiny_model()
    torch.manual_seed(1)
    second[0].weight.data.normal_()
    assert ckpt.sync_initial_parameters(store, first, KEY)
    assert not ckpt.sync_initial_parameters(store, second, KEY)
    assert torch.equal(first[0].weight, second[0].weight)


def _checkpoint(store: ObjectStore) -> dict[str, torch.Tensor]:
    tensors = {n: p.detach().clone() for n, p in _tiny_model().named_parameters()}
    ckpt.save_checkpoint(store, 0, 2, tensors, {"fragments": 1}, rank=0, world_size=1,
                         data_state={"position": 12}, takeover_s=0.0, run_key=KEY)
    return tensors


def test_signed_checkpoints_load_and_forged_ones_are_refused(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path / "run"))
    tensors = _checkpoint(store)
    loaded, info = ckpt.load_checkpoint(store, 0, KEY)
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors) and info.step == 2
    assert ckpt.read_data_state(store, 0, 0, KEY) == {"position": 12}

    # rewrite a shard and its marker consistently, as a co-tenant without the key would
    from safetensors.torch import save as st_save

    marker_key = "checkpoints/00000000/shard-0000.json"
    evil = st_save({k: torch.zeros_like(v).contiguous() for k, v in tensors.items()})
    store.put("checkpoints/00000000/shard-0000.safetensors", evil)
    import hashlib

    marker = json.loads(store.get(marker_key))
    marker["sha256"], marker["bytes"] = hashlib.sha256(evil).hexdigest(), len(evil)
    store.put(marker_key, json.dumps(marker).encode())
    with pytest.raises(CheckpointCorrupt, match="shard-0000.json: not signed"):
        ckpt.load_checkpoint(store, 0, KEY)


def test_a_forged_data_position_is_refused(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path / "run"))
    _checkpoint(store)
    store.put("checkpoints/00000000/data/rank-0.json",
              json.dumps({"round": 0, "rank": 0, "state": {"position": 0}}).encode())
    with pytest.raises(CheckpointCorrupt, match="signature"):
        ckpt.read_data_state(store, 0, 0, KEY)


def test_run_key_never_reaches_the_store(tmp_path: Path) -> None:
    run_store, _ = create_run(None, _cfg(tmp_path), key=KEY)
    record_launch(run_store, "local", [], key=KEY)
    store_files = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert store_files
    for path in store_files:
        data = path.read_bytes()
        assert KEY.hex().encode() not in data and KEY not in data, path


def test_a_forged_reduced_shard_with_a_valid_checksum_is_refused() -> None:
    """The checksum alone is unkeyed: anyone can compute it. The run's HMAC is what a forger lacks."""
    from dataclasses import asdict

    from diloco_serverless.exchange.codec import ShardHeader, encode_values, pack, unpack

    url = _url()
    store = ObjectStore(url).child("t")
    # rank 0 publishes first; the forger then plants the reduced shard 1 that rank 1 would write
    header = ShardHeader("t", 0, 1, "reduced", "fp32", 150, None, "torch.float32", [300])
    for forger_key in (None, OTHER):
        blob = pack(encode_values(torch.full((150,), 1e3), "fp32"), asdict(header), forger_key,
                    place="rounds/00000000/reduced/0001")
        unpack(blob, key="x")  # a well-formed object with a correct checksum
        store.put("rounds/00000000/reduced/0001", blob)
        with WithQuorum(url, 0, 2, run_id="t", run_key=KEY, min_replicas=1,
                                  **{**FAST, "straggler_timeout_s": 0.2}) as ar:
            with pytest.raises(CorruptObjectError, match=r"reduced/0001.*signature"):
                ar.allreduce(randn(300, 0))
        store.delete("rounds", recursive=True)


def test_contributions_carry_the_runs_mac() -> None:
    from diloco_serverless.exchange.codec import unpack

    url = _url()
    _round(url, KEY)
    blob = ObjectStore(url).child("t").get("rounds/00000000/contrib/0000/rank-1")
    unpack(blob, key="rounds/00000000/contrib/0000/rank-1", run_key=KEY)
    with pytest.raises(CorruptObjectError, match="signature"):
        unpack(blob, key="rounds/00000000/contrib/0000/rank-1", run_key=OTHER)
    with pytest.raises(CorruptObjectError, match="signature for this key"):  # copied to rank 0's key
        unpack(blob, key="rounds/00000000/contrib/0000/rank-0", run_key=KEY)
