"""ModalExecutor: one Modal function call per replica, on a GPU, with retries on preemption.

The executor builds a Modal App with one GPU function (``run_replica``, wrapping
:func:`~diloco_serverless.executors._remote.run_replica_process`) from library code, runs the App
*detached* and ``spawn``s the function once per rank, so the replicas keep running after the
launching process exits. Handles carry the ``FunctionCall`` id; any process with Modal credentials
can poll (``FunctionCall.get(timeout=0)``), cancel or read logs later.

Alternatively deploy the App once (``modal deploy -m diloco_serverless.entrypoints.modal_app``) and
pass ``deployed_app="diloco-serverless"``: launches then use ``Function.from_name``.

Image: ``debian_slim`` (this Python version) with this package's requirements plus the local
source when it runs from a source checkout (``local_source=None``, the default, detects this:
the package's parent folder holds a pyproject.toml naming diloco-serverless), else with
``diloco-serverless[<extras>]==<this version>`` pip-installed; ``local_source=True``/``False``
forces either, ``package=`` names another pip requirement, or pass any ``image``. Storage
credentials reach the containers only through Modal Secrets that you create and name in
``secrets`` (``modal secret create ...``): credential-looking variables in ``env`` are dropped
with a warning instead of being sent.

Failure mapping: a replica exiting non-zero raises ReplicaProcessError remotely; Modal retries it
(``modal.Retries``, also after preemption) and reports ``failed`` once retries are exhausted, with
the exit code and output tail. A function timeout is ``failed`` ("timed out"); a cancelled call is
``cancelled``; an expired result (Modal keeps outputs for a limited time) is ``failed`` with that reason.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

from diloco_serverless import __version__
from diloco_serverless.config import (
    RUN_KEY_ENV,
    tomllib,  # the stdlib module, or tomli on 3.10
)
from diloco_serverless.errors import ExecutorError
from diloco_serverless.executors._remote import run_replica_process
from diloco_serverless.executors.base import (
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

logger = logging.getLogger(__name__)

FUNCTION_NAME = "run_replica"
DEFAULT_APP_NAME = "diloco-serverless"
MODAL_GPUS = ("T4", "L4", "A10", "A10G", "A100", "A100-40GB", "A100-80GB", "L40S", "H100", "H100!", "H200",
              "B200", "B200+")
MAX_TIMEOUT_S = 24 * 3600
MAX_RETRIES = 10
_CALL_ID = re.compile(r"^fc-[A-Za-z0-9]{1,64}$")


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


#: The folder of the imported ``diloco_serverless`` package (tests point it elsewhere).
PACKAGE_DIR = Path(__file__).resolve().parents[1]
DIST_NAME = "diloco-serverless"


def source_checkout_root(package_dir: Path | None = None) -> Path | None:
    """The checkout holding ``package_dir`` (default :data:`PACKAGE_DIR`), or None.

    A checkout is a parent folder with a ``pyproject.toml`` whose ``[project] name`` is
    diloco-serverless (an editable install or ``PYTHONPATH=.``); a wheel in site-packages has
    none. An unreadable or malformed pyproject.toml counts as "not a checkout".
    """

    root = Path(package_dir or PACKAGE_DIR).parent
    try:
        with (root / "pyproject.toml").open("rb") as fh:
            name = tomllib.load(fh).get("project", {}).get("name", "")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return root if isinstance(name, str) and re.sub(r"[-_.]+", "-", name).lower() == DIST_NAME else None


def _requirement_texts() -> list[str]:
    """Requirement strings of the source that goes into the image: the checkout's pyproject.toml
    when running from one (an editable install's metadata can be older), else the installed
    distribution's metadata. ExecutorUnavailable if neither is there."""


    root = source_checkout_root()
    if root is not None:
        project = tomllib.loads((root / "pyproject.toml").read_text("utf-8")).get("project", {})
        if "dependencies" in project:  # else declared dynamic: the metadata has them
            extra = [_with_extra_marker(r, e) for e, reqs in project.get("optional-dependencies", {}).items()
                     for r in reqs]
            return [*project["dependencies"], *extra]
    try:
        return list(requires(DIST_NAME) or [])
    except PackageNotFoundError:
        raise ExecutorUnavailable(
            f"modal executor: cannot find the requirements of {DIST_NAME} (not installed, no pyproject.toml "
            "next to the package); run pip install -e . in your checkout") from None


def _with_extra_marker(requirement: str, extra: str) -> str:
    """``"x>=1; python_version<'3.11'"`` -> ``"x>=1; (python_version<'3.11') and extra == 'dev'"``."""
    req, _, marker = requirement.partition(";")
    marker = f"({marker.strip()}) and " if marker.strip() else ""
    return f"{req.strip()}; {marker}extra == '{extra}'"


def package_requirements(extras: Sequence[str]) -> list[str]:
    """This distribution's requirements with ``extras`` (for images built from local source)."""
    out = []
    for text in _requirement_texts():
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (*extras, "")):
            req.marker = None
            out.append(str(req))  # keeps extras such as moto[server]
    return out


def ships_local_source(local_source: bool | None, package: str | None = None) -> bool:
    """Resolve ``local_source``: True/False as given; None ("auto") = ship the local source when
    no ``package`` is named and this package runs from a source checkout (its version is
    likely not on PyPI), else pip-install."""
    if local_source is not None:
        return bool(local_source)
    root = None if package else source_checkout_root()
    if root is not None:
        logger.info("modal executor: %s runs from the source checkout %s; shipping its source to the "
                    "image (local_source=False pip-installs %s==%s instead)", DIST_NAME, root, DIST_NAME,
                    __version__)
    return root is not None


def default_image(modal: Any, *, extras: Sequence[str] = ("s3", "gcs"), package: str | None = None,
                  local_source: bool | None = None, python_version: str | None = None) -> Any:
    """``Image.debian_slim`` with this package's local source or this package (same version +
    extras) pip-installed; ``local_source=None`` picks per :func:`ships_local_source`."""
    py = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    image = modal.Image.debian_slim(python_version=py)
    if ships_local_source(local_source, package):
        return image.pip_install(*package_requirements(extras)).add_local_python_source("diloco_serverless")
    spec = package or f"diloco-serverless[{','.join(extras)}]=={__version__}"
    return image.pip_install(spec)


def function_options(
    modal: Any, *, gpu: str | None, secrets: Sequence[str], timeout_s: int, retries: int
) -> dict[str, Any]:
    """Keyword arguments for ``app.function`` / ``Function.with_options`` (GPU, secrets, timeout, retries)."""
    policy = modal.Retries(max_retries=retries, backoff_coefficient=2.0, initial_delay=10.0) if retries else None
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
        local_source: ship this checkout's source (True), pip-install ``diloco-serverless==<version>``
            (False), or None/"auto" (default): ship it when running from a source checkout.
        environment_name: Modal environment (default: the profile's).
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
        poll_interval_s: float = 10.0,
    ) -> None:
        self._modal = import_modal()
        if not modal_credentials_present():
            raise ExecutorUnavailable(
                "modal executor: no Modal credentials; set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET "
                "or run `modal token new` (writes ~/.modal.toml)"
            )
        self.gpu = normalize_gpu(gpu)
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
        self.poll_interval_s = poll_interval_s

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

    # --- launch -----------------------------------------------------------------------------
    def _function(self, run_id: str) -> tuple[Any, Any]:
        modal = self._modal
        if self.deployed_app:
            fn = modal.Function.from_name(self.deployed_app, FUNCTION_NAME, environment_name=self.environment_name)
            opts = function_options(modal, gpu=self.gpu, secrets=self.secrets, timeout_s=self.timeout_s,
                                    retries=self.retries)
            return None, fn.with_options(**opts)
        image = self.image if self.image is not None else default_image(modal, **self._image_options)
        return build_app(modal, app_name=self.app_name or f"diloco-{run_id}", image=image, gpu=self.gpu,
                         secrets=self.secrets, timeout_s=self.timeout_s, retries=self.retries)

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: str,
        entrypoint_args: Sequence[str],
        env: Mapping[str, str] | None = None,
    ) -> list[ReplicaHandle]:
        """Spawn one call of ``run_replica`` per rank in a detached App (or the deployed one)."""
        check_replica_count(n_replicas, self.kind)
        plain, dropped = split_secret_env(env)
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
        if app is None:
            calls = self._spawn_all(fn, n_replicas, entrypoint, args, plain)
            app_id, app_name = None, self.deployed_app
        else:
            with app.run(detach=True, environment_name=self.environment_name):
                calls = self._spawn_all(fn, n_replicas, entrypoint, args, plain)
                app_id, app_name = app.app_id, app.name
        return [
            ReplicaHandle(kind=self.kind, rank=rank, data={
                "function_call_id": fc.object_id, "app_id": app_id, "app_name": app_name, "gpu": self.gpu,
                "run_id": run_id})
            for rank, fc in enumerate(calls)
        ]

    def _spawn_all(self, fn: Any, n: int, entrypoint: str, args: list[str], env: dict[str, str]) -> list[Any]:
        calls: list[Any] = []
        for rank in range(n):
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
        return self._modal.FunctionCall.from_id(self._call_id(handle))

    def poll(self, handles: Sequence[ReplicaHandle]) -> list[ReplicaState]:
        """``FunctionCall.get(timeout=0)`` per rank, with Modal's outcomes mapped to states."""
        return [self._state(h) for h in handles]

    def _state(self, handle: ReplicaHandle) -> ReplicaState:
        exc_mod = self._modal.exception
        rank, detail = handle.rank, {"function_call_id": self._call_id(handle)}

        def state(status: ReplicaStatus, reason: str | None = None, code: int | None = None) -> ReplicaState:
            return ReplicaState(rank=rank, status=status, reason=reason, exit_code=code, detail=detail)

        try:
            self._call(handle).get(timeout=0)
        except exc_mod.FunctionTimeoutError as exc:
            return state(ReplicaStatus.FAILED, f"timed out after the Modal function timeout ({exc})")
        except exc_mod.OutputExpiredError:
            return state(ReplicaStatus.FAILED, "result expired on Modal (older than its retention); check the store")
        except exc_mod.TimeoutError:
            return state(ReplicaStatus.RUNNING)
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
        return state(ReplicaStatus.SUCCEEDED, code=0)

    def collect(
        self, handles: Sequence[ReplicaHandle], timeout: float | timedelta | None = None
    ) -> list[ReplicaResult]:
        """Wait for every call; raise ReplicaFailedError naming failed ranks with their log tails."""
        return collect_by_polling(self, handles, timeout, poll_interval_s=self.poll_interval_s)

    def logs(self, handle: ReplicaHandle, tail: int | None = 200) -> str:
        """The last ``tail`` log lines of the call (``FunctionCall.logs.tail``)."""
        entries = self._call(handle).logs.tail(entries=tail or 10_000)
        return "\n".join(str(getattr(e, "message", e)).rstrip("\n") for e in entries)

    def cancel(self, handles: Sequence[ReplicaHandle]) -> None:
        """``FunctionCall.cancel(terminate_containers=True)`` for every rank; errors name the rank."""
        errors = []
        for h in handles:
            try:
                self._call(h).cancel(terminate_containers=True)
            except Exception as exc:
                errors.append(f"rank {h.rank} ({h.data.get('function_call_id')}): {exc}")
        if errors:
            raise ExecutorError("modal executor: could not cancel " + "; ".join(errors))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _exit_code(text: str) -> int | None:
    match = re.search(r"exited with code (-?\d+)", text)
    return int(match.group(1)) if match else None
