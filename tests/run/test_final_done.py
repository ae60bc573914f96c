"""Finding 4: an unsigned ``final/DONE.json`` is never acted on (replica skip, write_final, push, Run.wait)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from diloco_serverless.errors import LaunchError
from diloco_serverless.launcher.hub import check_pushable, download_final
from diloco_serverless.launcher.status import SUCCEEDED, RunStatus
from diloco_serverless.run.final import FINAL_DONE, InvalidFinal, done_bytes, read_done
from diloco_serverless.run.integrity import new_run_key, parse_run_key
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer.checkpoint import final_exists

KEY = parse_run_key(new_run_key(), source="test")
OTHER = parse_run_key(new_run_key(), source="test")
FILES = {"final/model.safetensors": b"weights", "final/config.json": b"{}"}


def _store(tmp_path: Path) -> ObjectStore:
    return ObjectStore((tmp_path / "run").as_uri())


def _finish(store: ObjectStore, key: bytes | None = KEY) -> None:
    for k, v in FILES.items():
        store.put(k, v)
    store.put(FINAL_DONE, done_bytes(key, {k: hashlib.sha256(v).hexdigest() for k, v in FILES.items()}, rank=0))


def _succeeded() -> RunStatus:
    return RunStatus(run_id="r", url="u", executor="local", gpu=None, rounds_total=1, replicas=[], state=SUCCEEDED,
                     elapsed_s=1.0)


def test_a_signed_done_is_the_final_model(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _finish(store)
    assert final_exists(store, KEY)
    assert read_done(store, KEY) == {k: hashlib.sha256(v).hexdigest() for k, v in FILES.items()}


@pytest.mark.parametrize("planted", [
    b"{}",
    b'{"rank": 0, "files": []}',
    json.dumps({"files": {"final/x": "0" * 64}}).encode(),
    b"not json",
], ids=["empty", "no-files", "unsigned-list", "garbage"])
def test_a_planted_done_does_not_finish_the_run(tmp_path: Path, planted: bytes) -> None:
    """A replica starting (or write_final polling) must not take it as done; today's main does (exists())."""
    store = _store(tmp_path)
    store.put("final/x", b"anything")
    store.put(FINAL_DONE, planted)
    assert not final_exists(store, KEY)
    with pytest.raises(InvalidFinal):
        read_done(store, KEY)


def test_another_runs_done_and_a_done_with_a_file_gone_are_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _finish(store, OTHER)  # signed, by another run's key
    assert not final_exists(store, KEY)
    _finish(store, KEY)
    store.delete("final/config.json")
    assert not final_exists(store, KEY)


def test_push_refuses_a_planted_done_and_pushes_only_the_listed_files(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.put("final/x", b"~/.cache/huggingface/token contents")
    store.put(FINAL_DONE, json.dumps({"files": {"final/x": hashlib.sha256(b"x").hexdigest()}}).encode())
    with pytest.raises(LaunchError, match="signature"):
        check_pushable(_succeeded(), store, KEY)
    _finish(store)
    listed = check_pushable(_succeeded(), store, KEY)
    out = tmp_path / "push"
    assert sorted(download_final(store, out, listed)) == ["config.json", "model.safetensors"]  # not final/x
    store.put("final/model.safetensors", b"replaced after the run wrote it")
    with pytest.raises(LaunchError, match="SHA-256 differs"):
        download_final(store, tmp_path / "push2", listed)


def test_finding_11_a_planted_or_copied_manifest_never_becomes_the_latest_checkpoint(tmp_path: Path) -> None:
    """A forged manifest with a huge round (and its shard markers) used to become "latest": every healing
    replica then died loading it. Only a manifest signed for its own place counts."""
    import torch

    from diloco_serverless.run.layout import checkpoint_prefix
    from diloco_serverless.trainer.checkpoint import find_latest_checkpoint, save_checkpoint

    store = _store(tmp_path)
    save_checkpoint(store, 2, 8, {"w": torch.ones(4)}, {}, rank=0, world_size=1, takeover_s=0.0, run_key=KEY)
    assert find_latest_checkpoint(store, KEY) == 2
    genuine, forged = checkpoint_prefix(2), checkpoint_prefix(99_999_999)
    for name in store.list(genuine + "/"):  # the genuine objects, copied under a huge round
        store.put(forged + name[len(genuine):], store.get(name))
    assert find_latest_checkpoint(store, KEY) == 2
    store.put(f"{forged}/manifest.json", json.dumps({"format": 1, "round": 99_999_999, "num_shards": 1}).encode())
    assert find_latest_checkpoint(store, KEY) == 2  # unsigned


def test_finding_14_an_existing_key_file_and_folder_are_tightened(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import stat

    from diloco_serverless.run.integrity import RUN_KEY_ENV, local_key_path, save_local_key

    monkeypatch.setenv("DILOCO_KEYS_DIR", str(tmp_path / "keys"))
    monkeypatch.delenv(RUN_KEY_ENV, raising=False)
    path = local_key_path("s3://bucket/runs/r1")
    path.parent.mkdir(mode=0o755)
    os.chmod(path.parent, 0o755)
    path.write_text("old\n")
    os.chmod(path, 0o644)
    save_local_key("s3://bucket/runs/r1", new_run_key())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
