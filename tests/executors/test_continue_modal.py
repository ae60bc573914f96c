"""Modal runs longer than a call's cap: a chain of calls per rank, through the real ``modal`` SDK against
a fake of Modal's server (tests/support/modal_grpc_server.py: gRPC on 127.0.0.1; only the network is fake).

The container wrapper (``_remote.run_replica_process``) runs a real replica process
(tests/support/continue_replica.py) that exits 75; the wrapper spawns the next call itself through
``modal.Function.from_id(<function id>)`` and returns ``next_call_id``. The executor's ``poll``, ``logs``
and ``cancel`` follow the chain to the latest call.
"""

from __future__ import annotations

import time
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

pytest.importorskip("modal")

from modal._serialization import deserialize  # noqa: E402

from support.modal_grpc_server import FakeModalServer, fake_modal  # noqa: E402

RUN_URL = "s3://bucket/runs/run-long"
REPLICA = "support.continue_replica"


@pytest.fixture
def srv(monkeypatch: pytest.MonkeyPatch) -> Any:
    with fake_modal(monkeypatch) as server:
        yield server


def _launch(srv: FakeModalServer, **options: Any) -> tuple[ModalExecutor, Any, str]:
    ex = ModalExecutor(gpu=None, show_output=False, **options)
    (handle,) = ex.launch_replicas(1, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    return ex, handle, srv.sent("FunctionMap")[0].function_id


def _spawn_from(srv: FakeModalServer, parent: str | None = None) -> str:
    """A call of the run's function, spawned (by the SDK) from inside ``parent``'s input, like a container's."""
    import modal
    from modal._runtime.execution_context import _set_current_context_ids

    function_id = srv.sent("FunctionMap")[0].function_id
    reset = _set_current_context_ids([srv.calls[parent].input_id], [parent], [""]) if parent else None
    try:
        return str(modal.Function.from_id(function_id).spawn(0, "m", [], {}).object_id)
    finally:
        if reset is not None:
            reset()


def _inputs(function_id: str, **more: str) -> dict[str, str]:
    return {"PYTHONPATH": pythonpath_env(), "DILOCO_RUN_URL": RUN_URL, FUNCTION_ID_ENV: function_id,
            CALL_TIMEOUT_ENV: "600", "DILOCO_ATTEMPT": "0", "FAKE_CONTINUE_ATTEMPTS": "1", **more}


def test_the_wrapper_tells_the_deadline_and_starts_the_next_call_itself(
    srv: FakeModalServer, capfd: pytest.CaptureFixture[str]
) -> None:
    _, _, function_id = _launch(srv)
    before = time.time()
    result = run_replica_process(1, REPLICA, ["--x"], _inputs(function_id))
    out = capfd.readouterr().out
    # the replica saw the call's deadline (its start + the function timeout) and its chain index
    line = next(ln for ln in out.splitlines() if ln.startswith("continue replica rank=1 attempt=0"))
    deadline = float(line.rsplit("deadline=", 1)[1])
    assert before + 600 <= deadline <= time.time() + 600
    # it exited 75: the call spawned the next one (same function, inputs, attempt + 1) and returned its id
    assert [r.function_id for r in srv.sent("FunctionGetById")] == [function_id]
    first, spawned = srv.sent("FunctionMap")
    assert spawned.function_id == function_id
    assert result == {"rank": 1, "exit_code": 75, "next_call_id": max(srv.calls, key=lambda c: int(c[3:])),
                      "attempt": 0}
    args = deserialize(spawned.pipelined_inputs[0].input.args, None)[0]
    assert args[:3] == (1, REPLICA, ["--x"])
    assert args[3] == {**_inputs(function_id), "DILOCO_ATTEMPT": "1"}
    assert f"{CONTINUE_MARKER}: attempt 1 of rank 1 runs in call {result['next_call_id']}" in out
    # the next call runs attempt 1, which finishes
    assert run_replica_process(*args) == {"rank": 1, "exit_code": 0}
    assert "continue replica rank=1 attempt=1" in capfd.readouterr().out


def test_the_wrapper_without_a_function_id_leaves_it_to_the_retry_policy(srv: FakeModalServer) -> None:
    _, _, function_id = _launch(srv)
    inputs = {k: v for k, v in _inputs(function_id).items() if k != FUNCTION_ID_ENV}
    with pytest.raises(ReplicaProcessError, match=f"no {FUNCTION_ID_ENV} to start the next one"):
        run_replica_process(0, REPLICA, [], inputs)
    assert len(srv.sent("FunctionMap")) == 1


def test_a_function_modal_does_not_know_is_left_to_the_retry_policy(srv: FakeModalServer) -> None:
    _launch(srv)
    with pytest.raises(ReplicaProcessError, match="starting the next call of function fu-nope failed .*NotFoundError"):
        run_replica_process(0, REPLICA, [], _inputs("fu-nope"))


def test_launch_passes_the_chain_inputs(srv: FakeModalServer) -> None:
    ex = ModalExecutor(gpu=None, timeout_s=3600, show_output=False)
    handles = ex.launch_replicas(2, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    spawns = srv.sent("FunctionMap")
    assert [h.data["function_call_id"] for h in handles] == sorted(srv.calls, key=lambda c: int(c[3:]))
    for rank, req in enumerate(spawns):
        args = deserialize(req.pipelined_inputs[0].input.args, None)[0]
        assert args[0] == rank
        assert args[3] == {"DILOCO_RUN_URL": RUN_URL, CALL_TIMEOUT_ENV: "3600", "DILOCO_ATTEMPT": "0",
                           FUNCTION_ID_ENV: req.function_id}


def test_poll_logs_and_cancel_follow_the_chain(srv: FakeModalServer) -> None:
    ex, handle, _ = _launch(srv)
    first = handle.data["function_call_id"]
    second = _spawn_from(srv, first)
    srv.finish(first, {"rank": 0, "exit_code": 75, "next_call_id": second, "attempt": 0})
    third = _spawn_from(srv, second)
    srv.finish(second, {"rank": 0, "exit_code": 75, "next_call_id": third, "attempt": 1})
    # Modal nests each chained call under the input that spawned it: the call graph is 3 deep
    assert srv.calls[third].parent_input_id == srv.calls[second].input_id != ""
    assert srv.calls[second].parent_input_id == srv.calls[first].input_id
    srv.start(third)
    srv.log(third, f"log of {third}")
    (state,) = ex.poll([handle])
    assert state.status is ReplicaStatus.RUNNING and state.attempt == 2
    assert state.detail["function_call_id"] == third
    assert ex.logs(handle) == f"log of {third}"
    # another process (from the handle in run.json) finds the same latest call
    other = executor_for_handle(handle.to_json(), show_output=False)
    assert other.poll([handle])[0].detail["function_call_id"] == third
    other.cancel([handle])
    assert [r.function_call_id for r in srv.sent("FunctionCallCancel")] == [third]  # the earlier ones ended
    assert ex.poll([handle])[0].status is ReplicaStatus.CANCELLED


def test_a_chain_that_ends_well_is_succeeded(srv: FakeModalServer) -> None:
    ex, handle, _ = _launch(srv)
    first = handle.data["function_call_id"]
    second = _spawn_from(srv, first)
    srv.finish(first, {"rank": 0, "exit_code": 75, "next_call_id": second, "attempt": 0})
    srv.finish(second, {"rank": 0, "exit_code": 0})
    (state,) = ex.poll([handle])
    assert state.status is ReplicaStatus.SUCCEEDED and state.attempt == 1


def test_cancel_also_stops_a_call_started_while_cancelling(srv: FakeModalServer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    ex, handle, _ = _launch(srv)
    first = handle.data["function_call_id"]
    answer = srv.rpc_FunctionCallCancel
    started: list[str] = []

    def racing_cancel(req: Any) -> Any:
        if req.function_call_id == first and not started:
            # the container had just spawned the next call and returned when the cancel arrived
            started.append(_spawn_from(srv, first))
            srv.finish(first, {"rank": 0, "exit_code": 75, "next_call_id": started[0]})
        return answer(req)

    monkeypatch.setattr(srv, "rpc_FunctionCallCancel", racing_cancel)
    ex.cancel([handle])
    assert [r.function_call_id for r in srv.sent("FunctionCallCancel")] == [first, started[0]]


def test_a_forged_or_endless_chain_is_not_followed(srv: FakeModalServer, monkeypatch: pytest.MonkeyPatch) -> None:
    ex, handle, _ = _launch(srv)
    first = handle.data["function_call_id"]
    srv.finish(first, {"rank": 0, "exit_code": 75, "next_call_id": "../../fc-1"})
    state = ex.poll([handle])[0]
    assert state.status is ReplicaStatus.FAILED and "refusing to follow it" in (state.reason or "")

    # a call that stopped without starting the next one: continue, for whoever waits to start a fresh attempt
    ex, handle, _ = _launch(srv)
    srv.finish(handle.data["function_call_id"], {"rank": 0, "exit_code": 75})
    state = ex.poll([handle])[0]
    assert state.status is ReplicaStatus.CONTINUE and state.exit_code == 75
    assert "start a fresh attempt" in (state.reason or "")

    # a loop of hand-overs ends at the bound
    monkeypatch.setattr(modal_executor, "MAX_CHAIN_CALLS", 3)
    ex, handle, _ = _launch(srv)
    a = handle.data["function_call_id"]
    b, c = _spawn_from(srv, a), _spawn_from(srv, a)
    srv.finish(a, {"rank": 0, "exit_code": 75, "next_call_id": b})
    srv.finish(b, {"rank": 0, "exit_code": 75, "next_call_id": c})
    srv.finish(c, {"rank": 0, "exit_code": 75, "next_call_id": a})
    state = ModalExecutor(gpu=None, show_output=False).poll([handle])[0]
    assert state.status is ReplicaStatus.FAILED and "longer than 3" in (state.reason or "")
