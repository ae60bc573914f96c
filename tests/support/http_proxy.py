"""The scaffold shared by the test proxies in front of an S3 endpoint (moto): a bounded threaded HTTP
server on 127.0.0.1, a keep-alive request handler, and forwarding to the upstream.

A proxy subclasses :class:`HttpProxy` and fills in :meth:`HttpProxy.handle`, which gets the
:class:`ProxyHandler` of each request and answers it with the handler's :meth:`~ProxyHandler.read_body`,
:meth:`~ProxyHandler.send` and :meth:`~ProxyHandler.drop` and the proxy's :meth:`HttpProxy.forward`.
:mod:`support.fault_proxy` (injects faults) and :mod:`support.store_emulator` (shapes like a real
store) are the two users.

Bounded: binds 127.0.0.1 only; at most ``max_connections`` concurrent client connections (more are
closed at once and counted in ``refused_connections``); request bodies over ``max_body_bytes`` read as
``None`` (the subclass answers 413); idle keep-alive connections close after ``idle_timeout_s``; the
server stops by itself after ``lifetime_s`` and at context exit.
"""

from __future__ import annotations

import http.client
import select
import socket
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar, Self, TypedDict, Unpack

__all__ = ["CHUNK", "HOP_BY_HOP", "HttpProxy", "Pace", "ProxyHandler", "ProxyLimits", "ProxyServer",
           "parse_upstream"]

#: Bodies move in pieces of this many bytes (each piece passes through the pacing hook, if any).
CHUNK = 64 << 10
#: Headers that belong to one connection and are never passed on.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade", "expect", "proxy-connection"})

#: Called with the size of every body piece before it moves (the store emulator's bandwidth shaping).
Pace = Callable[[int], None]


class ProxyLimits(TypedDict, total=False):
    """The bounds every proxy takes as keyword arguments (each proxy class has its own defaults)."""

    max_connections: int
    max_body_bytes: int
    idle_timeout_s: float
    upstream_timeout_s: float
    lifetime_s: float


def parse_upstream(upstream: str) -> tuple[str, int]:
    """``(host, port)`` of an ``http://host:port`` URL; ValueError naming the URL for anything else."""
    parsed = urllib.parse.urlsplit(upstream)
    if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
        raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
    return parsed.hostname, parsed.port


class ProxyHandler(BaseHTTPRequestHandler):
    """One client connection (HTTP/1.1 keep-alive); every method goes to ``server.proxy.handle(self)``."""

    protocol_version = "HTTP/1.1"
    server: ProxyServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.proxy.idle_timeout_s)  # idle keep-alive connections close

    def do_GET(self) -> None:
        self.server.proxy.handle(self)

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    @property
    def head(self) -> bool:
        """Whether this is a HEAD request (its answer carries headers only)."""
        return self.command == "HEAD"

    def read_body(self, pace: Pace | None = None) -> bytes | None:
        """The request body (plain or chunked), each piece passed to ``pace`` first; None if it is
        over the proxy's ``max_body_bytes``."""
        limit = self.server.proxy.max_body_bytes
        parts: list[bytes] = []
        total = 0
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
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
                if pace is not None:
                    pace(size)
                self.rfile.readline()
            return b"".join(parts)
        length = int(self.headers.get("Content-Length") or 0)
        if length > limit:
            return None
        while total < length:
            chunk = self.rfile.read(min(CHUNK, length - total))
            if not chunk:
                break
            parts.append(chunk)
            total += len(chunk)
            if pace is not None:
                pace(len(chunk))
        return b"".join(parts)

    def client_gone(self) -> bool:
        """Whether the client has closed its connection (a cancelled request): the socket reads as
        end-of-file or fails. Never blocks."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def send(self, status: int, headers: Iterable[tuple[str, str]], body: bytes, pace: Pace | None = None) -> None:
        """Answer ``status`` with ``headers`` (hop-by-hop ones left out) and ``body`` in pieces, each
        passed to ``pace`` first. A HEAD answer keeps the upstream's Content-Length and sends no body."""
        headers = list(headers)
        self.send_response_only(status)
        for name, value in headers:
            if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        if self.head:
            length = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
        else:
            length = str(len(body))
        self.send_header("Content-Length", length)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if not self.head:
            view = memoryview(body)
            for i in range(0, len(view), CHUNK):
                piece = view[i:i + CHUNK]
                if pace is not None:
                    pace(len(piece))
                self.wfile.write(piece)
        self.wfile.flush()

    def drop(self) -> None:
        """Close the connection without an answer."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class ProxyServer(ThreadingHTTPServer):
    """A threaded server on 127.0.0.1 (free port) that serves at most ``proxy.max_connections``
    connections at once and refuses the rest (the client retries)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, proxy: HttpProxy) -> None:
        self.proxy = proxy
        self.request_queue_size = proxy.request_queue_size
        self._slots = threading.BoundedSemaphore(proxy.max_connections)
        super().__init__(("127.0.0.1", 0), ProxyHandler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients that vanish mid-request (SIGKILLed replicas) are expected: no traceback on stderr."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
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


class HttpProxy:
    """Base of a proxy in front of ``upstream`` (``http://host:port``): limits, lifecycle (``with``, or
    :meth:`start` / :meth:`stop`), forwarding. Subclasses implement :meth:`handle`."""

    #: What the proxy is called in errors.
    name: ClassVar[str] = "proxy"
    #: The name of its serving thread.
    thread_name: ClassVar[str] = "http-proxy"
    #: The listening socket's backlog.
    request_queue_size: ClassVar[int] = 128
    # default limits (:class:`ProxyLimits`); a subclass sets its own, a keyword argument overrides them
    max_connections: int = 256
    max_body_bytes: int = 256 << 20
    idle_timeout_s: float = 60.0
    upstream_timeout_s: float = 120.0
    lifetime_s: float = 3600.0

    def __init__(self, upstream: str, **limits: Unpack[ProxyLimits]) -> None:
        unknown = sorted(set(limits) - ProxyLimits.__optional_keys__)
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unknown keyword argument(s) {unknown}; "
                            f"the limits are {sorted(ProxyLimits.__optional_keys__)}")
        self.upstream = parse_upstream(upstream)
        self.max_connections = limits.get("max_connections", self.max_connections)
        self.max_body_bytes = limits.get("max_body_bytes", self.max_body_bytes)
        self.idle_timeout_s = limits.get("idle_timeout_s", self.idle_timeout_s)
        self.upstream_timeout_s = limits.get("upstream_timeout_s", self.upstream_timeout_s)
        self.lifetime_s = limits.get("lifetime_s", self.lifetime_s)
        self._lock = threading.Lock()
        self.refused_connections = 0
        self._server: ProxyServer | None = None
        self._thread: threading.Thread | None = None
        self._timer: threading.Timer | None = None
        self.stopped = threading.Event()  # set once the listening socket is closed

    def handle(self, handler: ProxyHandler) -> None:
        """Answer the request ``handler`` holds (every request of every connection comes here)."""
        raise NotImplementedError(f"{type(self).__name__} must implement handle()")

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError(f"the {self.name} is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> Self:
        if self._server is not None:
            return self
        self.stopped.clear()
        self._server = ProxyServer(self)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=self.thread_name, daemon=True)
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

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ upstream
    def forward(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        """Send the request to the upstream on a fresh connection; ``(status, headers, body)`` of its
        answer. OSError when the upstream cannot be reached or answers nothing."""
        conn = http.client.HTTPConnection(*self.upstream, timeout=self.upstream_timeout_s)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in headers.items():
                if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                    conn.putheader(name, value)
            if body or method in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body if body else None)
            resp = conn.getresponse()
            return resp.status, list(resp.getheaders()), resp.read()
        finally:
            conn.close()
