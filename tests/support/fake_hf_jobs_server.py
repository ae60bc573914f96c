"""A fake Hugging Face Jobs HTTP API on 127.0.0.1 that runs each Job's command as a local subprocess.

It speaks the subset of the Hub API that ``huggingface_hub.HfApi`` uses for Jobs (2.x):
``GET /api/whoami-v2``, ``POST /api/jobs/{ns}`` (run_job), ``GET /api/jobs/{ns}/{id}`` (inspect_job),
``POST /api/jobs/{ns}/{id}/cancel`` (cancel_job) and ``GET /api/jobs/{ns}/{id}/logs`` (SSE, fetch_job_logs;
like the Hub's, the stream replays the lines so far and then stays open, sending new lines and keep-alives:
the SDK's no-follow read returns after its 5 s read timeout; ``log_stream_close_s`` closes idle streams sooner).

A Job's ``command`` runs with ``python`` replaced by this interpreter (also on ``PATH`` first, for
``bash -c`` commands), in an environment made of a scrubbed copy of ours (no AWS_*/HF_*/DILOCO_*
variables, so credentials must arrive through the Job) plus the Job's ``environment`` and
``secrets``, in a fresh working directory and ``TMPDIR`` per attempt (a container's own /tmp).
``attempts`` re-runs a failed command like the Hub. Bearer tokens are checked: a wrong token gets 401.

``FakeHFJobsServer(clean_room=True)`` runs every attempt in a fresh :class:`CleanRoom` venv: the
packages of this environment (torch, s3fs, ...) but **not** ``diloco_serverless``, pip reaching no
index. A Job there trains only if it installs the code it was shipped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
import venv
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

SCRUBBED_PREFIXES = ("AWS_", "HF_", "DILOCO_", "REPLICA_", "GOOGLE_", "STORAGE_EMULATOR")
#: package folders and files of diloco_serverless itself (any install kind), kept out of a clean room
_OWN_ENTRIES = ("diloco_serverless", "diloco-serverless", "__editable__.diloco_serverless",
                "__editable___diloco_serverless")


class CleanRoom:
    """Python environments that have this environment's dependencies but not ``diloco_serverless``.

    Built offline in well under a second: ``deps/`` holds symlinks to every entry of this
    interpreter's site-packages except the package's own (its folder, dist-info, editable finder
    and ``.pth``); each :meth:`new_env` is a fresh ``venv --without-pip`` whose site-packages adds
    ``deps/`` as a site dir (so pip, torch, s3fs... import, and pip installs into the venv itself).
    :meth:`environ` is what a command there runs with: that venv first on PATH, no PYTHONPATH, pip
    without an index. Nothing of this environment is ever written to.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="diloco-clean-room-"))
        self.deps = self.root / "deps"
        self.deps.mkdir(parents=True, exist_ok=True)
        for site_dir in _site_dirs():
            for entry in sorted(site_dir.iterdir()):
                if _is_own(entry) or (self.deps / entry.name).exists():
                    continue
                (self.deps / entry.name).symlink_to(entry)

    def new_env(self) -> Path:
        """A fresh venv; returns its folder (``bin/python`` is its interpreter)."""
        env_dir = Path(tempfile.mkdtemp(prefix="venv-", dir=self.root))
        venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(env_dir)
        purelib = Path(sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)}))
        purelib.mkdir(parents=True, exist_ok=True)
        (purelib / "_diloco_clean_room_deps.pth").write_text(f"import site; site.addsitedir({str(self.deps)!r})\n")
        for name in ("pip", "pip3"):  # as in an image: `pip` is this interpreter's pip
            shim = env_dir / "bin" / name
            shim.write_text('#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n')
            shim.chmod(0o755)
        return env_dir

    @staticmethod
    def environ(env_dir: Path, base: dict[str, str]) -> dict[str, str]:
        """``base`` made clean: this venv first on PATH and no directory of the test's own
        environment on it (its ``python`` and ``pip`` would see the package), no PYTHONPATH."""
        env = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
        own = {Path(sys.prefix).resolve(), Path(sys.executable).parent.resolve()}
        path = [p for p in base.get("PATH", "").split(os.pathsep)
                if p and not any(Path(p).resolve() == o or o in Path(p).resolve().parents for o in own)]
        env.update(VIRTUAL_ENV=str(env_dir), PATH=os.pathsep.join([str(env_dir / "bin"), *path]),
                   PYTHONNOUSERSITE="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        return env

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _site_dirs() -> list[Path]:
    dirs = [*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    return [Path(d) for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def _is_own(entry: Path) -> bool:
    """An entry of site-packages that belongs to diloco_serverless (or points at its checkout)."""
    name = entry.name.lower()
    if name.startswith(_OWN_ENTRIES):
        return True
    if entry.suffix in (".pth", ".egg-link") and entry.is_file():
        return "diloco" in entry.read_text("utf-8", "replace").lower()
    return False


def _now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class FakeJob:
    """One submitted Job: its spec, stage, log lines and the thread running its attempts."""

    def __init__(self, job_id: str, namespace: str, spec: dict[str, Any], python: str, workroot: Path,
                 clean_room: CleanRoom | None = None) -> None:
        self.id, self.namespace, self.spec, self.python = job_id, namespace, spec, python
        self.workroot, self.clean_room = workroot, clean_room
        self.created_at = _now_iso()
        self.stage = "SCHEDULING"
        self.message: str | None = None
        self.lines: list[tuple[str, str]] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.cancelled = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _env(self, workdir: Path, python: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED_PREFIXES)}
        env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', '')}"
        env["TMPDIR"] = str(workdir / "tmp")
        env.update({k: str(v) for k, v in (self.spec.get("environment") or {}).items()})
        env.update({k: str(v) for k, v in (self.spec.get("secrets") or {}).items()})
        return env

    def _argv(self, python: str) -> list[str]:
        argv = list(self.spec["command"]) + list(self.spec.get("arguments") or [])
        return [python if a in ("python", "python3") and i == 0 else a for i, a in enumerate(argv)]

    def _start(self) -> subprocess.Popen[bytes]:
        """One attempt: a fresh working directory and TMPDIR (and, in a clean room, a fresh venv)."""
        workdir = Path(tempfile.mkdtemp(prefix=f"job-{self.id}-", dir=self.workroot))
        (workdir / "tmp").mkdir()
        python, env = self.python, None
        if self.clean_room is not None:
            env_dir = self.clean_room.new_env()
            python = str(env_dir / "bin" / "python")
            env = self.clean_room.environ(env_dir, self._env(workdir, python))
        env = env or self._env(workdir, python)
        return subprocess.Popen(self._argv(python), env=env, cwd=workdir, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def _run(self) -> None:
        attempts = int(self.spec.get("attempts") or 1)
        for attempt in range(attempts):
            with self.lock:
                if self.cancelled:
                    return
                self.proc = self._start()
                self.stage = "RUNNING"
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                with self.lock:
                    self.lines.append((_now_iso(), raw.decode("utf-8", "replace").rstrip("\n")))
            code = self.proc.wait()
            with self.lock:
                if self.cancelled:
                    self.stage = "CANCELED"
                    return
                if code == 0:
                    self.stage, self.message = "COMPLETED", None
                    return
                self.message = f"Job failed with exit code: {code}"
                if attempt + 1 < attempts:
                    self.lines.append((_now_iso(), f"[fake hub] attempt {attempt} failed, retrying"))
        with self.lock:
            self.stage = "ERROR"

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.stage in ("COMPLETED", "ERROR", "CANCELED"):
                return
            self.stage = "CANCELED"
            proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def info(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "id": self.id,
            "createdAt": self.created_at,
            "dockerImage": spec.get("dockerImage"),
            "spaceId": spec.get("spaceId"),
            "command": spec.get("command"),
            "arguments": spec.get("arguments", []),
            "environment": spec.get("environment", {}),
            "secrets": {k: None for k in (spec.get("secrets") or {})},  # the Hub never returns values
            "flavor": spec.get("flavor"),
            "labels": spec.get("labels"),
            "retry": int(spec.get("attempts") or 1) - 1,
            "status": {"stage": self.stage, "message": self.message},
            "owner": {"id": "0" * 24, "name": self.namespace, "type": "user"},
        }


class FakeHFJobsServer:
    """``with FakeHFJobsServer() as srv: HfApi(endpoint=srv.url, token=srv.token)``."""

    def __init__(self, *, token: str = "hf_fake_token", user: str = "fake-user", python: str = sys.executable,
                 clean_room: bool | CleanRoom = False, log_stream_close_s: float | None = None,
                 keep_alive_s: float = 30.0) -> None:
        self.token, self.user, self.python = token, user, python
        #: like the Hub's, a log stream stays open after its replay (new lines are sent as the Job writes
        #: them, ``: keep-alive`` every ``keep_alive_s``): the SDK's no-follow read ends at its own 5 s read
        #: timeout or at a line newer than the response's Date. A number closes an idle stream after that
        #: many seconds instead (the Hub may end a stream too; the SDK handles both).
        self.log_stream_close_s, self.keep_alive_s = log_stream_close_s, keep_alive_s
        self._stopping = threading.Event()
        self._own_room = clean_room is True
        self.workroot = Path(tempfile.mkdtemp(prefix="fake-hf-jobs-"))
        self.clean_room: CleanRoom | None = CleanRoom() if clean_room is True else (clean_room or None)
        self.jobs: dict[str, FakeJob] = {}
        self.requests: list[tuple[str, str]] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeHFJobsServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        for job in list(self.jobs.values()):
            job.cancel()
        self._httpd.shutdown()
        self._httpd.server_close()
        for job in list(self.jobs.values()):
            job.thread.join(10)
        if self._own_room and self.clean_room is not None:
            self.clean_room.close()
        shutil.rmtree(self.workroot, ignore_errors=True)

    def wait_all(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        for job in list(self.jobs.values()):
            job.thread.join(max(0.0, deadline - time.monotonic()))

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
                pass

            def _json(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorised(self) -> bool:
                if self.headers.get("Authorization") == f"Bearer {server.token}":
                    return True
                self._json(401, {"error": "Invalid credentials in Authorization header"})
                return False

            def _route(self, method: str) -> None:
                url = urlparse(self.path)
                server.requests.append((method, url.path))
                if not self._authorised():
                    return
                parts = url.path.strip("/").split("/")
                if method == "GET" and parts == ["api", "whoami-v2"]:
                    return self._json(200, {"type": "user", "name": server.user, "id": "0" * 24})
                if parts[:2] != ["api", "jobs"] or len(parts) < 3:
                    return self._json(404, {"error": f"no route {method} {url.path}"})
                namespace = parts[2]
                if method == "POST" and len(parts) == 3:
                    return self._submit(namespace)
                job = server.jobs.get(parts[3]) if len(parts) > 3 else None
                if job is None or job.namespace != namespace:
                    return self._json(404, {"error": f"job {parts[3:4]} not found"})
                if method == "GET" and len(parts) == 4:
                    with job.lock:
                        return self._json(200, job.info())
                if method == "POST" and parts[4:] == ["cancel"]:
                    job.cancel()
                    return self._json(200, {})
                if method == "GET" and parts[4:] == ["logs"]:
                    return self._logs(job, parse_qs(url.query))
                return self._json(404, {"error": f"no route {method} {url.path}"})

            def _submit(self, namespace: str) -> None:
                spec = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if not spec.get("command") or not (spec.get("dockerImage") or spec.get("spaceId")):
                    return self._json(400, {"error": "command and dockerImage are required"})
                job = FakeJob(uuid.uuid4().hex[:24], namespace, spec, server.python, server.workroot,
                              server.clean_room)
                server.jobs[job.id] = job
                with job.lock:
                    return self._json(200, job.info())

            def _logs(self, job: FakeJob, query: dict[str, list[str]]) -> None:
                with job.lock:
                    lines = list(job.lines)
                    sent = len(lines)
                if "tail" in query:
                    lines = lines[-int(query["tail"][0]) :] if int(query["tail"][0]) > 0 else []
                self.send_response(200)  # with a Date header (send_response adds it), as the Hub's
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for ts, line in lines:
                        event = json.dumps({"timestamp": ts, "data": line})
                        self.wfile.write(f"data: {event}\n\n".encode())
                    self.wfile.flush()
                    self._follow(job, sent)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the SDK closed the stream (its read timeout, or a line newer than Date)

            def _follow(self, job: FakeJob, sent: int) -> None:
                """Keep the stream open after the replay: new lines as the Job writes them, keep-alives."""
                idle_since = last_write = time.monotonic()
                while not server._stopping.wait(0.05):
                    with job.lock:
                        new = list(job.lines)[sent:]
                    now = time.monotonic()
                    if new:
                        sent += len(new)
                        for ts, line in new:
                            self.wfile.write(f"data: {json.dumps({'timestamp': ts, 'data': line})}\n\n".encode())
                        idle_since = last_write = now
                    elif now - last_write >= server.keep_alive_s:
                        self.wfile.write(b": keep-alive\n\n")
                        last_write = now
                    self.wfile.flush()
                    if server.log_stream_close_s is not None and now - idle_since >= server.log_stream_close_s:
                        return

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

        return Handler
