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

import random
import re
import time
import urllib.parse
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Unpack

from support.http_proxy import HttpProxy, ProxyHandler, ProxyLimits

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


class FaultProxy(HttpProxy):
    """The proxy; see the module docstring. Start with ``with`` (or :meth:`start` / :meth:`stop`)."""

    name = "proxy"
    thread_name = "fault-proxy"
    # backlog and default limits: HttpProxy's (128; 256 connections, 256 MiB bodies, 60 s idle,
    # 120 s upstream, 1 h lifetime)

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
        keep_events: int = 20000,
        **limits: Unpack[ProxyLimits],
    ) -> None:
        super().__init__(upstream, **limits)
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
        self._rng = random.Random(seed)
        self.counts: Counter[str] = Counter()  # injected faults by kind
        self.requests = 0
        self.events: deque[tuple[float, str, str, str, int | None]] = deque(maxlen=keep_events)

    def handle(self, handler: ProxyHandler) -> None:
        body = handler.read_body()
        if body is None:
            handler.close_connection = True
            handler.send(413, [("Content-Type", "text/plain")], b"request body too large for the chaos proxy")
            return
        req = self._describe(handler.command, handler.path, handler.headers)
        kind = self._decide(req)
        if self._run_hooks(req, "before") == "drop":
            handler.drop()
            return
        if kind in _ERRORS:
            status, code, message = _ERRORS[kind]
            xml = _ERROR_XML.format(code=code, message=message, resource=urllib.parse.quote(req.key), n=req.n)
            handler.send(status, [("Content-Type", "application/xml")], xml.encode())
            return
        if kind == "drop_before":
            handler.drop()
            return
        if kind == "delay":
            time.sleep(self._delay())
        try:
            status, headers, answer = self.forward(handler.command, handler.path, handler.headers, body)
        except OSError as exc:  # upstream down: a gateway error, like a load balancer would answer
            handler.send(502, [("Content-Type", "text/plain")], f"chaos proxy: upstream failed: {exc}".encode())
            return
        if kind == "drop_after" or self._run_hooks(req, "after") == "drop":
            handler.drop()
            return
        handler.send(status, headers, answer)

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
