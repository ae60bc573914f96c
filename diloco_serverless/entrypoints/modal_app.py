"""The replica function as a deployable Modal App, for users who prefer ``modal deploy``.

    modal deploy -m diloco_serverless.entrypoints.modal_app
    diloco launch --executor modal --set ... # with executor option deployed_app="diloco-serverless"

or from Python: ``launch(cfg, executor=ModalExecutor(deployed_app="diloco-serverless", secrets=["aws"]))``.
The launch overrides GPU, secrets, timeout and retries per run (``Function.with_options``), so the
deploy-time settings below are only defaults. Read at deploy time from the environment:

    DILOCO_MODAL_APP        App name (default "diloco-serverless")
    DILOCO_MODAL_GPU        GPU type (default "A100")
    DILOCO_MODAL_SECRETS    comma-separated Modal Secret names with storage credentials
    DILOCO_MODAL_TIMEOUT_S  per-attempt timeout in seconds (default 86400)
    DILOCO_MODAL_RETRIES    retries after failure/preemption (default 3)
    DILOCO_MODAL_PACKAGE    a pip requirement to install instead of shipping the local source
    DILOCO_MODAL_LOCAL_SOURCE  unset or 1 = ship the source of the package that deploys (checkout or
                            installed), 0 = pip-install the published diloco-serverless==<this version>

Failure: a replica that exits non-zero makes the call fail with its exit code and output tail;
Modal retries it per DILOCO_MODAL_RETRIES (or the launch's retries). Exit code 2 (a setup error)
ends the call normally with that code as its result, so it is never retried.
"""

from __future__ import annotations

import os

import modal

from diloco_serverless.executors.modal import (
    DEFAULT_APP_NAME,
    MAX_TIMEOUT_S,
    build_app,
    default_image,
    normalize_gpu,
)

APP_NAME = os.environ.get("DILOCO_MODAL_APP", DEFAULT_APP_NAME)

app, run_replica = build_app(
    modal,
    app_name=APP_NAME,
    image=default_image(
        modal,
        package=os.environ.get("DILOCO_MODAL_PACKAGE") or None,
        local_source={"1": True, "0": False}.get(os.environ.get("DILOCO_MODAL_LOCAL_SOURCE", "").strip()),
    ),
    gpu=normalize_gpu(os.environ.get("DILOCO_MODAL_GPU", "A100")),
    secrets=[s.strip() for s in os.environ.get("DILOCO_MODAL_SECRETS", "").split(",") if s.strip()],
    timeout_s=int(os.environ.get("DILOCO_MODAL_TIMEOUT_S", MAX_TIMEOUT_S)),
    retries=int(os.environ.get("DILOCO_MODAL_RETRIES", "3")),
)
