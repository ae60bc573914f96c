"""One teacher call over an OpenAI-compatible ``POST {base_url}/chat/completions``, with retries.

Transport: ``httpx`` (already installed by the package's pinned dependencies' extras; the ``replay``
extra names it), one :class:`httpx.AsyncClient` shared by a replay's concurrent calls. The API key
is read from the teacher's environment variable when the call is made and sent as a bearer header;
it is never stored, logged, cached or put in an error message.

Retries (``teacher.max_retries``) after 429, 408, 5xx, a timeout or a dropped connection, waiting a
full-jitter exponential backoff (``retry_backoff_s``, 0.5 s, x 2^attempt, at most 30 s) or the server's ``Retry-After``
(seconds or an HTTP date) when that is longer. Each attempt is one budget reservation: an answer
settles at its actual cost, an error answer without usage at zero, and an attempt that timed out or
lost its connection after the request was sent at its worst case (the provider may bill it).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco_serverless.replay.budget import Budget
from diloco_serverless.replay.errors import ReplayInputError
from diloco_serverless.replay.teachers import Teacher
from diloco_serverless.replay.trace import Action, parse_action

__all__ = ["Attempt", "CallOutcome", "call_teacher", "import_httpx", "parse_retry_after"]

log = logging.getLogger("diloco_serverless.replay")

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529})
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
REPLAY_EXTRA_HINT = "pip install 'diloco-serverless[replay]'"


def import_httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:
        raise ReplayInputError(f"teacher replay needs httpx, which is not installed ({exc.msg}); "
                               f"{REPLAY_EXTRA_HINT}") from None
    return httpx


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
        return max(0.0, seconds) if math.isfinite(seconds) else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def backoff_s(attempt: int, retry_after: float | None, rng: random.Random, base_s: float = BACKOFF_BASE_S) -> float:
    """Full jitter: uniform(0, min(cap, base x 2^attempt)), at least ``retry_after`` when given."""
    jitter = rng.uniform(0.0, min(BACKOFF_MAX_S, base_s * 2 ** attempt))
    return max(jitter, min(retry_after, 600.0)) if retry_after is not None else jitter


@dataclass
class Attempt:
    """One HTTP attempt: its status (or the transport error's name), latency and cost settled."""

    status: int | str
    latency_s: float
    cost_usd: float


@dataclass
class CallOutcome:
    """The result of one teacher call: the answer (None if it failed or was not made) and its record."""

    action: Action | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    reported_cost: float | None = None
    latency_s: float = 0.0
    attempts: list[Attempt] = field(default_factory=list)
    error: str | None = None
    budget_stop: bool = False
    raw_message: dict[str, Any] | None = None


def _usage(body: Mapping[str, Any]) -> tuple[int, int, float | None]:
    usage = body.get("usage") if isinstance(body.get("usage"), Mapping) else {}
    assert isinstance(usage, Mapping)

    def num(name: str) -> int:
        v = usage.get(name)
        return int(v) if isinstance(v, (int, float)) and v >= 0 else 0

    cost = usage.get("cost")
    cost_v = float(cost) if isinstance(cost, (int, float)) and math.isfinite(cost) and cost >= 0 else None
    return num("prompt_tokens"), num("completion_tokens"), cost_v


def _settle_cost(teacher: Teacher, prompt: int, completion: int, reported: float | None) -> float:
    if teacher.reported_cost and reported is not None:
        return reported
    return teacher.cost_usd(prompt, completion)


def _message(body: Any) -> dict[str, Any]:
    choices = body.get("choices") if isinstance(body, Mapping) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise ValueError("the answer has no choices[0]")
    msg = choices[0].get("message")
    if not isinstance(msg, Mapping):
        raise ValueError("choices[0] has no message")
    return dict(msg)


Sleep = Callable[[float], Awaitable[None]]


async def call_teacher(
    client: Any, teacher: Teacher, request: Mapping[str, Any], worst_usd: float, budget: Budget, *,
    rng: random.Random, sleep: Sleep = asyncio.sleep,
) -> CallOutcome:
    """POST ``request`` to ``teacher`` with retries, each attempt under a budget reservation."""
    httpx = import_httpx()
    url = f"{teacher.base_url}/chat/completions"
    key = teacher.api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out = CallOutcome(None)
    for attempt in range(teacher.max_retries + 1):
        reservation = await budget.reserve(worst_usd)
        if reservation is None:
            out.budget_stop = True
            out.error = budget.overrun or f"budget: ${budget.spent:.4f} of ${budget.max_usd:.4f} spent"
            return out
        start = time.monotonic()
        cost, retry_after = 0.0, None
        status: int | str = ""
        try:
            async with asyncio.timeout(teacher.timeout_s + 1.0):  # a whole-attempt deadline over httpx's per-phase
                resp = await client.post(url, json=dict(request), headers=headers, timeout=teacher.timeout_s)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached the server: not billed
            status = type(exc).__name__
        except (TimeoutError, httpx.TimeoutException, httpx.TransportError) as exc:
            status, cost = type(exc).__name__ or "Timeout", reservation.usd  # may be billed: its worst case
        else:
            status = resp.status_code
            try:
                body = resp.json()
            except ValueError:
                body = {}
            p_tok, c_tok, reported = _usage(body) if isinstance(body, Mapping) else (0, 0, None)
            if resp.status_code == 200:
                cost = _settle_cost(teacher, p_tok, c_tok, reported)
                try:
                    msg = _message(body)
                    action = parse_action(msg, f"teacher {teacher.name!r}")
                except (ValueError, ReplayInputError) as exc:
                    out.error = f"HTTP 200 without a usable answer: {exc}"
                    action, msg = None, None
                out.action, out.raw_message = action, msg
                out.prompt_tokens, out.completion_tokens, out.reported_cost = p_tok, c_tok, reported
            else:
                cost = _settle_cost(teacher, p_tok, c_tok, reported) if (p_tok or c_tok or reported) else 0.0
                retry_after = parse_retry_after(resp.headers.get("retry-after"))
                out.error = f"HTTP {resp.status_code}: {_error_text(body, key)}"
        latency = time.monotonic() - start
        await budget.settle(reservation, cost)
        out.cost_usd += cost
        out.attempts.append(Attempt(status, latency, cost))
        out.latency_s = latency
        if status == 200:
            if out.action is not None:
                out.error = None
            return out
        retryable = (isinstance(status, int) and status in RETRY_STATUS) or isinstance(status, str)
        if isinstance(status, str):
            out.error = f"{status} after {latency:.1f}s"
        if not retryable or attempt == teacher.max_retries:
            break
        wait = backoff_s(attempt, retry_after, rng, teacher.retry_backoff_s)
        log.info("teacher %s: %s, retry %d/%d in %.2fs", teacher.name, status, attempt + 1, teacher.max_retries, wait)
        await sleep(wait)
    return out


def _error_text(body: Any, key: str | None) -> str:
    """The server's error message, one line, with the key blanked should a server echo it."""
    err = body.get("error") if isinstance(body, Mapping) else None
    if isinstance(err, Mapping):
        err = err.get("message")
    text = " ".join((str(err) if err else "no error message").split())
    if key:
        text = text.replace(key, "***")
    return text[:200]
