"""ModalExecutor through the real ``modal`` SDK, with only the network replaced.

``tests/support/modal_grpc_server.py`` is a gRPC server on 127.0.0.1 speaking Modal's API; the SDK's
own ``App.run``, ``Function.spawn``, ``FunctionCall.from_id`` / ``get`` / ``get_call_graph`` /
``cancel`` / ``logs.tail`` and ``Function.from_id`` run unchanged against it, and every request is
recorded. Run by CI at the latest modal (constraints.txt) and at the floor (``.ci/run``).
"""

from __future__ import annotations

import pytest

from diloco_serverless.executors import ReplicaStatus
from diloco_serverless.executors._remote import CALL_TIMEOUT_ENV, FUNCTION_ID_ENV, ReplicaProcessError
from diloco_serverless.executors.modal import FUNCTION_NAME, MAX_LOG_ENTRIES, ModalExecutor
from diloco_serverless.executors.registry import executor_for_handle
from support import pythonpath_env

modal = pytest.importorskip("modal")

from modal._serialization import deserialize  # noqa: E402
from modal_proto import api_pb2  # noqa: E402

from support.modal_grpc_server import FakeModalServer, fake_modal  # noqa: E402

pytestmark = pytest.mark.sdk

RUN_URL = "s3://bucket/runs/run-t1"


@pytest.fixture
def srv(monkeypatch: pytest.MonkeyPatch) -> FakeModalServer:
    with fake_modal(monkeypatch) as server:
        yield server


def _spawned_inputs(srv: FakeModalServer) -> list[tuple[object, ...]]:
    return [deserialize(req.pipelined_inputs[0].input.args, None)[0] for req in srv.sent("FunctionMap")]


def test_launch_runs_a_detached_app_and_spawns_one_call_per_rank(srv: FakeModalServer) -> None:
    ex = ModalExecutor(gpu="T4", secrets=["aws"], retries=2, timeout_s=900, show_output=False)
    handles = ex.launch_replicas(2, "diloco_serverless.entrypoints.replica", ["--run-url", RUN_URL],
                                 env={"DILOCO_RUN_URL": RUN_URL, "AWS_SECRET_ACCESS_KEY": "leak"})
    (app,) = srv.sent("AppCreate")
    assert app.app_state == api_pb2.APP_STATE_DETACHED and app.description == "diloco-run-t1"
    (create,) = srv.sent("FunctionCreate")
    fn = create.function
    assert fn.function_name == FUNCTION_NAME and fn.timeout_secs == 900 and fn.retry_policy.retries == 2
    assert fn.resources.gpu_config.gpu_type == "T4" and len(fn.secret_ids) == 1
    assert [r.deployment_name for r in srv.sent("SecretGetOrCreate")] == ["aws"]
    # each rank is one call of the function, with the chain inputs and no credential
    function_id = srv.sent("FunctionMap")[0].function_id
    inputs = _spawned_inputs(srv)
    assert [i[0] for i in inputs] == [0, 1]
    assert inputs[1][3] == {"DILOCO_RUN_URL": RUN_URL, CALL_TIMEOUT_ENV: "900", "DILOCO_ATTEMPT": "0",
                            FUNCTION_ID_ENV: function_id}
    # the launcher disconnects from the detached App once every call is spawned
    names = srv.rpc_names()
    assert names.index("AppClientDisconnect") > max(i for i, n in enumerate(names) if n == "FunctionMap")
    assert [h.data["function_call_id"] for h in handles] == sorted(srv.calls)
    assert handles[0].data["app_id"] == app_id_of(srv) and handles[0].data["app_mode"] == "detached"


def app_id_of(srv: FakeModalServer) -> str:
    (app_id,) = srv.apps
    return app_id


def test_poll_while_running_and_after_each_ending(srv: FakeModalServer) -> None:
    """The first real run's bug: a call still running made ``get(timeout=0)`` raise the builtin
    TimeoutError, which was reported ``failed``."""
    ex = ModalExecutor(gpu=None, retries=0, show_output=False)
    handles = ex.launch_replicas(6, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    ids = [h.data["function_call_id"] for h in handles]
    assert [s.status for s in ex.poll(handles)] == [ReplicaStatus.PENDING] * 6
    for call_id in ids:
        srv.start(call_id)
    states = ex.poll(handles)
    assert [s.status for s in states] == [ReplicaStatus.RUNNING] * 6, [s.reason for s in states]
    assert all(req.timeout == 0 for req in srv.sent("FunctionGetOutputs"))  # a poll never waits

    srv.finish(ids[0], {"rank": 0, "exit_code": 0})
    srv.fail(ids[1], ReplicaProcessError("replica rank 1 exited with code 4; last output:\nboom"))
    srv.time_out(ids[2])
    srv.finish(ids[3], {"rank": 3, "exit_code": 2, "reason": "error: bad config", "retried": False})
    srv.expire(ids[4])
    states = ex.poll(handles)
    assert [s.status for s in states] == [ReplicaStatus.SUCCEEDED, ReplicaStatus.FAILED, ReplicaStatus.FAILED,
                                          ReplicaStatus.FAILED, ReplicaStatus.UNKNOWN, ReplicaStatus.RUNNING]
    assert states[1].exit_code == 4 and "ReplicaProcessError" in (states[1].reason or "")
    assert "timed out" in (states[2].reason or "")
    assert states[3].exit_code == 2 and "setup error, not retried" in (states[3].reason or "")
    assert states[4].ended and "heartbeat" in (states[4].reason or "")


def test_logs_are_clamped_to_modals_cap_and_cancel_terminates(srv: FakeModalServer) -> None:
    ex = ModalExecutor(gpu=None, show_output=False)
    handles = ex.launch_replicas(2, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    first = handles[0].data["function_call_id"]
    srv.start(first)
    srv.log(first, "step 1", "step 2", "step 3")
    assert ex.logs(handles[0], tail=2) == "step 2\nstep 3"
    assert ex.logs(handles[0], tail=25_000) == "step 1\nstep 2\nstep 3"  # the SDK refuses more than 20,000
    assert {r.limit for r in srv.sent("AppFetchLogs")} == {2, MAX_LOG_ENTRIES}
    assert all(r.function_call_id == first for r in srv.sent("AppFetchLogs"))

    other = executor_for_handle(handles[0].to_json(), show_output=False)  # e.g. `diloco cancel` later
    other.cancel(handles)
    assert [(r.function_call_id, r.terminate_containers) for r in srv.sent("FunctionCallCancel")] == [
        (h.data["function_call_id"], True) for h in handles]
    assert [s.status for s in other.poll(handles)] == [ReplicaStatus.CANCELLED] * 2


def test_a_deployed_app_is_looked_up_and_overridden_per_launch(srv: FakeModalServer) -> None:
    ex = ModalExecutor(gpu="L4", deployed_app="diloco-serverless", retries=0, timeout_s=600, show_output=False)
    (handle,) = ex.launch_replicas(1, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    (get,) = srv.sent("FunctionGet")
    assert (get.app_name, get.object_tag) == ("diloco-serverless", FUNCTION_NAME)
    assert not srv.sent("AppCreate")
    (spawn,) = srv.sent("FunctionMap")
    assert spawn.function_id.startswith("fu-deployed-diloco-serverless-run_replica-bound-")
    (bind,) = srv.sent("FunctionBindParams")
    options = bind.function_options
    assert options.timeout_secs == 600 and options.retry_policy.retries == 0  # retries=0 is a policy
    assert options.resources.gpu_config.gpu_type == "L4"
    assert handle.data["app_mode"] == "deployed" and handle.data["app_name"] == "diloco-serverless"


@pytest.mark.slow
def test_a_chain_of_calls_across_the_cap_runs_through_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call runs ``run_replica_process`` in a container subprocess; the replica stops before the
    call's cap (exit 75) and the call spawns the next one with ``modal.Function.from_id`` (new in modal
    1.6.0) from inside the running input, so Modal lists it under that input's ``children``."""
    env = {"PYTHONPATH": pythonpath_env(), "FAKE_CONTINUE_ATTEMPTS": "1"}
    with fake_modal(monkeypatch, execute=True) as srv:
        ex = ModalExecutor(gpu=None, retries=0, timeout_s=600, show_output=False, poll_interval_s=0.1)
        (handle,) = ex.launch_replicas(1, "support.continue_replica", [], env={"DILOCO_RUN_URL": RUN_URL, **env})
        first = handle.data["function_call_id"]
        srv.wait_ended(first)
        (second,) = srv.children(first)
        srv.wait_ended(second.call_id)
        assert srv.sent("FunctionGetById")[0].function_id == srv.sent("FunctionMap")[0].function_id
        assert srv.sent("FunctionMap")[1].parent_input_id == srv.calls[first].input_id
        (state,) = ex.poll([handle])
        assert state.status is ReplicaStatus.SUCCEEDED and state.attempt == 1
        assert state.detail["function_call_id"] == second.call_id
        assert "continue replica rank=0 attempt=1" in ex.logs(handle)
        assert "[diloco] continue" in "\n".join(srv.calls[first].logs)


def test_a_chained_call_still_running_is_found_in_its_parents_children(srv: FakeModalServer) -> None:
    """The call graph of a chained call nests it under the input that spawned it."""
    ex = ModalExecutor(gpu=None, show_output=False)
    (handle,) = ex.launch_replicas(1, "m", [], env={"DILOCO_RUN_URL": RUN_URL})
    first = handle.data["function_call_id"]
    srv.start(first)
    # the container spawns the next call from inside its input, then returns its id
    fn_id = srv.sent("FunctionMap")[0].function_id
    import threading

    from modal._runtime.execution_context import _set_current_context_ids

    spawned: list[str] = []

    def in_container() -> None:
        _set_current_context_ids([srv.calls[first].input_id], [first], [""])
        spawned.append(modal.Function.from_id(fn_id).spawn(0, "m", [], {}).object_id)

    worker = threading.Thread(target=in_container)
    worker.start()
    worker.join(30)
    (second,) = spawned
    srv.finish(first, {"rank": 0, "exit_code": 75, "next_call_id": second, "attempt": 0})
    srv.start(second)
    (state,) = ex.poll([handle])
    assert state.status is ReplicaStatus.RUNNING, state.reason
    assert state.detail["function_call_id"] == second and state.attempt == 1
