"""ObjectStore: the one storage abstraction every replica shares (docs/architecture.md, "A run in the store").

One URL in: ``file:///abs/path`` or a bare path (local), ``memory://name`` (in-process, tests),
``s3://bucket/prefix`` (s3fs), ``gs://bucket/prefix`` (gcsfs); other fsspec protocols work with
plain (non-create-only) semantics. Operations: :meth:`put`, :meth:`put_if_absent` (atomic
create-only, the exchange's one consensus primitive), :meth:`get`, :meth:`get_many` (concurrent;
both take an optional ``max_bytes`` and refuse a larger object without reading it in full),
:meth:`exists`, :meth:`list` (recursive), :meth:`list_dirs` (one level, delimited), :meth:`delete`.

Create-only per back end:

* S3: ``PutObject`` with ``If-None-Match: *`` (s3fs ``pipe_file(mode="create")``); a 412
  PreconditionFailed becomes ``FileExistsError`` in s3fs, i.e. ``False`` here.
* GCS: upload with ``ifGenerationMatch=0`` (gcsfs ``pipe_file(mode="create")``); 412 -> False.
* Local: a finished temporary file is ``os.link``-ed to the key (see :mod:`store_local`).
* Memory: check-and-write under a process-wide lock.

Large S3 and GCS objects (over ``TransferPolicy.part_size``, 16 MiB by default) go up in parallel parts
(S3 multipart, GCS composite: temporary parts under ``.uploads/`` joined by one ``compose``) and come
down as parallel ranged GETs. Every S3 and GCS read is ranged
and sizes itself from the first answer's ``Content-Range``, never a HEAD or metadata request
(:mod:`diloco_serverless.store._transfer`, :mod:`diloco_serverless.store._gcs`). Reads on
S3 and GCS (GETs, listings) are hedged: one that is slower than most of the store's recent answers
is sent again and the first answer wins (:mod:`diloco_serverless.store.hedge`).

Failures: only transient errors are retried (:mod:`store_retry`, :mod:`store_errors`); every
error is a :class:`StoreError` naming the operation, URL and key. An unreachable store raises
:class:`StoreUnavailable` within ``RetryPolicy.timeout_s``; denied credentials raise
:class:`StoreAccessDenied` at once.

Credentials never come from code: standard environment variables (``AWS_*``,
``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``STORAGE_EMULATOR_HOST``), a GCS key's JSON in
``GOOGLE_APPLICATION_CREDENTIALS_JSON`` (:mod:`~diloco_serverless.store.credentials`), explicit
``storage_options``, or the JSON object in ``DILOCO_STORAGE_OPTIONS`` (see
:func:`storage_options_from_env`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import copy
import json
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import fsspec
from fsspec.asyn import sync

from diloco_serverless.errors import StoreError
from diloco_serverless.store import _local as store_local
from diloco_serverless.store._gcs import gcs_put_parts, gcs_reader
from diloco_serverless.store._transfer import RangeRead, TransferPolicy, ranged_get, s3_put_parts, s3_reader
from diloco_serverless.store.credentials import gcs_key_from_env
from diloco_serverless.store.errors import (
    ObjectNotFound,
    ObjectTooLarge,
    StoreAccessDenied,
    StoreUnavailable,
    is_range_unsatisfiable,
    is_transient,
    translate_error,
)
from diloco_serverless.store.hedge import Hedger
from diloco_serverless.store.retry import RetryPolicy, call_with_retry

__all__ = [
    "ObjectStore",
    "RetryPolicy",
    "TransferPolicy",
    "StoreError",
    "ObjectNotFound",
    "ObjectTooLarge",
    "StoreAccessDenied",
    "StoreUnavailable",
    "storage_options_from_env",
    "ENV_STORAGE_OPTIONS",
]

T = TypeVar("T")

#: Environment variable holding a JSON object of fsspec storage options for remote stores.
ENV_STORAGE_OPTIONS = "DILOCO_STORAGE_OPTIONS"

_ALIASES = {"gcs": "gs", "s3a": "s3", "local": "file"}
_MEMORY_LOCK = threading.Lock()
_MAX_THREADS = 16
#: Back ends whose reads are ranged GETs (parallel above the part size, hedged): store/_transfer.py, store/_gcs.py
_RANGED = ("s3", "gs")
#: Folder (under a GCS store's root) of the temporary parts of composite uploads (store/_gcs.py).
UPLOADS_PREFIX = ".uploads"
_S3_POOL_CONNECTIONS = 64


_MD5_RE = re.compile(r"[0-9a-f]{32}")


def _s3_md5(info: dict[str, Any]) -> str | None:
    """The MD5 an S3 listing entry's ETag is (an object from one PUT, not SSE-KMS), else ``None``."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"').lower()
    return etag if _MD5_RE.fullmatch(etag) else None


def _gcs_md5(item: dict[str, Any]) -> str | None:
    """The MD5 of a GCS listing entry (``md5Hash``, base64), else ``None`` (a composite object has none)."""
    try:
        raw = base64.b64decode(str(item.get("md5Hash") or ""), validate=True)
    except (ValueError, binascii.Error):
        return None
    return raw.hex() if len(raw) == 16 else None


def _check_limit(max_bytes: int | None) -> int | None:
    if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0):
        raise ValueError(f"max_bytes must be an int >= 0 or None, got {max_bytes!r}")
    return max_bytes


def storage_options_from_env() -> dict[str, Any]:
    """The storage options in ``$DILOCO_STORAGE_OPTIONS`` (a JSON object), or ``{}``.

    Lets subprocess replicas reach a custom endpoint without putting anything in run.json.
    Raises ``ValueError`` naming the variable if it is not a JSON object.
    """
    raw = os.environ.get(ENV_STORAGE_OPTIONS, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"${ENV_STORAGE_OPTIONS} is not valid JSON ({exc}); "
                         "set it to a JSON object such as '{\"endpoint_url\": \"http://...\"}'") from exc
    if not isinstance(value, dict):
        raise ValueError(f"${ENV_STORAGE_OPTIONS} must be a JSON object, got {type(value).__name__}")
    return value


def _split_url(url: str) -> tuple[str, str, str]:
    """``url`` -> (protocol, root path as the file system spells it, normalised URL)."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"store URL must be a non-empty string, got {url!r}")
    url = url.strip()
    if "://" not in url:
        root = os.path.abspath(os.path.expanduser(url))
        return "file", root, _url_for("file", root)
    proto, rest = url.split("://", 1)
    proto = _ALIASES.get(proto.lower(), proto.lower())
    if proto == "file":
        root = os.path.abspath(os.path.expanduser(rest or "/"))
    elif proto == "memory":
        root = "/" + rest.strip("/")
    else:
        root = rest.strip("/")
        if not root:
            raise ValueError(f"store URL {url!r} names no bucket; use {proto}://<bucket>[/prefix]")
    return proto, root, _url_for(proto, root)


def _url_for(protocol: str, root: str) -> str:
    """The normalised URL of a store rooted at ``root`` (as the file system spells it)."""
    if protocol == "file":
        return "file://" + root
    return f"{protocol}://{root.strip('/')}"


def _check_key(key: str, *, allow_empty: bool = False) -> str:
    """Validate a '/'-separated relative key; return it without surrounding slashes."""
    if not isinstance(key, str):
        raise TypeError(f"store key must be a str, got {type(key).__name__}")
    stripped = key.strip("/")
    if not stripped:
        if allow_empty:
            return ""
        raise ValueError("store key must not be empty")
    if key.startswith("/") or "\\" in key:
        raise ValueError(f"store key {key!r} must be a relative '/'-separated path")
    for part in stripped.split("/"):
        if part in ("", ".", "..") or part.startswith(store_local.TEMP_PREFIX):
            raise ValueError(f"store key {key!r} has an empty, '.', '..' or reserved component")
    return stripped


def _is_child_key(key: str, prefix: str) -> bool:
    """True if ``key`` is a valid key one level below the folder ``prefix``."""
    try:
        key = _check_key(key)
    except ValueError:  # a folder name no key can spell (e.g. with a backslash): skip it
        return False
    parent, _, _ = key.rpartition("/")
    return parent == prefix


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; values in ``over`` win."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _default_options(protocol: str, retry: RetryPolicy) -> dict[str, Any]:
    """Options that make the back end's own retries small, so :class:`RetryPolicy` governs."""
    if protocol == "s3":
        connect_s = max(1.0, min(10.0, retry.timeout_s))
        return {"use_listings_cache": False,
                "config_kwargs": {"connect_timeout": connect_s, "read_timeout": 60,
                                  "retries": {"total_max_attempts": 1},
                                  # parallel parts of several objects at once (TransferPolicy)
                                  "max_pool_connections": _S3_POOL_CONNECTIONS}}
    if protocol == "gs":
        opts: dict[str, Any] = {"use_listings_cache": False}
        key = gcs_key_from_env()
        if key is not None:
            opts["token"] = key  # the service account of $GOOGLE_APPLICATION_CREDENTIALS_JSON (store.credentials)
        elif os.environ.get("STORAGE_EMULATOR_HOST"):
            opts["token"] = "anon"  # an emulator takes no credentials
        return opts
    return {}


def _endpoint(protocol: str, options: dict[str, Any]) -> str | None:
    """The server a remote store talks to when it is not the protocol's default (a custom
    ``endpoint_url`` or the emulator/endpoint environment variables), for error messages; any
    ``user:password@`` in it is dropped."""
    client = options.get("client_kwargs")
    found = options.get("endpoint_url") or (client.get("endpoint_url") if isinstance(client, dict) else None)
    if not found and protocol == "s3":
        found = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    elif not found and protocol == "gs":
        found = os.environ.get("STORAGE_EMULATOR_HOST")
    if not isinstance(found, str) or not found.strip():
        return None
    return re.sub(r"//[^/@]*@", "//", found.strip())


class ObjectStore:
    """A key -> bytes store rooted at one URL; see the module docstring.

    Args:
        url: ``file://``/bare path, ``memory://``, ``s3://bucket[/prefix]``, ``gs://bucket[/prefix]``.
        storage_options: fsspec options (endpoint, credentials); they win over
            ``$DILOCO_STORAGE_OPTIONS``, which applies to remote protocols only.
        retry: retry and deadline policy (default :class:`RetryPolicy()`).
        transfer: part size and concurrency of large S3 objects (default :class:`TransferPolicy()`:
            16 MiB parts, 8 at a time); see :mod:`diloco_serverless.store._transfer`.

    Raises:
        ValueError: malformed URL; ImportError (from fsspec) if the protocol's extra is missing.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 retry: RetryPolicy | None = None, transfer: TransferPolicy | None = None) -> None:
        self.protocol, self._root, self.url = _split_url(url)
        self.retry = retry or RetryPolicy()
        self.transfer = transfer or TransferPolicy()
        self.hedger = Hedger()  # answer times of this store's reads; shared by child(), with_retry(), ...
        options: dict[str, Any] = {}
        if self.protocol not in ("file", "memory"):
            options = _merge(_default_options(self.protocol, self.retry), storage_options_from_env())
        self._options = _merge(options, dict(storage_options or {}))
        self.endpoint = _endpoint(self.protocol, self._options) if self.protocol not in ("file", "memory") else None
        self._fs: Any = None
        self._pid = -1
        self._async = False
        if self.protocol != "file":
            self._open_fs()

    def _open_fs(self) -> None:
        """(Re)create the fsspec file system; also after a fork, whose child must not reuse
        the parent's event loop and connections (fsspec drops its instance cache on fork)."""
        # A copy: s3fs edits nested dicts such as config_kwargs in place.
        self._fs = fsspec.filesystem(self.protocol, **copy.deepcopy(self._options))
        if self.protocol == "s3":
            # All retries are ours (RetryPolicy): a create-only PUT whose response was lost and
            # that s3fs silently retried would report "exists" although we created it.
            self._fs.retries = 1
        self._pid = os.getpid()
        self._async = bool(getattr(self._fs, "async_impl", False))

    # ----------------------------------------------------------------- structure
    @property
    def whole_object_max(self) -> int | None:
        """Largest object (bytes) this back end writes at full speed as one request: the part size on S3
        (a larger PUT is a multipart upload, two extra round trips) and on GCS (a larger upload is one
        connection's stream, ~50-100 MB/s); ``None`` for back ends with no such limit (local, memory).
        A writer that can choose its object sizes (the exchange) stays at or below it."""
        return self.transfer.part_size if self.protocol in _RANGED else None

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    @property
    def fs(self) -> Any:
        """The underlying fsspec file system (``None`` for local stores)."""
        if self._fs is not None and self._pid != os.getpid():
            self._open_fs()
        return self._fs

    def child(self, prefix: str) -> ObjectStore:
        """A store rooted at ``url/prefix`` sharing this one's file system, options and retry."""
        prefix = _check_key(prefix)
        other = object.__new__(ObjectStore)
        other.__dict__.update(self.__dict__)
        other._root = self._path(prefix)
        other.url = _url_for(self.protocol, other._root)
        return other

    def with_retry(self, retry: RetryPolicy) -> ObjectStore:
        """The same store with another retry/deadline policy (e.g. the exchange's timeout)."""
        other = object.__new__(ObjectStore)
        other.__dict__.update(self.__dict__)
        other.retry = retry
        return other

    def with_transfer(self, transfer: TransferPolicy) -> ObjectStore:
        """The same store with another part size / concurrency for large objects."""
        other = object.__new__(ObjectStore)
        other.__dict__.update(self.__dict__)
        other.transfer = transfer
        return other

    def _path(self, key: str) -> str:
        if self.protocol == "file":
            if not key:
                return self._root
            path = os.path.join(self._root, *key.split("/"))
            _refuse_links(self._root, key, self.url)
            return path
        return f"{self._root.rstrip('/')}/{key}" if key else self._root

    def _rel(self, path: str) -> str:
        base = self._root.rstrip("/" if self.protocol != "file" else os.sep)
        rel = path[len(base) + 1:]
        return rel.replace(os.sep, "/") if self.protocol == "file" else rel

    # ----------------------------------------------------------------- plumbing
    def _run(self, op: str, key: str, attempt: Callable[[float], T],
             on_retry: Callable[[BaseException], None] | None = None) -> T:
        return call_with_retry(attempt, policy=self.retry, url=self.url, key=key, op=op,
                               on_retry=on_retry, endpoint=self.endpoint)

    def _fs_call(self, method: str, *args: Any, timeout_s: float, hedged: bool = False, **kwargs: Any) -> Any:
        """Call fs.<method>; on async file systems run ``_<method>`` bounded by ``timeout_s``, and with
        ``hedged`` (reads only) through :attr:`hedger`."""
        if self._async:
            fs = self.fs
            call = getattr(fs, "_" + method)
            if hedged:
                return sync(fs.loop, self.hedger.first, lambda: call(*args, **kwargs),
                            quantile=self.transfer.hedge_quantile, timeout=max(timeout_s, 0.001))
            return sync(fs.loop, call, *args, timeout=max(timeout_s, 0.001), **kwargs)
        return getattr(self.fs, method)(*args, **kwargs)

    def _gcs_put(self, path: str, data: bytes, remaining: float, *, create_only: bool) -> None:
        """One upload, or a parallel composite upload above the part size (GCS only); its temporary
        parts go under ``<root>/.uploads/``."""
        if len(data) <= self.transfer.part_size:
            mode: dict[str, Any] = {"mode": "create"} if create_only else {}
            self._fs_call("pipe_file", path, data, timeout_s=remaining, **mode)
            return
        fs = self.fs
        sync(fs.loop, gcs_put_parts, fs, path, data, self._path(UPLOADS_PREFIX), self.transfer, self.retry,
             time.monotonic() + remaining, create_only=create_only, timeout=max(remaining, 0.001))

    def _s3_put(self, path: str, data: bytes, remaining: float, *, create_only: bool) -> None:
        """One PutObject, or a parallel multipart upload above the part size (S3 only)."""
        if len(data) <= self.transfer.part_size:
            mode: dict[str, Any] = {"mode": "create"} if create_only else {}
            self._fs_call("pipe_file", path, data, timeout_s=remaining, **mode)
            return
        fs = self.fs
        bucket, name, _ = fs.split_path(path)
        sync(fs.loop, s3_put_parts, fs, bucket, name, data, self.transfer, self.retry, time.monotonic() + remaining,
             create_only=create_only, timeout=max(remaining, 0.001))

    def _reader(self, path: str) -> RangeRead:
        """Ranged GETs of ``path`` on S3 or GCS, hedged with :attr:`hedger`."""
        if self.protocol == "gs":
            return gcs_reader(self.fs, path, self.transfer, self.hedger)
        bucket, name, _ = self.fs.split_path(path)
        return s3_reader(self.fs, bucket, name, self.transfer, self.hedger)

    def _ranged_get(self, key: str, path: str, remaining: float, limit: int | None) -> bytes:
        """Ranged GETs (S3, GCS), in parallel above the part size; the size comes from the first
        answer (no HEAD, no metadata request)."""
        fs = self.fs
        return bytes(sync(fs.loop, ranged_get, self._reader(path), f"{self.protocol}://{path}", self.transfer,
                          self.retry, time.monotonic() + remaining, limit,
                          lambda size: self._too_large(key, limit or 0, size), timeout=max(remaining, 0.001)))

    # ----------------------------------------------------------------- writes
    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key``, replacing any object there. Readers see the old or the
        new bytes, never half (local: temp file + ``os.replace``; S3/GCS PUTs are atomic)."""
        key = _check_key(key)
        path, data = self._path(key), bytes(data)

        def attempt(remaining: float) -> None:
            if self.protocol == "file":
                store_local.atomic_write(path, data)
            elif self.protocol == "s3":
                self._s3_put(path, data, remaining, create_only=False)
            elif self.protocol == "gs":
                self._gcs_put(path, data, remaining, create_only=False)
            else:
                self._fs_call("pipe_file", path, data, timeout_s=remaining)

        self._run("put", key, attempt)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` only if no object exists there, atomically.

        Returns True if this call created the object, False if one existed (its bytes are
        left untouched). Whenever a remote store answers "exists", the object is read back and
        the answer is True if it holds exactly ``data``: a response lost after the store acted
        makes the client re-send the write (our retry, or one inside aiohttp, botocore or gcsfs
        that we never see), and that re-send's "exists" must not read as "someone else created
        it". Every create-only object the package writes is unique to its writer (a timestamp, a
        rank, a random key) or identical whoever writes it (a reduced shard), so equal bytes mean
        "mine, or the same as mine". Not atomic on fsspec protocols other than file, memory, s3 and gs.
        """
        key = _check_key(key)
        path, data = self._path(key), bytes(data)
        def attempt(remaining: float) -> bool:
            if self.protocol == "file":
                return store_local.atomic_create(path, data)
            if self.protocol == "memory":
                with _MEMORY_LOCK:
                    if self.fs.isfile(path):
                        return False
                    self.fs.pipe_file(path, data)
                    return True
            try:
                if self.protocol == "s3":
                    self._s3_put(path, data, remaining, create_only=True)
                elif self.protocol == "gs":
                    self._gcs_put(path, data, remaining, create_only=True)
                else:
                    self._fs_call("pipe_file", path, data, mode="create", timeout_s=remaining)
                return True
            except FileExistsError:
                return False

        created = self._run("put_if_absent", key, attempt)
        if not created:
            try:
                return self.get(key, max_bytes=len(data)) == data
            except (ObjectNotFound, ObjectTooLarge):  # deleted in between, or another writer's object
                return False
        return created

    def put_json(self, key: str, obj: Any) -> None:
        """:meth:`put` ``obj`` as UTF-8 JSON."""
        self.put(key, json.dumps(obj).encode("utf-8"))

    def put_json_if_absent(self, key: str, obj: Any) -> bool:
        """:meth:`put_if_absent` ``obj`` as UTF-8 JSON."""
        return self.put_if_absent(key, json.dumps(obj).encode("utf-8"))

    # ----------------------------------------------------------------- reads
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The bytes at ``key``. Raises :class:`ObjectNotFound` if there is no object.

        With ``max_bytes``, at most ``max_bytes + 1`` bytes are read (one ranged GET on remote
        stores, no extra request; local files are sized first) and an object larger than
        ``max_bytes`` raises :class:`ObjectTooLarge` instead of being returned.
        """
        key = _check_key(key)
        path = self._path(key)
        limit = _check_limit(max_bytes)

        def attempt(remaining: float) -> bytes:
            if self.protocol == "file":
                with open(path, "rb") as f:
                    if limit is None:
                        return f.read()
                    size = os.fstat(f.fileno()).st_size
                    if size > limit:
                        raise self._too_large(key, limit, size)
                    data = f.read(limit + 1)
            elif self.protocol in _RANGED:
                return self._ranged_get(key, path, remaining, limit)
            elif limit is None:
                return bytes(self._fs_call("cat_file", path, timeout_s=remaining))
            else:
                try:
                    data = bytes(self._fs_call("cat_file", path, start=0, end=limit + 1, timeout_s=remaining))
                except OSError as exc:
                    if not is_range_unsatisfiable(exc):
                        raise
                    data = b""
            if len(data) > limit:
                raise self._too_large(key, limit, len(data))
            return data

        return self._run("get", key, attempt)

    def _too_large(self, key: str, limit: int, seen: int) -> ObjectTooLarge:
        return ObjectTooLarge(
            f"get {self.url}/{key}: the object is larger than the {limit} bytes allowed "
            f"({'at least ' if seen == limit + 1 else ''}{seen} bytes); not read further",
            url=self.url, key=key, op="get", max_bytes=limit,
        )

    def get_json(self, key: str) -> Any:
        """:meth:`get` and parse UTF-8 JSON; a :class:`StoreError` naming the key if corrupt."""
        raw = self.get(key)
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreError(f"get_json {self.url}/{key}: not valid UTF-8 JSON ({exc}); the "
                             "object is corrupt or not JSON", url=self.url, key=key, op="get_json") from exc

    def get_many(self, keys: Sequence[str], *, missing_ok: bool = False,
                 max_bytes: int | None = None) -> dict[str, bytes]:
        """Fetch many objects concurrently: fsspec's batched async ``_cat`` on S3/GCS, a thread
        pool otherwise. Returns {key: bytes} in the order of ``keys``; missing keys are
        omitted if ``missing_ok``, else :class:`ObjectNotFound` names them. ``max_bytes`` applies
        to each object as in :meth:`get` (:class:`ObjectTooLarge` names the first one over it)."""
        wanted = [_check_key(k) for k in dict.fromkeys(keys)]
        limit = _check_limit(max_bytes)
        if not wanted:
            return {}
        found, missing = (self._get_many_async(wanted, limit) if self._async
                          else self._get_many_threads(wanted, limit))
        if missing and not missing_ok:
            names = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ObjectNotFound(f"get_many {self.url}: {len(missing)} object(s) not found: {names}",
                                 url=self.url, key=missing[0], op="get_many")
        return {k: found[k] for k in wanted if k in found}

    def _get_many_threads(self, keys: list[str], limit: int | None) -> tuple[dict[str, bytes], list[str]]:
        def one(key: str) -> bytes | None:
            try:
                return self.get(key, max_bytes=limit)
            except ObjectNotFound:
                return None

        with ThreadPoolExecutor(max_workers=min(_MAX_THREADS, len(keys))) as pool:
            values = list(pool.map(one, keys))
        found = {k: v for k, v in zip(keys, values) if v is not None}
        return found, [k for k, v in zip(keys, values) if v is None]

    def _get_many_async(self, keys: list[str], limit: int | None) -> tuple[dict[str, bytes], list[str]]:
        by_path = {self.fs._strip_protocol(self._path(k)): k for k in keys}
        found: dict[str, bytes] = {}
        missing: list[str] = []

        def attempt(remaining: float) -> None:
            todo = [p for p, k in by_path.items() if k not in found and k not in missing]
            if not todo:
                return
            if self.protocol in _RANGED:
                out = sync(self.fs.loop, self._ranged_get_all, todo, limit, time.monotonic() + remaining,
                           timeout=max(remaining, 0.001))
            else:
                ranged: dict[str, Any] = {} if limit is None else {"start": 0, "end": limit + 1}
                out = self._fs_call("cat", todo, on_error="return", timeout_s=remaining, **ranged)
            transient: BaseException | None = None
            for path, value in out.items():
                key = by_path.get(path, path)
                if isinstance(value, ObjectTooLarge):
                    raise value
                if limit is not None and isinstance(value, OSError) and is_range_unsatisfiable(value):
                    value = b""
                if not isinstance(value, BaseException):
                    if limit is not None and len(value) > limit:
                        raise self._too_large(key, limit, len(value))
                    found[key] = bytes(value)
                elif isinstance(value, FileNotFoundError):
                    missing.append(key)
                elif is_transient(value):
                    transient = value  # retried: the next attempt fetches only what is left
                else:
                    raise translate_error(value, url=self.url, key=key, op="get_many") from value
            if transient is not None:
                raise transient

        label = keys[0] if len(keys) == 1 else f"{keys[0]} (and {len(keys) - 1} more keys)"
        self._run("get_many", label, attempt)
        return found, missing

    async def _ranged_get_all(self, paths: list[str], limit: int | None, deadline: float) -> dict[str, Any]:
        """{path: bytes or the exception} for ranged GETs of ``paths`` (S3, GCS), at most
        ``_MAX_THREADS`` objects at a time (each with its own parallel parts)."""
        gate = asyncio.Semaphore(_MAX_THREADS)

        async def one(path: str) -> Any:
            key = self._rel(path) if path.startswith(self._root) else path
            async with gate:
                try:
                    return await ranged_get(self._reader(path), f"{self.protocol}://{path}", self.transfer,
                                            self.retry, deadline, limit,
                                            lambda size: self._too_large(key, limit or 0, size))
                except Exception as exc:
                    return exc

        values = await asyncio.gather(*(one(p) for p in paths))
        return dict(zip(paths, values))

    def exists(self, key: str) -> bool:
        """True if an object (not a mere prefix/folder) exists at ``key``."""
        key = _check_key(key)
        path = self._path(key)

        def attempt(remaining: float) -> bool:
            if self.protocol == "file":
                return os.path.isfile(path)
            try:
                if self.protocol == "s3":  # one HEAD; s3fs's info() would also LIST on a miss
                    bucket, name, _ = self.fs.split_path(path)
                    self._fs_call("call_s3", "head_object", Bucket=bucket, Key=name,
                                  timeout_s=remaining, hedged=True)
                    return True
                info = self._fs_call("info", path, timeout_s=remaining, hedged=True)
            except FileNotFoundError:
                return False
            return bool(info.get("type") != "directory")

        return self._run("exists", key, attempt)

    def list(self, prefix: str = "") -> list[str]:
        """All object keys under the folder ``prefix`` ('' = the whole store), recursively,
        relative to the store root, sorted. ``[]`` if there are none."""
        return builtins.list(self._list(prefix, detail=False))  # _list's keys come sorted

    def list_md5(self, prefix: str = "") -> dict[str, str | None]:
        """:meth:`list` with each object's MD5 (32 lower-case hex digits) where the listing tells it, with
        the same requests: S3's ETag of an object written by one PUT (an ETag that is not an MD5, as with
        SSE-KMS or multipart uploads, gives ``None``), GCS's ``md5Hash``; ``None`` on local and memory
        stores."""
        return self._list(prefix, detail=True)

    def _list(self, prefix: str, *, detail: bool) -> dict[str, str | None]:
        """The keys under ``prefix``, sorted, each with its MD5 (``detail``) or ``None``."""
        prefix = _check_key(prefix, allow_empty=True)
        path = self._path(prefix)

        def attempt(remaining: float) -> dict[str, str | None]:
            if self.protocol == "file":
                return dict.fromkeys(_local_find(path))
            if hasattr(self.fs, "invalidate_cache"):
                self.fs.invalidate_cache(path)
            try:
                return self._find(path, remaining, detail=detail)
            except FileNotFoundError:
                return {}

        paths = self._run("list", prefix, attempt)
        keys = {self._rel(p): md5 for p, md5 in paths.items() if not store_local.is_temp_name(p)}
        return {k: keys[k] for k in sorted(keys) if k}

    def _find(self, path: str, remaining: float, *, detail: bool = False) -> dict[str, str | None]:
        """Every object path under the folder ``path``, in one listing request per page.

        fsspec's ``find`` treats an empty listing as "maybe ``path`` is a file": s3fs then sends a HEAD
        and a second LIST, gcsfs a second LIST, so every empty poll of the exchange (a ready prefix
        nobody wrote to yet) cost three requests on S3 and two on GCS, one after the other. Here S3
        lists the parent with the folder's name as the key prefix (no fallback when a prefix is given)
        and GCS lists the folder's objects directly.
        """
        if self.protocol == "gs":
            items, _ = self._fs_call("do_list_objects", path, delimiter="", timeout_s=remaining, hedged=True)
            # a console's "folder" placeholder is no object
            return {str(o["name"]): _gcs_md5(o) if detail else None for o in items if not str(o["name"]).endswith("/")}
        if self.protocol == "memory":  # fsspec's find iterates its dict while other threads write to it
            folder = "/" + path.strip("/") + "/"
            return dict.fromkeys(k for k in list(self._fs.store) if k.startswith(folder))
        parent, _, name = path.rstrip("/").rpartition("/")
        if self.protocol == "s3" and parent:
            found = self._fs_call("find", parent, prefix=f"{name}/", detail=detail, timeout_s=remaining, hedged=True)
        else:
            found = self._fs_call("find", path, detail=detail, timeout_s=remaining, hedged=True)
        if not detail:
            return dict.fromkeys(found)
        return {p: _s3_md5(info) for p, info in found.items()}

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        """The immediate child "folders" of ``prefix`` ('' = the store root), NOT recursive:
        one delimited listing (S3 ``CommonPrefixes``, GCS ``prefixes``) instead of every key
        below. Keys relative to the store root (``list_dirs("a")`` -> ``["a/b", ...]``),
        sorted; ``[]`` if ``prefix`` holds no folders or does not exist.

        On object stores a folder exists while it holds an object; a local folder can outlive
        its last file, so callers should not infer that a listed folder holds anything.
        """
        prefix = _check_key(prefix, allow_empty=True)
        path = self._path(prefix)

        def attempt(remaining: float) -> builtins.list[str]:
            if self.protocol == "file":
                return _local_dirs(path)
            if hasattr(self.fs, "invalidate_cache"):
                self.fs.invalidate_cache(path)
            try:
                entries = self._fs_call("ls", path, detail=True, timeout_s=remaining, hedged=True)
            except (FileNotFoundError, NotADirectoryError):
                return []
            here = self.fs._strip_protocol(path).rstrip("/")
            names = (e["name"].rstrip("/") for e in entries if e.get("type") == "directory")
            return [n for n in names if n != here]

        paths = self._run("list_dirs", prefix, attempt)
        keys = {self._rel(p) for p in paths if not store_local.is_temp_name(p)}
        return sorted(k for k in keys if _is_child_key(k, prefix))

    # ----------------------------------------------------------------- deletes
    def delete(self, key: str, *, recursive: bool = False) -> None:
        """Delete the object at ``key``; with ``recursive`` everything under the folder ``key``
        (``''`` = the whole store). A missing key is not an error."""
        key = _check_key(key, allow_empty=recursive)
        path = self._path(key)

        def attempt(remaining: float) -> None:
            try:
                if self.protocol == "file":
                    _local_delete(path, recursive)
                elif recursive:
                    self._fs_call("rm", path, recursive=True, timeout_s=remaining)
                else:
                    self._fs_call("rm_file", path, timeout_s=remaining)
            except FileNotFoundError:
                pass

        self._run("delete", key, attempt)


def _refuse_links(root: str, key: str, url: str) -> None:
    """Refuse (:class:`StoreAccessDenied` naming it) a key of a ``file://`` store whose file, or any folder
    between the store's root and it, is a symbolic link: a file store opens files as files, so a link
    planted in a run folder (``final/x -> ~/.cache/huggingface/token``) is never read, written or
    appended to through."""
    current = root
    for part in key.split("/"):
        current = os.path.join(current, part)
        try:
            is_link = stat.S_ISLNK(os.lstat(current).st_mode)
        except OSError:
            return  # missing (or unreadable): nothing further down exists to follow
        if is_link:
            raise StoreAccessDenied(
                f"{url}/{key}: {current} is a symbolic link; a file store never follows links under its folder "
                "(one planted there could point at your credentials). Remove the link",
                url=url, key=key, op="open")


def _local_find(path: str) -> list[str]:
    """Files under ``path`` (or ``[path]`` if it is a file), temp files and symbolic links excluded (links
    to folders are not descended into)."""
    if os.path.islink(path):
        return []
    if os.path.isfile(path):
        return [path]
    out: list[str] = []
    for folder, _dirs, files in os.walk(path):
        out.extend(os.path.join(folder, f) for f in files
                   if not store_local.is_temp_name(f) and not os.path.islink(os.path.join(folder, f)))
    return out


def _local_dirs(path: str) -> list[str]:
    """Sub-folders directly in ``path``; ``[]`` if it is missing or not a folder."""
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if e.is_dir(follow_symlinks=False)
                    and not store_local.is_temp_name(e.name)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _local_delete(path: str, recursive: bool) -> None:
    if recursive and os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=False)
    elif os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a folder; pass recursive=True to delete it")
    else:
        os.unlink(path)
