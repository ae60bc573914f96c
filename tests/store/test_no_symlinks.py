"""Finding 10: nothing under a ``file://`` run folder is read, written or listed through a symbolic link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from diloco_serverless.store.errors import StoreAccessDenied
from diloco_serverless.store.objectstore import ObjectStore


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "home" / ".cache" / "huggingface" / "token"
    path.parent.mkdir(parents=True)
    path.write_text("hf_secret")
    return path


def test_a_linked_file_is_neither_listed_nor_read_nor_written(tmp_path: Path, secret: Path) -> None:
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    os.symlink(secret, run / "final" / "x")
    store = ObjectStore(run.as_uri())
    assert store.list("final/") == ["final/config.json"]  # what push would upload
    with pytest.raises(StoreAccessDenied, match="symbolic link"):
        store.get("final/x")
    with pytest.raises(StoreAccessDenied, match="symbolic link"):
        store.put("final/x", b"overwrite")
    assert secret.read_text() == "hf_secret"


def test_a_linked_folder_is_not_followed(tmp_path: Path, secret: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(secret.parent, run / "logs")  # <run>/logs -> ~/.cache/huggingface
    store = ObjectStore(run.as_uri())
    with pytest.raises(StoreAccessDenied, match="symbolic link"):
        store.list("logs/")
    with pytest.raises(StoreAccessDenied, match="symbolic link"):
        store.get("logs/token")
    with pytest.raises(StoreAccessDenied, match="symbolic link"):
        store.put("logs/rank-0.log", b"appended")
    assert sorted(p.name for p in secret.parent.iterdir()) == ["token"]
