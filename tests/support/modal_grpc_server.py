"""A fake of Modal's *server*: a gRPC server on 127.0.0.1 that answers the RPCs of Modal's API
(``modal_proto``), so that the real ``modal`` SDK runs unchanged against it.

Only the network is replaced: ``modal.FunctionCall``, ``modal.Function``, ``App.run``, the SDK's own
client, its retries and its translation of gRPC errors (``NOT_FOUND`` -> ``modal.exception.NotFoundError``)
all run as they do against Modal. Every request is recorded (``server.requests``, in order).

::

    with FakeModalServer() as srv:
        srv.install(monkeypatch)            # MODAL_SERVER_URL + fake tokens, a fresh SDK client
        ... ModalExecutor(...).launch_replicas(...) ...
        srv.start(call_id); srv.finish(call_id, {"exit_code": 0})   # script a call's life
        srv.rpc_names()                     # what the SDK sent

The world it keeps: apps, functions (``fu-N``), function calls (``fc-N``, each one input ``in-N``, a
``parent_input_id`` when spawned from inside a running input), a call's state (queued, running on a
task, or ended with a result), its log lines and the cancellations. With ``execute=True`` every spawned
call runs in a container of its own: a subprocess (``tests/support/modal_container.py``) that
deserialises the call's inputs, runs the function registered for it (the real ``run_replica_process``),
with this server as its Modal and the input's id as its current input, so that a call spawned there
(the next call of a chain) is the input's child, as on Modal; its output is the call's log and its
return value or exception the call's result. With ``mounts=True`` as well the server keeps the files
the SDK uploads (``MountBatchedCheckExistence`` names every file it has not seen missing, so the SDK
sends each one with ``MountPutFile``) and each container starts in a folder of its own where the
function's mounts (``Function.mount_ids``: the image's ``add_local_*`` layers) are laid out by their
remote paths, its working directory standing for ``/root``: what the container imports from there is
what the launcher sent.

What is Modal's server behaviour and not the SDK's is modelled as the SDK's source and docs describe it:
``FunctionGetOutputs`` with a timeout of 0 returns no output and ``num_unfinished_inputs=1`` while the
call runs (``_Invocation.poll_function`` then raises the builtin ``TimeoutError``); a chained call is
listed in the call graph under its parent's input; a cancelled call ends ``TERMINATED``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

modal = pytest.importorskip("modal")

from grpclib import GRPCError, Status  # noqa: E402
from grpclib.const import Cardinality  # noqa: E402
from grpclib.server import Server  # noqa: E402
from modal._serialization import deserialize, serialize  # noqa: E402
from modal_proto import api_grpc, api_pb2  # noqa: E402

__all__ = ["FakeModalServer", "ModalCall"]

CONTAINER = Path(__file__).with_name("modal_container.py")


@dataclass
class ModalCall:
    """One function call (one input) as the fake server keeps it."""

    call_id: str
    input_id: str
    function_id: str
    app_id: str
    args: bytes
    parent_input_id: str = ""
    task_id: str = ""
    result: api_pb2.GenericResult | None = None
    logs: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    cancelled: bool = False

    @property
    def ended(self) -> bool:
        return self.result is not None


class FakeModalServer:
    """``with FakeModalServer() as srv``: Modal's API on ``srv.url``; see the module docstring."""

    def __init__(self, *, execute: bool = False, container_env: dict[str, str] | None = None,
                 mounts: bool = False) -> None:
        self.execute, self.container_env, self.mounts = execute, dict(container_env or {}), mounts
        #: uploaded file contents by SHA-256, and each mount's files ``(remote path, sha256, mode)`` (``mounts=True``)
        self.blobs: dict[str, bytes] = {}
        self.mount_files: dict[str, list[tuple[str, str, int]]] = {}
        #: the Modal Secrets the workspace has (None: any name looked up exists)
        self.secrets: set[str] | None = None
        self.requests: list[tuple[str, Any]] = []
        self.apps: dict[str, dict[str, Any]] = {}
        self.functions: dict[str, dict[str, Any]] = {}
        self.calls: dict[str, ModalCall] = {}
        self.lock = threading.RLock()
        self._counter = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._workdir = Path(tempfile.mkdtemp(prefix="fake-modal-"))
        self.port = 0

    # --- lifecycle ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeModalServer:
        self._thread = threading.Thread(target=self._serve, name="fake-modal-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the fake Modal server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            procs = [c.proc for c in self.calls.values() if c.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        if self._loop is not None and self._server is not None:
            server, loop = self._server, self._loop

            async def stop() -> None:
                server.close()
                await server.wait_closed()

            asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        _reset_sdk_client()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._server = Server([_servicer(self)])
        loop.run_until_complete(self._server.start("127.0.0.1", 0))
        sockets = self._server._server.sockets if self._server._server else []  # grpclib keeps the asyncio server
        self.port = sockets[0].getsockname()[1]
        self._ready.set()
        loop.run_forever()
        loop.close()

    def environ(self) -> dict[str, str]:
        """What a process needs to use this server as its Modal."""
        return {"MODAL_SERVER_URL": self.url, "MODAL_TOKEN_ID": "ak-fake", "MODAL_TOKEN_SECRET": "as-fake"}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point this process's SDK at the server (environment and a fresh client), undone at the test's end."""
        for key, value in self.environ().items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("MODAL_PROFILE", raising=False)
        monkeypatch.setenv("MODAL_CONFIG_PATH", str(self._workdir / "absent.toml"))
        _reset_sdk_client()

    # --- what the SDK sent ----------------------------------------------------------------------
    def rpc_names(self) -> list[str]:
        with self.lock:
            return [name for name, _ in self.requests]

    def sent(self, name: str) -> list[Any]:
        with self.lock:
            return [req for n, req in self.requests if n == name]

    # --- scripting a call's life ----------------------------------------------------------------
    def start(self, call_id: str, task_id: str | None = None) -> None:
        """A container took the call's input."""
        with self.lock:
            self.calls[call_id].task_id = task_id or f"ta-{call_id[3:]}"

    def finish(self, call_id: str, value: Any) -> None:
        """The call returned ``value``."""
        self._end(call_id, api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS,
                                                 data=serialize(value)))

    def fail(self, call_id: str, exc: BaseException) -> None:
        """The call raised ``exc`` (serialised as Modal sends a user exception)."""
        self._end(call_id, api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_FAILURE,
                                                 exception=repr(exc), data=serialize(exc)))

    def time_out(self, call_id: str) -> None:
        self._end(call_id, api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT,
                                                 exception="Function timed out"))

    def expire(self, call_id: str) -> None:
        """The call ended so long ago that Modal no longer keeps its output."""
        with self.lock:
            call = self.calls[call_id]
            call.result = api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS)
            call.args = b"expired"

    def log(self, call_id: str, *lines: str) -> None:
        with self.lock:
            self.calls[call_id].logs.extend(lines)

    def wait_ended(self, call_id: str, timeout_s: float = 60.0) -> ModalCall:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                call = self.calls.get(call_id)
                if call is not None and call.ended:
                    return call
            time.sleep(0.05)
        raise TimeoutError(f"call {call_id} did not end in {timeout_s} s")

    def children(self, call_id: str) -> list[ModalCall]:
        with self.lock:
            parent = self.calls[call_id].input_id
            return [c for c in self.calls.values() if c.parent_input_id == parent]

    def _end(self, call_id: str, result: api_pb2.GenericResult) -> None:
        with self.lock:
            call = self.calls[call_id]
            if call.result is None:
                call.result = result

    def _next(self, prefix: str) -> str:
        with self.lock:
            self._counter += 1
            return f"{prefix}-{self._counter}"

    # --- the RPCs -------------------------------------------------------------------------------
    def answer(self, name: str, request: Any, reply_type: type) -> Any:
        """The reply to one RPC; an RPC this fake does not model gets an empty reply of its type."""
        handler: Callable[[Any], Any] | None = getattr(self, f"rpc_{name}", None)
        if handler is None:
            return reply_type()
        return handler(request)

    def rpc_AppCreate(self, req: Any) -> Any:  # noqa: N802 (gRPC method names)
        app_id = self._next("ap")
        with self.lock:
            self.apps[app_id] = {"name": req.description, "state": req.app_state}
        return api_pb2.AppCreateResponse(app_id=app_id, app_page_url=f"https://modal.fake/apps/{app_id}")

    def rpc_EnvironmentGetOrCreate(self, req: Any) -> Any:  # noqa: N802
        return api_pb2.EnvironmentGetOrCreateResponse(environment_id="en-main",
                                                      metadata=api_pb2.EnvironmentMetadata(
            name="main", settings=api_pb2.EnvironmentSettings(image_builder_version="2025.06")))

    def rpc_AppGetLogs(self, req: Any) -> list[Any]:  # noqa: N802
        return [api_pb2.TaskLogsBatch(app_done=True, entry_id="1-0")]

    def rpc_SecretGetOrCreate(self, req: Any) -> Any:  # noqa: N802
        if self.secrets is not None and req.deployment_name not in self.secrets:
            raise GRPCError(Status.NOT_FOUND, f"Secret '{req.deployment_name}' not found")
        return api_pb2.SecretGetOrCreateResponse(secret_id=self._next("st"))

    def rpc_ImageGetOrCreate(self, req: Any) -> Any:  # noqa: N802
        return api_pb2.ImageGetOrCreateResponse(
            image_id=self._next("im"),
            result=api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS))

    def rpc_MountGetOrCreate(self, req: Any) -> Any:  # noqa: N802
        mount_id = self._next("mo")
        with self.lock:
            self.mount_files[mount_id] = [(f.filename, f.sha256_hex, f.mode) for f in req.files]
        return api_pb2.MountGetOrCreateResponse(mount_id=mount_id, handle_metadata=api_pb2.MountHandleMetadata())

    def rpc_MountBatchedCheckExistence(self, req: Any) -> Any:  # noqa: N802
        with self.lock:
            missing = [h for h in req.sha256_hex_hashes if h not in self.blobs] if self.mounts else []
        return api_pb2.MountBatchedCheckExistenceResponse(missing_sha256_hex_hashes=missing)

    def rpc_MountPutFile(self, req: Any) -> Any:  # noqa: N802
        if not self.mounts:
            return api_pb2.MountPutFileResponse(exists=True)
        if req.data_blob_id:
            raise GRPCError(Status.UNIMPLEMENTED, "the fake Modal server keeps no blobs (files over the SDK's limit)")
        with self.lock:
            if hashlib.sha256(req.data).hexdigest() == req.sha256_hex:  # an empty file too
                self.blobs[req.sha256_hex] = bytes(req.data)
            return api_pb2.MountPutFileResponse(exists=req.sha256_hex in self.blobs)

    def _function(self, function_id: str, name: str, app_id: str) -> Any:
        with self.lock:
            self.functions.setdefault(function_id, {"name": name, "app_id": app_id})
        return api_pb2.FunctionHandleMetadata(function_name=name, function_type=api_pb2.Function.FUNCTION_TYPE_FUNCTION,
                                              app_id=app_id)

    def rpc_FunctionPrecreate(self, req: Any) -> Any:  # noqa: N802
        fid = self._next("fu")
        return api_pb2.FunctionPrecreateResponse(function_id=fid,
                                                 handle_metadata=self._function(fid, req.function_name, req.app_id))

    def rpc_FunctionCreate(self, req: Any) -> Any:  # noqa: N802
        fid = req.existing_function_id or self._next("fu")
        data = req.function_data if req.function_data.ranked_functions else api_pb2.FunctionData(
            ranked_functions=[api_pb2.FunctionData.RankedFunction(rank=0, function=req.function)])
        with self.lock:
            self.functions.setdefault(fid, {}).update(definition=req.function, data=data)
        name = req.function.function_name or req.function_data.function_name
        return api_pb2.FunctionCreateResponse(function_id=fid, function=req.function, function_data=data,
                                              handle_metadata=self._function(fid, name, req.app_id))

    def rpc_FunctionGet(self, req: Any) -> Any:  # noqa: N802  (Function.from_name: a deployed app)
        fid = f"fu-deployed-{req.app_name}-{req.object_tag}"
        return api_pb2.FunctionGetResponse(function_id=fid,
                                           handle_metadata=self._function(fid, req.object_tag, "ap-deployed"))

    def rpc_FunctionBindParams(self, req: Any) -> Any:  # noqa: N802  (Function.with_options)
        with self.lock:
            parent = self.functions.get(req.function_id)
        if parent is None:
            raise GRPCError(Status.NOT_FOUND, f"Function {req.function_id} not found")
        fid = f"{req.function_id}-{self._next('bound')}"
        with self.lock:
            self.functions[fid] = {**parent, "options": req.function_options, "bound_to": req.function_id}
        return api_pb2.FunctionBindParamsResponse(
            bound_function_id=fid,
            handle_metadata=self._function(fid, parent.get("name", ""), parent.get("app_id", "")))

    def rpc_FunctionGetById(self, req: Any) -> Any:  # noqa: N802  (Function.from_id)
        with self.lock:
            known = self.functions.get(req.function_id)
        if known is None:
            raise GRPCError(Status.NOT_FOUND, f"Function {req.function_id} not found")
        return api_pb2.FunctionGetByIdResponse(
            function=known.get("data"),
            handle_metadata=self._function(req.function_id, known.get("name", ""), known.get("app_id", "")))

    def rpc_FunctionMap(self, req: Any) -> Any:  # noqa: N802  (Function.spawn)
        with self.lock:
            if req.function_id not in self.functions:
                raise GRPCError(Status.NOT_FOUND, f"Function {req.function_id} not found")
            (item,) = req.pipelined_inputs
            n = self._next("x").split("-")[1]
            call = ModalCall(call_id=f"fc-{n}", input_id=f"in-{n}", function_id=req.function_id,
                             app_id=self.functions[req.function_id].get("app_id", ""), args=item.input.args,
                             parent_input_id=req.parent_input_id)
            self.calls[call.call_id] = call
        if self.execute:
            self._run_container(call)
        return api_pb2.FunctionMapResponse(
            function_call_id=call.call_id,
            pipelined_inputs=[api_pb2.FunctionPutInputsResponseItem(idx=0, input_id=call.input_id)])

    def _call(self, call_id: str) -> ModalCall:
        with self.lock:
            call = self.calls.get(call_id)
        if call is None:
            raise GRPCError(Status.NOT_FOUND, f"Function call {call_id} not found")
        return call

    def rpc_FunctionGetOutputs(self, req: Any) -> Any:  # noqa: N802  (FunctionCall.get)
        call = self._call(req.function_call_id)
        if call.result is None:
            return api_pb2.FunctionGetOutputsResponse(num_unfinished_inputs=1)
        if call.args == b"expired":
            return api_pb2.FunctionGetOutputsResponse(num_unfinished_inputs=0)
        return api_pb2.FunctionGetOutputsResponse(
            num_unfinished_inputs=0,
            outputs=[api_pb2.FunctionGetOutputsItem(result=call.result, idx=0, input_id=call.input_id,
                                                    data_format=api_pb2.DATA_FORMAT_PICKLE)])

    def rpc_FunctionCallFromId(self, req: Any) -> Any:  # noqa: N802
        call = self._call(req.function_call_id)
        return api_pb2.FunctionCallFromIdResponse(
            function_call_id=call.call_id, num_inputs=1,
            metadata=api_pb2.FunctionCallHandleMetadata(app_id=call.app_id, function_id=call.function_id))

    def rpc_FunctionGetCallGraph(self, req: Any) -> Any:  # noqa: N802
        """The whole graph the call belongs to: from its root input down, chained calls as children."""
        with self.lock:
            call = self._call(req.function_call_id)
            by_input = {c.input_id: c for c in self.calls.values()}
            root = call
            while root.parent_input_id and root.parent_input_id in by_input:
                root = by_input[root.parent_input_id]
            members, todo = [], [root]
            while todo:
                node = todo.pop()
                members.append(node)
                todo += [c for c in self.calls.values() if c.parent_input_id == node.input_id]
            name = {fid: f.get("name", "") for fid, f in self.functions.items()}
            return api_pb2.FunctionGetCallGraphResponse(
                inputs=[api_pb2.InputCallGraphInfo(input_id=c.input_id, function_call_id=c.call_id, task_id=c.task_id,
                                                   status=_input_status(c)) for c in members],
                function_calls=[api_pb2.FunctionCallCallGraphInfo(
                    function_call_id=c.call_id, parent_input_id=c.parent_input_id,
                    function_name=name.get(c.function_id, ""), module_name="") for c in members])

    def rpc_FunctionCallCancel(self, req: Any) -> Any:  # noqa: N802
        call = self._call(req.function_call_id)
        with self.lock:
            call.cancelled = True
            proc = call.proc
        if proc is not None and proc.poll() is None and req.terminate_containers:
            proc.kill()
        self._end(call.call_id, api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_TERMINATED,
                                                      exception="Function call was cancelled by the user"))
        return None  # google.protobuf.Empty

    def rpc_AppFetchLogs(self, req: Any) -> Any:  # noqa: N802  (FunctionCall.logs.tail)
        with self.lock:
            call = self.calls.get(req.function_call_id)
            lines = list(call.logs) if call is not None else []
        lines = lines[-req.limit:] if req.limit else lines
        now = time.time()
        items = [api_pb2.TaskLogs(data=line + "\n", timestamp=now, file_descriptor=api_pb2.FILE_DESCRIPTOR_STDOUT,
                                  function_call_id=req.function_call_id) for line in lines]
        return api_pb2.AppFetchLogsResponse(batches=[api_pb2.TaskLogsBatch(items=items, entry_id="1-0")] if items
                                            else [])

    # --- containers -----------------------------------------------------------------------------
    def _run_container(self, call: ModalCall) -> None:
        """Run the call's input in a subprocess 'container'; its output is the call's log."""
        with self.lock:
            definition = self.functions.get(call.function_id, {}).get("definition")
        function = definition.function_serialized if definition is not None else b""
        folder = self._workdir / call.call_id
        folder.mkdir()
        (folder / "function").write_bytes(function)
        (folder / "args").write_bytes(call.args)
        env = {**os.environ, **self.environ(), **self.container_env,
               "FAKE_MODAL_INPUT_ID": call.input_id, "FAKE_MODAL_CALL_ID": call.call_id}
        cwd = self._lay_out_mounts(definition, folder / "fs") if self.mounts and definition is not None else None
        call.task_id = f"ta-{call.call_id[3:]}"
        call.proc = subprocess.Popen([sys.executable, str(CONTAINER), str(folder)], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd)
        threading.Thread(target=self._watch, args=(call, folder), daemon=True).start()

    def _lay_out_mounts(self, definition: Any, fs: Path) -> Path:
        """Write the function's mounted files under ``fs`` by their remote paths; return ``fs/root``
        (Modal's ``/root``, a container's working directory)."""
        with self.lock:
            files = [f for mount_id in definition.mount_ids for f in self.mount_files.get(mount_id, [])]
            blobs = dict(self.blobs)
        for remote, sha, mode in files:
            dest = fs / remote.lstrip("/")
            if fs.resolve() not in dest.resolve().parents:
                raise ValueError(f"mount path {remote!r} leaves the container's file system")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(blobs[sha])
            if mode:
                dest.chmod(mode & 0o777)
        (fs / "root").mkdir(parents=True, exist_ok=True)
        return fs / "root"

    def _watch(self, call: ModalCall, folder: Path) -> None:
        proc = call.proc
        assert proc is not None and proc.stdout is not None
        for raw in proc.stdout:
            self.log(call.call_id, raw.decode("utf-8", "replace").rstrip("\n"))
        proc.wait()
        out = folder / "result"
        if out.is_file():
            status, _, data = out.read_bytes().partition(b"\n")
            if status == b"ok":
                self._end(call.call_id, api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS,
                                                              data=data))
                return
            exc = deserialize(data, None)
            self._end(call.call_id, api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_FAILURE,
                                                          exception=repr(exc), data=data))
            return
        self._end(call.call_id, api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_TERMINATED,
                                                      exception=f"container exited with code {proc.returncode}"))


def _input_status(call: ModalCall) -> int:
    from modal.types import InputStatus

    if call.result is None:
        return int(InputStatus.PENDING)
    if call.result.status == api_pb2.GenericResult.GENERIC_STATUS_SUCCESS:
        return int(InputStatus.SUCCESS)
    return int(InputStatus.FAILURE)


def _servicer(server: FakeModalServer) -> Any:
    """An implementation of every RPC of ``ModalClientBase``: each records its request and sends
    ``server.answer`` (a list of messages for a streaming RPC)."""
    mapping = api_grpc.ModalClientBase.__mapping__(_Probe())  # type: ignore[arg-type]
    methods: dict[str, Any] = {}
    for path, handler in mapping.items():
        name = path.rsplit("/", 1)[1]
        methods[name] = _method(server, name, handler.cardinality, handler.reply_type)
    cls = type("FakeModalServicer", (api_grpc.ModalClientBase,), methods)
    return cls()


class _Probe:
    def __getattr__(self, name: str) -> None:
        return None


def _method(server: FakeModalServer, name: str, cardinality: Cardinality, reply_type: type) -> Any:
    async def method(self: Any, stream: Any) -> None:
        request = await stream.recv_message()
        with server.lock:
            server.requests.append((name, request))
        reply = await asyncio.get_running_loop().run_in_executor(None, server.answer, name, request, reply_type)
        if cardinality in (Cardinality.UNARY_STREAM, Cardinality.STREAM_STREAM):
            for message in reply if isinstance(reply, list) else [reply]:
                await stream.send_message(message)
        else:
            await stream.send_message(reply if reply is not None else reply_type())

    method.__name__ = name
    return method


def _reset_sdk_client() -> None:
    """Forget the SDK's process-wide client, so the next call makes one from the current environment."""
    from modal.client import _Client

    _Client._client_from_env = None


@contextlib.contextmanager
def fake_modal(monkeypatch: pytest.MonkeyPatch, **options: Any) -> Iterator[FakeModalServer]:
    with FakeModalServer(**options) as srv:
        srv.install(monkeypatch)
        yield srv
