"""Modal runs longer than a call's cap: a chain of calls per rank, against a fake ``modal`` module (SDK level).

The container wrapper (``_remote.run_replica_process``) runs a real replica process
(tests/support/continue_replica.py) that exits 75; the wrapper spawns the next call itself through
``modal.Function.from_id(<function id>)`` and returns ``next_call_id``. The executor's ``poll``, ``logs``
and ``cancel`` follow the chain to the latest call. The fake's ``exception`` is the real ``modal.exception``.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from diloco_serverless.executors import ReplicaStatus
from diloco_serverless.executors import modal as modal_executor
from diloco_serverless.executors._remote import (
    CALL_TIMEOUT_ENV,
    FUNCTION_ID_ENV,
    ReplicaProcessError,
    run_replica_process,
)
from diloco_serverless.executors.base import CONTINUE_MARKER
from diloco_serverless.executors.modal import ModalExecutor
from diloco_serverless.executors.registry import executor_for_handle
from support import pythonpath_env
from support.fake_modal import call_result, fake_modal_module, install_fake_modal

modal_exception = pytest.importorskip("modal.exception")

RUN_URL = "s3://bucket/runs/run-long"
REPLICA = "support.continue_replica"


class Fake:
    """The fake ``modal``: one function ``fu-fn``; calls ``fc-<n>`` whose ``get`` outcome is scripted."""

    def __init__(self) -> None:
        self.spawns: list[tuple[str, tuple[Any, ...]]] = []  # (function id, args)
        self.outcomes: dict[str, Any] = {}  # call id -> result, exception, or "running"
        self.cancelled: list[str] = []
        self.from_id: list[str] = []

    def call(self, call_id: str, outcome: Any = "running") -> str:
        self.outcomes[call_id] = outcome
        return call_id

    def module(self) -> types.ModuleType:
        fake = self

        class Call:
            def __init__(self, call_id: str) -> None:
                self.object_id = call_id
                self.logs = types.SimpleNamespace(tail=lambda entries=100: [
                    types.SimpleNamespace(message=f"log of {call_id}\n")])

            def get(self, timeout: float | None = None) -> Any:
                return call_result(fake.outcomes[self.object_id], modal_exception)

            def cancel(self, terminate_containers: bool = False) -> None:
                assert terminate_containers
                fake.cancelled.append(self.object_id)
                fake.outcomes[self.object_id] = modal_exception.InputCancellation("cancelled")

            def get_call_graph(self) -> list[Any]:
                return [types.SimpleNamespace(function_call_id=self.object_id, task_id="ta-1")]

        class Fn:
            object_id = "fu-fn"

            def spawn(self, *args: Any) -> Call:
                call_id = fake.call(f"fc-{len(fake.spawns)}")
                fake.spawns.append((self.object_id, args))
                return Call(call_id)

        class App:
            def __init__(self, name: str | None = None) -> None:
                self.name, self.app_id = name, "ap-1"

            def function(self, **options: Any) -> Any:
                return lambda raw_f: Fn()

            @contextmanager
            def run(self, **kw: Any) -> Iterator[Any]:
                yield self

        def function_from_id(function_id: str) -> Fn:
            fake.from_id.append(function_id)
            assert function_id == "fu-fn", function_id
            return Fn()

        def call_from_id(call_id: str) -> Call:
            if call_id not in fake.outcomes:
                raise modal_exception.NotFoundError(f"no call {call_id}")
            return Call(call_id)

        @contextmanager
        def enable_output() -> Iterator[None]:
            yield

        return fake_modal_module(
            modal_exception,
            App=App,
            Function=types.SimpleNamespace(from_id=function_from_id),
            FunctionCall=types.SimpleNamespace(from_id=call_from_id),
            Image=types.SimpleNamespace(debian_slim=lambda **kw: types.SimpleNamespace(
                pip_install=lambda *a: types.SimpleNamespace(add_local_python_source=lambda *m: "image"))),
            enable_output=enable_output,
        )


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Fake:
    f = Fake()
    install_fake_modal(monkeypatch, f.module())
    return f


def _inputs(**more: str) -> dict[str, str]:
    return {"PYTHONPATH": pythonpath_env(), "DILOCO_RUN_URL": RUN_URL, FUNCTION_ID_ENV: "fu-fn",
            CALL_TIMEOUT_ENV: "600", "DILOCO_ATTEMPT": "0", "FAKE_CONTINUE_ATTEMPTS": "1", **more}


def test_the_wrapper_tells_the_deadline_and_starts_the_next_call_itself(
    fake: Fake, capfd: pytest.CaptureFixture[str]
) -> None:
    before = time.time()
    result = run_replica_process(1, REPLICA, ["--x"], _inputs())
    out = capfd.readouterr().out
    # the replica saw the call's deadline (its start + the function timeout) and its chain index
    line = next(ln for ln in out.splitlines() if ln.startswith("continue replica rank=1 attempt=0"))
    deadline = float(line.rsplit("deadline=", 1)[1])
    assert before + 600 <= deadline <= time.time() + 600
    # it exited 75: the call spawned the next one (same function, inputs, attempt + 1) and returned its id
    assert result == {"rank": 1, "exit_code": 75, "next_call_id": "fc-0", "attempt": 0}
    assert fake.from_id == ["fu-fn"]
    ((function_id, args),) = fake.spawns
    assert function_id == "fu-fn" and args[:3] == (1, REPLICA, ["--x"])
    assert args[3] == {**_inputs(), "DILOCO_ATTEMPT": "1"}
    assert f"{CONTINUE_MARKER}: attempt 1 of rank 1 runs in call fc-0" in out
    # the next call runs attempt 1, which finishes
    assert run_replica_process(*args) == {"rank": 1, "exit_code": 0}
    assert "continue replica rank=1 attempt=1" in capfd.readouterr().out


def test_the_wrapper_without_a_function_id_leaves_it_to_the_retry_policy(fake: Fake) -> None:
    inputs = {k: v for k, v in _inputs().items() if k != FUNCTION_ID_ENV}
    with pytest.raises(ReplicaProcessError, match=f"no {FUNCTION_ID_ENV} to start the next one"):
        run_replica_process(0, REPLICA, [], inputs)
    assert fake.spawns == []


def test_launch_passes_the_chain_inputs(fake: Fake) -> None:
    ex = ModalExecutor(gpu="A100", timeout_s=3600, show_output=False)
    handles = ex.launch_replicas(2, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    assert [h.data["function_call_id"] for h in handles] == ["fc-0", "fc-1"]
    for rank, (_, args) in enumerate(fake.spawns):
        assert args[0] == rank
        assert args[3] == {"DILOCO_RUN_URL": RUN_URL, CALL_TIMEOUT_ENV: "3600", "DILOCO_ATTEMPT": "0",
                           FUNCTION_ID_ENV: "fu-fn"}


def test_poll_logs_and_cancel_follow_the_chain(fake: Fake) -> None:
    ex = ModalExecutor(gpu="A100", show_output=False)
    (handle,) = ex.launch_replicas(1, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    fake.outcomes["fc-0"] = {"rank": 0, "exit_code": 75, "next_call_id": fake.call("fc-7"), "attempt": 0}
    fake.outcomes["fc-7"] = {"rank": 0, "exit_code": 75, "next_call_id": fake.call("fc-8"), "attempt": 1}
    (state,) = ex.poll([handle])
    assert state.status is ReplicaStatus.RUNNING and state.attempt == 2
    assert state.detail["function_call_id"] == "fc-8"
    assert ex.logs(handle) == "log of fc-8"
    # another process (from the handle in run.json) finds the same latest call
    other = executor_for_handle(handle.to_json(), show_output=False)
    assert other.poll([handle])[0].detail["function_call_id"] == "fc-8"
    other.cancel([handle])
    assert fake.cancelled == ["fc-8"]  # only the latest call: the earlier ones have ended
    assert ex.poll([handle])[0].status is ReplicaStatus.CANCELLED
    # a chain that ends well is succeeded
    fake.outcomes["fc-8"] = {"rank": 0, "exit_code": 0}
    assert ex.poll([handle])[0].status is ReplicaStatus.SUCCEEDED


def test_cancel_also_stops_a_call_started_while_cancelling(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    ex = ModalExecutor(gpu="A100", show_output=False)
    (handle,) = ex.launch_replicas(1, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    calls = sys.modules["modal"].FunctionCall
    from_id = calls.from_id

    def racing_from_id(call_id: str) -> Any:
        call = from_id(call_id)
        if call_id == "fc-0":
            def cancel(terminate_containers: bool = False) -> None:
                # the container had just spawned the next call and returned when the cancel arrived
                fake.cancelled.append("fc-0")
                fake.outcomes["fc-0"] = {"rank": 0, "exit_code": 75, "next_call_id": fake.call("fc-5")}
            call.cancel = cancel
        return call

    monkeypatch.setattr(calls, "from_id", racing_from_id)
    ex.cancel([handle])
    assert fake.cancelled == ["fc-0", "fc-5"]


def test_a_forged_or_endless_chain_is_not_followed(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    ex = ModalExecutor(gpu="A100", show_output=False)
    (handle,) = ex.launch_replicas(1, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    fake.outcomes["fc-0"] = {"rank": 0, "exit_code": 75, "next_call_id": "../../fc-1"}
    state = ex.poll([handle])[0]
    assert state.status is ReplicaStatus.FAILED and "refusing to follow it" in (state.reason or "")
    # a call that stopped without starting the next one: continue, for whoever waits to start a fresh attempt
    fake.outcomes["fc-0"] = {"rank": 0, "exit_code": 75}
    state = ex.poll([handle])[0]
    assert state.status is ReplicaStatus.CONTINUE and state.exit_code == 75
    assert "start a fresh attempt" in (state.reason or "")
    # a loop of hand-overs ends at the bound
    monkeypatch.setattr(modal_executor, "MAX_CHAIN_CALLS", 3)
    fake.outcomes["fc-0"] = {"rank": 0, "exit_code": 75, "next_call_id": fake.call("fc-1")}
    fake.outcomes["fc-1"] = {"rank": 0, "exit_code": 75, "next_call_id": fake.call("fc-2")}
    fake.outcomes["fc-2"] = {"rank": 0, "exit_code": 75, "next_call_id": "fc-0"}
    fresh = ModalExecutor(gpu="A100", show_output=False)
    state = fresh.poll([handle])[0]
    assert state.status is ReplicaStatus.FAILED and "longer than 3" in (state.reason or "")
