"""A shaping HTTP proxy in front of an S3 endpoint (moto) that behaves like a real object store.

::

    with StoreEmulator(moto_endpoint, PRESETS["s3-standard"], scale=0.05, seed=1) as emu:  # 127.0.0.1 only
        options = {"endpoint_url": emu.url, ...}            # s3fs / boto talk to the emulator
        ...
        emu.bytes_by_client()                               # {client: (up, down)}
        emu.peak_rate("run/rounds", "GET")                  # busiest second of that prefix

Per :class:`~support.store_presets.StorePreset` it applies, to every request:

* **First-byte latency**: after the request body has arrived, the answer waits a time drawn from a
  lognormal with median ``first_byte_ms`` and shape ``preset.sigma`` (p99 = ``first_byte_p99_ms``),
  from one seeded ``random.Random`` (a seed fixes the distribution; which of two racing requests gets
  which draw is up to the OS).
* **Per-connection bandwidth**: request and response bodies are moved in 64 KiB chunks, each request
  paced to ``conn_mb_s`` (one request = one connection's stream, as on a real store).
* **Per-client aggregate cap** (``client_mb_s``, the replica's NIC): all chunks of one client's
  requests, up and down together (a conservative half-duplex link), share one pacing clock.
  A client is identified, in this order, by a ``rank-<r>`` token in its User-Agent (the benchmark
  sets ``bench-rank-<r>``, the chaos harness ``chaos-rank-<r>``; :func:`client_options` makes one),
  by the access key id in its ``Authorization`` header, else by its address.
* **Per-prefix request-rate limits**: a token bucket per (prefix, class) with ``put_rate`` (PUT, POST,
  DELETE) or ``get_rate`` (GET, HEAD, listings) tokens per second and one second of burst (at the
  unscaled rate: ``scale`` stretches time, not request counts). The prefix is
  the first ``prefix_depth`` components of the object key's folder (bucket excluded; a listing uses its
  ``prefix=`` parameter). A request over the limit gets S3's ``503 SlowDown`` XML (after the first-byte wait); the store
  does not act.
* **Abandoned reads**: a GET or listing whose client closed the connection during the first-byte wait
  (the losing request of a hedged read) is not served: nothing is read from the store or sent, as a
  real server stops at a reset connection. It is recorded with status 499 and counted in ``abandoned``.
  Writes are always carried out (a store may complete a PUT whose client left).

``scale`` speeds the store up (or, below 1, slows it down) uniformly: latencies are divided by it,
bandwidths and request rates (the refill of the token buckets) multiplied; burst sizes stay.
A test runs fast with ``scale=10``; a benchmark on a small
machine keeps the store (not the proxy's own CPU) the bottleneck with ``scale < 1``.

Counters (thread-safe): bytes and requests per client, requests per method, requests per prefix per
whole second (:meth:`peak_rate`), SlowDowns answered, and the last ``keep_events`` requests as
:class:`Request` records (method, key, query, Range header, status, arrival and answer times) for tests
that count HEADs, parts or ranged GETs, or check that requests overlap. Bounded like
:mod:`support.fault_proxy`: 127.0.0.1 only, ``max_connections``, ``max_body_bytes``, idle keep-alive
timeout, ``lifetime_s``.
"""

from __future__ import annotations

import math
import random
import re
import threading
import time
import urllib.parse
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Unpack

from support.http_proxy import HttpProxy, Pace, ProxyHandler, ProxyLimits
from support.store_presets import StorePreset

__all__ = ["Request", "StoreEmulator", "client_options", "client_of", "prefix_of"]

_RANK_RE = re.compile(r"rank-(\d+)")
_AKID_RE = re.compile(r"Credential=([^/,\s]+)/")
_WRITES = frozenset({"PUT", "POST", "DELETE"})
_SLOWDOWN_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    "<Message>Please reduce your request rate.</Message><Resource>{resource}</Resource>"
    "<RequestId>emu-{n}</RequestId></Error>"
)


def client_options(client: int | str) -> dict[str, Any]:
    """s3fs storage options that make the emulator see requests as client ``rank-<client>``."""
    return {"config_kwargs": {"user_agent_extra": f"emu-rank-{client}"}}


def client_of(headers: Any, address: str) -> str:
    """The client a request counts against: ``rank-<r>`` from the User-Agent, else the access key
    id in ``Authorization``, else the peer address."""
    m = _RANK_RE.search(headers.get("User-Agent", "") or "")
    if m:
        return f"rank-{m.group(1)}"
    m = _AKID_RE.search(headers.get("Authorization", "") or "")
    return f"key-{m.group(1)}" if m else f"addr-{address}"


def prefix_of(key: str, query: str, depth: int) -> str:
    """The rate-limited prefix of a request: the first ``depth`` components of the key's folder
    (a listing: of its ``prefix=`` parameter); ``""`` for the bucket root."""
    if not key:
        listed = urllib.parse.parse_qs(query).get("prefix", [""])[0]
        parts = [p for p in listed.split("/") if p]
        if listed and not listed.endswith("/"):
            parts = parts[:-1]
    else:
        parts = key.split("/")[:-1]
    return "/".join(parts[:depth])


@dataclass(frozen=True)
class Request:
    """One request as the emulator saw it."""

    method: str
    key: str
    query: str
    range: str | None
    client: str
    status: int
    arrived: float = 0.0  # time.monotonic() when the request line arrived
    answered: float = 0.0  # time.monotonic() when its answer was ready (after the first-byte wait)


@dataclass
class _Bucket:
    """A token bucket: ``rate`` tokens/s, ``burst`` tokens at most (and at first)."""

    rate: float
    burst: float
    tokens: float = -1.0
    stamp: float = field(default_factory=time.monotonic)

    def take(self) -> bool:
        now = time.monotonic()
        if self.tokens < 0:
            self.tokens = self.burst
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class _Link:
    """A pacing clock: :meth:`reserve` books ``n`` bytes and returns when they are through."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        with self._lock:
            start = max(time.monotonic(), self.free_at)
            self.free_at = start + n / self.bytes_per_s
            return self.free_at


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


class StoreEmulator(HttpProxy):
    """The shaping proxy; see the module docstring. Start with ``with`` (or :meth:`start` / :meth:`stop`)."""

    name = "emulator"
    thread_name = "store-emulator"
    request_queue_size = 256
    max_connections = 512
    max_body_bytes = 1 << 30
    idle_timeout_s = 60.0
    upstream_timeout_s = 300.0
    lifetime_s = 3600.0

    def __init__(
        self,
        upstream: str,
        preset: StorePreset,
        *,
        scale: float = 1.0,
        seed: int = 0,
        keep_events: int = 100_000,
        trace: bool = False,
        **limits: Unpack[ProxyLimits],
    ) -> None:
        super().__init__(upstream, **limits)
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        self.preset = preset
        self.scale = scale
        self._rng = random.Random(seed)
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._clients: dict[str, _Link] = {}
        self._bytes: dict[str, list[int]] = {}
        self._per_second: Counter[tuple[str, str, int]] = Counter()
        self.requests_by_client: Counter[str] = Counter()
        self.requests_by_method: Counter[str] = Counter()
        self.slowdowns = 0
        self.abandoned = 0  # reads whose client left before the first byte (recorded with status 499)
        self.events: deque[Request] = deque(maxlen=keep_events)
        #: With ``trace=True``: every served request as (request, when its body had arrived, when its answer
        #: body had gone out), for a benchmark's timeline; None otherwise.
        self.trace: deque[tuple[Request, float, float]] | None = deque(maxlen=keep_events) if trace else None

    def handle(self, handler: ProxyHandler) -> None:
        arrived = time.monotonic()
        split = urllib.parse.urlsplit(handler.path)
        parts = urllib.parse.unquote(split.path).lstrip("/").split("/", 1)
        key = parts[1] if len(parts) > 1 else ""
        client = client_of(handler.headers, handler.client_address[0])
        prefix = prefix_of(key, split.query, self.preset.prefix_depth)
        kind = "PUT" if handler.command in _WRITES else "GET"
        allowed = self._admit(prefix, kind)
        pace = self._pacer(client, up=True)  # registers the client even when its request is refused
        body = handler.read_body(pace if allowed else None)
        body_in = time.monotonic()
        if body is None:
            handler.close_connection = True
            handler.send(413, [("Content-Type", "text/plain")], b"request body too large for the emulator")
            return
        _sleep_until(time.monotonic() + self._first_byte_s())
        if kind == "GET" and handler.client_gone():  # a cancelled read (a hedged GET's loser): nothing is sent
            self.abandoned += 1
            self._record(Request(handler.command, key, split.query, handler.headers.get("Range"), client, 499,
                                 arrived, time.monotonic()))
            handler.close_connection = True
            return
        if not allowed:
            n = self._record(Request(handler.command, key, split.query, handler.headers.get("Range"), client, 503,
                                     arrived, time.monotonic()))
            xml = _SLOWDOWN_XML.format(resource=urllib.parse.quote(key), n=n).encode()
            handler.send(503, [("Content-Type", "application/xml")], xml)
            return
        try:
            status, headers, answer = self.forward(handler.command, handler.path, handler.headers, body)
        except OSError as exc:
            handler.send(502, [("Content-Type", "text/plain")], f"emulator: upstream failed: {exc}".encode())
            return
        req = Request(handler.command, key, split.query, handler.headers.get("Range"), client, status, arrived,
                      time.monotonic())
        self._record(req)
        handler.send(status, headers, answer, self._pacer(client, up=False))
        if self.trace is not None:
            self.trace.append((req, body_in, time.monotonic()))

    # ------------------------------------------------------------------ derived parameters
    @property
    def first_byte_median_s(self) -> float:
        return self.preset.first_byte_ms / 1000.0 / self.scale

    @property
    def conn_bytes_per_s(self) -> float:
        return self.preset.conn_mb_s * 1e6 * self.scale

    @property
    def client_bytes_per_s(self) -> float:
        return self.preset.client_mb_s * 1e6 * self.scale

    # ------------------------------------------------------------------ counters
    def reset(self) -> None:
        """Zero every counter and forget the recorded requests (rate buckets keep their state)."""
        with self._lock:
            self._bytes.clear()
            self._per_second.clear()
            self.requests_by_client.clear()
            self.requests_by_method.clear()
            self.slowdowns = 0
            self.abandoned = 0
            self.events.clear()
            if self.trace is not None:
                self.trace.clear()

    def bytes_by_client(self) -> dict[str, tuple[int, int]]:
        """Body bytes moved per client: ``{client: (up, down)}`` (up = request bodies)."""
        with self._lock:
            return {c: (v[0], v[1]) for c, v in self._bytes.items()}

    def peak_rate(self, prefix: str | None = None, kind: str | None = None) -> int:
        """Most requests seen in one whole second, for one ``prefix`` and ``kind`` ("PUT" or "GET")
        or summed over all of them when ``None``; SlowDowns included."""
        with self._lock:
            per: Counter[int] = Counter()
            for (p, k, sec), n in self._per_second.items():
                if (prefix is None or p == prefix) and (kind is None or k == kind):
                    per[sec] += n
        return max(per.values(), default=0)

    def requests_by_prefix(self) -> dict[tuple[str, str], int]:
        """Requests seen per (prefix, kind), SlowDowns included."""
        out: Counter[tuple[str, str]] = Counter()
        with self._lock:
            for (p, k, _sec), n in self._per_second.items():
                out[(p, k)] += n
        return dict(out)

    def requests(self) -> list[Request]:
        with self._lock:
            return list(self.events)

    # ------------------------------------------------------------------ per request
    def _admit(self, prefix: str, kind: str) -> bool:
        rate = self.preset.put_rate if kind == "PUT" else self.preset.get_rate
        with self._lock:
            self._per_second[(prefix, kind, int(time.time()))] += 1
            # refill scales with time; the burst is a number of requests and does not
            bucket = self._buckets.setdefault((prefix, kind), _Bucket(rate * self.scale, max(1.0, rate)))
            ok = bucket.take()
            if not ok:
                self.slowdowns += 1
            return ok

    def _first_byte_s(self) -> float:
        sigma = self.preset.sigma
        with self._lock:
            z = self._rng.gauss(0.0, 1.0)
        return self.first_byte_median_s * math.exp(sigma * z)

    def _pacer(self, client: str, *, up: bool) -> Pace:
        conn = _Link(self.conn_bytes_per_s)
        with self._lock:
            link = self._clients.setdefault(client, _Link(self.client_bytes_per_s))
            counts = self._bytes.setdefault(client, [0, 0])

        def pace(n: int) -> None:
            _sleep_until(max(conn.reserve(n), link.reserve(n)))  # the slower of the two links
            with self._lock:
                counts[0 if up else 1] += n

        return pace

    def _record(self, req: Request) -> int:
        with self._lock:
            self.events.append(req)
            self.requests_by_client[req.client] += 1
            self.requests_by_method[req.method] += 1
            return sum(self.requests_by_method.values())
