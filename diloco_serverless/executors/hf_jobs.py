"""HFJobsExecutor: one Hugging Face Job per replica (``huggingface_hub`` ``run_job`` & co).

Each rank is a Job running ``python -m <entrypoint> <args>`` in ``image`` on ``flavor`` hardware, with
``REPLICA_RANK`` in its environment and labels ``diloco-run=<run id>``, ``diloco-rank=<r>`` so the
jobs of a run can be found on the Hub. Storage credentials travel only as Job *secrets* (encrypted
by the Hub, never shown by ``inspect_job``): the names in ``secrets`` are read from this process's
environment, and any credential-looking variable passed in ``env`` (see ``base.looks_secret``) is
moved to the secrets too. Values are never logged nor stored in handles.

Retries: ``retries`` maps to the Jobs API ``attempts`` (the Hub re-runs a failed Job); a restarted
replica heals from the store's latest checkpoint. Stage mapping: SCHEDULING -> pending, RUNNING ->
running, COMPLETED -> succeeded, ERROR -> failed (with the Hub's status message), CANCELED ->
cancelled, DELETED -> failed.

Handles (``job_id``, ``namespace``, ``endpoint``, ...) are stored in run.json, which any replica
credential can rewrite. The token is therefore only ever sent to the endpoint of *this* process
(``endpoint=``, else ``HF_ENDPOINT``, else https://huggingface.co): :meth:`HFJobsExecutor.from_handle`
refuses a handle that names another endpoint, and job ids and namespaces are checked to be plain
names before they go into a request path.

Images: the default image is a stock PyTorch image; ``install`` (default: this package at this
version with its s3/gcs/hf extras) is pip-installed before the replica starts. Pass ``install=None``
with an image that already contains the package.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

from diloco_serverless import __version__
from diloco_serverless.errors import ExecutorError
from diloco_serverless.executors.base import (
    STORAGE_CONFIG_ENV,
    STORAGE_SECRET_ENV,
    ExecutorUnavailable,
    ReplicaHandle,
    ReplicaResult,
    ReplicaState,
    ReplicaStatus,
    check_replica_count,
    collect_by_polling,
    run_id_from_url,
    run_url_from,
    split_secret_env,
)

DEFAULT_IMAGE = "pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime"
DEFAULT_INSTALL = f"diloco-serverless[s3,gcs,hf]=={__version__}"

_STAGES: dict[str, ReplicaStatus] = {
    "SCHEDULING": ReplicaStatus.PENDING,
    "RUNNING": ReplicaStatus.RUNNING,
    "COMPLETED": ReplicaStatus.SUCCEEDED,
    "ERROR": ReplicaStatus.FAILED,
    "CANCELED": ReplicaStatus.CANCELLED,
    "DELETED": ReplicaStatus.FAILED,
}


def _import_hub() -> Any:
    try:
        import huggingface_hub
    except ImportError as exc:
        raise ExecutorUnavailable(
            "hf-jobs executor needs huggingface_hub: pip install 'diloco-serverless[hf]'"
        ) from exc
    return huggingface_hub


def current_endpoint(hub: Any | None = None) -> str:
    """The Hub endpoint this process talks to: ``HF_ENDPOINT`` (read now) or the library's default."""
    hub = hub or _import_hub()
    return str(os.environ.get("HF_ENDPOINT") or hub.constants.ENDPOINT).rstrip("/")


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def _label(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", value)[:63].strip("-") or "unnamed"


class HFJobsExecutor:
    """Launch replicas as Hugging Face Jobs.

    Args:
        flavor: Jobs hardware flavor (``huggingface_hub.JobHardware``), e.g. "a10g-large", "a100-large".
        image: Docker image (or ``hf.co/spaces/...``) the Jobs run in.
        secrets: storage credentials for the replicas: names of variables to read from this
            environment, or a mapping name -> value. ``forward_credentials`` adds the standard ones
            (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) that are set here, and copies the
            storage settings (AWS_ENDPOINT_URL, AWS_REGION, ...) into the Jobs' plain environment.
        timeout: maximum Job duration, seconds or a string like "12h" (Jobs API semantics).
        namespace: user or org owning the Jobs (default: the token's user, via ``whoami``).
        endpoint: Hub endpoint (default ``HF_ENDPOINT`` / https://huggingface.co); the token is sent there.
        token: HF token (default ``HF_TOKEN`` or the token saved by ``hf auth login``).
        retries: re-runs of a failed Job (Jobs ``attempts = retries + 1``).
        install: pip requirement installed in the Job before the replica starts; None to skip.
        poll_interval_s: how often ``collect`` polls the Jobs API.

    Raises ExecutorUnavailable (before anything is launched) without ``huggingface_hub``, without a
    token, for an unknown flavor or for a secret name that is not set in the environment.
    """

    kind = "hf-jobs"

    def __init__(
        self,
        flavor: str = "a10g-large",
        image: str = DEFAULT_IMAGE,
        secrets: Sequence[str] | Mapping[str, str] = (),
        timeout: int | float | str | None = "12h",
        namespace: str | None = None,
        endpoint: str | None = None,
        token: str | None = None,
        *,
        retries: int = 2,
        install: str | None = DEFAULT_INSTALL,
        forward_credentials: bool = True,
        poll_interval_s: float = 10.0,
    ) -> None:
        hub = _import_hub()
        flavors = {f.value for f in hub.JobHardware}
        if flavor not in flavors:
            raise ExecutorUnavailable(f"hf-jobs executor: unknown flavor {flavor!r}; choose one of {sorted(flavors)}")
        token = token or os.environ.get("HF_TOKEN") or hub.get_token()
        if not token:
            raise ExecutorUnavailable("hf-jobs executor: no Hugging Face token; set HF_TOKEN or run `hf auth login`")
        self.flavor, self.image, self.timeout = flavor, image, timeout
        self.retries, self.install, self.poll_interval_s = retries, install, poll_interval_s
        self._secrets = self._resolve_secrets(secrets, forward_credentials)
        self._forwarded_env = (
            {k: os.environ[k] for k in STORAGE_CONFIG_ENV if k in os.environ} if forward_credentials else {}
        )
        self._api = hub.HfApi(endpoint=(endpoint or current_endpoint(hub)).rstrip("/"), token=token)
        self.endpoint = self._api.endpoint
        self._namespace = namespace

    @classmethod
    def from_handle(cls, handle: ReplicaHandle, *, run_url: str | None = None, **options: Any) -> HFJobsExecutor:
        """An executor for ``handle``'s jobs: token and endpoint from ``options`` or this environment.

        The handle comes from run.json, which any replica credential can rewrite, so its endpoint
        is never used: a handle naming an endpoint other than the one in use is refused
        (ExecutorUnavailable) before any request, so the token never goes there. Its namespace
        (a plain name) is reused.
        """
        endpoint = str(options.get("endpoint") or current_endpoint()).rstrip("/")
        stored = handle.data.get("endpoint")
        if stored is not None and str(stored).rstrip("/") != endpoint:
            raise ExecutorUnavailable(
                f"hf-jobs executor: run.json's handle of rank {handle.rank} names endpoint {str(stored)!r}, but this "
                f"process uses {endpoint!r}; refusing to send your HF token there (if you launched the run against "
                "that endpoint and trust it, set HF_ENDPOINT to it)"
            )
        options["endpoint"] = endpoint
        if handle.data.get("namespace") is not None:
            where = f"rank {handle.rank}'s handle"
            options.setdefault("namespace", _checked_name(handle.data["namespace"], "namespace", where))
        options.setdefault("forward_credentials", False)
        return cls(**options)

    def _job_ref(self, handle: ReplicaHandle) -> tuple[str, str]:
        """``(job_id, namespace)`` of ``handle``, both plain names (they go into request paths)."""
        where = f"rank {handle.rank}'s handle"
        job_id = _checked_name(handle.data.get("job_id"), "job_id", where)
        ns = handle.data.get("namespace")
        return job_id, _checked_name(ns, "namespace", where) if ns else self.namespace

    @staticmethod
    def _resolve_secrets(secrets: Sequence[str] | Mapping[str, str], forward: bool) -> dict[str, str]:
        if isinstance(secrets, Mapping):
            resolved = {str(k): str(v) for k, v in secrets.items()}
        else:
            missing = [name for name in secrets if name not in os.environ]
            if missing:
                raise ExecutorUnavailable(
                    f"hf-jobs executor: secret variable(s) {missing} are not set in this environment; "
                    "export them or pass secrets as a name -> value mapping"
                )
            resolved = {name: os.environ[name] for name in secrets}
        if forward:
            for name in STORAGE_SECRET_ENV:
                if name in os.environ and name not in resolved:
                    resolved[name] = os.environ[name]
        return resolved

    @property
    def namespace(self) -> str:
        """The Jobs namespace (resolved once via ``whoami`` if not given)."""
        if self._namespace is None:
            self._namespace = str(self._api.whoami()["name"])
        return self._namespace

    # --- launch -----------------------------------------------------------------------------
    def command(self, entrypoint: str, entrypoint_args: Sequence[str]) -> list[str]:
        """The Job command: ``python -m entrypoint args`` (after ``pip install`` when ``install`` is set)."""
        run = ["python", "-m", entrypoint, *map(str, entrypoint_args)]
        if self.install is None:
            return run
        script = f"pip install --quiet {shlex.quote(self.install)} && exec {shlex.join(run)}"
        return ["bash", "-c", script]

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: str,
        entrypoint_args: Sequence[str],
        env: Mapping[str, str] | None = None,
    ) -> list[ReplicaHandle]:
        """Submit one Job per rank; if a submission fails, cancel the submitted ones and raise."""
        check_replica_count(n_replicas, self.kind)
        plain, secret = split_secret_env({**self._forwarded_env, **(env or {})})
        secrets = {**self._secrets, **secret}
        run_id = run_id_from_url(run_url_from(env, entrypoint_args)) or "unnamed"
        command = self.command(entrypoint, entrypoint_args)
        handles: list[ReplicaHandle] = []
        for rank in range(n_replicas):
            try:
                job = self._api.run_job(
                    image=self.image, command=command, env={**plain, "REPLICA_RANK": str(rank)},
                    secrets=secrets or None, flavor=self.flavor, timeout=self.timeout,
                    attempts=self.retries + 1, labels={"diloco-run": _label(run_id), "diloco-rank": str(rank)},
                    name=_label(f"diloco-{run_id}-rank-{rank}"), namespace=self.namespace,
                )
            except Exception as exc:
                self.cancel(handles)
                raise ExecutorError(
                    f"hf-jobs executor: submitting rank {rank} of run {run_id!r} failed ({exc}); "
                    f"cancelled the {len(handles)} job(s) already submitted"
                ) from exc
            data = {"job_id": job.id, "namespace": self.namespace, "endpoint": self.endpoint,
                    "url": job.url, "run_id": run_id, "flavor": self.flavor}
            handles.append(ReplicaHandle(kind=self.kind, rank=rank, data=data))
        return handles

    # --- observe ----------------------------------------------------------------------------
    def poll(self, handles: Sequence[ReplicaHandle]) -> list[ReplicaState]:
        """``inspect_job`` per rank, mapped to states; a missing Job is ``failed``."""
        return [self._state(h) for h in handles]

    def _state(self, handle: ReplicaHandle) -> ReplicaState:
        from huggingface_hub.errors import HfHubHTTPError

        job_id, ns = self._job_ref(handle)
        try:
            job = self._api.inspect_job(job_id=job_id, namespace=ns)
        except HfHubHTTPError as exc:
            code = getattr(exc.response, "status_code", None)
            if code == 404:
                return ReplicaState(rank=handle.rank, status=ReplicaStatus.FAILED,
                                    reason=f"job {job_id} not found in namespace {ns!r}")
            raise ExecutorError(
                f"hf-jobs executor: inspecting rank {handle.rank} (job {job_id}) failed: {exc}"
            ) from exc
        stage = str(getattr(job.status.stage, "value", job.status.stage))
        status = _STAGES.get(stage, ReplicaStatus.PENDING)
        message = job.status.message
        reason = message if status is not ReplicaStatus.SUCCEEDED else None
        if status is ReplicaStatus.FAILED and not reason:
            reason = f"job {job_id} ended in stage {stage}"
        exit_code = 0 if status is ReplicaStatus.SUCCEEDED else _exit_code(message)
        detail = {"job_id": job_id, "stage": stage, "url": f"{self.endpoint}/jobs/{ns}/{job_id}"}
        return ReplicaState(rank=handle.rank, status=status, reason=reason, exit_code=exit_code, detail=detail)

    def collect(
        self, handles: Sequence[ReplicaHandle], timeout: float | timedelta | None = None
    ) -> list[ReplicaResult]:
        """Wait for every Job; raise ReplicaFailedError naming failed ranks with their log tails."""
        return collect_by_polling(self, handles, timeout, poll_interval_s=self.poll_interval_s)

    def logs(self, handle: ReplicaHandle, tail: int | None = 200) -> str:
        """The last ``tail`` lines of the Job's logs (``fetch_job_logs``; all if None)."""
        job_id, ns = self._job_ref(handle)
        lines = self._api.fetch_job_logs(job_id=job_id, namespace=ns, tail=tail)
        return "\n".join(line.rstrip("\n") for line in lines)

    def follow_logs(self, handle: ReplicaHandle) -> Iterator[str]:
        """Stream the Job's log lines until it finishes."""
        job_id, ns = self._job_ref(handle)
        yield from self._api.fetch_job_logs(job_id=job_id, namespace=ns, follow=True)

    def cancel(self, handles: Sequence[ReplicaHandle]) -> None:
        """``cancel_job`` for every rank that is not finished; errors name the rank and job."""
        errors = []
        for h in handles:
            try:
                if not self._state(h).terminal:
                    job_id, ns = self._job_ref(h)
                    self._api.cancel_job(job_id=job_id, namespace=ns)
            except Exception as exc:
                why = str(exc).removeprefix("hf-jobs executor: ")
                errors.append(f"rank {h.rank} (job {h.data.get('job_id')!r}): {why}")
        if errors:
            raise ExecutorError("hf-jobs executor: could not cancel " + "; ".join(errors))


def _exit_code(message: str | None) -> int | None:
    match = re.search(r"exit(?:ed with)? code:?\s*(-?\d+)", message or "", re.IGNORECASE)
    return int(match.group(1)) if match else None


def _checked_name(value: Any, field: str, where: str) -> str:
    """``value`` if it is a plain Hub name (letters, digits, ``.``, ``_``, ``-``), else ExecutorError."""
    if isinstance(value, str) and _NAME.match(value) and ".." not in value:
        return value
    raise ExecutorError(
        f"hf-jobs executor: {where} has {field}={value!r}, not a plain name; refusing it "
        "(run.json may have been tampered with)"
    )
