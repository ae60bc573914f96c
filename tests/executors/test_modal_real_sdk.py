"""The Modal spec built with the *real* ``modal`` SDK, offline.

``build_app`` / ``default_image`` / ``function_options`` are called with the installed ``modal``
module; nothing contacts Modal. Modal builds objects lazily: the App, the Function, the Image layers
and the Secrets only record what they are made of until a client hydrates them. The test reads that
record, and then runs the Function's own loader (``_Function._load``, the code ``app.run()`` runs)
against a stub in place of Modal's gRPC client, capturing the ``FunctionCreateRequest`` that would
be sent: the GPU, timeout, retry policy and secrets in the request are Modal's own translation of
our options. The image layers are checked the same way: the pip layer's Dockerfile commands (from
its own dockerfile function) and the files the source layer would mount (from its own file walk).

These read private attributes of modal (``_spec``, ``_load``, ``_deps``, ``_entries``); they are
pinned by constraints.txt and checked against the floor in ``test_sdk_floors.py``. When a modal
release moves them, the failure names the attribute, not our code.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

from diloco_serverless.executors._remote import run_replica_process
from diloco_serverless.executors.modal import (
    FUNCTION_NAME,
    build_app,
    default_image,
    function_options,
)

modal = pytest.importorskip("modal")


def _raw(obj: Any) -> Any:
    from modal._utils.async_utils import synchronizer

    return synchronizer._translate_in(obj)


class _Stop(Exception):
    pass


class _StubClient:
    """Stands in for modal's client: records FunctionCreate and stops there."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self._stub = self.stub = self  # modal 1.6 reads client._stub, 1.5 client.stub

    async def FunctionCreate(self, request: Any) -> Any:  # noqa: N802 (gRPC method name)
        self.requests.append(request)
        raise _Stop


def _function_definition(fn: Any) -> Any:
    """The ``api_pb2.Function`` that ``app.run()`` would send for ``fn``, built by modal's own loader."""
    from modal._load_context import LoadContext
    from modal_proto import api_pb2

    raw = _raw(fn)
    client = _StubClient()
    for i, secret in enumerate(raw._spec.secrets):
        secret._hydrate(f"st-{i}", client, None)
    for i, mount in enumerate(raw._spec.mounts):
        mount._hydrate(f"mo-{i}", client, api_pb2.MountHandleMetadata())
    raw._spec.image._hydrate("im-1", client, None)
    with pytest.raises(_Stop):
        asyncio.run(raw._load(raw, None, LoadContext(client=client, app_id="ap-1", environment_name="main"), None))
    (request,) = client.requests
    return request.function


def _closure(fn: Any) -> dict[str, Any]:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def test_the_function_spec_built_by_the_real_sdk() -> None:
    image = default_image(modal, extras=("s3",))
    app, fn = build_app(modal, app_name="diloco-run-x", image=image, gpu="H100:2", secrets=["aws-creds", "hub"],
                        timeout_s=3600, retries=4)
    raw = _raw(fn)
    assert _raw(app).name == "diloco-run-x" and raw._raw_f is run_replica_process
    assert raw._spec.gpus == "H100:2"
    assert [repr(s) for s in raw._spec.secrets] == ["modal.Secret.from_name('aws-creds')",
                                                    "modal.Secret.from_name('hub')"]

    definition = _function_definition(fn)
    assert definition.function_name == FUNCTION_NAME and definition.app_name == "diloco-run-x"
    assert definition.timeout_secs == 3600
    assert (definition.retry_policy.retries, definition.retry_policy.backoff_coefficient,
            definition.retry_policy.initial_delay_ms) == (4, 2.0, 10_000)
    gpu = definition.resources.gpu_config
    assert (gpu.gpu_type, gpu.count) == ("H100", 2)
    assert list(definition.secret_ids) == ["st-0", "st-1"]
    assert definition.function_serialized  # serialized=True: the container unpickles run_replica_process
    assert definition.image_id == "im-1"


def test_retries_zero_is_a_policy_not_the_absence_of_one() -> None:
    """Finding 5: ``retries=0`` must reach Modal as a retry policy with 0 retries, for an App we build
    and for ``with_options`` on a deployed function (where None would keep the deployed policy)."""
    _, fn = build_app(modal, app_name="a", image=default_image(modal), gpu=None, secrets=[], timeout_s=60, retries=0)
    definition = _function_definition(fn)
    assert definition.HasField("retry_policy") and definition.retry_policy.retries == 0

    from modal._function_variants import _FunctionOptions

    deployed = modal.Function.from_name("diloco-serverless", FUNCTION_NAME)
    opts = function_options(modal, gpu="L4", secrets=["aws"], timeout_s=600, retries=0)
    options = _raw(deployed.with_options(**opts))._options
    deploy_time = _FunctionOptions.new(retries=modal.Retries(max_retries=3))  # DILOCO_MODAL_RETRIES at deploy
    merged = deploy_time.merge_options(options)
    assert merged.retry_policy.retries == 0 and merged.timeout_secs == 600
    assert merged.resources.gpu_config.gpu_type == "L4"
    for secret in options.secrets:
        secret._hydrate("st-9", _StubClient(), None)
    assert options.to_proto().HasField("retry_policy")


def test_the_image_layers_carry_the_requirements_and_the_source() -> None:
    """Finding 2: the last layer mounts the running package's source, whatever installed it."""
    image = _raw(default_image(modal, extras=("s3",), python_version="3.11"))
    assert image._added_python_source_set == frozenset({"diloco_serverless"})
    pip_layer, source = image._deps()
    commands = _closure(pip_layer._load)["dockerfile_function"]("2024.10").commands
    assert commands[0] == "FROM base"
    assert commands[1].startswith("RUN python -m pip install ") and "'s3fs>=2024.6'" in commands[1]
    assert "gcsfs" not in commands[1] and "diloco-serverless" not in commands[1]
    (debian,) = pip_layer._deps()
    assert "debian_slim" in repr(debian)

    (entry,) = source._entries
    assert entry.module_name == "diloco_serverless"
    files = {str(remote): local for e in entry._proxy_entries() for local, remote in e.get_files_to_upload()}
    from diloco_serverless.executors import _package

    assert files["/root/diloco_serverless/executors/_remote.py"] == _package.PACKAGE_DIR / "executors" / "_remote.py"
    assert "/root/diloco_serverless/entrypoints/replica.py" in files
    assert not [f for f in files if f.endswith(".pyc") or "/." in f or "__pycache__" in f]


def test_a_published_release_is_an_explicit_pip_layer_without_source() -> None:
    image = _raw(default_image(modal, local_source=False))
    assert image._added_python_source_set == frozenset()
    commands = _closure(image._load)["dockerfile_function"]("2024.10").commands
    assert commands[1] == "RUN python -m pip install 'diloco-serverless[s3,gcs]==0.1.0'"


def test_enable_output_is_a_context_manager_of_the_real_sdk() -> None:
    with modal.enable_output():
        pass
    assert "modal" in sys.modules
