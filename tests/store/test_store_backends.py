"""Back-end specifics of ObjectStore: local atomicity, the create-only preconditions that go on
the wire to S3 and GCS, async batched get_many, and subprocesses configured only by env.

Run: python -m pytest -q tests/store/test_store_backends.py
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from diloco_serverless.store import objectstore as objectstore_module
from diloco_serverless.store._local import TEMP_PREFIX
from diloco_serverless.store.objectstore import ENV_STORAGE_OPTIONS, ObjectStore, ObjectTooLarge
from diloco_serverless.store.retry import RetryPolicy

FAST = RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.05, timeout_s=30.0)


# --------------------------------------------------------------------------- local files
def _watch(store: ObjectStore, key: str, stop: threading.Event, seen: set[bytes]) -> None:
    while not stop.is_set():
        try:
            seen.add(store.get(key))
        except FileNotFoundError:
            seen.add(b"<missing>")


def test_local_readers_never_see_half_a_file(file_store_url: str) -> None:
    store = ObjectStore(file_store_url)
    old, new = b"a" * (4 << 20), b"b" * (4 << 20)
    store.put("reduced/0000", old)
    stop, seen = threading.Event(), set()
    reader = threading.Thread(target=_watch, args=(store, "reduced/0000", stop, seen))
    reader.start()
    for i in range(20):
        store.put("reduced/0000", new if i % 2 == 0 else old)
        store.put_if_absent(f"created/{i}", new)
    stop.set()
    reader.join()
    assert seen <= {old, new} and old in seen


def test_local_put_if_absent_watchers_see_nothing_or_everything(file_store_url: str) -> None:
    store = ObjectStore(file_store_url)
    payload = os.urandom(8 << 20)
    stop, seen = threading.Event(), set()
    reader = threading.Thread(target=_watch, args=(store, "quorum.json", stop, seen))
    reader.start()
    assert store.put_if_absent("quorum.json", payload)
    stop.set()
    reader.join()
    assert seen <= {b"<missing>", payload}
    root = file_store_url[len("file://"):]
    assert os.listdir(root) == ["quorum.json"]  # the temporary file is gone
    assert os.stat(os.path.join(root, "quorum.json")).st_nlink == 1


def test_local_listing_hides_temp_files(file_store_url: str) -> None:
    store = ObjectStore(file_store_url)
    store.put("a/b", b"1")
    root = file_store_url[len("file://"):]
    with open(os.path.join(root, "a", TEMP_PREFIX + "crashed"), "wb") as f:
        f.write(b"half")
    assert store.list() == ["a/b"]


def test_local_delete_folder_needs_recursive(file_store_url: str) -> None:
    store = ObjectStore(file_store_url)
    store.put("rounds/00000001/a", b"1")
    with pytest.raises(Exception, match="recursive"):
        store.delete("rounds/00000001")
    store.delete("rounds", recursive=True)
    assert store.list() == []


# --------------------------------------------------------------------------- S3 wire
def test_s3_put_if_absent_sends_if_none_match(s3_store_url: str,
                                              s3_storage_options: dict[str, Any]) -> None:
    """Record the headers botocore sends: create-only carries ``If-None-Match: *``; put
    doesn't. moto honours the header (412 PreconditionFailed, Condition If-None-Match)."""
    store = ObjectStore(s3_store_url, s3_storage_options, retry=FAST)
    store.exists("warm-up")  # creates the client
    sent: list[tuple[str, str | None]] = []

    def record(request: Any, **_: Any) -> None:
        if request.method == "PUT":
            value = request.headers.get("If-None-Match")
            value = value.decode() if isinstance(value, bytes) else value
            sent.append((request.url.rsplit("/", 1)[-1], value))

    client = store.fs.s3
    client.meta.events.register("before-send.s3.PutObject", record)
    try:
        assert store.put_if_absent("quorum.json", b"1") is True
        assert store.put_if_absent("quorum.json", b"2") is False
        store.put("plain", b"3")
    finally:
        client.meta.events.unregister("before-send.s3.PutObject", record)
    assert sent == [("quorum.json", "*"), ("quorum.json", "*"), ("plain", None)]
    assert store.get("quorum.json") == b"1"


def test_s3_get_many_batches_and_retries_only_failures(
        s3_store_url: str, s3_storage_options: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = ObjectStore(s3_store_url, s3_storage_options, retry=FAST)
    keys = [f"contrib/{s:04d}/rank-0" for s in range(8)]
    for i, key in enumerate(keys):
        store.put(key, bytes([i]) * 100)
    fs, calls = store.fs, []
    original = fs._call_s3

    async def flaky_call_s3(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "get_object":  # every GET (ranged; no HEAD) goes through here
            path = f"{kwargs['Bucket']}/{kwargs['Key']}"
            calls.append(path)
            if path.endswith("0003/rank-0") and calls.count(path) == 1:
                raise ConnectionResetError("injected reset")
        return await original(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", flaky_call_s3)
    got = store.get_many(keys + ["contrib/0009/rank-0"], missing_ok=True)
    assert got == {key: bytes([i]) * 100 for i, key in enumerate(keys)}
    assert len(calls) == 9 + 1  # one batch of 9, then only the failed key again


def test_s3_get_with_max_bytes_is_one_ranged_get(s3_store_url: str, s3_storage_options: dict[str, Any]) -> None:
    """A size-limited read is a single GET of bytes 0..max_bytes (no HEAD first, even with s3fs's
    default intra-object concurrency), so an oversized object is never downloaded in full."""
    store = ObjectStore(s3_store_url, s3_storage_options, retry=FAST)
    store.put("big", b"x" * (1 << 20))
    store.put("small", b"y" * 10)
    sent: list[tuple[str, str]] = []

    def record(request: Any, **_: Any) -> None:
        value = request.headers.get("Range")
        sent.append((request.method, value.decode() if isinstance(value, bytes) else str(value)))

    client = store.fs.s3
    client.meta.events.register("before-send.s3", record)
    try:
        with pytest.raises(ObjectTooLarge, match="big"):
            store.get("big", max_bytes=100)
        assert store.get("small", max_bytes=100) == b"y" * 10
        with pytest.raises(ObjectTooLarge, match="big"):
            store.get_many(["small", "big"], max_bytes=100)
    finally:
        client.meta.events.unregister("before-send.s3", record)
    assert sent == [("GET", "bytes=0-100")] * 4


@pytest.mark.parametrize("proto", ["memory", "file"])
def test_local_get_with_max_bytes_reads_at_most_one_byte_more(
        proto: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ObjectStore(request.getfixturevalue(f"{proto}_store_url"))
    store.put("big", b"x" * (4 << 20))
    read: list[int] = []
    if proto == "memory":
        original = store.fs.cat_file

        def cat_file(path: str, *args: Any, **kwargs: Any) -> bytes:
            data: bytes = original(path, *args, **kwargs)
            read.append(len(data))
            return data

        monkeypatch.setattr(store.fs, "cat_file", cat_file)
    else:
        class Spy:
            def __init__(self, f: Any) -> None:
                self.f = f

            def __enter__(self) -> Spy:
                return self

            def __exit__(self, *exc: object) -> None:
                self.f.close()

            def fileno(self) -> int:
                return int(self.f.fileno())

            def read(self, n: int = -1) -> bytes:
                data: bytes = self.f.read(n)
                read.append(len(data))
                return data

        monkeypatch.setattr(objectstore_module, "open", lambda path, mode: Spy(open(path, mode)), raising=False)
    with pytest.raises(ObjectTooLarge, match="big"):
        store.get("big", max_bytes=1000)
    with pytest.raises(ObjectTooLarge, match="big"):
        store.get_many(["big"], max_bytes=1000)
    assert all(n <= 1001 for n in read)
    assert store.get("big") == b"x" * (4 << 20)  # without a limit, the whole object


# --------------------------------------------------------------------------- GCS wire
def test_gcs_put_if_absent_sends_if_generation_match(gcs_store_url: str,
                                                     gcs_storage_options: dict[str, Any],
                                                     gcs_requests: Any) -> None:
    """The emulator ignores ``ifGenerationMatch``; prove the client sends ``=0`` on create-only
    uploads (and not on plain puts), as recorded by the emulator."""
    store = ObjectStore(gcs_store_url + "/run", gcs_storage_options, retry=FAST)
    gcs_requests.requests.clear()
    store.put_if_absent("quorum.json", b"1")
    store.put("plain", b"2")
    uploads = gcs_requests.uploads()
    assert len(uploads) == 2
    assert uploads[0]["query"].get("ifGenerationMatch") == ["0"]
    assert "ifGenerationMatch" not in uploads[1]["query"]
    gcs_requests.enforce_generation_match = True  # now answer 412 like GCS
    assert store.put_if_absent("quorum.json", b"3") is False
    assert store.get("quorum.json") == b"1"


# --------------------------------------------------------------------------- subprocesses
CHILD = """
import sys
from diloco_serverless.store import ObjectStore
store = ObjectStore(sys.argv[1])
assert store.put_if_absent("from-child", b"hello") is True
assert store.put_if_absent("from-child", b"again") is False
print(store.list())
"""


def _run_child(url: str, env: dict[str, str]) -> str:
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("AWS_", "STORAGE_EMULATOR", "GOOGLE_")) and k != ENV_STORAGE_OPTIONS}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", CHILD, url], env=full, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_subprocess_reaches_s3_from_env_alone(s3_store_url: str, s3_env: dict[str, str],
                                              s3_storage_options: dict[str, Any]) -> None:
    """botocore honours AWS_ENDPOINT_URL: no storage_options needed in the child."""
    assert "from-child" in _run_child(s3_store_url + "/run", s3_env)
    assert ObjectStore(s3_store_url + "/run", s3_storage_options).get("from-child") == b"hello"


def test_subprocess_reaches_s3_via_diloco_storage_options(
        s3_store_url: str, s3_env: dict[str, str], s3_storage_options: dict[str, Any]) -> None:
    env = {k: v for k, v in s3_env.items() if k != "AWS_ENDPOINT_URL"}
    env[ENV_STORAGE_OPTIONS] = json.dumps({"endpoint_url": s3_env["AWS_ENDPOINT_URL"]})
    _run_child(s3_store_url + "/run", env)
    assert ObjectStore(s3_store_url + "/run", s3_storage_options).get("from-child") == b"hello"


def test_subprocess_reaches_gcs_from_env_alone(gcs_store_url: str, gcs_env: dict[str, str],
                                               gcs_storage_options: dict[str, Any],
                                               gcs_requests: Any) -> None:
    gcs_requests.enforce_generation_match = True
    assert "from-child" in _run_child(gcs_store_url + "/run", gcs_env)
    assert ObjectStore(gcs_store_url + "/run", gcs_storage_options).get("from-child") == b"hello"


def _forked_put(store: ObjectStore) -> None:
    store.put("from-fork", str(os.getpid()).encode())


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_store_survives_fork(s3_store_url: str, s3_storage_options: dict[str, Any]) -> None:
    """A store used before a fork keeps working in the child (new loop and connections)."""
    import multiprocessing

    store = ObjectStore(s3_store_url, s3_storage_options, retry=FAST)
    store.put("before-fork", b"x")
    child = multiprocessing.get_context("fork").Process(target=_forked_put, args=(store,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert store.get("from-fork") == str(child.pid).encode()


def test_local_create_only_without_hard_links(file_store_url: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """On file systems where link(2) fails with EPERM (FAT, some FUSE mounts) the claim-file
    fallback still lets exactly one of N racing creators win, and leaves no claim behind."""
    import errno

    def no_link(src: str, dst: str) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", dst)

    monkeypatch.setattr(os, "link", no_link)
    store = ObjectStore(file_store_url)
    n = 12
    barrier = threading.Barrier(n)

    def contend(i: int) -> bool:
        barrier.wait()
        return store.put_if_absent("quorum.json", f"writer-{i}".encode())

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(contend, range(n)))
    assert sum(results) == 1
    assert store.get("quorum.json") == f"writer-{results.index(True)}".encode()
    assert os.listdir(file_store_url[len("file://"):]) == ["quorum.json"]
    store.delete("quorum.json")
    assert store.put_if_absent("quorum.json", b"again") is True


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_a_lost_create_response_resent_below_us_still_reads_as_ours(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """aiohttp (or botocore, or gcsfs) re-sends a PUT whose response was lost after the store acted;
    the re-send gets 412 and the client raises FileExistsError without our retry ever firing. Before,
    put_if_absent then returned False for the object this very call created (launch() raised RunExists
    for its own run; every replica thought another one wrote final/)."""
    url = request.getfixturevalue(f"{backend}_store_url")
    options = request.getfixturevalue(f"{backend}_storage_options")
    if backend == "gcs":
        request.getfixturevalue("gcs_requests").enforce_generation_match = True
    store = ObjectStore(url, options, retry=FAST)
    store.exists("warm-up")
    real = store.fs._pipe_file

    async def write_then_resend(path: str, data: bytes, **kw: Any) -> Any:
        await real(path, data, **kw)  # the store acts; the response is "lost"...
        return await real(path, data, **kw)  # ...and the transport re-sends: 412 -> FileExistsError

    store.fs._pipe_file = write_then_resend  # type: ignore[method-assign]
    try:
        assert store.put_if_absent("final/LOCK.json", b'{"rank": 1, "attempt": 0}') is True
        assert store.put_if_absent("final/LOCK.json", b'{"rank": 2, "attempt": 0}') is False
    finally:
        del store.fs._pipe_file
    assert store.get("final/LOCK.json") == b'{"rank": 1, "attempt": 0}'


@pytest.mark.parametrize("backend", ["s3", "gcs", "file", "memory"])
def test_a_listing_tells_each_objects_md5_where_the_store_does(backend: str, request: pytest.FixtureRequest) -> None:
    """``list_md5`` is ``list`` with S3's ETag / GCS's md5Hash as an MD5: what lets a replica check a vote
    from a listing without reading it. Stores that show none (local, memory) give None, never a guess."""
    if backend in ("s3", "gcs"):
        store = ObjectStore(request.getfixturevalue(f"{backend}_store_url"),
                            request.getfixturevalue(f"{backend}_storage_options"), retry=FAST)
    elif backend == "file":
        store = ObjectStore(request.getfixturevalue("file_store_url"))
    else:
        store = ObjectStore(f"memory://md5-{os.urandom(4).hex()}")
    blobs = {"r/votes/rank-0": b"vote zero", "r/votes/rank-1": b"another vote", "r/other/x": b"elsewhere"}
    for key, data in blobs.items():
        store.put(key, data)
    listed = store.list_md5("r/votes")
    assert sorted(listed) == store.list("r/votes") == ["r/votes/rank-0", "r/votes/rank-1"]
    if backend in ("s3", "gcs"):
        assert listed == {k: hashlib.md5(blobs[k]).hexdigest() for k in listed}
    else:
        assert set(listed.values()) == {None}


def test_an_s3_etag_that_is_no_md5_is_not_taken_for_one() -> None:
    """A multipart upload's ETag (``<md5 of md5s>-<parts>``) or an SSE-KMS one is not the object's MD5."""
    assert objectstore_module._s3_md5({"ETag": '"9b2cf535f27731c974343645a3985328-3"'}) is None
    md5 = "9b2cf535f27731c974343645a3985328"
    assert objectstore_module._s3_md5({"ETag": f'"{md5.upper()}"'}) == md5
    assert objectstore_module._gcs_md5({"md5Hash": "not base64!"}) is None
    assert objectstore_module._gcs_md5({}) is None
