"""Checks ``diloco launch`` runs before it creates a run or starts (and bills) any replica.

In order, cheapest first: the config and overrides, ``--replicas``, the executor kind and GPU type,
whether the store is reachable from where the replicas run, for local replicas whether this machine
can hold that many (4 per usable core and ~512 MiB of available memory each; ``-x oversubscribe=true``
skips the check), the executor's SDK and tokens (its
constructor checks them), a probe object written, read back and deleted in the store, that remote
replicas will get credentials for the store (:mod:`~diloco_serverless.launcher.credentials`: HF Jobs
secrets, Modal Secrets looked up; its warnings land in :attr:`LaunchPlan.warnings`), and that the
run id is free. Each failure is a :class:`LaunchError` whose message is one line naming the bad
value and the fix; nothing has been created when it is raised (the probe object is removed). Every
store operation is bounded by the config's ``store_timeout_s``, so a store that never answers fails
the launch within about that time.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_serverless.config import RunConfig, find_secret, tomllib
from diloco_serverless.errors import ConfigError, LaunchError, StoreError, one_line
from diloco_serverless.executors.base import ExecutorUnavailable, ServerlessExecutor
from diloco_serverless.executors.modal import normalize_gpu
from diloco_serverless.executors.registry import (
    EXECUTOR_KINDS,
    build_executor,
    executor_kind,
)
from diloco_serverless.launcher import pricing
from diloco_serverless.launcher.credentials import check_replica_credentials
from diloco_serverless.launcher.terraform import exchange_url_from_terraform
from diloco_serverless.launcher.user_modules import check_user_modules, hand_user_modules
from diloco_serverless.run.layout import RUN_JSON
from diloco_serverless.run.record import store_policy
from diloco_serverless.store.objectstore import ObjectStore

PROBE_PREFIX = ".diloco-probe"

#: Local replicas per usable CPU core: replicas mostly wait on the store, but past this the
#: machine thrashes and rounds time out. Override with ``-x oversubscribe=true``.
LOCAL_REPLICAS_PER_CORE = 4
#: Memory one local replica needs (torch + the tiny model, its reference copy and AdamW: measured
#: at ~460 MiB peak RSS for the tiny model's forward and backward).
LOCAL_REPLICA_MEMORY_BYTES = 512 * 2**20
#: The executor option that skips the local capacity check (``-x oversubscribe=true``).
OVERSUBSCRIBE_OPTION = "oversubscribe"


@dataclass
class LaunchPlan:
    """What preflight established: the store root, the executor (built), its kind and GPU."""

    root: ObjectStore
    executor: ServerlessExecutor
    kind: str
    gpu: str | None
    leftovers: int = 0  # objects already in the run folder (only with overwrite)
    #: things the person launching should know (e.g. forwarded credentials that expire); also logged
    warnings: list[str] = field(default_factory=list)


def resolve_config(config: RunConfig | str | Path | None, overrides: Sequence[str], *,
                   replicas: int | None = None, store: str | None = None, run_id: str | None = None,
                   store_from_terraform: str | Path | None = None,
                   store_timeout_s: float | None = None, push_to_hub: str | None = None) -> RunConfig:
    """The RunConfig to launch: file or object, then ``--set`` overrides, then explicit flags
    (``push_to_hub`` is ``hub.repo_id``)."""
    if replicas is not None and replicas < 1:
        raise LaunchError(f"--replicas must be at least 1 (got {replicas}); e.g. --replicas 4")
    if store is not None and store_from_terraform is not None:
        raise LaunchError("pass either --store or --store-from-terraform, not both")
    try:
        if isinstance(config, RunConfig):
            cfg = config.with_overrides(list(overrides)) if overrides else config
        else:
            cfg = RunConfig.load(str(config) if config is not None else None, list(overrides))
        if store_from_terraform is not None:
            store = _terraform_store(store_from_terraform)
        updates: dict[str, Any] = {k: v for k, v in (("replicas", replicas), ("store", store), ("run_id", run_id),
                                     ("store_timeout_s", store_timeout_s)) if v is not None}
        if push_to_hub is not None:
            updates["hub"] = {**cfg.hub.model_dump(mode="json"), "repo_id": push_to_hub}
        if updates:
            cfg = RunConfig.from_dict({**cfg.to_json_dict(), **updates}, source="command-line flags")
    except ConfigError as e:
        raise LaunchError(one_line(str(e))) from None
    return cfg


def _terraform_store(path: str | Path) -> str:
    try:
        return exchange_url_from_terraform(path).rstrip("/")
    except LaunchError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise LaunchError(one_line(str(e))) from None


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``["retries=3", "local_source=true"]`` -> ``{"retries": 3, "local_source": True}`` (TOML values,
    falling back to plain strings, as ``--set`` does; ``none`` means Python None, e.g. ``install=none``)."""

    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            kind = find_secret(item)
            shown = repr(item) if kind is None else f"<a value that looks like {kind}, not shown>"
            raise LaunchError(f"--executor-opt {shown} must look like KEY=VALUE, e.g. -x local_source=true")
        if text.strip().lower() == "none":
            out[key.strip()] = None
            continue
        try:
            out[key.strip()] = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = text.strip()
    return out


def check_max_usd(max_usd: float, name: str = "max_usd") -> float:
    """The budget as given, or LaunchError naming ``name`` (the flag or argument): it must be a
    finite number of US dollars above zero; NaN, infinity, zero or less would disable the guard."""
    example = f"{name} 20" if name.startswith("--") else f"{name}=20"
    if isinstance(max_usd, bool) or not isinstance(max_usd, (int, float)):
        raise LaunchError(f"{name} must be a number of US dollars, got {type(max_usd).__name__}; e.g. {example}")
    if not math.isfinite(max_usd) or max_usd <= 0:
        raise LaunchError(f"{name} must be positive and finite, in US dollars (got {max_usd}); e.g. {example}")
    return float(max_usd)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def available_memory() -> int | None:
    """Bytes of memory available to new processes (Linux ``MemAvailable``), or None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def local_replica_limit() -> tuple[int, str]:
    """(most local replicas this machine holds, why): LOCAL_REPLICAS_PER_CORE per usable core, and no
    more than the available memory holds at LOCAL_REPLICA_MEMORY_BYTES each."""
    cores = usable_cores()
    limit = LOCAL_REPLICAS_PER_CORE * cores
    cores_hold = f"{cores} usable CPU cores hold" if cores != 1 else "1 usable CPU core holds"
    why = f"{cores_hold} at most {limit} ({LOCAL_REPLICAS_PER_CORE} per core)"
    memory = available_memory()
    if memory is not None:
        by_memory = max(1, memory // LOCAL_REPLICA_MEMORY_BYTES)
        if by_memory < limit:
            limit = by_memory
            why = (f"{memory / 2**30:.1f} GiB of available memory holds at most {limit} "
                   f"(~{LOCAL_REPLICA_MEMORY_BYTES // 2**20} MiB each)")
    return limit, why


def check_local_capacity(replicas: int, *, oversubscribe: bool = False) -> None:
    """LaunchError when ``replicas`` local processes exceed what this machine holds (see
    :func:`local_replica_limit`), unless ``oversubscribe``."""
    if oversubscribe:
        return
    limit, why = local_replica_limit()
    if replicas > limit:
        raise LaunchError(
            f"--replicas {replicas} is more local replicas than this machine holds: {why}; lower --replicas, "
            f"run them elsewhere (--executor modal or hf-jobs), or pass -x {OVERSUBSCRIBE_OPTION}=true to launch anyway"
        )


def _oversubscribe(options: dict[str, Any]) -> bool:
    """Pop the ``oversubscribe`` executor option (a preflight setting, not the executor's)."""
    value = options.pop(OVERSUBSCRIBE_OPTION, False)
    if not isinstance(value, bool):
        raise LaunchError(f"-x {OVERSUBSCRIBE_OPTION} must be true or false, got {value!r}")
    return value


def check_executor_kind(kind: str, gpu: str | None) -> str | None:
    """Validate the executor kind and GPU type with the executors' own rules; return the canonical GPU.

    Checked before the executor is built, so an unknown GPU is reported even where the SDK or
    token is missing. ``None`` means the executor's default.
    """
    if kind not in EXECUTOR_KINDS:
        raise LaunchError(f"unknown executor {kind!r}; use --executor local, modal or hf-jobs")
    if gpu is None:
        return None
    if kind == "local":
        if gpu.strip().lower() != "cpu":
            raise LaunchError(f"the local executor runs on CPU; drop --gpu {gpu} (or use --executor modal)")
        return None
    if kind == "modal":
        try:
            canonical = normalize_gpu(gpu)
        except ExecutorUnavailable as e:
            raise LaunchError(f"{e}; e.g. --gpu H100") from None
        return "cpu" if canonical is None else canonical  # an explicit CPU container, not the A100 default
    flavors = _hf_flavors()
    if gpu not in flavors:
        raise LaunchError(f"unknown HF Jobs flavor {gpu!r}; use one of: {', '.join(sorted(flavors))}")
    return gpu


def _hf_flavors() -> set[str]:
    """HF Jobs flavors from ``huggingface_hub.JobHardware``, or the price table without the SDK."""
    try:
        from huggingface_hub import JobHardware

        return {f.value for f in JobHardware}
    except ImportError:
        return set(pricing.HF_JOBS_USD_PER_HOUR)


def check_store_reachable(store_url: str, kind: str) -> None:
    """Replicas must be able to open the store: memory:// is per-process, folders are per-machine."""
    scheme = store_url.split("://", 1)[0] if "://" in store_url else "file"
    if scheme == "memory":
        raise LaunchError(f"store {store_url} lives in one process and replicas are separate processes; "
                          "use a folder (--store ./runs) or a bucket (s3://..., gs://...)")
    if kind != "local" and scheme == "file":
        raise LaunchError(f"{kind} replicas run in the cloud and cannot see the local folder {store_url}; "
                          "use --store s3://bucket/prefix or gs://bucket/prefix (or --store-from-terraform)")


def probe_store(root: ObjectStore) -> None:
    """Write, read back and delete a small object under the store root; LaunchError if any step fails."""
    key = f"{PROBE_PREFIX}-{uuid.uuid4().hex}"
    payload = b"diloco-serverless store probe"
    try:
        root.put(key, payload)
        try:
            if root.get(key) != payload:
                raise LaunchError(f"store {root.url} returned different bytes for probe object {key}; "
                                  "check the endpoint (AWS_ENDPOINT_URL) points at a real object store")
        finally:
            root.delete(key)
    except StoreError as e:
        raise LaunchError(f"cannot use store {root.url}: {one_line(str(e))}") from None


def check_run_free(root: ObjectStore, run_id: str, *, overwrite: bool = False) -> int:
    """Refuse a run folder that already holds objects (a run, or an earlier run's leftovers that would
    otherwise be adopted: its rounds, checkpoints, even its ``final/``). With ``overwrite`` the
    leftovers are allowed (the launcher deletes them); returns how many objects there are."""
    if root.exists(f"{run_id}/{RUN_JSON}") and not overwrite:
        raise LaunchError(f"run {root.url}/{run_id} already exists; to continue it run `diloco resume "
                          f"{root.url}/{run_id}`, to start it over pass --overwrite, or pick another --run-id "
                          "(or omit it for a fresh one)")
    leftovers = len(root.list(f"{run_id}/"))
    if leftovers and not overwrite:
        raise LaunchError(
            f"{root.url}/{run_id} already holds {leftovers} objects of an earlier run (no run.json); a new run "
            "there would adopt them. Pick another --run-id, or pass --overwrite to delete them first"
        )
    return leftovers


def check_trust_remote_code(cfg: RunConfig, trust_remote_code: bool) -> None:
    """``model.trust_remote_code`` in a config is not enough: the person launching must confirm it."""
    if cfg.model.trust_remote_code and not trust_remote_code:
        raise LaunchError(
            f"the config sets model.trust_remote_code for {cfg.model.name!r}: replicas would run code from that "
            "repository with your storage and Hub credentials. Pass --trust-remote-code "
            "(launch(trust_remote_code=True)) if you trust it"
        )


def with_executor_devices(cfg: RunConfig, executor: ServerlessExecutor, kind: str) -> RunConfig:
    """``cfg`` with ``parallel.devices`` set to the devices the executor gives each replica (its
    ``devices_per_replica``: the GPU count of ``--gpu H100:8`` or of an ``h100x8`` flavor, or
    ``-x devices_per_replica=G`` for local processes). LaunchError when the config asks for another
    count than the executor gives; ``cfg`` unchanged when the executor does not say."""
    given = getattr(executor, "devices_per_replica", None)
    want = cfg.parallel.devices
    if not isinstance(given, int) or given == want:
        return cfg
    if want != 1:
        how = "-x devices_per_replica" if kind == "local" else "the GPU count (--gpu TYPE:N / the flavor)"
        raise LaunchError(
            f"parallel.devices is {want} but the {kind} executor gives each replica {given} device(s); set "
            f"parallel.devices={given} or change {how} to {want}"
        )
    try:
        return cfg.with_overrides([f"parallel.devices={given}"])
    except ConfigError as e:
        raise LaunchError(f"{given} devices per replica do not fit this config: {one_line(str(e))}") from None


def check_launch(cfg: RunConfig, executor: ServerlessExecutor | str, *, gpu: str | None = None,
                 executor_options: dict[str, Any] | None = None,
                 storage_options: dict[str, Any] | None = None,
                 trust_remote_code: bool = False, overwrite: bool = False) -> LaunchPlan:
    """Run every check; build the executor; return the plan. LaunchError on the first problem."""
    check_trust_remote_code(cfg, trust_remote_code)
    user_modules = check_user_modules(cfg)
    if isinstance(executor, str):
        kind = executor
        gpu = check_executor_kind(kind, gpu)
        check_store_reachable(cfg.store, kind)
        options = dict(executor_options or {})
        oversubscribe = _oversubscribe(options) if kind == "local" else False
        if kind == "local" and options.get("secrets"):
            raise LaunchError("--secret is for modal and hf-jobs replicas; local replicas inherit your environment")
        if kind == "local":
            per = str(options.get("devices_per_replica") or cfg.parallel.devices).strip()
            check_local_capacity(cfg.replicas * (int(per) if per.isdigit() else 1), oversubscribe=oversubscribe)
        built = build_executor(kind, gpu, options)
        gpu = getattr(built, "gpu", None) or getattr(built, "flavor", None) or gpu
    else:
        built = executor
        kind = executor_kind(executor, "custom")
        gpu = gpu or getattr(executor, "gpu", None) or getattr(executor, "flavor", None)
        if kind in EXECUTOR_KINDS:
            check_store_reachable(cfg.store, kind)
        if kind == "local":
            check_local_capacity(cfg.replicas, oversubscribe=_oversubscribe(dict(executor_options or {})))
    try:
        root = ObjectStore(cfg.store, storage_options, retry=store_policy(cfg))
    except (StoreError, ValueError, ImportError) as e:
        raise LaunchError(f"cannot open store {cfg.store}: {one_line(str(e))}") from None
    probe_store(root)
    warnings = check_replica_credentials(root.url, root.protocol, built, endpoint=root.endpoint)
    warnings += hand_user_modules(built, user_modules)
    try:
        leftovers = check_run_free(root, cfg.run_id, overwrite=overwrite)
    except StoreError as e:
        raise LaunchError(f"cannot read store {root.url}: {one_line(str(e))}") from None
    return LaunchPlan(root=root, executor=built, kind=kind, gpu=gpu, leftovers=leftovers, warnings=warnings)
