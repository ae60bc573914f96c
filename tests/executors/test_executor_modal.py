"""ModalExecutor: what a launch gives the SDK (against a recording fake ``modal`` module), and polls,
collect and cancel through the real SDK against the fake Modal server (tests/support/modal_grpc_server.py);
plus the remote function and a live smoke test.

The fake module records what App, app.function, Image, Secret, Retries, App.run and spawn receive (the
real SDK's translation of the same options is checked in test_modal_real_sdk.py and
test_modal_transport.py). Its ``exception`` attribute is the *real* ``modal.exception`` module.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco_serverless.errors import ExecutorError
from diloco_serverless.executors import ReplicaStatus, _package
from diloco_serverless.executors import modal as modal_executor
from diloco_serverless.executors._remote import ReplicaProcessError, run_replica_process
from diloco_serverless.executors.base import (
    ExecutorUnavailable,
    ReplicaFailedError,
    handle_from_json,
)
from diloco_serverless.executors.modal import ModalExecutor
from diloco_serverless.executors.registry import executor_for_handle, get_executor
from support import FAKE_REPLICA, REPO_ROOT, pythonpath_env

pytest.importorskip("modal")

from modal._serialization import deserialize  # noqa: E402
from modal_proto import api_pb2  # noqa: E402

from support.modal_grpc_server import FakeModalServer  # noqa: E402
from support.modal_grpc_server import fake_modal as fake_modal_server  # noqa: E402

RUN_URL = "s3://bucket/runs/run-m1"
#: the image pins torch to the version this process runs (and CI tests), whatever the requirements say
TORCH = _package.tested_torch()


class Recorder:
    """The RPCs the real SDK sent the fake Modal server during one launch (see :func:`_launch`)."""

    def __init__(self, srv: FakeModalServer, start: int) -> None:
        self.requests = srv.requests[start:]

    def sent(self, name: str) -> list[Any]:
        return [req for n, req in self.requests if n == name]

    @property
    def function(self) -> Any:
        """The ``api_pb2.Function`` the launch created (its GPU, timeout, retry policy, secrets)."""
        (create,) = self.sent("FunctionCreate")
        return create.function

    @property
    def pip(self) -> list[str] | None:
        """The requirements of the image's ``pip install`` layer, as Modal's image builder got them (the SDK
        sorts them)."""
        for req in self.sent("ImageGetOrCreate"):
            for command in req.image.dockerfile_commands:
                if command.startswith("RUN python -m pip install "):
                    return shlex.split(command)[5:]
        return None

    @property
    def source(self) -> set[str]:
        """The files of this package that the launch mounts into the container (``add_local_python_source``)."""
        return {f.filename for req in self.sent("MountGetOrCreate") for f in req.files
                if f.filename.startswith("/root/diloco_serverless/")}

    def inputs(self) -> list[tuple[Any, ...]]:
        return [deserialize(r.pipelined_inputs[0].input.args, None)[0] for r in self.sent("FunctionMap")]


def _launch(srv: FakeModalServer, n: int = 1, *, env: dict[str, str] | None = None, entrypoint: str = "m",
            args: list[str] | None = None, **options: Any) -> tuple[list[Any], Recorder]:
    options.setdefault("show_output", False)
    start = len(srv.requests)
    ex = options.pop("executor", None) or ModalExecutor(**options)
    handles = ex.launch_replicas(n, entrypoint, args or [], env=env or {"DILOCO_RUN_URL": RUN_URL})
    return handles, Recorder(srv, start)


@pytest.fixture
def srv(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeModalServer]:
    with fake_modal_server(monkeypatch) as server:
        yield server


INSTALLED_METADATA = """Metadata-Version: 2.1
Name: diloco-serverless
Version: 0.1.0
Provides-Extra: s3
Provides-Extra: gcs
Requires-Dist: torch>=2.7
Requires-Dist: fsspec>=2024.6
Requires-Dist: s3fs>=2024.6; extra == "s3"
Requires-Dist: gcsfs>=2024.6; extra == "gcs"
"""


@pytest.fixture
def installed_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make the package look pip-installed from a wheel: site-packages holds the package and its
    dist-info, no pyproject.toml."""
    package_dir = tmp_path / "site-packages" / "diloco_serverless"
    package_dir.mkdir(parents=True)
    (package_dir / "__init__.py").write_text('__version__ = "0.1.0"\n')
    info = package_dir.parent / "diloco_serverless-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(INSTALLED_METADATA)
    monkeypatch.setattr(_package, "PACKAGE_DIR", package_dir)
    return package_dir


def test_launch_builds_app_function_image_secrets_and_spawns(srv: FakeModalServer, installed_wheel: Path) -> None:
    ex = get_executor("modal", gpu="h100", secrets=["aws-creds"], timeout_s=3600, retries=4, poll_interval_s=0.01,
                      show_output=False)
    env = {"DILOCO_RUN_URL": RUN_URL, "AWS_ENDPOINT_URL": "https://s3.example", "AWS_SECRET_ACCESS_KEY": "leak"}
    handles, sent = _launch(srv, 3, executor=ex, env=env, entrypoint="diloco_serverless.entrypoints.replica",
                            args=["--run-url", RUN_URL])

    (app,) = sent.sent("AppCreate")
    assert app.description == "diloco-run-m1" and app.app_state == api_pb2.APP_STATE_DETACHED
    fn = sent.function
    assert fn.function_name == "run_replica" and fn.function_serialized  # run_replica_process, pickled by ref
    assert deserialize(fn.function_serialized, None) is run_replica_process
    assert (fn.resources.gpu_config.gpu_type, fn.resources.gpu_config.count) == ("H100", 1) and fn.timeout_secs == 3600
    policy = fn.retry_policy
    assert (policy.retries, policy.backoff_coefficient, policy.initial_delay_ms) == (4, 2.0, 10_000)
    assert [r.deployment_name for r in sent.sent("SecretGetOrCreate")] == ["aws-creds"] and len(fn.secret_ids) == 1
    # an installed (non-editable) package ships its own source too, with its installed requirements
    assert sent.pip == sorted([TORCH, "fsspec>=2024.6", "s3fs>=2024.6", "gcsfs>=2024.6"])
    assert "/root/diloco_serverless/executors/_remote.py" in sent.source
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert any(c.startswith(f"FROM python:{py}") for r in sent.sent("ImageGetOrCreate")
               for c in r.image.dockerfile_commands)  # debian_slim of this Python

    inputs = sent.inputs()
    function_id = sent.sent("FunctionMap")[0].function_id
    for rank, args in enumerate(inputs):
        assert args == (rank, "diloco_serverless.entrypoints.replica", ["--run-url", RUN_URL],
                        {"DILOCO_RUN_URL": RUN_URL, "AWS_ENDPOINT_URL": "https://s3.example",
                         "DILOCO_CALL_TIMEOUT_S": "3600", "DILOCO_ATTEMPT": "0",
                         "DILOCO_MODAL_FUNCTION_ID": function_id})  # see test_continue_modal.py
    records = json.loads(json.dumps([h.to_json() for h in handles]))
    (app_id,) = srv.apps
    call_ids = sorted(srv.calls, key=lambda c: int(c[3:]))
    assert records[1] == {"kind": "modal", "rank": 1, "function_call_id": call_ids[1], "app_id": app_id,
                          "app_name": "diloco-run-m1", "app_mode": "detached", "gpu": "H100", "run_id": "run-m1"}
    assert "leak" not in json.dumps(records) and "leak" not in repr(inputs)


def test_local_source_image(srv: FakeModalServer) -> None:
    _, sent = _launch(srv, gpu=None, local_source=True, extras=("s3",))
    assert not sent.function.resources.HasField("gpu_config") or not sent.function.resources.gpu_config.gpu_type
    assert sent.pip is not None and "s3fs>=2024.6" in sent.pip and not any("gcsfs" in r for r in sent.pip)
    assert "/root/diloco_serverless/entrypoints/replica.py" in sent.source


def _image(srv: FakeModalServer, **options: Any) -> tuple[list[str] | None, bool]:
    """(the pip layer's requirements, whether the running package's source is mounted) of a launch."""
    _, sent = _launch(srv, gpu=None, **options)
    return sent.pip, bool(sent.source)


def test_default_image_ships_the_source_of_a_checkout(srv: FakeModalServer, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    repo = REPO_ROOT  # this repository is a checkout (whatever CI imports)
    monkeypatch.setattr(_package, "PACKAGE_DIR", repo / "diloco_serverless")
    assert modal_executor.source_checkout_root() == repo
    pip, mounted = _image(srv)
    assert mounted and pip is not None
    assert "diloco-serverless[s3,gcs]==0.1.0" not in pip and "s3fs>=2024.6" in pip and TORCH in pip
    assert _image(srv, local_source="auto") == (pip, True)

    # another checkout: its pyproject's requirements (not the installed metadata) go into the image
    checkout = tmp_path / "checkout"
    (checkout / "diloco_serverless").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text(
        '[project]\nname = "Diloco_Serverless"\nversion = "9.0"\ndependencies = ["torch>=9"]\n'
        '[project.optional-dependencies]\ns3 = ["s3fs>=9"]\ndev = ["moto[server]>=5; python_version>\'3\'"]\n')
    monkeypatch.setattr(_package, "PACKAGE_DIR", checkout / "diloco_serverless")
    assert _image(srv, extras=("s3", "dev")) == (sorted([TORCH, "s3fs>=9", "moto[server]>=5"]), True)
    # an explicit package= or local_source=False pip-installs even from a checkout
    assert _image(srv, package="git+https://example/x.git") == (["git+https://example/x.git"], False)
    assert _image(srv, local_source=False) == (["diloco-serverless[s3,gcs]==0.1.0"], False)


@pytest.mark.parametrize("pyproject", [None, '[project]\nname = "other-project"\n', "not = = toml"])
def test_default_image_ships_the_source_of_an_installed_package(srv: FakeModalServer, installed_wheel: Path,
                                                               pyproject: str | None) -> None:
    """Finding 2: outside a checkout (a wheel in site-packages, pipx, uv tool) the running source still
    ships; pip-installing the published version is explicit (local_source=False or package=)."""
    if pyproject is not None:  # a foreign or broken pyproject.toml next to the package is no checkout
        (installed_wheel.parent / "pyproject.toml").write_text(pyproject)
    assert modal_executor.source_checkout_root() is None
    pip, mounted = _image(srv)
    assert (pip, mounted) == (sorted([TORCH, "fsspec>=2024.6", "s3fs>=2024.6", "gcsfs>=2024.6"]), True)
    assert _image(srv, local_source="auto") == (pip, True)
    assert _image(srv, extras=("s3",)) == (sorted([TORCH, "fsspec>=2024.6", "s3fs>=2024.6"]), True)
    assert _image(srv, local_source=False) == (["diloco-serverless[s3,gcs]==0.1.0"], False)
    with pytest.raises(ExecutorUnavailable, match="local_source must be true, false or auto"):
        ModalExecutor(local_source="yes")


def test_enable_output_and_its_expected_warning(srv: FakeModalServer, installed_wheel: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Finding 4: the launch shows Modal's output (image build progress, the App's logs); the log-tail
    timeout warning that a detached App always triggers is dropped, other Modal warnings are not."""
    _, shown = _launch(srv, gpu=None, show_output=True)
    assert shown.sent("AppGetLogs")  # with modal.enable_output(), App.run follows the App's logs
    _, quiet = _launch(srv, gpu=None, show_output=False)
    assert not quiet.sent("AppGetLogs")
    ex = ModalExecutor(gpu=None)
    with caplog.at_level(logging.WARNING, logger="modal-client"), ex._output():
        logging.getLogger("modal-client").warning("Timed out waiting for final app logs.")
        logging.getLogger("modal-client").warning("something else")
    assert [r.getMessage() for r in caplog.records if r.name == "modal-client"] == ["something else"]


def test_bad_configuration_fails_in_init(
    srv: FakeModalServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(ExecutorUnavailable, match="unknown GPU 'V100'"):
        ModalExecutor(gpu="V100")
    with pytest.raises(ExecutorUnavailable, match="retries"):
        ModalExecutor(retries=11)
    monkeypatch.delenv("MODAL_TOKEN_ID")
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "absent.toml"))
    with pytest.raises(ExecutorUnavailable, match="MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"):
        ModalExecutor()
    (tmp_path / "absent.toml").write_text("[default]\ntoken_id = 'x'\n")
    assert ModalExecutor().gpu == "A100"  # a config file counts as credentials
    monkeypatch.setitem(sys.modules, "modal", None)
    with pytest.raises(ExecutorUnavailable, match=r"pip install 'diloco-serverless\[modal\]'"):
        get_executor("modal")
    assert srv.rpc_names() == []  # nothing reached Modal


def _fake_replica_env() -> dict[str, str]:
    path = pythonpath_env()
    return {"PYTHONPATH": path, "DILOCO_RUN_URL": RUN_URL}


def test_remote_function_runs_the_replica(capfd: pytest.CaptureFixture[str]) -> None:
    assert run_replica_process(2, FAKE_REPLICA, [], _fake_replica_env()) == {"rank": 2, "exit_code": 0}
    assert "fake replica rank=2 attempt=0" in capfd.readouterr().out
    with pytest.raises(ReplicaProcessError, match=r"rank 1 exited with code 6(.|\n)*rank 1 fails with boom"):
        run_replica_process(1, FAKE_REPLICA, ["--exit-code", "6"], _fake_replica_env())


def test_remote_function_returns_a_setup_error_so_modal_does_not_retry_it(capfd: pytest.CaptureFixture[str]) -> None:
    """Finding 5: modal.Retries cannot be conditioned on the error, so exit code 2 ends the call normally."""
    result = run_replica_process(1, FAKE_REPLICA, ["--exit-code", "2"], _fake_replica_env())
    assert result == {"rank": 1, "exit_code": 2, "reason": "rank 1 fails with boom (exit 2)", "retried": False}
    assert "[diloco] setup error (exit code 2), not retried: rank 1 fails with boom" in capfd.readouterr().out


@pytest.mark.live
@pytest.mark.skipif(not os.environ.get("MODAL_TOKEN_ID"), reason="live Modal test needs MODAL_TOKEN_ID")
def test_live_modal_smoke() -> None:
    """One CPU container on real Modal running a stdlib module (only with MODAL_TOKEN_ID)."""
    ex = ModalExecutor(gpu=None, local_source=True, retries=0, timeout_s=900, poll_interval_s=5)
    handles = ex.launch_replicas(1, "platform", [], env={"DILOCO_RUN_URL": "memory://live/smoke"})
    try:
        assert ex.collect(handles, timeout=1800)[0].ok
    finally:
        ex.cancel(handles)


def test_forged_handle_decides_nothing_about_where_credentials_go(srv: FakeModalServer) -> None:
    """run.json is writable by every replica credential. A Modal handle's extra settings are ignored
    (Modal's server and profile come from this process's config), an invalid GPU does not block the
    rebuild, and a call id that is not ``fc-...`` is refused before the SDK sees it."""
    forged = {"kind": "modal", "rank": 0, "function_call_id": "fc-0/../../other", "gpu": "evil",
              "server_url": "https://evil.example", "environment_name": "evil", "app_name": "evil",
              "token_id": "ak-evil"}
    other = executor_for_handle(forged)
    assert isinstance(other, ModalExecutor)
    assert other.gpu is None and other.environment_name is None and other.app_name is None
    assert os.environ["MODAL_TOKEN_ID"] == "ak-fake" and os.environ["MODAL_SERVER_URL"] == srv.url
    handle = handle_from_json(forged)
    for action in (lambda: other.poll([handle]), lambda: other.logs(handle)):
        with pytest.raises(ExecutorError, match=r"function_call_id='fc-0/\.\./\.\./other', not a Modal call id"):
            action()
    with pytest.raises(ExecutorError, match="could not cancel rank 0"):
        other.cancel([handle])
    assert srv.rpc_names() == []  # refused before any request


def test_the_run_key_reaches_modal_replicas_in_the_call_inputs(srv: FakeModalServer, installed_wheel: Path) -> None:
    """Other credentials must go through named Modal Secrets; the per-run key travels with each call,
    so a replica can verify what it reads (docs/security.md), and never lands in the handles."""
    key = "ab" * 32
    env = {"DILOCO_RUN_URL": RUN_URL, "DILOCO_RUN_KEY": key, "AWS_SECRET_ACCESS_KEY": "leak"}
    handles, sent = _launch(srv, 2, gpu="h100", env=env)
    function_id = sent.sent("FunctionMap")[0].function_id
    for _, _, _, inputs in sent.inputs():
        assert inputs == {"DILOCO_RUN_URL": RUN_URL, "DILOCO_RUN_KEY": key, "DILOCO_CALL_TIMEOUT_S": "86400",
                          "DILOCO_ATTEMPT": "0", "DILOCO_MODAL_FUNCTION_ID": function_id}
    assert key not in json.dumps([h.to_json() for h in handles])


# --- polls, collect and cancel ----------------------------------------------------------------------------
def _ids(handles: list[Any]) -> list[str]:
    return [h.data["function_call_id"] for h in handles]


def test_poll_maps_modal_outcomes_to_states(srv: Any) -> None:
    ex = ModalExecutor(gpu=None, poll_interval_s=0.01, show_output=False)
    handles = ex.launch_replicas(7, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    ids = _ids(handles)
    srv.finish(ids[1], {"rank": 1, "exit_code": 0})
    srv.fail(ids[2], ReplicaProcessError("replica rank 2 exited with code 4; last output:\nboom"))
    srv.time_out(ids[3])
    srv.expire(ids[4])
    srv.finish(ids[5], {"rank": 5, "exit_code": 2, "reason": "error: replica rank 5 of s3://b/r: RunNotFound: no run",
                        "retried": False})
    srv.start(ids[6])
    states = ex.poll(handles)
    assert [s.status for s in states] == [
        ReplicaStatus.PENDING, ReplicaStatus.SUCCEEDED, ReplicaStatus.FAILED, ReplicaStatus.FAILED,
        ReplicaStatus.UNKNOWN, ReplicaStatus.FAILED, ReplicaStatus.RUNNING,
    ]
    assert states[2].exit_code == 4 and "ReplicaProcessError" in (states[2].reason or "")
    assert "timed out" in (states[3].reason or "")
    # an expired result is not a failure: unknown, deferring to the heartbeat, and ended
    assert "no longer keeps its result" in (states[4].reason or "") and "heartbeat" in (states[4].reason or "")
    assert states[4].ended and not states[4].terminal and states[4].to_json()["status"] == "unknown"
    # a queued call is not running; a setup error returned by the remote function is failed, code 2
    assert states[0].reason == "queued: waiting for a container" and not states[0].ended
    assert states[5].exit_code == 2 and "setup error, not retried: error: replica rank 5" in (states[5].reason or "")
    assert {r.timeout for r in srv.sent("FunctionGetOutputs")} == {0}  # never blocks


def test_a_call_graph_modal_does_not_give_is_unknown(srv: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpclib import GRPCError, Status

    ex = ModalExecutor(gpu=None, show_output=False)
    (handle,) = ex.launch_replicas(1, "m", [], env={"DILOCO_RUN_URL": RUN_URL})

    def unavailable(req: Any) -> Any:
        raise GRPCError(Status.INVALID_ARGUMENT, "call graph unavailable")

    monkeypatch.setattr(srv, "rpc_FunctionGetCallGraph", unavailable)
    (state,) = ex.poll([handle])
    assert state.status is ReplicaStatus.UNKNOWN and "queued or running" in (state.reason or "")


def test_collect_does_not_wait_forever_on_an_expired_result(srv: Any) -> None:
    ex = ModalExecutor(gpu=None, poll_interval_s=0.01, show_output=False)
    handles = ex.launch_replicas(2, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    srv.finish(_ids(handles)[0], {"exit_code": 0})
    srv.expire(_ids(handles)[1])
    with pytest.raises(ReplicaFailedError) as info:
        ex.collect(handles, timeout=5)
    assert "rank 1 unknown" in str(info.value) and [r.ok for r in info.value.results] == [True, False]


def test_collect_names_failed_ranks_with_log_tail(srv: Any) -> None:
    ex = ModalExecutor(gpu=None, poll_interval_s=0.01, show_output=False)
    handles = ex.launch_replicas(2, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    ids = _ids(handles)
    srv.finish(ids[0], {"rank": 0, "exit_code": 0})
    srv.log(ids[1], "log line 0", "log line 1", "boom at step 3")
    srv.fail(ids[1], ReplicaProcessError("replica rank 1 exited with code 9; last output:\nboom"))
    with pytest.raises(ReplicaFailedError) as info:
        ex.collect(handles, timeout=5)
    msg = str(info.value)
    assert "rank(s) 1" in msg and "exit code 9" in msg and "boom at step 3" in msg


def test_cancel_and_poll_from_handles_in_another_executor(srv: Any) -> None:
    ex = ModalExecutor(gpu="T4", show_output=False)
    records = [h.to_json() for h in ex.launch_replicas(2, "m", [], env={"DILOCO_RUN_URL": RUN_URL})]
    handles = [handle_from_json(json.dumps(r)) for r in records]
    other = executor_for_handle(handles[0], show_output=False)
    assert isinstance(other, ModalExecutor) and other.gpu == "T4"
    srv.finish(_ids(handles)[1], {"exit_code": 0})
    other.cancel(handles[:1])
    assert [(r.function_call_id, r.terminate_containers) for r in srv.sent("FunctionCallCancel")] == [
        (_ids(handles)[0], True)]
    assert [s.status for s in other.poll(handles)] == [ReplicaStatus.CANCELLED, ReplicaStatus.SUCCEEDED]
