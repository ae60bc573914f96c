"""A seeded, fault-injecting HTTP proxy in front of an S3 endpoint (moto), for chaos tests.

::

    with FaultProxy(moto_endpoint, seed=1, rate=0.03) as proxy:        # 127.0.0.1 only
        env = {"AWS_ENDPOINT_URL": proxy.url, ...}                     # boto / s3fs talk to the proxy
        ...
        proxy.counts                                                   # Counter: injected faults by kind

Every request the proxy receives is forwarded to ``upstream`` unless a fault is injected. Faults:

=================  =====================================================================================
``slowdown``       answer ``503 SlowDown`` with S3's XML error body; the store did not act
``internal``       answer ``500 InternalError`` (XML); the store did not act
``drop_before``    close the connection without an answer BEFORE forwarding: the store did not act
``drop_after``     forward, receive the store's answer, then close the connection without passing it
                   on: the store acted and the client never hears (the "lost response" case)
``delay``          wait ``delay_s`` (1-2 s, drawn per request) and then forward normally
=================  =====================================================================================

Faults come from two sources, checked in this order for each request:

* ``rules`` (:class:`FaultRule`): targeted faults, e.g. "the first create-only PUT of a key matching
  ``quorum\\.json$`` loses its response" (``FaultRule("drop_after", Target(methods=("PUT",),
  create_only=True, key=r"quorum\\.json$"), first_n=1)``). A rule fires on the first ``first_n``
  requests it matches (each with ``probability``), so a test can force one exact fault.
* ``rate`` and ``kinds``: every request matching ``random_target`` (default: every object request)
  gets a fault with probability ``rate``, its kind drawn uniformly from ``kinds``.

Decisions come from one ``random.Random(seed)`` under a lock. Concurrent clients reach the proxy in
an order the OS decides, so a seed fixes the fault *distribution* and the targeted faults exactly, not
which of two racing requests gets a random fault.

``hooks``: callables ``hook(request: RequestInfo, stage)`` run for every request at stage
``"before"`` (before forwarding) and ``"after"`` (upstream answered, client not yet told). A hook may
return ``"drop"`` to close the connection at that point (counted under the hook's ``"hook"`` kind, not
as a fault). The chaos harness uses this to SIGKILL a replica at an exact protocol step; requests
carry the client's rank when its User-Agent contains ``chaos-rank-<r>`` (see :func:`user_agent_options`).

Bounded: binds 127.0.0.1 only; at most ``max_connections`` concurrent client connections (more are
closed at once); request bodies over ``max_body_bytes`` are refused (413); idle keep-alive connections
close after ``idle_timeout_s``; the server stops by itself after ``lifetime_s`` and at context exit.
HTTP/1.1 keep-alive is supported on purpose: aiohttp silently re-sends an idempotent request (PUT)
whose *reused* connection closes without an answer, which is exactly how a lost create-only response
turns into a 412 the writer never expected.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import sys
import threading
import time
import urllib.parse
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "ALL_KINDS",
    "TRANSIENT_KINDS",
    "FaultProxy",
    "FaultRule",
    "RequestInfo",
    "Target",
    "user_agent_options",
]

#: Faults after which the store did not act (or acted normally, ``delay``): retrying is always safe.
TRANSIENT_KINDS: tuple[str, ...] = ("slowdown", "internal", "drop_before", "delay")
#: Every fault kind, the lost response included.
ALL_KINDS: tuple[str, ...] = (*TRANSIENT_KINDS, "drop_after")

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "trailers", "transfer-encoding", "upgrade", "expect", "proxy-connection"})
_RANK_RE = re.compile(r"chaos-rank-(\d+)")

_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
    "<Resource>{resource}</Resource><RequestId>chaos-{n}</RequestId></Error>"
)
_ERRORS = {"slowdown": (503, "SlowDown", "Please reduce your request rate."),
           "internal": (500, "InternalError", "We encountered an internal error. Please try again.")}


def user_agent_options(rank: int) -> dict[str, Any]:
    """s3fs storage options that mark a client's requests as rank ``rank``'s (merged by ObjectStore)."""
    return {"config_kwargs": {"user_agent_extra": f"chaos-rank-{rank}"}}


@dataclass(frozen=True)
class RequestInfo:
    """What the proxy knows about one request."""

    method: str
    bucket: str
    key: str  # the object key ("" for bucket-level requests such as LIST)
    query: str
    create_only: bool  # carries If-None-Match (S3's create-only write)
    rank: int | None  # from a ``chaos-rank-<r>`` User-Agent, else None
    n: int  # 0-based sequence number of the request at the proxy


@dataclass(frozen=True)
class Target:
    """Which requests a rule (or the random faults) applies to; ``None`` fields match anything.

    ``key`` is a regular expression searched in the object key (without the bucket);
    ``create_only`` matches requests with (True) or without (False) ``If-None-Match``.
    """

    methods: tuple[str, ...] | None = None
    key: str | None = None
    create_only: bool | None = None
    ranks: tuple[int, ...] | None = None
    objects_only: bool = False  # skip bucket-level requests (LIST, bucket HEAD)

    def matches(self, req: RequestInfo) -> bool:
        if self.methods is not None and req.method not in self.methods:
            return False
        if self.objects_only and not req.key:
            return False
        if self.create_only is not None and req.create_only != self.create_only:
            return False
        if self.ranks is not None and req.rank not in self.ranks:
            return False
        return self.key is None or re.search(self.key, req.key) is not None


@dataclass
class FaultRule:
    """Inject ``kind`` on the first ``first_n`` requests matching ``target`` (None: every match)."""

    kind: str
    target: Target = field(default_factory=Target)
    first_n: int | None = 1
    probability: float = 1.0
    fired: int = 0  # how many times it fired so far

    def __post_init__(self) -> None:
        if self.kind not in ALL_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; use one of {ALL_KINDS}")


Hook = Callable[[RequestInfo, str], "str | None"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self._slots = threading.BoundedSemaphore(proxy.max_connections)
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients that vanish mid-request (SIGKILLed replicas) are expected: no traceback on stderr."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # bounded: refuse, the client retries
            self.shutdown_request(request)
            with self.proxy._lock:
                self.proxy.refused_connections += 1
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def setup(self) -> None:
        self.timeout = self.server.proxy.idle_timeout_s
        super().setup()

    # every method goes through one function
    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _read_body(self) -> bytes | None:
        limit = self.server.proxy.max_body_bytes
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            parts, total = [], 0
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                total += size
                if total > limit:
                    return None
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(parts)
        length = int(self.headers.get("Content-Length") or 0)
        if length > limit:
            return None
        return self.rfile.read(length) if length else b""

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _send(self, status: int, headers: Iterable[tuple[str, str]], body: bytes, *, head: bool) -> None:
        self.send_response_only(status)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)) if not head else dict(
            (k.lower(), v) for k, v in headers).get("content-length", "0"))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if not head and body:
            self.wfile.write(body)
        self.wfile.flush()

    def _handle(self) -> None:
        proxy = self.server.proxy
        body = self._read_body()
        head = self.command == "HEAD"
        if body is None:
            self.close_connection = True
            self._send(413, [("Content-Type", "text/plain")], b"request body too large for the chaos proxy", head=head)
            return
        req = proxy._describe(self.command, self.path, self.headers)
        kind = proxy._decide(req)
        if proxy._run_hooks(req, "before") == "drop":
            self._drop()
            return
        if kind in _ERRORS:
            status, code, message = _ERRORS[kind]
            xml = _ERROR_XML.format(code=code, message=message, resource=urllib.parse.quote(req.key), n=req.n)
            self._send(status, [("Content-Type", "application/xml")], xml.encode(), head=head)
            return
        if kind == "drop_before":
            self._drop()
            return
        if kind == "delay":
            time.sleep(proxy._delay())
        try:
            status, headers, answer = proxy._forward(self.command, self.path, self.headers, body)
        except OSError as exc:  # upstream down: a gateway error, like a load balancer would answer
            self._send(502, [("Content-Type", "text/plain")], f"chaos proxy: upstream failed: {exc}".encode(),
                       head=head)
            return
        if kind == "drop_after" or proxy._run_hooks(req, "after") == "drop":
            self._drop()
            return
        self._send(status, headers, answer, head=head)


class FaultProxy:
    """The proxy; see the module docstring. Start with ``with`` (or :meth:`start` / :meth:`stop`)."""

    def __init__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        rate: float = 0.0,
        kinds: Iterable[str] = TRANSIENT_KINDS,
        rules: Iterable[FaultRule] = (),
        random_target: Target | None = None,
        hooks: Iterable[Hook] = (),
        delay_s: tuple[float, float] = (1.0, 2.0),
        max_faults: int | None = None,
        max_connections: int = 256,
        max_body_bytes: int = 256 << 20,
        idle_timeout_s: float = 60.0,
        upstream_timeout_s: float = 120.0,
        lifetime_s: float = 3600.0,
        keep_events: int = 20000,
    ) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (parsed.hostname, parsed.port)
        self.kinds = tuple(kinds)
        for k in self.kinds:
            if k not in ALL_KINDS:
                raise ValueError(f"unknown fault kind {k!r}; use one of {ALL_KINDS}")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.rate = rate
        self.rules = list(rules)
        self.random_target = random_target or Target(objects_only=True)
        self.hooks = list(hooks)
        self.delay_s = delay_s
        self.max_faults = max_faults
        self.max_connections = max_connections
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.upstream_timeout_s = upstream_timeout_s
        self.lifetime_s = lifetime_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()  # injected faults by kind
        self.requests = 0
        self.refused_connections = 0
        self.events: deque[tuple[float, str, str, str, int | None]] = deque(maxlen=keep_events)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._timer: threading.Timer | None = None
        self.stopped = threading.Event()  # set once the listening socket is closed

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FaultProxy:
        if self._server is not None:
            return self
        self.stopped.clear()
        self._server = _Server(self)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="fault-proxy", daemon=True)
        self._thread.start()
        self._timer = threading.Timer(self.lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if server is not None:
            self.stopped.set()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ control
    def set_faults(self, *, rate: float | None = None, kinds: Iterable[str] | None = None) -> None:
        """Change the random faults while running (e.g. ``rate=0`` to stop them)."""
        with self._lock:
            if rate is not None:
                self.rate = rate
            if kinds is not None:
                self.kinds = tuple(kinds)

    def add_rule(self, rule: FaultRule) -> None:
        with self._lock:
            self.rules.append(rule)

    def add_hook(self, hook: Hook) -> None:
        with self._lock:
            self.hooks.append(hook)

    @property
    def total_faults(self) -> int:
        with self._lock:
            return sum(v for k, v in self.counts.items() if k in ALL_KINDS)

    def snapshot(self) -> dict[str, int]:
        """Injected faults by kind (every kind present, zeros included)."""
        with self._lock:
            return {k: self.counts.get(k, 0) for k in ALL_KINDS}

    def injected(self, kind: str | None = None) -> list[tuple[float, str, str, str, int | None]]:
        """The recorded fault events ``(time, kind, method, key, rank)``, optionally of one kind."""
        with self._lock:
            return [e for e in self.events if kind is None or e[1] == kind]

    # ------------------------------------------------------------------ per request
    def _describe(self, method: str, path: str, headers: Any) -> RequestInfo:
        split = urllib.parse.urlsplit(path)
        parts = urllib.parse.unquote(split.path).lstrip("/").split("/", 1)
        bucket, key = parts[0], (parts[1] if len(parts) > 1 else "")
        rank_m = _RANK_RE.search(headers.get("User-Agent", ""))
        with self._lock:
            n = self.requests
            self.requests += 1
        return RequestInfo(method, bucket, key, split.query, headers.get("If-None-Match") is not None,
                           int(rank_m.group(1)) if rank_m else None, n)

    def _decide(self, req: RequestInfo) -> str | None:
        with self._lock:
            kind = None
            for rule in self.rules:
                if (rule.first_n is None or rule.fired < rule.first_n) and rule.target.matches(req):
                    if self._rng.random() < rule.probability:
                        rule.fired += 1
                        kind = rule.kind
                        break
            if kind is None and self.rate > 0 and self.kinds and self.random_target.matches(req):
                under_cap = self.max_faults is None or sum(self.counts[k] for k in ALL_KINDS) < self.max_faults
                if self._rng.random() < self.rate and under_cap:
                    kind = self._rng.choice(self.kinds)
            if kind is not None:
                self.counts[kind] += 1
                self.events.append((time.time(), kind, req.method, req.key, req.rank))
            return kind

    def _delay(self) -> float:
        with self._lock:
            return self._rng.uniform(*self.delay_s)

    def _run_hooks(self, req: RequestInfo, stage: str) -> str | None:
        with self._lock:
            hooks = list(self.hooks)
        action = None
        for hook in hooks:
            if hook(req, stage) == "drop":
                action = "drop"
        if action == "drop":
            with self._lock:
                self.counts["hook"] += 1
        return action

    def _forward(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=self.upstream_timeout_s)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in headers.items():
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    conn.putheader(name, value)
            if body or method in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body if body else None)
            resp = conn.getresponse()
            answer = resp.read()
            return resp.status, list(resp.getheaders()), answer
        finally:
            conn.close()
