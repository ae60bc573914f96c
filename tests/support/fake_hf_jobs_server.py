"""A fake Hugging Face Jobs HTTP API on 127.0.0.1 that runs each Job's command as a local subprocess.

It speaks the subset of the Hub API that ``huggingface_hub.HfApi`` uses for Jobs (2.x):
``GET /api/whoami-v2``, ``POST /api/jobs/{ns}`` (run_job), ``GET /api/jobs/{ns}/{id}`` (inspect_job),
``POST /api/jobs/{ns}/{id}/cancel`` (cancel_job) and ``GET /api/jobs/{ns}/{id}/logs`` (SSE, fetch_job_logs;
the stream holds the lines so far and closes, the client re-connects while the Job runs).

A Job's ``command`` runs with ``python`` replaced by this interpreter, in an environment made of a
scrubbed copy of ours (no AWS_*/HF_*/DILOCO_* variables, so credentials must arrive through the Job)
plus the Job's ``environment`` and ``secrets``. ``attempts`` re-runs a failed command like the Hub.
Bearer tokens are checked: a wrong token gets 401.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

SCRUBBED_PREFIXES = ("AWS_", "HF_", "DILOCO_", "REPLICA_", "GOOGLE_", "STORAGE_EMULATOR")


def _now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class FakeJob:
    """One submitted Job: its spec, stage, log lines and the thread running its attempts."""

    def __init__(self, job_id: str, namespace: str, spec: dict[str, Any], python: str) -> None:
        self.id, self.namespace, self.spec, self.python = job_id, namespace, spec, python
        self.created_at = _now_iso()
        self.stage = "SCHEDULING"
        self.message: str | None = None
        self.lines: list[tuple[str, str]] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.cancelled = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED_PREFIXES)}
        env.update({k: str(v) for k, v in (self.spec.get("environment") or {}).items()})
        env.update({k: str(v) for k, v in (self.spec.get("secrets") or {}).items()})
        return env

    def _argv(self) -> list[str]:
        argv = list(self.spec["command"]) + list(self.spec.get("arguments") or [])
        return [self.python if a in ("python", "python3") and i == 0 else a for i, a in enumerate(argv)]

    def _run(self) -> None:
        attempts = int(self.spec.get("attempts") or 1)
        for attempt in range(attempts):
            with self.lock:
                if self.cancelled:
                    return
                self.proc = subprocess.Popen(self._argv(), env=self._env(), stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, start_new_session=True)
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

    def __init__(self, *, token: str = "hf_fake_token", user: str = "fake-user", python: str = sys.executable) -> None:
        self.token, self.user, self.python = token, user, python
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
        for job in list(self.jobs.values()):
            job.cancel()
        self._httpd.shutdown()
        self._httpd.server_close()

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
                job = FakeJob(uuid.uuid4().hex[:24], namespace, spec, server.python)
                server.jobs[job.id] = job
                with job.lock:
                    return self._json(200, job.info())

            def _logs(self, job: FakeJob, query: dict[str, list[str]]) -> None:
                with job.lock:
                    lines = list(job.lines)
                if "tail" in query:
                    lines = lines[-int(query["tail"][0]) :] if int(query["tail"][0]) > 0 else []
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for ts, line in lines:
                    event = json.dumps({"timestamp": ts, "data": line})
                    self.wfile.write(f"data: {event}\n\n".encode())
                self.wfile.flush()

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

        return Handler
