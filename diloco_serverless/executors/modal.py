"""ModalExecutor: one Modal function call per replica, on a GPU, with retries on preemption.

The executor builds a Modal App with one GPU function (``run_replica``, wrapping
:func:`~diloco_serverless.executors._remote.run_replica_process`) from library code, runs the App
*detached* and ``spawn``s the function once per rank, so the replicas keep running after the
launching process exits. Handles carry the ``FunctionCall`` id; any process with Modal credentials
can poll (``FunctionCall.get(timeout=0)``), cancel or read logs later.

Alternatively deploy the App once (``modal deploy -m diloco_serverless.entrypoints.modal_app``) and
pass ``deployed_app="diloco-serverless"``: launches then use ``Function.from_name``, with this
launch's GPU, secrets, timeout and retries (``retries=0`` included) set by ``with_options``.

Image: ``debian_slim`` (this Python version) with this package's requirements (from the checkout's
pyproject.toml, or the installed metadata; ``torch`` pinned to the version the launcher runs) plus the
source of the running package (``Image.add_local_python_source``, which works for a checkout and
for an installed package in site-packages, pipx or ``uv tool`` alike): every replica runs the code
that launched it. Installing a published release instead is explicit: ``local_source=False`` pip-installs
``diloco-serverless[<extras>]==<this version>``, ``package=`` names any pip requirement, or pass
your own ``image``. An RL run's own reward modules (:meth:`ModalExecutor.set_user_modules`) are added
to whichever image at ``/root/<name>`` (:func:`add_user_modules`). Launches run inside
``modal.enable_output()`` (``show_output=True``), so the first image build shows its progress.
Storage credentials reach the containers only through Modal Secrets that you create and name in
``secrets`` (``modal secret create ...``): credential-looking variables in ``env`` are dropped with a
warning instead of being sent.

Failure mapping: a replica exiting non-zero raises ReplicaProcessError remotely; Modal retries it
(``modal.Retries``, also after preemption) and reports ``failed`` once retries are exhausted, with
the exit code and output tail. Exit code 2 (a setup error) is returned as the call's result instead,
so Modal does not retry it, and is ``failed`` with the replica's ``error:`` line. A function timeout
is ``failed`` ("timed out"); a cancelled call is ``cancelled``. A call waiting for a container is
``pending`` and one with a container ``running`` (from ``FunctionCall.get_call_graph``); when Modal
cannot say, or no longer keeps the result (``OutputExpiredError``), the state is ``unknown`` with the
reason, and callers defer to the replica's heartbeat in the store.

Runs longer than a call's cap (``timeout_s``, at most 24 h): each call tells its replica the call's
deadline (its start + ``timeout_s``), the replica stops before it with its state saved (exit code
75), and the call starts the next call of the same function itself and returns ``{"exit_code": 75,
"next_call_id": "fc-..."}`` (see :mod:`~diloco_serverless.executors._remote`): a chain of calls per
rank, none of which uses a retry. The handle keeps the first call; ``poll``, ``logs`` and ``cancel``
follow ``next_call_id`` to the latest (each id checked, at most :data:`MAX_CHAIN_CALLS` calls).
Modal does not tell a container its retry number, so ``DILOCO_ATTEMPT`` is the call's place in the
chain (a retried call keeps its number).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from diloco_serverless import __version__
from diloco_serverless.config import RUN_KEY_ENV
from diloco_serverless.errors import ExecutorError
from diloco_serverless.executors import _package
from diloco_serverless.executors._package import (
    DIST_NAME,
    IMPORT_NAME,
    job_requirements,
    package_requirements,
    source_checkout_root,
)
from diloco_serverless.executors._remote import CALL_TIMEOUT_ENV, FUNCTION_ID_ENV, run_replica_process
from diloco_serverless.executors.base import (
    CONTINUE_EXIT_CODE,
    SETUP_ERROR_EXIT_CODE,
    ExecutorUnavailable,
    ReplicaHandle,
    ReplicaResult,
    ReplicaState,
    ReplicaStatus,
    collect_by_polling,
    ranks_to_start,
    run_id_from_url,
    run_url_from,
    split_secret_env,
)
from diloco_serverless.executors.credentials import storage_config_env
from diloco_serverless.executors.user_code import MODAL_ROOT, UserModule

__all__ = ["DIST_NAME", "ModalExecutor", "add_user_modules", "build_app", "default_image", "function_options",
           "normalize_gpu",
           "package_requirements", "ships_local_source", "source_checkout_root"]

logger = logging.getLogger(__name__)

FUNCTION_NAME = "run_replica"
DEFAULT_APP_NAME = "diloco-serverless"
MODAL_GPUS = ("T4", "L4", "A10", "A10G", "A100", "A100-40GB", "A100-80GB", "L40S", "H100", "H100!", "H200",
              "B200", "B200+")
MAX_TIMEOUT_S = 24 * 3600
MAX_RETRIES = 10
_CALL_ID = re.compile(r"^fc-[A-Za-z0-9]{1,64}$")
#: the most calls a replica's chain may have (a 24 h cap: 1000 days; a 1 h cap: 41 days)
MAX_CHAIN_CALLS = 1000
#: the most log entries ``FunctionCall.logs.tail`` gives (modal ``_logs._FETCH_LIMIT``; more raises LogsFetchError)
MAX_LOG_ENTRIES = 20_000


#: how the calls of a launch live on after the launching process exits, by App mode (docs/executors.md,
#: "Detached or deployed")
APP_MODES = {
    "detached": "an App run with detach=True for this launch: its calls keep running after this process exits; "
                "`diloco doctor --executor modal` checks that on your account",
    "deployed": "a deployed App (modal deploy): its calls do not depend on any launching process",
}


def import_modal() -> Any:
    """The ``modal`` SDK, or ExecutorUnavailable naming the extra to install."""
    try:
        import modal
    except ImportError as exc:
        raise ExecutorUnavailable("modal executor needs the Modal SDK: pip install 'diloco-serverless[modal]'") from exc
    return modal


def modal_credentials_present() -> bool:
    """True if MODAL_TOKEN_ID and MODAL_TOKEN_SECRET are set or a Modal config file exists."""
    if os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET"):
        return True
    return Path(os.environ.get("MODAL_CONFIG_PATH") or "~/.modal.toml").expanduser().is_file()


def normalize_gpu(gpu: str | None) -> str | None:
    """Canonical Modal GPU string (``"a100-80gb:2"`` -> ``"A100-80GB:2"``); ExecutorUnavailable if unknown.

    ``None`` (or "cpu") means a CPU-only container (smoke tests, tiny models).
    """
    if gpu is None or gpu.strip().lower() in ("", "cpu", "none"):
        return None
    base, sep, count = gpu.strip().partition(":")
    canonical = base.upper()
    if canonical not in MODAL_GPUS or (sep and not (count.isdigit() and 1 <= int(count) <= 8)):
        raise ExecutorUnavailable(
            f"modal executor: unknown GPU {gpu!r}; use one of {', '.join(MODAL_GPUS)} (optionally ':N', N <= 8)"
        )
    return f"{canonical}:{count}" if sep else canonical


def gpu_count(gpu: str | None) -> int | None:
    """GPUs per replica of a canonical Modal GPU string (``"H100:8"`` -> 8, ``"H100"`` -> 1, None -> None)."""
    if gpu is None:
        return None
    _, sep, count = gpu.partition(":")
    return int(count) if sep else 1


def ships_local_source(local_source: bool | None, package: str | None = None) -> bool:
    """Resolve ``local_source``: True/False as given; None (the default, "auto") ships the running
    package's source unless a ``package`` to pip-install is named."""
    if local_source is not None:
        return bool(local_source)
    return package is None


def default_image(modal: Any, *, extras: Sequence[str] = ("s3", "gcs"), package: str | None = None,
                  local_source: bool | None = None, python_version: str | None = None) -> Any:
    """``Image.debian_slim`` with this package's requirements and the source of the running package
    (:func:`ships_local_source`), or with ``package`` / ``diloco-serverless[extras]==<version>``
    pip-installed when asked for explicitly."""
    py = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    image = modal.Image.debian_slim(python_version=py)
    if ships_local_source(local_source, package):
        root = source_checkout_root()
        where = f"the checkout {root}" if root is not None else f"the installed package at {_package.PACKAGE_DIR}"
        logger.info("modal executor: shipping the source of %s from %s to the image", DIST_NAME, where)
        return image.pip_install(*job_requirements(extras)).add_local_python_source(IMPORT_NAME)
    spec = package or f"{DIST_NAME}[{','.join(extras)}]=={__version__}"
    return image.pip_install(spec)


def add_user_modules(image: Any, modules: Sequence[UserModule]) -> Any:
    """``image`` with the user's modules at ``/root/<name>`` (a file: ``Image.add_local_file``; a package
    folder: ``Image.add_local_dir``, every file but dot-files, caches and bytecode), where
    ``add_local_python_source`` puts this package: the containers' working directory, so the replica
    (``python -m``) imports them by name. Mounted at container start (``copy=False``), as the package is."""
    for module in modules:
        logger.info("modal executor: shipping the user's %s to the image", module.describe())
        if module.is_package:
            image = image.add_local_dir(module.path, f"{MODAL_ROOT}/{module.name}", ignore=_not_shipped)
        else:
            image = image.add_local_file(module.path, f"{MODAL_ROOT}/{module.path.name}")
    return image


def _not_shipped(path: Path) -> bool:
    """``add_local_dir``'s ignore predicate (a path relative to the folder): what
    :meth:`UserModule.files` leaves out."""
    return any(p.startswith(".") or p == "__pycache__" for p in path.parts) or path.suffix in (".pyc", ".pyo")


def function_options(
    modal: Any, *, gpu: str | None, secrets: Sequence[str], timeout_s: int, retries: int
) -> dict[str, Any]:
    """Keyword arguments for ``app.function`` / ``Function.with_options`` (GPU, secrets, timeout, retries).

    ``retries`` is always a ``modal.Retries``, 0 included: ``with_options(retries=None)`` would keep
    the deployed function's own policy."""
    policy = modal.Retries(max_retries=retries, backoff_coefficient=2.0, initial_delay=10.0)
    return {
        "gpu": gpu,
        "secrets": [modal.Secret.from_name(name) for name in secrets],
        "timeout": int(timeout_s),
        "retries": policy,
    }


def build_app(modal: Any, *, app_name: str, image: Any, gpu: str | None, secrets: Sequence[str], timeout_s: int,
              retries: int) -> tuple[Any, Any]:
    """A Modal App with the GPU function ``run_replica``; returns ``(app, function)``.

    The function is registered ``serialized=True`` from library code: the container imports
    :func:`run_replica_process` from the package installed in the image.
    """
    app = modal.App(app_name)
    opts = function_options(modal, gpu=gpu, secrets=secrets, timeout_s=timeout_s, retries=retries)
    fn = app.function(image=image, serialized=True, name=FUNCTION_NAME, include_source=False, **opts)(
        run_replica_process
    )
    return app, fn


def lookup_secrets(modal: Any, names: Sequence[str], environment_name: str | None = None) -> None:
    """Look each named Modal Secret up (one request each) before anything is created or billed.

    Raises ExecutorUnavailable naming the first secret Modal does not have (with the
    ``modal secret create`` command that makes it) or that could not be looked up."""
    for name in names:
        where = {"environment_name": environment_name} if environment_name else {}
        try:
            modal.Secret.from_name(name, **where).hydrate()
        except modal.exception.NotFoundError:
            env_flag = f" --env {environment_name}" if environment_name else ""
            raise ExecutorUnavailable(
                f"modal executor: there is no Modal Secret named {name!r}"
                f"{f' in environment {environment_name!r}' if environment_name else ''}; create it with "
                f"`modal secret create{env_flag} {name} AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...` "
                f"(GCS: GOOGLE_APPLICATION_CREDENTIALS_JSON=\"$(cat key.json)\") or fix the name in --secret"
            ) from None
        except Exception as exc:  # auth, network: the launch cannot go on either way
            raise ExecutorUnavailable(
                f"modal executor: could not look up the Modal Secret {name!r} ({type(exc).__name__}: "
                f"{str(exc).strip()[:200]}); check `modal token info` and your network"
            ) from None


class ModalExecutor:
    """Launch replicas as Modal function calls on GPUs.

    Args:
        gpu: Modal GPU type, e.g. "A100", "H100", "A100-80GB:2"; None for a CPU-only container.
        image: a ``modal.Image``; default :func:`default_image`.
        secrets: names of Modal Secrets holding storage credentials (``modal secret create NAME K=V``).
        timeout_s: per-attempt limit of a replica (Modal allows up to 24 h).
        retries: re-runs after a failure or preemption (``modal.Retries``, at most 10).
        app_name: name of the ephemeral App (default ``diloco-<run id>``).
        deployed_app: launch against this deployed App's ``run_replica`` instead of building one.
        extras / package / python_version: see :func:`default_image`.
        local_source: ship the running package's source (True; None/"auto", the default, does too
            unless ``package`` is named), or pip-install the published ``diloco-serverless==<version>`` (False).
        environment_name: Modal environment (default: the profile's).
        show_output: run the launch inside ``modal.enable_output()`` (image build progress, App URL).
        poll_interval_s: how often ``collect`` polls.

    Raises ExecutorUnavailable (before anything is launched or billed) without the SDK, without
    credentials, or for an unknown GPU / out-of-range timeout or retries.
    """

    kind = "modal"

    def __init__(
        self,
        gpu: str | None = "A100",
        image: Any = None,
        secrets: Sequence[str] = (),
        timeout_s: int = MAX_TIMEOUT_S,
        retries: int = 3,
        *,
        app_name: str | None = None,
        deployed_app: str | None = None,
        extras: Sequence[str] = ("s3", "gcs"),
        package: str | None = None,
        local_source: bool | str | None = None,
        python_version: str | None = None,
        environment_name: str | None = None,
        show_output: bool = True,
        poll_interval_s: float = 10.0,
    ) -> None:
        self._modal = import_modal()
        if not modal_credentials_present():
            raise ExecutorUnavailable(
                "modal executor: no Modal credentials; set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET "
                "or run `modal token new` (writes ~/.modal.toml)"
            )
        self.gpu = normalize_gpu(gpu)
        #: GPUs per replica (``"H100:8"`` -> 8): the replica runs one local process per GPU
        #: (``parallel.devices``, set from this by the launcher); None for a CPU-only container
        self.devices_per_replica: int | None = gpu_count(self.gpu)
        if not 1 <= int(timeout_s) <= MAX_TIMEOUT_S:
            raise ExecutorUnavailable(f"modal executor: timeout_s must be in 1..{MAX_TIMEOUT_S}, got {timeout_s}")
        if not 0 <= retries <= MAX_RETRIES:
            raise ExecutorUnavailable(f"modal executor: retries must be in 0..{MAX_RETRIES}, got {retries}")
        if isinstance(secrets, str):
            secrets = [secrets]
        if isinstance(local_source, str) and local_source.strip().lower() == "auto":
            local_source = None  # -x local_source=auto
        if local_source is not None and not isinstance(local_source, bool):
            raise ExecutorUnavailable(f"modal executor: local_source must be true, false or auto, got {local_source!r}")
        self.image, self.secrets, self.timeout_s, self.retries = image, list(secrets), int(timeout_s), retries
        self.app_name, self.deployed_app, self.environment_name = app_name, deployed_app, environment_name
        self._image_options: dict[str, Any] = {
            "extras": tuple(extras), "package": package, "local_source": local_source, "python_version": python_version,
        }
        self.poll_interval_s, self.show_output = poll_interval_s, bool(show_output)
        #: first call id -> (latest call id, its index) of each rank's chain of calls seen so far
        self._chains: dict[str, tuple[str, int]] = {}
        #: the user's modules (reward functions) added to the image (:meth:`set_user_modules`)
        self.user_modules: tuple[UserModule, ...] = ()

    @classmethod
    def from_handle(cls, handle: ReplicaHandle, *, run_url: str | None = None, **options: Any) -> ModalExecutor:
        """An executor able to poll/cancel/read ``handle`` (credentials from the environment).

        The handle comes from run.json, which any replica credential can rewrite. Where Modal
        credentials go (server, profile, environment) comes only from this process's Modal config
        and ``options``; from the handle only the GPU (informational, ignored unless valid) and,
        per call, a well-formed ``function_call_id`` are used.
        """
        gpu = handle.data.get("gpu")
        try:
            options.setdefault("gpu", normalize_gpu(gpu) if isinstance(gpu, str) else None)
        except ExecutorUnavailable:
            options.setdefault("gpu", None)
        return cls(**options)

    @property
    def attempt_cap_s(self) -> float | None:
        """Modal's function timeout ``timeout_s``: every call ends there (a chain of calls continues the run)."""
        return float(self.timeout_s)

    # --- launch -----------------------------------------------------------------------------
    def set_user_modules(self, modules: Sequence[UserModule]) -> None:
        """The user's own modules the replicas import (``rl.reward_funcs``; the launcher resolves them,
        :func:`~diloco_serverless.executors.user_code.resolve_user_modules`): each launch adds them to the
        image (:func:`add_user_modules`, the default image or yours); a deployed App keeps its own image."""
        self.user_modules = tuple(modules)

    def _function(self, run_id: str) -> tuple[Any, Any]:
        modal = self._modal
        if self.deployed_app:
            if self.user_modules:
                logger.warning("modal executor: the deployed App %r runs the image it was deployed with, so it must "
                               "already have %s (redeploy from where they import, or launch without deployed_app)",
                               self.deployed_app, "; ".join(m.describe() for m in self.user_modules))
            fn = modal.Function.from_name(self.deployed_app, FUNCTION_NAME, environment_name=self.environment_name)
            opts = function_options(modal, gpu=self.gpu, secrets=self.secrets, timeout_s=self.timeout_s,
                                    retries=self.retries)
            return None, fn.with_options(**opts)
        image = self.image if self.image is not None else default_image(modal, **self._image_options)
        image = add_user_modules(image, self.user_modules)
        return build_app(modal, app_name=self.app_name or f"diloco-{run_id}", image=image, gpu=self.gpu,
                         secrets=self.secrets, timeout_s=self.timeout_s, retries=self.retries)

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: str,
        entrypoint_args: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        ranks: Sequence[int] | None = None,
    ) -> list[ReplicaHandle]:
        """Spawn one call of ``run_replica`` per rank (every rank, or only ``ranks``) in a detached App
        (or the deployed one)."""
        chosen = ranks_to_start(n_replicas, ranks, self.kind)
        # endpoints and regions (R2, MinIO) reach the replicas as plain settings; credentials never do
        plain, dropped = split_secret_env({**storage_config_env(), **(env or {})})
        if RUN_KEY_ENV in dropped:
            # The run key is made for this run alone and must reach every replica: it travels in the
            # call's inputs (Modal keeps those with the call, never in an image, a log or the store).
            plain[RUN_KEY_ENV] = dropped.pop(RUN_KEY_ENV)
        if dropped:
            logger.warning("modal executor: not sending credential variable(s) %s to Modal; put them in a Modal "
                           "Secret and pass its name in secrets=[...]", sorted(dropped))
        run_id = run_id_from_url(run_url_from(env, entrypoint_args)) or "unnamed"
        app, fn = self._function(run_id)
        args = [str(a) for a in entrypoint_args]
        with self._output():
            if app is None:
                calls = self._spawn_all(fn, chosen, entrypoint, args, plain)
                app_id, app_name = None, self.deployed_app
            else:
                with app.run(detach=True, environment_name=self.environment_name):
                    calls = self._spawn_all(fn, chosen, entrypoint, args, plain)
                    app_id, app_name = app.app_id, app.name
        mode = "detached" if app is not None else "deployed"
        logger.info("modal executor: %d call(s) of %s in the %s App %s (%s)", len(calls), FUNCTION_NAME, mode,
                    app_name, APP_MODES[mode])
        return [
            ReplicaHandle(kind=self.kind, rank=rank, data={
                "function_call_id": fc.object_id, "app_id": app_id, "app_name": app_name, "app_mode": mode,
                "gpu": self.gpu, "run_id": run_id})
            for rank, fc in zip(chosen, calls)
        ]

    @contextlib.contextmanager
    def _output(self) -> Iterator[None]:
        """``modal.enable_output()`` (the App's URL, the image build, the replicas' first log lines)
        unless ``show_output=False``.

        With output enabled, ``App.run`` streams the App's logs and, on leaving, waits up to Modal's
        ``logs_timeout`` (10 s) for them to end, then warns "Timed out waiting for final app logs".
        A detached App's logs end only with the run, so that warning is expected here and dropped."""
        if not self.show_output:
            yield
            return
        modal_logger = logging.getLogger("modal-client")
        quiet = _DropMessage("Timed out waiting for final app logs")
        modal_logger.addFilter(quiet)
        try:
            with self._modal.enable_output():
                yield
        finally:
            modal_logger.removeFilter(quiet)

    def _spawn_all(self, fn: Any, ranks: list[int], entrypoint: str, args: list[str], env: dict[str, str]) -> list[Any]:
        calls: list[Any] = []
        env = {**env, **self._chain_env(fn)}
        for rank in ranks:
            try:
                calls.append(fn.spawn(rank, entrypoint, args, env))
            except Exception as exc:
                for fc in calls:
                    fc.cancel()
                raise ExecutorError(
                    f"modal executor: spawning rank {rank} failed ({exc}); cancelled the {len(calls)} call(s) "
                    "already spawned"
                ) from exc
        return calls

    def _chain_env(self, fn: Any) -> dict[str, str]:
        """What a call needs to tell its replica the deadline and to start the next call of its chain:
        the function's timeout, the chain index 0 and the function's object id."""
        env = {CALL_TIMEOUT_ENV: str(self.timeout_s), "DILOCO_ATTEMPT": "0"}
        function_id = _function_id(fn)
        if function_id is None:
            logger.warning("modal executor: the function has no object id here; replicas reaching the %d s timeout "
                           "will be retried instead of continued in a fresh call", self.timeout_s)
        else:
            env[FUNCTION_ID_ENV] = function_id
        return env

    # --- observe ----------------------------------------------------------------------------
    def _call_id(self, handle: ReplicaHandle) -> str:
        call_id = handle.data.get("function_call_id")
        if not isinstance(call_id, str) or not _CALL_ID.match(call_id):
            raise ExecutorError(
                f"modal executor: rank {handle.rank}'s handle has function_call_id={call_id!r}, not a Modal call id "
                "(fc-...); refusing it (run.json may have been tampered with)"
            )
        return call_id

    def _call(self, handle: ReplicaHandle) -> Any:
        """The latest call of ``handle``'s chain (see :meth:`_latest`)."""
        return self._modal.FunctionCall.from_id(self._latest(handle)[0])

    def _chain_tail(self, handle: ReplicaHandle) -> tuple[str, int]:
        """``(call id, index)`` of the newest call of the rank's chain this executor has seen."""
        first = self._call_id(handle)
        return self._chains.get(first, (first, 0))

    def _link(self, handle: ReplicaHandle, next_id: object, index: int) -> tuple[str, int]:
        """Record that call ``index`` of the chain handed over to ``next_id``; ExecutorError when that is
        not a Modal call id or the chain is longer than MAX_CHAIN_CALLS."""
        if not isinstance(next_id, str) or not _CALL_ID.match(next_id):
            raise ExecutorError(f"modal executor: rank {handle.rank}'s call {index} of its chain returned "
                                f"next_call_id={next_id!r}, not a Modal call id (fc-...); refusing to follow it")
        if index + 1 >= MAX_CHAIN_CALLS:
            raise ExecutorError(f"modal executor: rank {handle.rank}'s chain of calls is longer than "
                                f"{MAX_CHAIN_CALLS}; not following it further (raise timeout_s)")
        self._chains[self._call_id(handle)] = (next_id, index + 1)
        return next_id, index + 1

    def _latest(self, handle: ReplicaHandle) -> tuple[str, int]:
        """``(call id, index)`` of the latest call of the rank's chain: follows ``next_call_id`` from
        every call that ended handing over (``exit_code`` 75), at most MAX_CHAIN_CALLS."""
        call_id, index = self._chain_tail(handle)
        for _ in range(MAX_CHAIN_CALLS):
            try:
                result = self._modal.FunctionCall.from_id(call_id).get(timeout=0)
            except (Exception, self._modal.exception.InputCancellation):  # running, failed, cancelled, expired:
                break  # it is the latest (InputCancellation is a BaseException)
            next_id = _next_call_id(result)
            if next_id is None:
                break
            call_id, index = self._link(handle, next_id, index)
        return call_id, index

    def poll(self, handles: Sequence[ReplicaHandle]) -> list[ReplicaState]:
        """``FunctionCall.get(timeout=0)`` per rank (of the latest call of its chain), with Modal's
        outcomes mapped to states."""
        return [self._state(h) for h in handles]

    def _state(self, handle: ReplicaHandle) -> ReplicaState:
        """The state of the latest call of the rank's chain: a call that handed over to a next one
        (``continue`` with ``next_call_id``) is followed, at most MAX_CHAIN_CALLS calls."""
        while True:
            call_id, index = self._chain_tail(handle)
            state = self._call_state(handle, call_id, index)
            if state.status is not ReplicaStatus.CONTINUE or "next_call_id" not in state.detail:
                return state
            try:
                self._link(handle, state.detail["next_call_id"], index)
            except ExecutorError as exc:  # _link bounds the loop
                return ReplicaState(rank=handle.rank, status=ReplicaStatus.FAILED, attempt=index,
                                    reason=str(exc).removeprefix("modal executor: "), detail=dict(state.detail))

    def _call_state(self, handle: ReplicaHandle, call_id: str, index: int) -> ReplicaState:
        """The state of call ``index`` of the rank's chain; a call that ended handing over to the next
        one is ``continue`` with ``next_call_id`` in its detail."""
        exc_mod = self._modal.exception
        rank, detail = handle.rank, {"function_call_id": call_id, "chain_index": index}

        def state(status: ReplicaStatus, reason: str | None = None, code: int | None = None,
                  **more: Any) -> ReplicaState:
            return ReplicaState(rank=rank, status=status, reason=reason, exit_code=code, attempt=index,
                                detail={**detail, **more})

        call = self._modal.FunctionCall.from_id(call_id)
        try:
            result = call.get(timeout=0)
        except exc_mod.FunctionTimeoutError as exc:
            return state(ReplicaStatus.FAILED, f"timed out after the Modal function timeout ({exc})")
        except exc_mod.OutputExpiredError:
            return state(ReplicaStatus.UNKNOWN, "the call ended, but Modal no longer keeps its result (older than its "
                         "retention); the replica's heartbeat in the store tells how it ended", ended=True)
        except (TimeoutError, exc_mod.TimeoutError):  # ``get(timeout=0)`` of a call still running raises the
            return self._unfinished(call, state)       # builtin TimeoutError (modal ``_Invocation.poll_function``)
        except exc_mod.InputCancellation:
            return state(ReplicaStatus.CANCELLED, "cancelled")
        except exc_mod.RemoteError as exc:
            text = str(exc)
            if re.search(r"cancel|terminat", text, re.IGNORECASE):
                return state(ReplicaStatus.CANCELLED, f"cancelled ({text.strip()[:200]})")
            return state(ReplicaStatus.FAILED, f"remote error: {text.strip()[:500]}")
        except exc_mod.NotFoundError as exc:
            return state(ReplicaStatus.FAILED, f"function call {detail['function_call_id']} not found: {exc}")
        except (exc_mod.AuthError, exc_mod.ConnectionError) as exc:
            raise ExecutorError(f"modal executor: polling rank {rank} failed: {exc}") from exc
        except Exception as exc:  # the replica's own exception, re-raised locally by Modal
            return state(ReplicaStatus.FAILED, _first_line(exc), _exit_code(str(exc)))
        code = result.get("exit_code", 0) if isinstance(result, Mapping) else 0
        if code in (0, None):
            return state(ReplicaStatus.SUCCEEDED, code=0)
        if code == CONTINUE_EXIT_CODE:
            next_id = _next_call_id(result)
            if next_id is None:  # no next call: whoever waits on the run starts a fresh attempt
                return state(ReplicaStatus.CONTINUE, "stopped before the call's deadline with its state saved; "
                             "start a fresh attempt of this rank", CONTINUE_EXIT_CODE)
            return state(ReplicaStatus.CONTINUE, f"continued in call {next_id}", CONTINUE_EXIT_CODE,
                         next_call_id=next_id)
        why = str(result.get("reason") or f"exited with code {code}")
        if code == SETUP_ERROR_EXIT_CODE:
            why = f"setup error, not retried: {why}"
        return state(ReplicaStatus.FAILED, why, int(code) if isinstance(code, int) else None)

    @staticmethod
    def _unfinished(call: Any, state: Callable[..., ReplicaState]) -> ReplicaState:
        """A call without a result yet: ``running`` once a container took its input, ``pending`` while
        it waits for one (``FunctionCall.get_call_graph``), ``unknown`` when Modal does not say."""
        try:
            graph = list(call.get_call_graph())
        except Exception as exc:  # best effort: the call graph is not a promise of Modal's
            return state(ReplicaStatus.UNKNOWN, f"not finished; Modal did not say whether it is queued or running "
                         f"({type(exc).__name__})")
        mine = [i for i in _walk_call_graph(graph) if getattr(i, "function_call_id", None) == call.object_id]
        if not mine:
            return state(ReplicaStatus.UNKNOWN, "not finished; Modal did not say whether it is queued or running")
        if any(getattr(i, "task_id", "") for i in mine):
            return state(ReplicaStatus.RUNNING)
        return state(ReplicaStatus.PENDING, "queued: waiting for a container")

    def collect(
        self, handles: Sequence[ReplicaHandle], timeout: float | timedelta | None = None
    ) -> list[ReplicaResult]:
        """Wait for every call; raise ReplicaFailedError naming failed ranks with their log tails."""
        return collect_by_polling(self, handles, timeout, poll_interval_s=self.poll_interval_s)

    def logs(self, handle: ReplicaHandle, tail: int | None = 200) -> str:
        """The last ``tail`` log lines of the latest call of the rank's chain (``FunctionCall.logs.tail``;
        at most :data:`MAX_LOG_ENTRIES`, the SDK's own cap: a larger ``tail`` gives that many)."""
        wanted = MAX_LOG_ENTRIES if not tail or tail <= 0 else min(int(tail), MAX_LOG_ENTRIES)
        if tail and tail > MAX_LOG_ENTRIES:
            logger.info("modal executor: Modal gives at most the last %d log entries of a call; asked for %d",
                        MAX_LOG_ENTRIES, tail)
        entries = self._call(handle).logs.tail(entries=wanted)
        return "\n".join(str(getattr(e, "message", e)).rstrip("\n") for e in entries)

    def cancel(self, handles: Sequence[ReplicaHandle]) -> None:
        """``FunctionCall.cancel(terminate_containers=True)`` of the latest call of every rank's chain
        (again for a call that the cancelled one started meanwhile); errors name the rank."""
        errors = []
        for h in handles:
            try:
                self._cancel_chain(h)
            except Exception as exc:
                errors.append(f"rank {h.rank} ({h.data.get('function_call_id')}): {exc}")
        if errors:
            raise ExecutorError("modal executor: could not cancel " + "; ".join(errors))


    def _cancel_chain(self, handle: ReplicaHandle) -> None:
        cancelled: set[str] = set()
        for _ in range(3):  # a call handing over while cancelled: its successor is cancelled as well
            call_id, _index = self._latest(handle)
            if call_id in cancelled:
                return
            self._modal.FunctionCall.from_id(call_id).cancel(terminate_containers=True)
            cancelled.add(call_id)


def _function_id(fn: Any) -> str | None:
    """The object id (``fu-...``) of a Modal function, hydrating it if needed; None when it has none."""
    for attempt in range(2):
        try:
            value = fn.object_id
        except Exception:
            value = None
        if isinstance(value, str) and value:
            return value
        hydrate = getattr(fn, "hydrate", None)
        if attempt or not callable(hydrate):
            return None
        try:
            hydrate()
        except Exception:
            return None
    return None


def _walk_call_graph(nodes: Sequence[Any]) -> Iterator[Any]:
    """Every input of a call graph, depth first: a call spawned inside a container (the next call of a
    chain) is one of its parent input's ``children``, not a top-level input."""
    stack, seen = list(reversed(list(nodes))), 0
    while stack and seen < 100_000:
        node = stack.pop()
        seen += 1
        yield node
        stack.extend(reversed(list(getattr(node, "children", None) or ())))


def _next_call_id(result: object) -> object:
    """The ``next_call_id`` of a call's result that handed over to a next call (exit code 75), else None."""
    if isinstance(result, Mapping) and result.get("exit_code") == CONTINUE_EXIT_CODE:
        return result.get("next_call_id")
    return None


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefix)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _exit_code(text: str) -> int | None:
    match = re.search(r"exited with code (-?\d+)", text)
    return int(match.group(1)) if match else None
