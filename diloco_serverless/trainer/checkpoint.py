"""Global DiLoCo checkpoints in the store, written in shards by the participants (safetensors + JSON).

Layout under ``<run>/checkpoints/<round:08d>/`` (``round`` = the last exchange round the state includes)::

    manifest.json              create-only, identical on every writer: round, step, shard plan, JSON meta
    shard-<j:04d>.safetensors  create-only: the tensors of shard j (global params, outer optimizer state)
    shard-<j:04d>.json         written after the shard: its sha256 and keys (the shard's completion marker)
    data/rank-<r>.json         rank r's data position (per replica, optional)
  checkpoints/latest.json      {"round", "step", "time"}: the newest complete checkpoint

Every replica holds the same global state, so any replica can write any shard and the bytes are
identical: rank r writes shard r, waits up to ``takeover_s`` for the others, then writes the ones
still missing itself (first create wins). A checkpoint is *complete* when its manifest and every
shard marker exist; readers verify each shard's sha256 and keys and refuse a mismatch
(:class:`CheckpointCorrupt`). Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diloco_serverless.errors import CheckpointError
from diloco_serverless.run.final import FINAL_DONE, InvalidFinal, done_bytes, read_done
from diloco_serverless.run.integrity import mac_bytes, mac_json, verify_json
from diloco_serverless.run.layout import (
    FINAL_PREFIX,
    LATEST_CHECKPOINT_KEY,
    checkpoint_prefix,
    fmt_round,
)
from diloco_serverless.store.errors import ObjectNotFound, ObjectTooLarge
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer.diloco import CheckpointMismatch
from diloco_serverless.trainer.model import upload_pretrained

__all__ = [
    "CheckpointCorrupt",
    "CheckpointInfo",
    "find_latest_checkpoint",
    "load_checkpoint",
    "plan_shards",
    "prune_checkpoints",
    "read_data_state",
    "save_checkpoint",
    "save_replica_state",
    "load_replica_state",
    "complete_rounds",
    "final_exists",
    "sync_initial_parameters",
    "write_final",
]

FORMAT = 1
#: Largest checkpoint manifest read while looking for the latest complete checkpoint (its tensor list).
MAX_MANIFEST_BYTES = 8 << 20
logger = logging.getLogger(__name__)


class CheckpointCorrupt(CheckpointError):
    """A stored checkpoint object does not match its manifest (checksum, keys or format)."""


@dataclass(frozen=True)
class CheckpointInfo:
    round: int
    step: int
    num_shards: int
    meta: dict[str, Any]


def _shard_key(round_: int, j: int, ext: str) -> str:
    return f"{checkpoint_prefix(round_)}/shard-{j:04d}.{ext}"


def plan_shards(tensors: dict[str, torch.Tensor], num_shards: int) -> list[list[str]]:
    """Split the sorted tensor keys into ``num_shards`` contiguous groups of similar byte size."""
    keys = sorted(tensors)
    sizes = [tensors[k].numel() * tensors[k].element_size() for k in keys]
    total = max(1, sum(sizes))
    plan: list[list[str]] = [[] for _ in range(num_shards)]
    done = 0
    for key, size in zip(keys, sizes):
        j = min(num_shards - 1, int(done * num_shards / total))
        plan[j].append(key)
        done += size
    return plan


def _manifest(round_: int, step: int, tensors: dict[str, torch.Tensor], plan: list[list[str]],
              meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT, "round": round_, "step": step, "num_shards": len(plan), "shards": plan,
        "tensors": {k: {"dtype": str(t.dtype), "shape": list(t.shape)} for k, t in sorted(tensors.items())},
        "meta": meta,
    }


def _signed(run_key: bytes | None, kind: str, doc: dict[str, Any], key: str) -> bytes:
    """``doc`` as JSON, with the run's HMAC bound to ``kind`` and ``key`` (where it is written)."""
    return json.dumps(mac_json(run_key, kind, doc, place=key) if run_key is not None else doc).encode()


def _verified_json(store: ObjectStore, key: str, kind: str, run_key: bytes | None) -> Any:
    """The JSON object at ``key``; with a run key, CheckpointCorrupt unless it carries the run's HMAC."""
    doc = store.get_json(key)
    if run_key is not None and not verify_json(run_key, kind, doc, place=key):
        raise CheckpointCorrupt(
            f"{store.url}/{key} does not carry this run's signature (forged, or from another launch); refusing "
            f"it. Check who can write the bucket prefix (docs/security.md), then delete "
            f"{key.rsplit('/', 1)[0]} to fall back to an older checkpoint"
        )
    return doc


def _write_shard(store: ObjectStore, round_: int, j: int, keys: list[str], tensors: dict[str, torch.Tensor],
                 run_key: bytes | None = None) -> None:
    if store.exists(_shard_key(round_, j, "json")):
        return
    blob = st_save({k: tensors[k].contiguous() for k in keys}, metadata={"round": str(round_), "shard": str(j)})
    store.put_if_absent(_shard_key(round_, j, "safetensors"), blob)
    stored = store.get(_shard_key(round_, j, "safetensors"))  # the first writer's bytes
    marker = {"sha256": hashlib.sha256(stored).hexdigest(), "keys": keys, "bytes": len(stored),
              "round": round_, "shard": j}
    store.put_if_absent(_shard_key(round_, j, "json"), _signed(run_key, "checkpoint-shard", marker,
                                                               _shard_key(round_, j, "json")))


def save_checkpoint(store: ObjectStore, round_: int, step: int, tensors: dict[str, torch.Tensor],
                    meta: dict[str, Any], *, rank: int, world_size: int, data_state: dict[str, Any] | None = None,
                    takeover_s: float = 30.0, poll_s: float = 0.1, run_key: bytes | None = None) -> bool:
    """Write this rank's part of the checkpoint of ``round_``; take over missing shards after ``takeover_s``.

    ``store`` is rooted at the run. Returns True when the checkpoint is complete (then
    ``latest.json`` points at it, unless a newer one already does). With ``run_key`` the manifest,
    the shard markers (which hold each shard's SHA-256) and the data position carry the run's HMAC.
    Store errors propagate.
    """
    plan = plan_shards(tensors, world_size)
    prefix = checkpoint_prefix(round_)
    manifest = _manifest(round_, step, tensors, plan, meta)
    store.put_if_absent(f"{prefix}/manifest.json",
                        _signed(run_key, "checkpoint-manifest", manifest, f"{prefix}/manifest.json"))
    if data_state is not None:
        state = {"round": round_, "rank": rank, "state": data_state}
        data_key = f"{prefix}/data/rank-{rank}.json"
        store.put(data_key, _signed(run_key, "data-state", state, data_key))
    _write_shard(store, round_, rank % world_size, plan[rank % world_size], tensors, run_key)
    deadline = time.monotonic() + takeover_s
    while True:
        missing = _missing_shards(store, round_, world_size)
        if not missing:
            break
        if time.monotonic() >= deadline:
            for j in missing:
                _write_shard(store, round_, j, plan[j], tensors, run_key)
            break
        time.sleep(poll_s)
    _advance_latest(store, round_, step)
    return True


def _missing_shards(store: ObjectStore, round_: int, num_shards: int) -> list[int]:
    have = set(store.list(checkpoint_prefix(round_) + "/"))
    return [j for j in range(num_shards) if _shard_key(round_, j, "json") not in have]


def _advance_latest(store: ObjectStore, round_: int, step: int) -> None:
    try:
        current = store.get_json(LATEST_CHECKPOINT_KEY)
        if int(current.get("round", -1)) >= round_:
            return
    except (ObjectNotFound, ValueError, AttributeError):
        pass
    store.put_json(LATEST_CHECKPOINT_KEY, {"round": round_, "step": step, "time": time.time()})


def complete_rounds(store: ObjectStore, run_key: bytes | None = None) -> list[int]:
    """Rounds whose manifest and every shard marker exist, ascending. With ``run_key`` a manifest counts
    only when it carries the run's signature for its own place and names its own round: a planted or
    copied manifest (a huge round, say) never becomes the "latest complete" checkpoint (it is skipped,
    with a warning naming it)."""
    by_round: dict[int, set[str]] = {}
    for key in store.list("checkpoints/"):
        parts = key.split("/")
        if len(parts) >= 3 and parts[1].isdigit():
            by_round.setdefault(int(parts[1]), set()).add("/".join(parts[2:]))
    done = []
    for r, names in sorted(by_round.items()):
        if "manifest.json" not in names:
            continue
        key = f"{checkpoint_prefix(r)}/manifest.json"
        try:
            manifest = json.loads(store.get(key, max_bytes=MAX_MANIFEST_BYTES))
            if run_key is not None and not verify_json(run_key, "checkpoint-manifest", manifest, place=key):
                logger.warning("skipping %s/%s: it does not carry this run's signature for its place", store.url, key)
                continue
            if run_key is not None and manifest.get("round") != r:
                continue
            n = int(manifest["num_shards"])
        except (ObjectNotFound, ObjectTooLarge, KeyError, ValueError, TypeError, AttributeError, RecursionError):
            continue
        if all(f"shard-{j:04d}.json" in names for j in range(n)):
            done.append(r)
    return done


def find_latest_checkpoint(store: ObjectStore, run_key: bytes | None = None) -> int | None:
    """The newest complete checkpoint's round (signed, with ``run_key``: :func:`complete_rounds`), or None."""
    rounds = complete_rounds(store, run_key)
    return rounds[-1] if rounds else None


def load_checkpoint(store: ObjectStore, round_: int,
                    run_key: bytes | None = None) -> tuple[dict[str, torch.Tensor], CheckpointInfo]:
    """Read and verify checkpoint ``round_`` (with ``run_key``, its signatures too); raises
    :class:`CheckpointCorrupt` naming the object."""
    prefix = checkpoint_prefix(round_)
    manifest = _verified_json(store, f"{prefix}/manifest.json", "checkpoint-manifest", run_key)
    if manifest.get("format") != FORMAT or manifest.get("round") != round_:
        raise CheckpointCorrupt(f"{store.url}/{prefix}/manifest.json: format/round mismatch ({manifest.get('format')}, "
                                f"{manifest.get('round')}); delete the checkpoint folder to fall back to an older one")
    n = int(manifest["num_shards"])
    keys = [_shard_key(round_, j, ext) for j in range(n) for ext in ("json", "safetensors")]
    blobs = store.get_many(keys)
    tensors: dict[str, torch.Tensor] = {}
    for j in range(n):
        marker = json.loads(blobs[_shard_key(round_, j, "json")])
        blob = blobs[_shard_key(round_, j, "safetensors")]
        where = f"{store.url}/{_shard_key(round_, j, 'safetensors')}"
        marker_key = _shard_key(round_, j, "json")
        signed = run_key is None or verify_json(run_key, "checkpoint-shard", marker, place=marker_key)
        if not signed or (run_key is not None and (marker.get("round"), marker.get("shard")) != (round_, j)):
            raise CheckpointCorrupt(f"{store.url}/{_shard_key(round_, j, 'json')}: not signed with this run's key "
                                    f"for round {round_} shard {j}; refusing it, delete {prefix} to fall back")
        if hashlib.sha256(blob).hexdigest() != marker["sha256"]:
            raise CheckpointCorrupt(f"{where}: sha256 mismatch; the object is damaged, delete {prefix} to fall back")
        part = st_load(blob)
        if sorted(part) != sorted(manifest["shards"][j]):
            raise CheckpointCorrupt(f"{where}: holds keys {sorted(part)[:3]}..., manifest expects "
                                    f"{manifest['shards'][j][:3]}...")
        tensors.update(part)
    for k, spec in manifest["tensors"].items():
        t = tensors.get(k)
        if t is None or list(t.shape) != spec["shape"] or str(t.dtype) != spec["dtype"]:
            raise CheckpointCorrupt(f"{store.url}/{prefix}: tensor {k!r} missing or not {spec}")
    return tensors, CheckpointInfo(round_, int(manifest["step"]), n, manifest["meta"])


def read_data_state(store: ObjectStore, round_: int, rank: int,
                    run_key: bytes | None = None) -> dict[str, Any] | None:
    """Rank ``rank``'s data position saved with checkpoint ``round_`` (None if it did not write one)."""
    key = f"{checkpoint_prefix(round_)}/data/rank-{rank}.json"
    try:
        doc = _verified_json(store, key, "data-state", run_key)
    except ObjectNotFound:
        return None
    if not isinstance(doc, dict) or doc.get("round") != round_ or doc.get("rank") != rank:
        raise CheckpointCorrupt(f"{store.url}/{key} is not rank {rank}'s data position of round {round_}")
    state: dict[str, Any] = doc["state"]
    return state


def prune_checkpoints(store: ObjectStore, keep_from_round: int) -> None:
    """Delete complete or partial checkpoints older than ``keep_from_round``."""
    keys = store.list("checkpoints/")
    rounds = {int(k.split("/")[1]) for k in keys if k.count("/") >= 2 and k.split("/")[1].isdigit()}
    for r in sorted(x for x in rounds if x < keep_from_round):
        store.delete(f"checkpoints/{fmt_round(r)}", recursive=True)


# ------------------------------------------------------------------------------ the final model
FINAL_LOCK = "final/LOCK.json"


def final_exists(store: ObjectStore, run_key: bytes | None = None) -> bool:
    """True when ``<run>/final/`` is complete: its ``DONE.json`` exists, is signed with the run key for
    its place (with ``run_key``) and every file it lists exists. A planted or edited one counts as
    absent (a warning names it), so nothing skips training or the final model on its word."""
    try:
        files = read_done(store, run_key)
    except InvalidFinal as e:
        logger.warning("%s", e)
        return False
    if files is None:
        return False
    present = set(store.list(FINAL_PREFIX + "/"))
    missing = sorted(set(files) - present)
    if missing:
        logger.warning("%s/%s lists files that are gone (%s); the final model is not complete",
                       store.url, FINAL_DONE, ", ".join(missing[:3]))
    return not missing


#: One value per replica process: tells this process's final lock from one an earlier (dead)
#: incarnation of the same rank left behind.
_PROCESS_NONCE = uuid.uuid4().hex


def _takes_over(held: Any, rank: int, stale_lock_s: float) -> bool:
    """Whether a lock held by ``held`` may be taken over: its writer was an earlier process of this same
    rank (executors run one process per rank at a time, so that one is dead), or it is stale."""
    if not isinstance(held, dict):
        return True  # unreadable: nobody can be writing under it
    if held.get("rank") == rank and held.get("nonce") != _PROCESS_NONCE:
        return True
    stamp = held.get("time")
    return not isinstance(stamp, (int, float)) or time.time() - float(stamp) >= stale_lock_s


def write_final(
    store: ObjectStore, model: Any, tokenizer: Any, *, rank: int, attempt: int = 0, stale_lock_s: float = 600.0,
    poll_s: float = 1.0, state_dict: dict[str, Any] | None = None, run_key: bytes | None = None,
) -> bool:
    """Write the final model (``save_pretrained``, safetensors) + tokenizer under ``final/``, once per run.
    ``state_dict``: the whole model's tensors when ``model`` holds only shards of them (FSDP).

    The writer is whoever creates ``final/LOCK.json`` first (create-only); it uploads the files, then
    ``final/DONE.json`` (each file's SHA-256, signed with ``run_key``: :mod:`diloco_serverless.run.final`;
    an invalid DONE is never taken as done). Every other replica waits for DONE, so the run never reports success with
    ``final/`` incomplete. A lock is taken over when its writer died: at once by the restarted
    process of the same rank, by anyone once the lock is ``stale_lock_s`` old. Returns True if this
    call wrote the model. Store errors propagate.
    """
    lock = {"rank": rank, "attempt": attempt, "nonce": _PROCESS_NONCE, "time": time.time()}
    while not final_exists(store, run_key):
        if store.put_if_absent(FINAL_LOCK, json.dumps(lock).encode()):
            break
        try:
            held = store.get_json(FINAL_LOCK)
        except ObjectNotFound:
            continue  # deleted in between: try to create it again
        except (ValueError, TypeError):
            held = None
        if _takes_over(held, rank, stale_lock_s):
            lock["time"] = time.time()
            store.put(FINAL_LOCK, json.dumps(lock).encode())
            break
        time.sleep(poll_s)
    else:
        return False
    digests: dict[str, str] = {}
    upload_pretrained(model, tokenizer, store, "final", state_dict=state_dict, digests=digests)
    done = done_bytes(run_key, digests, **lock, done=time.time())
    if not store.put_if_absent(FINAL_DONE, done) and not final_exists(store, run_key):
        store.put(FINAL_DONE, done)  # a planted DONE.json was there: we hold the lock, ours replaces it
    return True


# ------------------------------------------------------------------------------ initial parameters
INITIAL_KEY = "checkpoints/initial.safetensors"


def safe_open_metadata(blob: bytes) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file's header, or None when it has none or is unreadable."""
    if len(blob) < 8:
        return None
    size = int.from_bytes(blob[:8], "little")
    try:
        header = json.loads(blob[8 : 8 + size].decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else None


def _tensors_mac(run_key: bytes, tensors: dict[str, torch.Tensor], kind: str = "initial-parameters",
                 extra: bytes = b"", *, place: str = "checkpoints/initial.safetensors") -> str:
    """The run's HMAC over every tensor (name, dtype, shape, bytes) and ``extra``, bound to ``kind`` and
    ``place`` (the key of the object)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}\x00{t.dtype}\x00{list(t.shape)}\x00".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    digest.update(b"\x00" + extra)
    return mac_bytes(run_key, kind, digest.digest(), place=place)


# ------------------------------------------------------------------------------ per-replica state
def _replica_key(round_: int, rank: int) -> str:
    return f"{checkpoint_prefix(round_)}/replica/rank-{rank}.safetensors"


def save_replica_state(store: ObjectStore, round_: int, rank: int, tensors: dict[str, torch.Tensor],
                       doc: dict[str, Any], run_key: bytes | None = None) -> None:
    """Store rank ``rank``'s own state at checkpoint ``round_`` (inner optimizer moments, RNG, codec
    residuals as ``tensors``; schedule positions as the JSON ``doc``), signed with the run key.

    With it a restarted replica continues exactly where it was (:func:`load_replica_state`).
    """
    text = json.dumps({"round": round_, "rank": rank, **doc}, sort_keys=True, allow_nan=False)
    metadata = {"format": str(FORMAT), "doc": text}
    if run_key is not None:
        metadata["mac"] = _tensors_mac(run_key, tensors, "replica-state", text.encode(),
                                       place=_replica_key(round_, rank))
    store.put(_replica_key(round_, rank), st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata))


def load_replica_state(store: ObjectStore, round_: int, rank: int,
                       run_key: bytes | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """Rank ``rank``'s state saved with checkpoint ``round_``: (tensors, doc), or None if it wrote none.

    Raises :class:`CheckpointCorrupt` naming the object when it is unreadable, not this rank's
    state of that round, or (with ``run_key``) not signed with the run's key.
    """
    key = _replica_key(round_, rank)
    try:
        blob = store.get(key)
    except ObjectNotFound:
        return None
    where = f"{store.url}/{key}"
    meta = safe_open_metadata(blob) or {}
    try:
        tensors = st_load(blob)
        doc = json.loads(meta["doc"])
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointCorrupt(f"{where} is not a replica state ({exc}); delete it to resume without it") from exc
    if run_key is not None:
        tag = meta.get("mac")
        want = _tensors_mac(run_key, tensors, "replica-state", str(meta["doc"]).encode(), place=key)
        if not isinstance(tag, str) or not hmac.compare_digest(tag, want):
            raise CheckpointCorrupt(f"{where} does not carry this run's signature; refusing it (docs/security.md)")
    if not isinstance(doc, dict) or doc.get("round") != round_ or doc.get("rank") != rank:
        raise CheckpointCorrupt(f"{where} is not rank {rank}'s state of round {round_}")
    return tensors, doc


def sync_initial_parameters(store: ObjectStore, model: torch.nn.Module, run_key: bytes | None = None) -> bool:
    """Make every replica start from the same global parameters, bit for bit.

    The first replica stores its freshly initialised parameters create-only under
    ``checkpoints/initial.safetensors``; every replica (the writer too) then loads that object into
    ``model``. This removes any dependence on identical RNG streams across machines, torch builds
    or devices. Returns True if this call wrote the object. Raises ``CheckpointMismatch`` (from
    :mod:`diloco_serverless.trainer.diloco`) naming the parameter when the stored shapes differ from the model.
    """

    named = {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters()}
    metadata = {"format": str(FORMAT)}
    if run_key is not None:
        metadata["mac"] = _tensors_mac(run_key, named)
    wrote = store.put_if_absent(INITIAL_KEY, st_save(named, metadata=metadata))
    blob = store.get(INITIAL_KEY)
    stored = st_load(blob)
    where = f"{store.url}/{INITIAL_KEY}"
    if run_key is not None:
        tag = (safe_open_metadata(blob) or {}).get("mac")
        if not isinstance(tag, str) or not hmac.compare_digest(tag, _tensors_mac(run_key, stored)):
            raise CheckpointCorrupt(
                f"{where} does not carry this run's signature (forged, or from another launch); refusing to start "
                "from it. Check who can write the bucket prefix (docs/security.md)"
            )
    if sorted(stored) != sorted(named):
        extra, missing = sorted(set(stored) - set(named))[:3], sorted(set(named) - set(stored))[:3]
        raise CheckpointMismatch(
            f"{where} holds other parameters than the model (only stored: {extra}, only in "
            f"model: {missing}); use the run's model config"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in stored.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise CheckpointMismatch(
                    f"parameter {name!r}: {where} has shape {tuple(tensor.shape)}, the model has "
                    f"{tuple(params[name].shape)}; use the run's model config"
                )
            params[name].copy_(tensor)
    return wrote
