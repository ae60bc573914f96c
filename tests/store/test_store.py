"""ObjectStore behaviour suite, run against memory://, file://, S3 (moto) and GCS (emulator).

Run: python -m pytest -q tests/store/test_store.py tests/store/test_store_errors.py
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from diloco_serverless.errors import StoreError
from diloco_serverless.store.errors import ObjectNotFound
from diloco_serverless.store.objectstore import ObjectStore, ObjectTooLarge
from diloco_serverless.store.retry import RetryPolicy

BACKENDS = ["memory", "file", "s3", "gcs"]
FAST_RETRY = RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.05, timeout_s=30.0)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> tuple[str, str, dict[str, Any] | None]:
    """(name, url, storage_options) of a fresh store on each back end.

    On GCS the emulator's 412 shim is on (GCS answers ``ifGenerationMatch=0`` uploads of an
    existing object with 412; the emulator alone ignores it). That the client *sends* the
    precondition is proven without the shim in test_store_backends.py."""
    name = request.param
    if name == "gcs":
        request.getfixturevalue("gcs_requests").enforce_generation_match = True
    url = request.getfixturevalue(f"{name}_store_url")
    options = request.getfixturevalue(f"{name}_storage_options") if name in ("s3", "gcs") else None
    return name, url, options


@pytest.fixture
def store(backend: tuple[str, str, dict[str, Any] | None]) -> ObjectStore:
    _, url, options = backend
    return ObjectStore(url + "/root", options, retry=FAST_RETRY)


def test_put_get_roundtrip_and_overwrite(store: ObjectStore) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
    store.put("a/blob", payload)
    assert store.get("a/blob") == payload
    store.put("a/blob", b"second")
    assert store.get("a/blob") == b"second"
    store.put("empty", b"")
    assert store.get("empty") == b""


def test_get_missing_names_url_and_key(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound) as info:
        store.get("rounds/00000001/quorum.json")
    assert isinstance(info.value, FileNotFoundError)
    assert store.url in str(info.value) and "rounds/00000001/quorum.json" in str(info.value)
    assert info.value.key == "rounds/00000001/quorum.json"


def test_put_if_absent_creates_once(store: ObjectStore) -> None:
    assert store.put_if_absent("rounds/00000000/quorum.json", b"first") is True
    assert store.put_if_absent("rounds/00000000/quorum.json", b"second") is False
    assert store.get("rounds/00000000/quorum.json") == b"first"


def test_get_many(store: ObjectStore) -> None:
    for r in range(5):
        store.put(f"contrib/rank-{r}", f"value-{r}".encode())
    keys = [f"contrib/rank-{r}" for r in (3, 0, 4, 1)]
    got = store.get_many(keys)
    assert list(got) == keys
    assert got == {k: f"value-{k[-1]}".encode() for k in keys}
    assert store.get_many([]) == {}
    assert store.get_many(["contrib/rank-2", "contrib/rank-2"]) == {"contrib/rank-2": b"value-2"}
    partial = store.get_many(["contrib/rank-0", "contrib/rank-9"], missing_ok=True)
    assert partial == {"contrib/rank-0": b"value-0"}
    with pytest.raises(ObjectNotFound, match="contrib/rank-9"):
        store.get_many(["contrib/rank-0", "contrib/rank-9"])


def test_get_with_max_bytes_refuses_larger_objects(store: ObjectStore) -> None:
    for n in (0, 9, 10, 11, 1 << 20):
        store.put(f"obj/{n}", bytes(range(256)) * (n // 256) + bytes(n % 256))
    for n in (0, 9, 10):
        assert store.get(f"obj/{n}", max_bytes=10) == store.get(f"obj/{n}")
    for n in (11, 1 << 20):
        with pytest.raises(ObjectTooLarge, match=f"obj/{n}.*larger than the 10 bytes") as info:
            store.get(f"obj/{n}", max_bytes=10)
        assert info.value.key == f"obj/{n}" and info.value.max_bytes == 10 and store.url in str(info.value)
    assert store.get("obj/0", max_bytes=0) == b""
    with pytest.raises(ObjectTooLarge):
        store.get("obj/9", max_bytes=0)
    with pytest.raises(ObjectNotFound):
        store.get("obj/missing", max_bytes=10)
    small = ["obj/0", "obj/9", "obj/10"]
    assert store.get_many(small + ["obj/missing"], missing_ok=True, max_bytes=10) == {k: store.get(k) for k in small}
    with pytest.raises(ObjectTooLarge, match="obj/11"):
        store.get_many(small + ["obj/11"], max_bytes=10)
    with pytest.raises(ValueError, match="max_bytes"):
        store.get("obj/0", max_bytes=-1)


def test_exists_is_about_objects(store: ObjectStore) -> None:
    store.put("rounds/00000002/ready/rank-1", b"")
    assert store.exists("rounds/00000002/ready/rank-1")
    assert not store.exists("rounds/00000002/ready/rank-0")
    assert not store.exists("rounds/00000002")  # a prefix is not an object


def test_list_is_recursive_sorted_relative(store: ObjectStore) -> None:
    assert store.list() == []
    keys = ["run.json", "rounds/00000001/ready/rank-1", "rounds/00000001/ready/rank-0",
            "rounds/00000002/quorum.json", "members/rank-0.json"]
    for key in keys:
        store.put(key, b"x")
    assert store.list() == sorted(keys)
    assert store.list("rounds/00000001") == ["rounds/00000001/ready/rank-0",
                                             "rounds/00000001/ready/rank-1"]
    assert store.list("rounds/00000001/") == store.list("rounds/00000001")
    assert store.list("nothing/here") == []


def test_list_dirs_is_one_level(store: ObjectStore) -> None:
    assert store.list_dirs() == []
    for key in ("run-b/run.json", "run-b/rounds/00000001/quorum.json", "run-a/members/rank-0.json",
                "loose.txt", "run-c/rounds/00000000/ready/rank-0", "run-c/rounds/00000003/quorum.json"):
        store.put(key, b"x")
    assert store.list_dirs() == ["run-a", "run-b", "run-c"]  # no files, no grandchildren
    assert store.list_dirs("") == store.list_dirs()
    assert store.list_dirs("run-b") == ["run-b/rounds"]
    assert store.list_dirs("run-c/rounds/") == ["run-c/rounds/00000000", "run-c/rounds/00000003"]
    assert store.list_dirs("run-a/members") == []  # only objects below
    assert store.list_dirs("loose.txt") == []  # an object, not a folder
    assert store.list_dirs("nothing/here") == []
    assert store.child("run-c").list_dirs("rounds") == ["rounds/00000000", "rounds/00000003"]


def test_list_dirs_does_not_walk_the_tree(store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store.put("run-a/rounds/00000001/quorum.json", b"x")
    if store.fs is not None:  # object stores: one ls, never find/walk
        for name in ("find", "_find", "walk", "_walk"):
            monkeypatch.setattr(store.fs, name, _forbidden, raising=False)
    else:
        import os
        monkeypatch.setattr(os, "walk", _forbidden)
    assert store.list_dirs() == ["run-a"]


def _forbidden(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("list_dirs must not list recursively")


def test_delete(store: ObjectStore) -> None:
    for key in ("rounds/00000001/a", "rounds/00000001/sub/b", "rounds/00000002/a"):
        store.put(key, b"x")
    store.delete("rounds/00000002/a")
    assert not store.exists("rounds/00000002/a")
    store.delete("rounds/00000002/a")  # missing is not an error
    store.delete("rounds/00000001", recursive=True)
    assert store.list() == []
    store.delete("never/existed", recursive=True)


def test_child_shares_the_store(store: ObjectStore) -> None:
    run = store.child("run-1")
    assert run.url == store.url + "/run-1" and run.protocol == store.protocol
    run.put("run.json", b"{}")
    assert store.get("run-1/run.json") == b"{}"
    assert run.list() == ["run.json"]
    assert run.child("rounds").url == store.url + "/run-1/rounds"


def test_json_helpers(store: ObjectStore) -> None:
    store.put_json("run.json", {"run_id": "r", "rounds": [1, 2], "name": "naïve"})
    assert store.get_json("run.json") == {"run_id": "r", "rounds": [1, 2], "name": "naïve"}
    assert store.put_json_if_absent("run.json", {}) is False
    store.put("bad.json", b"\xff{not json")
    with pytest.raises(StoreError, match="bad.json"):
        store.get_json("bad.json")


def test_put_if_absent_race_exactly_one_winner(backend: tuple[str, str, Any]) -> None:
    """N threads race to create one key: exactly one True, and the object holds its bytes.
    (moto's fixture serialises PutObject as S3 does; see conftest.)"""
    _, url, options = backend
    store = ObjectStore(url + "/race", options, retry=FAST_RETRY)
    n = 12
    barrier = threading.Barrier(n)

    def contend(i: int) -> bool:
        barrier.wait()
        return store.put_if_absent("quorum.json", f"writer-{i}".encode())

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(contend, range(n)))
    assert sum(results) == 1
    winner = results.index(True)
    assert store.get("quorum.json") == f"writer-{winner}".encode()


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a", ".diloco-tmp-x"])
def test_bad_keys_rejected(memory_store_url: str, key: str) -> None:
    store = ObjectStore(memory_store_url)
    with pytest.raises(ValueError):
        store.put(key, b"x")


def test_url_normalisation(tmp_path: Any) -> None:
    bare = ObjectStore(str(tmp_path / "runs") + "/")
    assert bare.protocol == "file" and bare.url == "file://" + str(tmp_path / "runs")
    assert ObjectStore("file://" + str(tmp_path) + "/x/").url == "file://" + str(tmp_path / "x")
    assert ObjectStore("memory://abc/").url == "memory://abc"
    with pytest.raises(ValueError, match="bucket"):
        ObjectStore("s3://")
    with pytest.raises(ValueError):
        ObjectStore("  ")
