"""A run's layout in the object store: run.json, heartbeats, metrics, and every key in between.

The bucket is the only thing replicas and the CLI share, so a run *is* its folder
``<store_url>/<run_id>`` (docs/architecture.md, "A run in the store")::

    run.json                                 {"run_id", "created_at", "version", "config", "launch"}
    members/rank-<r>.json                    heartbeat (see :class:`Heartbeat`)
    rounds/<round:08d>/ready/rank-<r>        exchange objects (written by allreduce.py)
    rounds/<round:08d>/quorum.json           (N <= 16 flat/direct: rounds/<round:08d>/votes/rank-<r>)
    rounds/<round:08d>/contrib/<shard:04d>/rank-<r>
    rounds/<round:08d>/reduced/<shard:04d>
    checkpoints/<round:08d>/...   checkpoints/latest.json
    metrics/rank-<r>/<round:08d>.json
    logs/rank-<r>.log
    final/                                   save_pretrained output

Key builders here are pure functions; every other module builds keys through them. Helpers take an
``ObjectStore`` rooted at the run (what :func:`load_run` returns). ``run.json`` is created with
create-only semantics (``put_if_absent``), so two launches can never share a run id.

Failure: :class:`RunNotFound` when a URL holds no run.json, :class:`InvalidRun` when it is not JSON
or its config does not validate, :class:`RunExists` when creating over an existing run; every message
names the URL and says what to do. Store errors (access denied, unavailable) propagate unchanged.

Deadlines: every store operation made for a run is bounded by the run's ``store_timeout_s``
(:func:`store_policy`); before run.json is read that value is unknown, so the functions that open a
URL take ``timeout_s`` for the first read (``None``: the store's default policy). A replica opens its
run store with::

    run_store, record = load_run(run_url, storage_options, key=run_key, timeout_s=STORE_TIMEOUT_S)
    run_store = run_store.with_retry(store_policy(record.config))
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from diloco_serverless.config import RUN_ID_PATTERN, RunConfig, find_secret
from diloco_serverless.errors import ConfigError, RunError
from diloco_serverless.run.bounded import get_bounded, get_many_bounded
from diloco_serverless.run.integrity import load_local_revision, mac_json, save_local_revision, verify_json
from diloco_serverless.run.layout import RUN_JSON, RUN_VERSION
from diloco_serverless.store.errors import ObjectNotFound, ObjectTooLarge
from diloco_serverless.store.objectstore import ObjectStore, TransferPolicy
from diloco_serverless.store.retry import RetryPolicy

__all__ = [
    "InvalidRun",
    "RunExists",
    "RunNotFound",
    "RunRecord",
    "create_run",
    "join_run_url",
    "list_runs",
    "load_run",
    "open_run_store",
    "record_launch",
    "split_run_url",
    "store_policy",
    "timeout_policy",
    "transfer_policy",
]


class RunNotFound(RunError, FileNotFoundError):
    """No run.json at the URL."""


class RunExists(RunError, FileExistsError):
    """create_run found a run.json already there."""


class InvalidRun(RunError, ValueError):
    """run.json exists but is not JSON, misses fields, or its config does not validate."""


def split_run_url(run_url: str) -> tuple[str, str]:
    """``"s3://b/prefix/run-x"`` -> ``("s3://b/prefix", "run-x")``; a bare ``"run-x"`` -> ``(".", "run-x")``.

    Raises ValueError when the URL has no run id component (e.g. ``"s3://bucket"``).
    """
    url = run_url.strip().rstrip("/")
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "/" not in rest:
        if scheme or not rest:
            raise ValueError(
                f"run URL {run_url!r} has no run id; expected <store_url>/<run_id>, e.g. s3://bucket/runs/run-x"
            )
        return ".", rest
    parent, run_id = rest.rsplit("/", 1)
    if not run_id:
        raise ValueError(f"run URL {run_url!r} has no run id; expected <store_url>/<run_id>")
    return (f"{scheme}://{parent}" if scheme else (parent or "/")), run_id


def join_run_url(store_url: str, run_id: str) -> str:
    """``<store_url>/<run_id>`` without doubled slashes."""
    return f"{store_url.rstrip('/')}/{run_id}"


# --------------------------------------------------------------------------------- run.json
def _utc_now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class RunRecord:
    """The parsed ``run.json``: identity, validated config and launch record (executor + handles)."""

    run_id: str
    created_at: str
    version: int
    config: RunConfig
    launch: dict[str, Any] | None = None
    url: str = ""  # where it was read from; not stored

    def to_json_dict(self) -> dict[str, Any]:
        """The JSON object stored as run.json."""
        return {
            "run_id": self.run_id,
            "created_at": self.created_at,
            "version": self.version,
            "config": self.config.to_json_dict(),
            "launch": self.launch,
        }

    @classmethod
    def from_json_dict(cls, data: Any, *, url: str) -> RunRecord:
        """Parse run.json content; InvalidRun naming ``url`` and the problem on failure."""
        if not isinstance(data, dict):
            raise InvalidRun(f"{url}/{RUN_JSON} is not a JSON object; the run is corrupt, launch a new one")
        missing = [k for k in ("run_id", "created_at", "version", "config") if k not in data]
        if missing:
            raise InvalidRun(f"{url}/{RUN_JSON} lacks {missing}; it was not written by diloco, launch a new run")
        if not isinstance(data["version"], int) or data["version"] > RUN_VERSION:
            raise InvalidRun(
                f"{url}/{RUN_JSON} has version {data['version']!r}, this diloco-serverless reads <= {RUN_VERSION}; "
                "upgrade the package"
            )
        if not isinstance(data["config"], dict):
            raise InvalidRun(
                f"{url}/{RUN_JSON}: 'config' must be an object, got {type(data['config']).__name__}; "
                "the run is corrupt, launch a new one"
            )
        try:
            config = RunConfig.from_dict(data["config"], source=f"{url}/{RUN_JSON}")
        except ConfigError as exc:
            raise InvalidRun(str(exc)) from None
        run_id = data["run_id"]
        if not isinstance(run_id, str) or not re.match(RUN_ID_PATTERN, run_id):
            raise InvalidRun(
                f"{url}/{RUN_JSON} has run_id {_shown(run_id)}, which is not a run id "
                "(letters, digits, '.', '_', '-'); the run is corrupt or was not written by diloco, launch a new one"
            )
        folder = url.rstrip("/").rsplit("/", 1)[-1] if url else run_id
        if run_id != folder:
            raise InvalidRun(
                f"{url}/{RUN_JSON} has run_id {_shown(run_id)} but sits in folder {_shown(folder)}; "
                "a run's record must name its own folder, launch a new run"
            )
        if config.run_id != run_id:
            raise InvalidRun(
                f"{url}/{RUN_JSON} has run_id {_shown(run_id)} but its config says {_shown(config.run_id)}; "
                "the run is corrupt, launch a new one"
            )
        launch = data.get("launch")
        if launch is not None and not isinstance(launch, dict):
            raise InvalidRun(f"{url}/{RUN_JSON}: 'launch' must be an object or null, got {type(launch).__name__}")
        return cls(run_id, str(data["created_at"]), data["version"], config, launch, url)


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for quoting a stored value in an error."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: What run.json's HMAC is bound to (diloco_serverless.run.integrity).
RUN_JSON_KIND = "run.json"


#: The field of run.json that orders its versions: 1 at creation, +1 at every launch record (signed with the rest).
REVISION = "revision"


def _dumps(obj: dict[str, Any], key: bytes | None, revision: int = 1) -> bytes:
    obj = {**obj, REVISION: revision}
    doc = mac_json(key, RUN_JSON_KIND, obj, place=RUN_JSON) if key is not None else obj
    return json.dumps(doc, indent=1, sort_keys=False).encode("utf-8")


def timeout_policy(timeout_s: float | None) -> RetryPolicy | None:
    """The default :class:`RetryPolicy` with the deadline ``timeout_s`` (seconds, finite and > 0;
    ValueError otherwise), or None for ``None`` (the store's own default)."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or timeout_s <= 0:
        raise ValueError(f"a store deadline must be a finite number of seconds > 0, got {timeout_s!r}")
    return RetryPolicy(timeout_s=float(timeout_s))


def store_policy(config: RunConfig) -> RetryPolicy:
    """The retry policy of every store operation made for the run ``config`` describes: the
    defaults of :class:`RetryPolicy` with the deadline ``config.store_timeout_s``. Apply it with
    ``ObjectStore(url, options, retry=store_policy(cfg))`` or ``store.with_retry(store_policy(cfg))``."""
    return RetryPolicy(timeout_s=config.store_timeout_s)


def transfer_policy(config: RunConfig) -> TransferPolicy:
    """How large objects of the run travel (``store_part_size_mb``, ``store_part_concurrency``) and when
    its reads are hedged (``store_hedge_quantile``); apply it with ``store.with_transfer(transfer_policy(cfg))``."""
    return TransferPolicy.from_mb(config.store_part_size_mb, config.store_part_concurrency,
                                  config.store_hedge_quantile)


def open_run_store(run_url: str, storage_options: dict[str, Any] | None = None, *,
                   timeout_s: float | None = None) -> ObjectStore:
    """An ObjectStore rooted at the run (no I/O); ``timeout_s`` bounds each of its operations
    (None: the default :class:`RetryPolicy`)."""
    return ObjectStore(run_url, storage_options, retry=timeout_policy(timeout_s))


def create_run(
    store: ObjectStore | str | None,
    config: RunConfig,
    *,
    storage_options: dict[str, Any] | None = None,
    key: bytes | None = None,
) -> tuple[ObjectStore, RunRecord]:
    """Create ``<store>/<config.run_id>/run.json`` create-only; returns (run store, record).

    ``store`` is the store root (ObjectStore or URL; None = ``config.store``). The recorded config's
    ``store`` is the normalised store URL, and a relative local ``data.source`` is made absolute, so
    replicas started elsewhere read the same locations. With ``key`` (the run key), run.json carries
    its HMAC, and readers holding the key refuse any other content. A store opened here from a URL
    bounds each operation by ``config.store_timeout_s``; a given ObjectStore keeps its own policy.
    Raises RunExists if the run id is taken.
    """
    root = (store if isinstance(store, ObjectStore)
            else ObjectStore(store or config.store, storage_options, retry=store_policy(config)))
    config = config.model_copy(update={"store": root.url, "data": _absolute_data_source(config)})
    run_store = root.child(config.run_id)
    record = RunRecord(config.run_id, _utc_now_iso(), RUN_VERSION, config, None, run_store.url)
    if not run_store.put_if_absent(RUN_JSON, _dumps(record.to_json_dict(), key, 1)):
        raise RunExists(
            f"run {run_store.url} already exists; choose another run id (--set run_id=...) "
            f"or attach to it with `diloco status {run_store.url}`"
        )
    if key is not None:
        save_local_revision(run_store.url, 1)
    return run_store, record


def _absolute_data_source(config: RunConfig) -> Any:
    """``data`` with a relative local JSONL path made absolute (local replicas may run elsewhere)."""
    source = config.data.source
    if source == "stdlib" or "://" in source or not Path(source).exists():
        return config.data
    return config.data.model_copy(update={"source": str(Path(source).resolve())})


def _read_record(run_store: ObjectStore, key: bytes | None) -> RunRecord:
    try:
        raw = get_bounded(run_store, RUN_JSON, "run.json")
    except ObjectTooLarge as exc:
        raise InvalidRun(f"{run_store.url}/{RUN_JSON} is larger than a run record can be ({exc}); the run is "
                         "corrupt") from None
    except ObjectNotFound:
        raise RunNotFound(
            f"no run at {run_store.url}: {RUN_JSON} does not exist; check the run URL "
            "(list runs with `diloco ls <store_url>`)"
        ) from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRun(f"{run_store.url}/{RUN_JSON} is not valid JSON ({exc}); the run is corrupt") from None
    if key is not None and not verify_json(key, RUN_JSON_KIND, data, place=RUN_JSON):
        raise InvalidRun(
            f"{run_store.url}/{RUN_JSON} does not carry this run's signature: it was changed after launch by "
            "someone with write access to the bucket, or belongs to another launch; refusing it. Check who can "
            "write the prefix (docs/security.md) and launch a new run"
        )
    if key is not None:
        _check_revision(run_store.url, data)
    return RunRecord.from_json_dict(data, url=run_store.url)


def _revision(data: Any) -> int:
    value = data.get(REVISION, 0) if isinstance(data, dict) else 0
    return value if type(value) is int and value >= 0 else 0


def _check_revision(url: str, data: Any) -> None:
    """InvalidRun when this machine wrote a newer run.json than ``data`` (an older one, still validly
    signed, was put back: its handles would be acted on by cancel, status and resume)."""
    newest = load_local_revision(url)
    if newest is not None and _revision(data) < newest:
        raise InvalidRun(
            f"{url}/{RUN_JSON} is revision {_revision(data)}, older than revision {newest} this machine wrote: "
            "an earlier version was put back by someone with write access to the bucket; refusing to act on "
            "its handles. Check who can write the prefix (docs/security.md)"
        )


def load_run(
    run_url: str | ObjectStore, storage_options: dict[str, Any] | None = None, *, key: bytes | None = None,
    timeout_s: float | None = None,
) -> tuple[ObjectStore, RunRecord]:
    """Open the run at ``run_url`` -> (store rooted at the run, its RunRecord).

    With ``key`` (the run key), run.json must carry its HMAC under that key. ``timeout_s`` bounds
    each store operation, the read of run.json included, and stays the returned store's deadline
    (None: the given store's policy, or the default :class:`RetryPolicy` for a URL); to go on with
    the run's own deadline, use ``store.with_retry(store_policy(record.config))``. Raises
    RunNotFound / InvalidRun naming the URL; store errors (StoreAccessDenied, StoreUnavailable, the
    latter when the deadline passes) propagate with their own message.
    """
    policy = timeout_policy(timeout_s)
    if isinstance(run_url, ObjectStore):
        run_store = run_url if policy is None else run_url.with_retry(policy)
    else:
        run_store = ObjectStore(run_url, storage_options, retry=policy)
    return run_store, _read_record(run_store, key)


def _refuse_secret_values(obj: Any, where: str) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _refuse_secret_values(v, f"{where}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _refuse_secret_values(v, f"{where}[{i}]")
    elif isinstance(obj, str) and (kind := find_secret(obj)) is not None:
        raise ValueError(f"{where} looks like {kind}; never record credentials in run.json, keep them in the env")


def record_launch(
    run_url: str | ObjectStore,
    executor_kind: str,
    handles: list[dict[str, Any]],
    *,
    storage_options: dict[str, Any] | None = None,
    key: bytes | None = None,
    timeout_s: float | None = None,
    **extra: Any,
) -> RunRecord:
    """Store the launch record ``{"executor", "handles", "launched_at", **extra}`` in run.json.

    Handles must be JSON-serialisable dicts ({"kind", "rank", ...}); values that look like secrets are
    refused (ValueError). Overwrites any previous launch record (a relaunch), signed with ``key``
    (which must also verify the record it replaces). ``timeout_s`` bounds the read and the write as
    in :func:`load_run`. Returns the new record.
    """
    run_store, record = load_run(run_url, storage_options, key=key, timeout_s=timeout_s)
    try:
        stored = _revision(json.loads(get_bounded(run_store, RUN_JSON, "run.json").decode("utf-8")))
    except (ValueError, UnicodeDecodeError):
        stored = 0
    revision = max(stored, (load_local_revision(run_store.url) or 0) if key is not None else 0) + 1
    launch = {"executor": executor_kind, "handles": list(handles), "launched_at": _utc_now_iso(), **extra}
    _refuse_secret_values(launch, "launch")
    try:
        json.dumps(launch)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"launch record for {run_store.url} is not JSON-serialisable: {exc}") from None
    new = RunRecord(record.run_id, record.created_at, record.version, record.config, launch, run_store.url)
    run_store.put(RUN_JSON, _dumps(new.to_json_dict(), key, revision))
    if key is not None:
        save_local_revision(run_store.url, revision)
    return new


# --------------------------------------------------------------------------------- listing
def list_runs(store: ObjectStore | str, storage_options: dict[str, Any] | None = None, *,
              skipped: list[tuple[str, str]] | None = None, timeout_s: float | None = None) -> list[RunRecord]:
    """Runs directly under a store URL (folders holding a run.json), oldest first.

    Reads one delimited listing of the store's top-level folders and fetches their
    ``<folder>/run.json`` concurrently; it never lists the rounds inside a run, so it stays
    fast on a large S3/GCS prefix. A run.json that is unreadable or invalid (not JSON, a config that
    does not validate, a run_id that is not a run id or not its folder's name) skips that run: it is
    appended to ``skipped`` as (folder, reason) when a list is given, else warned about; folders
    without one are ignored. One bad run never stops the listing. ``timeout_s`` bounds each store
    operation (None: the given store's policy, or the default :class:`RetryPolicy` for a URL).
    """
    policy = timeout_policy(timeout_s)
    if isinstance(store, ObjectStore):
        root = store if policy is None else store.with_retry(policy)
    else:
        root = ObjectStore(store, storage_options, retry=policy)
    keys = [f"{folder}/{RUN_JSON}" for folder in root.list_dirs("")]
    out: list[RunRecord] = []
    for key, raw in sorted(get_many_bounded(root, keys, "run.json").items()):
        folder = key.split("/", 1)[0]
        url = join_run_url(root.url, folder)
        try:
            try:
                data = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                raise InvalidRun(f"{url}/{RUN_JSON} is not valid JSON ({type(exc).__name__})") from None
            out.append(RunRecord.from_json_dict(data, url=url))
        except (ValueError, RunError) as exc:
            if skipped is None:
                warnings.warn(f"skipping run {url}: {exc}", stacklevel=2)
            else:
                skipped.append((folder, str(exc)))
    return sorted(out, key=lambda r: (r.created_at, r.run_id))
