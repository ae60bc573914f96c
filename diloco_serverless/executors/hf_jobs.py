"""HFJobsExecutor: one Hugging Face Job per replica (``huggingface_hub`` ``run_job`` & co).

Each rank is a Job running ``python -m <entrypoint> <args>`` in ``image`` on ``flavor`` hardware, with
``REPLICA_RANK`` in its environment and labels ``diloco-run=<run id>``, ``diloco-rank=<r>`` so the
jobs of a run can be found on the Hub. Storage credentials travel only as Job *secrets* (encrypted
by the Hub, never shown by ``inspect_job``): the names in ``secrets`` are read from this process's
environment, and any credential-looking variable passed in ``env`` (see ``base.looks_secret``) is
moved to the secrets too. Values are never logged nor stored in handles.

Retries: ``retries`` maps to the Jobs API ``attempts`` (the Hub re-runs a failed Job); a restarted
replica heals from the store's latest checkpoint. A setup error (exit code 2, see
entrypoints/replica.py) is not retried: the Job's command prints ``SETUP_ERROR_MARKER`` and exits
0, and ``poll`` reports that Job ``failed`` with the replica's ``error: ...`` line. The Hub does not
tell a Job its attempt number, so ``DILOCO_ATTEMPT`` is not set. Stage mapping: SCHEDULING ->
pending, RUNNING and UPDATING -> running, COMPLETED -> succeeded (failed when the log ends with the setup-error
marker, continue when it ends with the continue marker), ERROR -> failed (with the Hub's status
message), CANCELED -> cancelled, DELETED -> failed, any other stage -> unknown.

Runs longer than the Job ``timeout``: the Job's shell sets ``DILOCO_ATTEMPT_DEADLINE`` to its own
start + the timeout (and the Job's environment has ``DILOCO_ATTEMPT_TIMEOUT_S``), the replica stops
before it with its state saved (exit code 75), and the shell prints :data:`CONTINUE_MARKER` and exits
0 (no attempt used); ``poll`` then reports ``continue``: whoever waits on the run starts a fresh Job
for that rank, which resumes from the saved state.

Handles (``job_id``, ``namespace``, ``endpoint``, ...) are stored in run.json, which any replica
credential can rewrite. The token is therefore only ever sent to the endpoint of *this* process
(``endpoint=``, else ``HF_ENDPOINT``, else https://huggingface.co): :meth:`HFJobsExecutor.from_handle`
refuses a handle that names another endpoint, and job ids and namespaces are checked to be plain
names before they go into a request path.

Code: by default (``install="local"``) every Job runs the code that launched it. At launch the
executor builds a wheel of the running package (``_package.build_wheel``: from a checkout or from
the installed files, deterministic, version ``<version>+src.<content hash>``), hands it to the
``code_uploader`` the launcher set (:meth:`HFJobsExecutor.set_code_uploader`; the launcher stores
it in the run's own store, ``<run>/code/<wheel>``), and each Job then installs the package's
requirements from the index (``torch`` pinned to the launcher's version, replacing the image's 2.7.1:
``_package.job_requirements``), fetches the wheel with the run's storage credentials, checks its
SHA-256 against the one in the Job's command (``_fetch_code.py``) and ``pip install``s it with
``extras``. ``install="<pip requirement>"`` installs that instead (e.g. a published release), and
``install=None`` runs an image that already has the package. An RL run's own reward modules
(:meth:`HFJobsExecutor.set_user_modules`, resolved by the launcher) go into the same wheel as top-level
modules, so they are installed, checked and versioned with the package.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from diloco_serverless.errors import ExecutorError
from diloco_serverless.executors import _fetch_code
from diloco_serverless.executors._package import build_wheel, job_requirements
from diloco_serverless.executors.base import (
    ATTEMPT_TIMEOUT_ENV,
    CODE_SHA256_ENV,
    CODE_URL_ENV,
    CODE_VERSION_ENV,
    CONTINUE_EXIT_CODE,
    CONTINUE_MARKER,
    SETUP_ERROR_MARKER,
    STORAGE_CONFIG_ENV,
    STORAGE_SECRET_ENV,
    CodeUploader,
    ExecutorUnavailable,
    ReplicaHandle,
    ReplicaResult,
    ReplicaState,
    ReplicaStatus,
    ShippedCode,
    collect_by_polling,
    ranks_to_start,
    run_id_from_url,
    run_url_from,
    setup_error_reason,
    split_secret_env,
)
from diloco_serverless.executors.credentials import gcs_key_secret
from diloco_serverless.executors.user_code import UserModule

logger = logging.getLogger(__name__)

DEFAULT_IMAGE = "pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime"
#: ``install`` value that ships the running package's code (the default).
LOCAL_CODE = "local"
DEFAULT_INSTALL = LOCAL_CODE
DEFAULT_EXTRAS = ("s3", "gcs", "hf")
#: where a Job writes the fetched wheel (expanded by the Job's shell)
CODE_DIR = "${TMPDIR:-/tmp}/diloco-code"
_SAFE = re.compile(r"^[A-Za-z0-9_.+-]+$")
#: log lines read to tell a setup error from a success once a Job is COMPLETED
_MARKER_TAIL = 40

_STAGES: dict[str, ReplicaStatus] = {
    "SCHEDULING": ReplicaStatus.PENDING,
    "RUNNING": ReplicaStatus.RUNNING,
    "UPDATING": ReplicaStatus.RUNNING,  # a running Job whose settings change: it keeps running
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
_LABEL_MAX = 63


def label_value(value: str) -> str:
    """``value`` as a Job label value: letters, digits, ``-`` and ``_`` only (the Hub stores labels
    as tags, which allow nothing else; see ``huggingface_hub._jobs_api._sanitize_job_name``), at
    most 63 characters. A value that had to change gets ``-<8 hex of its SHA-256>`` so that
    distinct run ids (``a.b`` and ``a-b``) keep distinct labels; a plain value is kept as it is."""
    clean = re.sub(r"[^A-Za-z0-9_-]+", "-", value).strip("-")
    if clean == value and 0 < len(value) <= _LABEL_MAX:
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    return f"{clean[:_LABEL_MAX - 9].rstrip('-') or 'x'}-{digest}"


def flavor_gpus(flavor: str) -> int | None:
    """GPUs per job of a Jobs hardware flavor: ``"h200x8"`` -> 8, ``"a10g-largex2"`` -> 2, ``"a100-large"``
    -> 1, ``"cpu-basic"`` -> None (the flavor names carry the count as an ``x<N>`` suffix)."""
    if flavor.startswith("cpu"):
        return None
    m = re.search(r"x(\d+)$", flavor)
    return int(m.group(1)) if m else 1


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
        retries: re-runs of a failed Job (Jobs ``attempts = retries + 1``); exit code 2 is never re-run.
        install: ``"local"`` (default): ship the running package's code (needs a code uploader, see
            :meth:`set_code_uploader`; ``diloco launch`` sets one); a pip requirement (e.g.
            ``"diloco-serverless[s3,gcs,hf]==0.1.0"`` for a published release) to install instead;
            None (or ``"none"``) when the image already has the package.
        extras: the package's extras installed with shipped code (default s3, gcs, hf).
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
        extras: Sequence[str] = DEFAULT_EXTRAS,
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
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ExecutorUnavailable(f"hf-jobs executor: retries must be an integer >= 0, got {retries!r}")
        if isinstance(install, str) and install.strip().lower() in ("", "none"):
            install = None
        if isinstance(extras, str):
            extras = [e.strip() for e in extras.split(",") if e.strip()]
        bad = [e for e in extras if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", e)]
        if bad:
            raise ExecutorUnavailable(f"hf-jobs executor: extras must be plain names, got {bad}")
        self.flavor, self.image, self.timeout = flavor, image, timeout
        #: GPUs of the flavor (``"h200x8"`` -> 8): the replica runs one local process per GPU
        #: (``parallel.devices``, set from this by the launcher); None for a CPU flavor
        self.devices_per_replica: int | None = flavor_gpus(flavor)
        self._timeout_s = timeout_seconds(timeout)
        self.retries, self.install, self.poll_interval_s = retries, install, poll_interval_s
        self.extras = tuple(extras)
        self._code_uploader: CodeUploader | None = None
        #: the user's modules (reward functions) shipped in the wheel with the package (:meth:`set_user_modules`)
        self.user_modules: tuple[UserModule, ...] = ()
        #: what the last launch shipped (None before, or when ``install`` is not "local")
        self.shipped_code: ShippedCode | None = None
        #: outcomes of COMPLETED Jobs once read (a finished Job's log does not change)
        self._final: dict[str, ReplicaState] = {}
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
            for name, value in gcs_key_secret().items():  # a GCS key file travels as its JSON text
                resolved.setdefault(name, value)
        return resolved

    @property
    def attempt_cap_s(self) -> float | None:
        """The Job ``timeout`` in seconds (None when unset: the Hub's default applies)."""
        return None if self._timeout_s is None else float(self._timeout_s)

    @property
    def secret_names(self) -> list[str]:
        """Names of the secrets every Job gets (their values are never exposed)."""
        return sorted(self._secrets)

    @property
    def namespace(self) -> str:
        """The Jobs namespace (resolved once via ``whoami`` if not given)."""
        if self._namespace is None:
            self._namespace = str(self._api.whoami()["name"])
        return self._namespace

    # --- launch -----------------------------------------------------------------------------
    def set_code_uploader(self, uploader: CodeUploader | None) -> None:
        """Where shipped code goes: ``uploader(filename, data) -> url`` stores the wheel (the launcher
        writes ``<run>/code/<filename>`` in the run's store) and returns the URL replicas read it from."""
        self._code_uploader = uploader

    def set_user_modules(self, modules: Sequence[UserModule]) -> None:
        """The user's own modules the replicas import (``rl.reward_funcs``; the launcher resolves them,
        :func:`~diloco_serverless.executors.user_code.resolve_user_modules`): with ``install="local"``
        they go into the shipped wheel as top-level modules, installed with the package in every Job."""
        self.user_modules = tuple(modules)

    def ship_code(self) -> ShippedCode:
        """Build the wheel of the running package (with :attr:`user_modules`) and upload it;
        ExecutorUnavailable without an uploader."""
        if self._code_uploader is None:
            raise ExecutorUnavailable(
                "hf-jobs executor: install='local' ships this package's code through the run's store, but no code "
                "uploader is set (diloco launch sets one; from Python call executor.set_code_uploader(fn)); or pass "
                "install='<pip requirement>' / install=None for an image that has the package")
        wheel = build_wheel(user_modules=self.user_modules)
        url = self._code_uploader(wheel.filename, wheel.data)
        if not isinstance(url, str) or not url:
            raise ExecutorError(f"hf-jobs executor: the code uploader returned {url!r}, not a URL of {wheel.filename}")
        return ShippedCode(url=url, sha256=wheel.sha256, version=wheel.version, filename=wheel.filename)

    def command(self, entrypoint: str, entrypoint_args: Sequence[str], code: ShippedCode | None = None) -> list[str]:
        """The Job command: ``bash -c`` of the install steps (per ``install``), then the replica.

        The replica runs as a child of the shell, which forwards SIGTERM (a cancelled Job) to it and
        turns its exit code 2 (a setup error) into :data:`SETUP_ERROR_MARKER` plus exit 0, so the
        Hub's ``attempts`` do not re-run it; any other code is the Job's exit code.
        """
        pip = "python -m pip install --quiet"
        steps = [
            "export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore",
            f'setup_error() {{ echo "{SETUP_ERROR_MARKER}: $1"; exit 0; }}',
        ]
        if self._timeout_s is not None:  # the Job's cap counts from here, installs included
            steps.append(f"export DILOCO_ATTEMPT_DEADLINE=$(( $(date +%s) + {self._timeout_s} ))")
        if self.install == LOCAL_CODE:
            if code is None:
                raise ExecutorError("hf-jobs executor: install='local' needs the shipped code (see ship_code)")
            if not (_SAFE.match(code.filename) and re.fullmatch(r"[0-9a-f]{64}", code.sha256)):
                raise ExecutorError(f"hf-jobs executor: unexpected wheel name or SHA-256: {code.filename!r}")
            wheel = f"{CODE_DIR}/{code.filename}"  # only safe characters: fine inside double quotes
            extras = f"[{','.join(self.extras)}]" if self.extras else ""
            steps += [
                f"echo '[diloco] installing {code.filename}: the requirements, then the shipped wheel'",
                f"{pip} {shlex.join(job_requirements(self.extras))} || exit $?",
                f'python -c {shlex.quote(_fetch_source())} {shlex.quote(code.url)} {code.sha256} "{wheel}"'
                " || { c=$?; [ \"$c\" = 2 ] && setup_error 'the shipped code was not installed'; exit \"$c\"; }",
                f'{pip} "{wheel}{extras}" || exit $?',
            ]
        elif self.install is not None:
            steps.append(f"{pip} {shlex.quote(self.install)} || exit $?")
        run = shlex.join(["python", "-m", entrypoint, *map(str, entrypoint_args)])
        steps += [
            f"{run} &",
            "pid=$!",
            "trap 'kill -TERM \"$pid\" 2>/dev/null' TERM INT",
            "while :; do wait \"$pid\"; code=$?; kill -0 \"$pid\" 2>/dev/null || break; done",
            "[ \"$code\" = 2 ] && setup_error 'the replica exited with code 2'",
            f'[ "$code" = {CONTINUE_EXIT_CODE} ] && {{ echo "{CONTINUE_MARKER}"; exit 0; }}',
            "exit \"$code\"",
        ]
        return ["bash", "-c", "\n".join(steps)]

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: str,
        entrypoint_args: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        ranks: Sequence[int] | None = None,
    ) -> list[ReplicaHandle]:
        """Ship the code (``install="local"``), then submit one Job per rank (every rank, or only
        ``ranks``); if a submission fails, cancel the submitted ones and raise."""
        chosen = ranks_to_start(n_replicas, ranks, self.kind)
        plain, secret = split_secret_env({**self._forwarded_env, **(env or {})})
        secrets = {**self._secrets, **secret}
        run_id = run_id_from_url(run_url_from(env, entrypoint_args)) or "unnamed"
        code = self.ship_code() if self.install == LOCAL_CODE else None
        if code is None and self.user_modules:
            logger.warning("hf-jobs executor: install=%r ships no code, so the replicas must already have %s",
                           self.install, "; ".join(m.describe() for m in self.user_modules))
        self.shipped_code = code
        if code is not None:
            plain.update({CODE_URL_ENV: code.url, CODE_SHA256_ENV: code.sha256, CODE_VERSION_ENV: code.version})
        if self._timeout_s is not None:
            plain[ATTEMPT_TIMEOUT_ENV] = str(self._timeout_s)
        command = self.command(entrypoint, entrypoint_args, code)
        labels = {"diloco-run": label_value(run_id)}
        handles: list[ReplicaHandle] = []
        for rank in chosen:
            try:
                job = self._api.run_job(
                    image=self.image, command=command, env={**plain, "REPLICA_RANK": str(rank)},
                    secrets=secrets or None, flavor=self.flavor, timeout=self.timeout,
                    attempts=self.retries + 1, labels={**labels, "diloco-rank": str(rank)},
                    name=label_value(f"diloco-{run_id}-rank-{rank}"), namespace=self.namespace,
                )
            except Exception as exc:
                self.cancel(handles)
                raise ExecutorError(
                    f"hf-jobs executor: submitting rank {rank} of run {run_id!r} failed ({exc}); "
                    f"cancelled the {len(handles)} job(s) already submitted"
                ) from exc
            data: dict[str, Any] = {"job_id": job.id, "namespace": self.namespace, "endpoint": self.endpoint,
                                    "url": job.url, "run_id": run_id, "label": labels["diloco-run"],
                                    "flavor": self.flavor}
            if code is not None:
                data.update(code_sha256=code.sha256, code_version=code.version)
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
        detail = {"job_id": job_id, "stage": stage, "url": f"{self.endpoint}/jobs/{ns}/{job_id}"}
        status = _STAGES.get(stage)
        if status is None:
            return ReplicaState(rank=handle.rank, status=ReplicaStatus.UNKNOWN, detail=detail,
                                reason=f"job {job_id} is in stage {stage!r}, which this version does not know")
        if status is ReplicaStatus.SUCCEEDED:
            return self._completed(handle, job_id, ns, detail)
        message = job.status.message
        reason = message
        if status is ReplicaStatus.FAILED and not reason:
            reason = f"job {job_id} ended in stage {stage}"
        return ReplicaState(rank=handle.rank, status=status, reason=reason, exit_code=_exit_code(message),
                            detail=detail)

    def _completed(self, handle: ReplicaHandle, job_id: str, ns: str, detail: dict[str, Any]) -> ReplicaState:
        """A COMPLETED Job: succeeded, or failed when its log ends with the setup-error marker."""
        known = self._final.get(job_id)
        if known is None:
            try:
                lines = [ln.rstrip("\n") for ln in self._api.fetch_job_logs(job_id=job_id, namespace=ns,
                                                                             tail=_MARKER_TAIL)]
            except Exception as exc:  # asked again at the next poll
                return ReplicaState(rank=handle.rank, status=ReplicaStatus.UNKNOWN, detail=detail,
                                    reason=f"job {job_id} completed, but its log could not be read to tell a setup "
                                    f"error from a success ({type(exc).__name__})")
            tail = "\n".join(lines)
            if any(ln.startswith(CONTINUE_MARKER) for ln in lines):
                known = ReplicaState(rank=handle.rank, status=ReplicaStatus.CONTINUE, exit_code=CONTINUE_EXIT_CODE,
                                     detail=detail, reason=f"job {job_id} stopped before its {self.timeout} timeout "
                                     "with its state saved; start a fresh Job of this rank to continue")
            elif any(ln.startswith(SETUP_ERROR_MARKER) for ln in lines):
                known = ReplicaState(rank=handle.rank, status=ReplicaStatus.FAILED, exit_code=2, detail=detail,
                                     reason=f"setup error, not retried: {setup_error_reason(tail)}")
            else:
                known = ReplicaState(rank=handle.rank, status=ReplicaStatus.SUCCEEDED, exit_code=0, detail=detail)
            self._final[job_id] = known
        return ReplicaState(rank=handle.rank, status=known.status, reason=known.reason, exit_code=known.exit_code,
                            detail=detail)

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


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def timeout_seconds(timeout: int | float | str | None) -> int | None:
    """A Job ``timeout`` in whole seconds, read as the Jobs API does (a number of seconds, or a string
    with a unit: ``"90m"``, ``"12h"``, ``"2d"``); None for none. ExecutorUnavailable when unreadable."""
    if timeout is None or timeout == "":
        return None
    try:
        if isinstance(timeout, str) and timeout.strip()[-1:] in _UNITS:
            seconds = int(float(timeout.strip()[:-1]) * _UNITS[timeout.strip()[-1]])
        elif isinstance(timeout, bool):
            raise ValueError
        else:
            seconds = int(float(timeout))
    except (ValueError, OverflowError):
        seconds = 0
    if seconds <= 0:
        raise ExecutorUnavailable(f"hf-jobs executor: timeout must be seconds above 0 or a string like '90m', "
                                  f"'12h' or '2d', got {timeout!r}")
    return seconds


def _fetch_source() -> str:
    """The text of ``_fetch_code.py``, run with ``python -c`` in a Job before the package is installed."""
    return Path(_fetch_code.__file__).read_text("utf-8")


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
