"""Shared pytest fixtures: object-store servers on 127.0.0.1 and fresh store URLs.

* ``s3_server`` (session): moto's ``ThreadedMotoServer`` (s3fs's own test pattern), yields the
  endpoint URL. ``s3_store_url`` gives a fresh bucket per test; ``s3_storage_options`` the
  fsspec options for in-process use; ``s3_env`` the environment for a subprocess
  (``ObjectStore("s3://bucket")`` there needs no storage_options: botocore reads
  ``AWS_ENDPOINT_URL``).
* ``gcs_server`` (session): ``gcp-storage-emulator`` in memory, yields the endpoint URL;
  ``gcs_store_url``, ``gcs_storage_options``, ``gcs_env`` likewise; ``gcs_requests`` records
  the requests the emulator receives (the emulator ignores ``ifGenerationMatch``, so tests
  check that the client sends it; ``gcs_requests.enforce_generation_match = True`` makes the
  emulator answer 412 like GCS does).
* ``file_store_url`` and ``memory_store_url``: fresh local / in-process stores.

Nothing here reaches the internet; all credentials are dummies.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support.moto_s3 import moto_server

# gcsfs reads this at import time; its experimental zonal/HNS path calls APIs the emulator lacks.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

# Each xdist worker shares the cores with the other worker and with the replica processes tests start (which
# get OMP_NUM_THREADS=1 from their harnesses): one intra-op thread per worker keeps them from oversubscribing
# the machine (about 9% off the in-process training tests on 2 cores). torch reads it when it loads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

S3_KEY = "testing"
S3_SECRET = "testing"
S3_REGION = "us-east-1"


@pytest.fixture(autouse=True, scope="session")
def _private_run_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Run keys the launcher keeps (diloco_serverless.run.integrity) go to a temporary folder, not to
    ~/.config; subprocesses inherit the variable. A stray DILOCO_RUN_KEY would sign every run alike."""
    saved = {k: os.environ.get(k) for k in ("DILOCO_KEYS_DIR", "DILOCO_RUN_KEY")}
    os.environ["DILOCO_KEYS_DIR"] = str(tmp_path_factory.mktemp("run-keys"))
    os.environ.pop("DILOCO_RUN_KEY", None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


# --------------------------------------------------------------------------- S3 (moto)
@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (session-wide). Yields its endpoint URL."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    with moto_server() as endpoint:
        yield endpoint


def _s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_KEY,
                        aws_secret_access_key=S3_SECRET, region_name=S3_REGION)


@pytest.fixture
def s3_storage_options(s3_server: str) -> dict[str, Any]:
    """fsspec/s3fs options for the moto server (dummy credentials)."""
    return {"endpoint_url": s3_server, "key": S3_KEY, "secret": S3_SECRET,
            "client_kwargs": {"region_name": S3_REGION}}


@pytest.fixture
def s3_store_url(s3_server: str) -> str:
    """A fresh, empty bucket on the moto server: ``"s3://<bucket>"``."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    bucket = _unique("test")
    _s3_client(s3_server).create_bucket(Bucket=bucket)
    return f"s3://{bucket}"


@pytest.fixture
def s3_env(s3_server: str) -> dict[str, str]:
    """Environment variables for a subprocess to reach the moto server with no options."""
    return {
        "AWS_ACCESS_KEY_ID": S3_KEY,
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "AWS_DEFAULT_REGION": S3_REGION,
        "AWS_REGION": S3_REGION,
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


# --------------------------------------------------------------------------- GCS (emulator)
@dataclass
class GcsRecorder:
    """What the emulator received: one dict per request {method, path, query, range}.

    ``enforce_generation_match`` makes the emulator answer preconditions as GCS does (it ignores them
    itself): a create-only upload or compose onto an existing object and a download whose
    ``ifGenerationMatch`` is not the object's generation get 412, and downloads carry
    ``x-goog-generation``.
    ``before_download(request, storage)``, when set, runs before each download is served (a test
    replaces the object there)."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    enforce_generation_match: bool = False
    before_download: Callable[[Any, Any], None] | None = None

    def uploads(self) -> list[dict[str, Any]]:
        """The object-upload requests (POST .../upload/...)."""
        return [r for r in self.requests if r["method"] == "POST" and "/upload/" in r["path"]]


_GCS_RECORDER = GcsRecorder()


def _instrument_gcs_emulator() -> None:
    """Record every request; optionally answer preconditions as GCS does (:class:`GcsRecorder`)."""
    from gcp_storage_emulator import server as gserver
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    if getattr(gserver.Router.handle, "_diloco", False):
        return
    handle, multipart, download, compose = (gserver.Router.handle, objects._multipart_upload, objects.download,
                                            objects.compose)

    def recorded_handle(self: Any, method: str) -> Any:
        req = gserver.Request(self._request_handler, method)
        _GCS_RECORDER.requests.append({"method": method, "path": req.path, "query": req.query,
                                       "range": req.get_header("range", None)})
        return handle(self, method)

    def checked_download(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        if _GCS_RECORDER.before_download is not None:
            _GCS_RECORDER.before_download(request, storage)
        if _GCS_RECORDER.enforce_generation_match:
            try:
                obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            except NotFound:
                obj = None
            if obj is not None:
                want = request.query.get("ifGenerationMatch", [None])[0]
                if want is not None and want != str(obj["generation"]):
                    response.status = gserver.HTTPStatus.PRECONDITION_FAILED
                    response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                    return None
                response["x-goog-generation"] = str(obj["generation"])
        return download(request, response, storage, *args, **kwargs)

    def refused_create(request: Any, response: Any, storage: Any, name: Callable[[], str]) -> bool:
        """Answer 412 (and say so) to a create-only write (``ifGenerationMatch=0``) of an existing object
        (``name()`` is its name)."""
        if not _GCS_RECORDER.enforce_generation_match or request.query.get("ifGenerationMatch") != ["0"]:
            return False
        try:
            storage.get_file_obj(request.params["bucket_name"], name())
        except NotFound:
            return False
        response.status = gserver.HTTPStatus.PRECONDITION_FAILED
        response.json({"error": {"code": 412, "message": "conditionNotMet"}})
        return True

    def checked_compose(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        if refused_create(request, response, storage, lambda: request.params["object_id"]):
            return None
        return compose(request, response, storage, *args, **kwargs)

    def checked_multipart(request: Any, response: Any, storage: Any) -> Any:
        def name() -> str:
            return request.query.get("name", [None])[0] or request.data["meta"].get("name")

        if refused_create(request, response, storage, name):
            return None
        return multipart(request, response, storage)

    read_data = gserver._read_data

    def exact_read_data(request_handler: Any, query: Any) -> Any:
        """The emulator parses a multipart upload with the email package, which drops a trailing ``\r`` of
        the object (it reads it as the line end before the boundary): 1 object in 256 of random bytes came
        back a byte short. Split such a body on its boundary instead, as GCS does."""
        content_type = request_handler.headers.get("Content-Type") or ""
        if not content_type.startswith("multipart/related"):
            return read_data(request_handler, query)
        raw = gserver._decode_raw_data(gserver._read_raw_data(request_handler), request_handler)
        boundary = content_type.split("boundary=", 1)[1].strip('"').encode()
        meta_part, content_part = raw.split(b"--" + boundary)[1:3]

        def body(part: bytes) -> tuple[bytes, bytes]:  # (headers, body) of one part
            at_crlf, at_lf = part.find(b"\r\n\r\n"), part.find(b"\n\n")  # which ends the headers first
            eol = b"\r\n" if at_crlf != -1 and (at_lf == -1 or at_crlf < at_lf) else b"\n"
            head, _, rest = part.removeprefix(eol).partition(eol + eol)
            return head, rest.removesuffix(eol)  # the line end before the next delimiter is the delimiter's

        head, content = body(content_part)
        ctype = next((line.split(b":", 1)[1].strip().decode() for line in head.splitlines()
                      if line.lower().startswith(b"content-type:")), "application/octet-stream")
        return {"meta": json.loads(body(meta_part)[1]), "content": content, "content-type": ctype}

    recorded_handle._diloco = True  # type: ignore[attr-defined]
    gserver._read_data = exact_read_data
    gserver.Router.handle = recorded_handle  # type: ignore[method-assign]
    objects._multipart_upload = checked_multipart
    for _, handlers in gserver.HANDLERS:  # the routing table holds the handler functions themselves
        if handlers.get(gserver.GET) is download:
            handlers[gserver.GET] = checked_download
        if handlers.get(gserver.POST) is compose:
            handlers[gserver.POST] = checked_compose


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """A gcp-storage-emulator (in memory) on 127.0.0.1 (session-wide). Yields its endpoint."""
    pytest.importorskip("gcsfs")
    pytest.importorskip("gcp_storage_emulator.server")
    from support.gcs_emulator import gcs_emulator

    _instrument_gcs_emulator()
    with gcs_emulator() as endpoint:
        yield endpoint


@pytest.fixture
def gcs_requests(gcs_server: str) -> Iterator[GcsRecorder]:
    """The emulator's request log, emptied for this test; precondition enforcement off after."""
    _GCS_RECORDER.requests.clear()
    yield _GCS_RECORDER
    _GCS_RECORDER.enforce_generation_match = False
    _GCS_RECORDER.before_download = None


@pytest.fixture
def gcs_storage_options(gcs_server: str) -> dict[str, Any]:
    """gcsfs options for the emulator (anonymous)."""
    return {"endpoint_url": gcs_server, "token": "anon"}


@pytest.fixture
def gcs_store_url(gcs_server: str) -> str:
    """A fresh, empty bucket on the emulator: ``"gs://<bucket>"``."""
    import gcsfs

    gcsfs.GCSFileSystem.clear_instance_cache()
    bucket = _unique("test")
    fs = gcsfs.GCSFileSystem(endpoint_url=gcs_server, token="anon", skip_instance_cache=True)
    fs.mkdir(bucket)
    return f"gs://{bucket}"


@pytest.fixture
def gcs_env(gcs_server: str) -> dict[str, str]:
    """Environment variables for a subprocess to reach the emulator with no options."""
    return {"STORAGE_EMULATOR_HOST": gcs_server, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


# --------------------------------------------------------------------------- local
@pytest.fixture
def file_store_url(tmp_path: Path) -> str:
    """A fresh local folder as a store URL: ``"file:///.../store"`` (not created yet)."""
    return "file://" + str(tmp_path / "store")


@pytest.fixture
def memory_store_url() -> Iterator[str]:
    """A fresh in-process store: ``"memory://<unique>"``; emptied after the test."""
    name = _unique("test")
    yield f"memory://{name}"
    import fsspec

    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def env_with(extra: dict[str, str]) -> dict[str, str]:
    """``os.environ`` plus ``extra`` (helper for subprocess tests); drops DILOCO_STORAGE_OPTIONS
    from the parent unless ``extra`` sets it."""
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_STORAGE_OPTIONS"}
    env.update(extra)
    return env


__all__ = ["GcsRecorder", "env_with"]
