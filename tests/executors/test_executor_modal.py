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
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
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
from support.fake_modal import fake_modal_module, install_fake_modal

modal_exception = pytest.importorskip("modal.exception")

RUN_URL = "s3://bucket/runs/run-m1"
#: the image pins torch to the version this process runs (and CI tests), whatever the requirements say
TORCH = _package.tested_torch()


class FakeCall:
    """What the launch keeps of a spawned call: its id (polls, logs and cancel run the real SDK against the
    fake Modal server below)."""

    def __init__(self, fake: FakeModal, call_id: str, args: tuple[Any, ...]) -> None:
        self.fake, self.object_id, self.args = fake, call_id, args

    def cancel(self, terminate_containers: bool = False) -> None:
        self.fake.cancelled.append((self.object_id, terminate_containers))


class FakeFunction:
    def __init__(self, fake: FakeModal, raw_f: Any, options: dict[str, Any]) -> None:
        self.fake, self.raw_f, self.options = fake, raw_f, options

    def spawn(self, *args: Any) -> FakeCall:
        call = FakeCall(self.fake, f"fc-{len(self.fake.calls)}", args)
        self.fake.calls[call.object_id] = call
        self.fake.spawns.append((self, args, self.fake.app_running))
        return call

    def with_options(self, **options: Any) -> FakeFunction:
        self.fake.with_options.append(options)
        return FakeFunction(self.fake, self.raw_f, {**self.options, **options})


class FakeImage:
    def __init__(self, ops: list[tuple[str, Any]]) -> None:
        self.ops = ops

    @classmethod
    def debian_slim(cls, python_version: str | None = None) -> FakeImage:
        return cls([("debian_slim", python_version)])

    def pip_install(self, *packages: str) -> FakeImage:
        return FakeImage([*self.ops, ("pip_install", packages)])

    def add_local_python_source(self, *modules: str) -> FakeImage:
        return FakeImage([*self.ops, ("add_local_python_source", modules)])


class FakeModal:
    """Builds the fake ``modal`` module and records every SDK call."""

    def __init__(self) -> None:
        self.apps: list[Any] = []
        self.functions: list[FakeFunction] = []
        self.spawns: list[tuple[FakeFunction, tuple[Any, ...], bool]] = []
        self.calls: dict[str, FakeCall] = {}
        self.cancelled: list[tuple[str, bool]] = []
        self.runs: list[dict[str, Any]] = []
        self.with_options: list[dict[str, Any]] = []
        self.from_name: list[tuple[Any, ...]] = []
        self.app_running = False
        self.output_enabled = False
        self.runs_with_output: list[bool] = []

    def module(self) -> types.ModuleType:
        fake = self

        class App:
            def __init__(self, name: str | None = None) -> None:
                self.name, self.app_id = name, None
                fake.apps.append(self)

            def function(self, **options: Any) -> Any:
                def decorate(raw_f: Any) -> FakeFunction:
                    fn = FakeFunction(fake, raw_f, options)
                    fake.functions.append(fn)
                    return fn
                return decorate

            @contextmanager
            def run(self, **kw: Any) -> Iterator[App]:
                fake.runs.append(kw)
                fake.runs_with_output.append(fake.output_enabled)
                self.app_id, fake.app_running = "ap-123", True
                try:
                    yield self
                finally:
                    fake.app_running = False
                    if fake.output_enabled:  # what modal's App.run logs when a detached App outlives it
                        logging.getLogger("modal-client").warning("Timed out waiting for final app logs.")

        class Function:
            @staticmethod
            def from_name(app_name: str, name: str, **kw: Any) -> FakeFunction:
                fake.from_name.append((app_name, name, kw))
                return FakeFunction(fake, None, {})

        class FunctionCall:
            @staticmethod
            def from_id(call_id: str) -> FakeCall:
                if call_id not in fake.calls:
                    raise modal_exception.NotFoundError(f"no call {call_id}")
                return fake.calls[call_id]

        @contextmanager
        def enable_output() -> Iterator[None]:
            fake.output_enabled = True
            try:
                yield
            finally:
                fake.output_enabled = False

        return fake_modal_module(modal_exception, App=App, Function=Function, FunctionCall=FunctionCall,
                                 Image=FakeImage, enable_output=enable_output)


@pytest.fixture
def fake_modal(monkeypatch: pytest.MonkeyPatch) -> FakeModal:
    fake = FakeModal()
    install_fake_modal(monkeypatch, fake.module())
    return fake


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


def test_launch_builds_app_function_image_secrets_and_spawns(fake_modal: FakeModal, installed_wheel: Path) -> None:
    ex = get_executor("modal", gpu="h100", secrets=["aws-creds"], timeout_s=3600, retries=4, poll_interval_s=0.01)
    env = {"DILOCO_RUN_URL": RUN_URL, "AWS_ENDPOINT_URL": "https://s3.example", "AWS_SECRET_ACCESS_KEY": "leak"}
    handles = ex.launch_replicas(3, "diloco_serverless.entrypoints.replica", ["--run-url", RUN_URL], env=env)

    assert [a.name for a in fake_modal.apps] == ["diloco-run-m1"]
    (fn,) = fake_modal.functions
    opts = fn.options
    assert fn.raw_f is run_replica_process
    assert opts["gpu"] == "H100" and opts["timeout"] == 3600 and opts["serialized"] is True
    assert opts["name"] == "run_replica" and opts["secrets"] == [("secret", "aws-creds")]
    assert opts["retries"] == ("retries", {"max_retries": 4, "backoff_coefficient": 2.0, "initial_delay": 10.0})
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    # an installed (non-editable) package ships its own source too, with its installed requirements
    assert opts["image"].ops == [("debian_slim", py), ("pip_install", (TORCH, "fsspec>=2024.6",
                                 "s3fs>=2024.6", "gcsfs>=2024.6")), ("add_local_python_source", ("diloco_serverless",))]
    assert fake_modal.runs == [{"detach": True, "environment_name": None}]
    assert fake_modal.runs_with_output == [True]  # modal.enable_output(): the first image build shows progress

    assert len(fake_modal.spawns) == 3
    for rank, (_, args, inside_run) in enumerate(fake_modal.spawns):
        assert inside_run  # spawned while the detached App runs
        assert args == (rank, "diloco_serverless.entrypoints.replica", ["--run-url", RUN_URL],
                        {"DILOCO_RUN_URL": RUN_URL, "AWS_ENDPOINT_URL": "https://s3.example",
                         "DILOCO_CALL_TIMEOUT_S": "3600", "DILOCO_ATTEMPT": "0"})  # see test_continue_modal.py
    records = json.loads(json.dumps([h.to_json() for h in handles]))
    assert records[1] == {"kind": "modal", "rank": 1, "function_call_id": "fc-1", "app_id": "ap-123",
                          "app_name": "diloco-run-m1", "app_mode": "detached", "gpu": "H100",
                          "run_id": "run-m1"}
    assert "leak" not in json.dumps(records)


def test_deployed_app_uses_function_from_name(fake_modal: FakeModal) -> None:
    """Finding 5: retries=0 overrides the deployed function's own policy (``retries=None`` would keep it)."""
    ex = ModalExecutor(gpu="L4", deployed_app="diloco-serverless", secrets=["aws"], retries=0, timeout_s=600)
    ex.launch_replicas(1, "m", ["--run-url", RUN_URL])
    assert fake_modal.from_name == [("diloco-serverless", "run_replica", {"environment_name": None})]
    no_retries = ("retries", {"max_retries": 0, "backoff_coefficient": 2.0, "initial_delay": 10.0})
    assert fake_modal.with_options == [{"gpu": "L4", "secrets": [("secret", "aws")], "timeout": 600,
                                        "retries": no_retries}]
    assert not fake_modal.apps and not fake_modal.runs


def test_local_source_image(fake_modal: FakeModal) -> None:
    ex = ModalExecutor(gpu=None, local_source=True, extras=("s3",))
    ex.launch_replicas(1, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    ops = fake_modal.functions[0].options["image"].ops
    assert fake_modal.functions[0].options["gpu"] is None
    assert ops[1][0] == "pip_install" and "s3fs>=2024.6" in ops[1][1] and "gcsfs>=2024.6" not in ops[1][1]
    assert ops[2] == ("add_local_python_source", ("diloco_serverless",))


def _image_ops(fake: FakeModal, **options: Any) -> list[tuple[str, Any]]:
    ModalExecutor(gpu=None, **options).launch_replicas(1, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    return fake.functions[-1].options["image"].ops


def test_default_image_ships_the_source_of_a_checkout(fake_modal: FakeModal, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    repo = REPO_ROOT  # this repository is a checkout (whatever CI imports)
    monkeypatch.setattr(_package, "PACKAGE_DIR", repo / "diloco_serverless")
    assert modal_executor.source_checkout_root() == repo
    ops = _image_ops(fake_modal)
    assert ops[2] == ("add_local_python_source", ("diloco_serverless",))
    assert "diloco-serverless[s3,gcs]==0.1.0" not in ops[1][1] and "s3fs>=2024.6" in ops[1][1]
    assert _image_ops(fake_modal, local_source="auto") == ops

    # another checkout: its pyproject's requirements (not the installed metadata) go into the image
    checkout = tmp_path / "checkout"
    (checkout / "diloco_serverless").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text(
        '[project]\nname = "Diloco_Serverless"\nversion = "9.0"\ndependencies = ["torch>=9"]\n'
        '[project.optional-dependencies]\ns3 = ["s3fs>=9"]\ndev = ["moto[server]>=5; python_version>\'3\'"]\n')
    monkeypatch.setattr(_package, "PACKAGE_DIR", checkout / "diloco_serverless")
    ops = _image_ops(fake_modal, extras=("s3", "dev"))
    assert ops[1:] == [("pip_install", (TORCH, "s3fs>=9", "moto[server]>=5")),
                       ("add_local_python_source", ("diloco_serverless",))]
    # an explicit package= or local_source=False pip-installs even from a checkout
    assert _image_ops(fake_modal, package="git+https://example/x.git")[1:] == [
        ("pip_install", ("git+https://example/x.git",))]
    assert _image_ops(fake_modal, local_source=False)[1:] == [
        ("pip_install", ("diloco-serverless[s3,gcs]==0.1.0",))]


@pytest.mark.parametrize("pyproject", [None, '[project]\nname = "other-project"\n', "not = = toml"])
def test_default_image_ships_the_source_of_an_installed_package(fake_modal: FakeModal, installed_wheel: Path,
                                                               pyproject: str | None) -> None:
    """Finding 2: outside a checkout (a wheel in site-packages, pipx, uv tool) the running source still
    ships; pip-installing the published version is explicit (local_source=False or package=)."""
    if pyproject is not None:  # a foreign or broken pyproject.toml next to the package is no checkout
        (installed_wheel.parent / "pyproject.toml").write_text(pyproject)
    assert modal_executor.source_checkout_root() is None
    ops = _image_ops(fake_modal)
    assert ops[1:] == [("pip_install", (TORCH, "fsspec>=2024.6", "s3fs>=2024.6", "gcsfs>=2024.6")),
                       ("add_local_python_source", ("diloco_serverless",))]
    assert _image_ops(fake_modal, local_source="auto") == ops
    assert _image_ops(fake_modal, extras=("s3",))[1][1] == (TORCH, "fsspec>=2024.6", "s3fs>=2024.6")
    assert _image_ops(fake_modal, local_source=False)[1:] == [("pip_install", ("diloco-serverless[s3,gcs]==0.1.0",))]
    with pytest.raises(ExecutorUnavailable, match="local_source must be true, false or auto"):
        ModalExecutor(local_source="yes")


def test_enable_output_and_its_expected_warning(fake_modal: FakeModal, installed_wheel: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Finding 4: the launch shows Modal's output (image build progress); the log-tail timeout warning
    that a detached App always triggers is dropped, other Modal warnings are not."""
    with caplog.at_level(logging.WARNING, logger="modal-client"):
        ModalExecutor(gpu=None).launch_replicas(1, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
        logging.getLogger("modal-client").warning("something else")
    assert fake_modal.runs_with_output == [True]
    assert [r.getMessage() for r in caplog.records if r.name == "modal-client"] == ["something else"]
    ModalExecutor(gpu=None, show_output=False).launch_replicas(1, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    assert fake_modal.runs_with_output == [True, False]


def test_bad_configuration_fails_in_init(
    fake_modal: FakeModal, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
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
    assert not fake_modal.spawns


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


def test_forged_handle_decides_nothing_about_where_credentials_go(
    fake_modal: FakeModal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run.json is writable by every replica credential. A Modal handle's extra settings are ignored
    (Modal's server and profile come from this process's config), an invalid GPU does not block the
    rebuild, and a call id that is not ``fc-...`` is refused before the SDK sees it."""
    looked_up: list[str] = []
    modal_module = sys.modules["modal"]
    real_from_id = modal_module.FunctionCall.from_id
    monkeypatch.setattr(modal_module.FunctionCall, "from_id",
                        staticmethod(lambda call_id: (looked_up.append(call_id), real_from_id(call_id))[1]))
    forged = {"kind": "modal", "rank": 0, "function_call_id": "fc-0/../../other", "gpu": "evil",
              "server_url": "https://evil.example", "environment_name": "evil", "app_name": "evil",
              "token_id": "ak-evil"}
    other = executor_for_handle(forged)
    assert isinstance(other, ModalExecutor)
    assert other.gpu is None and other.environment_name is None and other.app_name is None
    assert os.environ["MODAL_TOKEN_ID"] == "ak-fake" and "MODAL_SERVER_URL" not in os.environ
    handle = handle_from_json(forged)
    for action in (lambda: other.poll([handle]), lambda: other.logs(handle)):
        with pytest.raises(ExecutorError, match=r"function_call_id='fc-0/\.\./\.\./other', not a Modal call id"):
            action()
    with pytest.raises(ExecutorError, match="could not cancel rank 0"):
        other.cancel([handle])
    assert looked_up == [] and fake_modal.cancelled == []


def test_the_run_key_reaches_modal_replicas_in_the_call_inputs(fake_modal: FakeModal, installed_wheel: Path) -> None:
    """Other credentials must go through named Modal Secrets; the per-run key travels with each call,
    so a replica can verify what it reads (docs/security.md), and never lands in the handles."""
    key = "ab" * 32
    ex = get_executor("modal", gpu="h100", poll_interval_s=0.01)
    env = {"DILOCO_RUN_URL": RUN_URL, "DILOCO_RUN_KEY": key, "AWS_SECRET_ACCESS_KEY": "leak"}
    handles = ex.launch_replicas(2, "diloco_serverless.entrypoints.replica", ["--run-url", RUN_URL], env=env)
    assert len(fake_modal.spawns) == 2
    for _, args, _ in fake_modal.spawns:
        assert args[3] == {"DILOCO_RUN_URL": RUN_URL, "DILOCO_RUN_KEY": key, "DILOCO_CALL_TIMEOUT_S": "86400",
                           "DILOCO_ATTEMPT": "0"}
    assert key not in json.dumps([h.to_json() for h in handles])


# --- polls, collect and cancel: the real SDK against the fake Modal server ---------------------------------
@pytest.fixture
def srv(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from support.modal_grpc_server import fake_modal as fake_modal_server

    with fake_modal_server(monkeypatch) as server:
        yield server


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
