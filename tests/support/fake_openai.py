"""A local OpenAI-compatible chat-completions server on 127.0.0.1 for the replay tests and benchmark.

``FakeOpenAI(script)`` serves ``POST /v1/chat/completions`` (HTTP/1.1, keep-alive) from an asyncio
loop in a background thread. ``script(request)`` returns a :class:`Reply`: an answer (text and/or
tool calls), a status (429 with ``Retry-After``, 500, ...), a delay before answering (slow answers),
and the usage (prompt and completion tokens) and ``usage.cost`` fields to report. The server records
every request (body and headers) and what it billed: the sum of the costs of the answers it sent with
status 200, which is what a provider would charge. ``max_concurrency`` makes it serve at most that
many requests at once (the server's own limit; the others queue), and ``peak_in_flight`` says how
many it ever held. ``GET /_stats`` returns those counters (``POST /_stats`` also resets them), for a
server run in its own process: ``python tests/support/fake_openai.py --latency-ms 50
--max-concurrency 16`` prints its URL and serves fixed answers until killed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FakeOpenAI", "Reply", "Request", "text_reply", "tool_reply"]


@dataclass
class Request:
    """One request the server received."""

    model: str
    body: dict[str, Any]
    headers: dict[str, str]
    n: int  # 0-based count of requests for this model so far

    @property
    def last_user(self) -> str:
        users = [m for m in self.body.get("messages", []) if m.get("role") == "user"]
        return str(users[-1].get("content", "")) if users else ""


@dataclass
class Reply:
    """What the server answers. Usage defaults: prompt tokens = the request's JSON byte count / 4,
    completion tokens = the answer's words; ``cost`` None = no ``usage.cost`` field."""

    status: int = 200
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost: float | None = None
    billed: float = 0.0  # what the server counts as charged for this answer (tests set it)
    error: str = "scripted error"
    body: dict[str, Any] | None = None  # a raw body to send instead


def text_reply(content: str, **kw: Any) -> Reply:
    return Reply(content=content, **kw)


def tool_reply(name: str, arguments: dict[str, Any] | str, content: str | None = None, **kw: Any) -> Reply:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": args}}
    return Reply(content=content, tool_calls=[call], **kw)


Script = Callable[[Request], Reply]
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 408: "Request Timeout",
            429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}


class FakeOpenAI:
    """The server; use as a context manager (``with FakeOpenAI(script) as server: server.url``)."""

    def __init__(self, script: Script, *, max_concurrency: int | None = None) -> None:
        self.script = script
        self.max_concurrency = max_concurrency
        self.requests: list[Request] = []
        self.billed = 0.0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.answered = 0
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> FakeOpenAI:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fake-openai", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fake OpenAI server did not start")

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._sem = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        self._server = loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            loop.run_until_complete(self._server.wait_closed())
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in
                           (line.split(":", 1) for line in lines[1:] if ":" in line)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                status, out_headers, payload = await self._handle(method, path, headers, body)
                reason = _REASONS.get(status, "Status")
                data = json.dumps(payload).encode()
                hdrs = {"content-type": "application/json", "content-length": str(len(data)), **out_headers}
                writer.write(f"HTTP/1.1 {status} {reason}\r\n".encode() +
                             "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()).encode() + b"\r\n" + data)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            writer.close()

    async def _handle(self, method: str, path: str, headers: dict[str, str],
                      raw: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
        if path.endswith("/_stats"):  # for a server in another process (benchmarks/replay.py)
            stats = {"billed": self.billed, "answered": self.answered, "peak_in_flight": self.peak_in_flight}
            if method == "POST":
                self.billed, self.answered, self.peak_in_flight = 0.0, 0, 0
            return 200, {}, stats
        if method != "POST" or not path.endswith("/chat/completions"):
            return 404, {}, {"error": {"message": f"no route {method} {path}"}}
        body = json.loads(raw or b"{}")
        model = str(body.get("model", ""))
        with self._lock:
            n = self._counts.get(model, 0)
            self._counts[model] = n + 1
            req = Request(model, body, headers, n)
            self.requests.append(req)
        if self._sem is not None:
            await self._sem.acquire()
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            reply = self.script(req)
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
        finally:
            self.in_flight -= 1
            if self._sem is not None:
                self._sem.release()
        if reply.body is not None:
            return reply.status, reply.headers, reply.body
        if reply.status != 200:
            return reply.status, reply.headers, {"error": {"message": reply.error, "code": reply.status}}
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        prompt = reply.prompt_tokens if reply.prompt_tokens is not None else len(raw) // 4
        completion = (reply.completion_tokens if reply.completion_tokens is not None
                      else len((reply.content or "").split()) + 8 * len(reply.tool_calls or []))
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if reply.cost is not None:
            usage["cost"] = reply.cost
        with self._lock:
            self.billed += reply.billed if reply.billed else (reply.cost or 0.0)
            self.answered += 1
        finish = "tool_calls" if reply.tool_calls else "stop"
        return 200, reply.headers, {
            "id": f"chatcmpl-{n}", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage,
        }


def _main() -> None:
    import argparse
    import signal
    import sys

    ap = argparse.ArgumentParser(description="a fake OpenAI server with fixed answers (prints its URL)")
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--cost", type=float, default=0.001, help="usage.cost of each answer")
    args = ap.parse_args()

    def script(req: Request) -> Reply:
        return Reply(content=f"answer {req.model}", delay_s=args.latency_ms / 1000, completion_tokens=8,
                     cost=args.cost)

    server = FakeOpenAI(script, max_concurrency=args.max_concurrency)
    server.start()
    print(server.url, flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT}) if sys.platform != "win32" else None
    server.stop()


if __name__ == "__main__":
    _main()
