"""``replay_trace``: every state of a trace sent to every teacher, concurrently, under a hard budget.

Calls go state by state (all teachers of state 1, then of state 2, ...), at most ``concurrency`` at
a time, each answered from the cache when the cache has it (free), else asked under a budget
reservation (:mod:`.budget`) and cached. When the budget is exhausted the run stops cleanly: calls in
flight finish, calls not yet started are reported as not replayed (still answered from the cache
where it has them), and :class:`ReplayResult` says what was spent. A re-run with the same cache
continues where this one stopped and pays for nothing twice.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_serverless.replay.budget import Budget
from diloco_serverless.replay.cache import AnswerCache, request_digest
from diloco_serverless.replay.client import CallOutcome, call_teacher, import_httpx
from diloco_serverless.replay.errors import ReplayInputError
from diloco_serverless.replay.teachers import Teacher, prompt_token_bound
from diloco_serverless.replay.trace import Action, State, check_unique, parse_action

__all__ = ["CallRecord", "ReplayResult", "replay_trace", "replay_trace_sync", "build_request"]


@dataclass(frozen=True)
class CallRecord:
    """One (state, teacher) call. ``status``: ok, cached, failed or not_replayed (budget)."""

    state_id: str
    teacher: str
    model: str
    status: str
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float  # paid by this run (0 for a cached answer)
    attempts: int
    error: str | None = None
    cached_cost_usd: float = 0.0  # what the cached answer cost when it was first asked

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ReplayResult:
    """Answers by state and teacher (None = no answer), one record per call, and the spend."""

    states: list[State]
    teachers: list[Teacher]
    answers: dict[str, dict[str, Action | None]]
    records: list[CallRecord]
    spent_usd: float
    max_total_usd: float
    stopped: str | None = None  # why the run stopped early (budget), None when every call was made
    wall_s: float = 0.0
    peak_committed_usd: float = 0.0

    @property
    def not_replayed(self) -> list[tuple[str, str]]:
        """(state_id, teacher) pairs left unasked because the budget ran out."""
        return [(r.state_id, r.teacher) for r in self.records if r.status == "not_replayed"]

    @property
    def failed(self) -> list[CallRecord]:
        return [r for r in self.records if r.status == "failed"]

    def status_of(self, state_id: str, teacher: str) -> str:
        for r in self.records:
            if r.state_id == state_id and r.teacher == teacher:
                return r.status
        return "not_replayed"


def build_request(state: State, teacher: Teacher) -> dict[str, Any]:
    """The chat-completions body for ``state``: the trace's messages (and tools) as they are."""
    body: dict[str, Any] = {
        "model": teacher.model, "messages": [dict(m) for m in state.messages],
        "max_tokens": teacher.max_tokens, "temperature": teacher.temperature, **teacher.extra_body,
    }
    if state.tools:
        body["tools"] = [dict(t) for t in state.tools]
    return body


def _cache_key_body(teacher: Teacher, request: Mapping[str, Any]) -> dict[str, Any]:
    return {"base_url": teacher.base_url, "request": dict(request)}


ProgressFn = Callable[[CallRecord, Budget], None]


async def replay_trace(
    states: Sequence[State], teachers: Sequence[Teacher], *, max_total_usd: float, concurrency: int = 8,
    cache: AnswerCache | str | Path | None = None, progress: ProgressFn | None = None, seed: int | None = None,
    client: Any = None,
) -> ReplayResult:
    """Replay ``states`` against ``teachers`` (see the module docstring).

    Args:
        max_total_usd: the most this run may pay (cached answers are free); never exceeded as long as
            the teachers' prices and ``max_tokens`` are upper bounds.
        concurrency: calls in flight at most.
        cache: an :class:`AnswerCache`, or a folder / store URL for one; None caches nothing.
        progress: called after each call with its record and the budget (for a progress bar).
        client: an ``httpx.AsyncClient`` to use (default: one made and closed here).
    """
    if concurrency < 1:
        raise ReplayInputError(f"concurrency must be >= 1, got {concurrency}")
    if not teachers:
        raise ReplayInputError("no teachers given; name them in a teacher file (docs/data.md, 'Teacher replay')")
    check_unique(states)
    for t in teachers:
        t.api_key()  # fail before any call when a key is missing
    httpx = import_httpx()
    answer_cache = AnswerCache(cache) if isinstance(cache, (str, Path)) else cache
    budget = Budget(max_total_usd)
    rng = random.Random(seed)
    jobs = [(s, t) for s in states for t in teachers]
    results: dict[tuple[str, str], tuple[CallRecord, Action | None]] = {}
    queue: asyncio.Queue[tuple[State, Teacher]] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    start = time.monotonic()
    requests = {(s.state_id, t.name): build_request(s, t) for s, t in jobs}
    digests: dict[tuple[str, str], str] = {}
    known: dict[str, dict[str, Any]] = {}
    if answer_cache is not None:  # every lookup in one pass (one listing, concurrent reads), not one per call
        digests = {k: request_digest(_cache_key_body(t, requests[k])) for k, t in
                   (((s.state_id, t.name), t) for s, t in jobs)}
        known = await asyncio.to_thread(answer_cache.get_many, list(digests.values()))
    asking: dict[str, asyncio.Future[Action | None]] = {}  # identical requests in one trace are asked once

    async def one(http: Any, state: State, teacher: Teacher) -> tuple[CallRecord, Action | None]:
        request = requests[(state.state_id, teacher.name)]
        digest = digests.get((state.state_id, teacher.name), "")
        if answer_cache is not None:
            entry = known.get(digest)
            if entry is None and digest in asking:
                action = await asyncio.shield(asking[digest])
                if action is not None:
                    return CallRecord(state.state_id, teacher.name, teacher.model, "cached", 0.0, 0, 0, 0.0, 0), action
            if entry is not None:
                try:
                    action = parse_action(entry["answer"], f"cache entry {digest}")
                    usage = entry.get("usage", {})
                    return CallRecord(state.state_id, teacher.name, teacher.model, "cached", 0.0,
                                      int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)),
                                      0.0, 0, None, float(entry.get("cost_usd", 0.0))), action
                except (KeyError, TypeError, ValueError, ReplayInputError):
                    pass  # an unreadable entry is asked again
        if budget.exhausted or budget.overrun:
            return _not_replayed(state, teacher), None
        worst = teacher.worst_case_usd(prompt_token_bound(state.messages, state.tools))
        mine: asyncio.Future[Action | None] | None = None
        if digest and digest not in asking:
            mine = asking[digest] = asyncio.get_running_loop().create_future()
        try:
            out: CallOutcome = await call_teacher(http, teacher, request, worst, budget, rng=rng)
        except BaseException:
            if mine is not None:
                mine.set_result(None)  # a follower then asks for itself
            raise
        if mine is not None:
            mine.set_result(out.action)
        paid = out.cost_usd
        if out.budget_stop:  # the ceiling came before an answer (possibly after a retried attempt)
            return _not_replayed(state, teacher, paid, len(out.attempts)), None
        if out.action is None:
            return CallRecord(state.state_id, teacher.name, teacher.model, "failed", out.latency_s,
                              out.prompt_tokens, out.completion_tokens, paid, len(out.attempts), out.error), None
        if answer_cache is not None:
            await answer_cache.aput(digest, {
                "teacher": teacher.name, "model": teacher.model, "answer": out.action.to_json(),
                "usage": {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens},
                "cost_usd": out.cost_usd, "latency_s": out.latency_s,
            })
        return CallRecord(state.state_id, teacher.name, teacher.model, "ok", out.latency_s, out.prompt_tokens,
                          out.completion_tokens, paid, len(out.attempts)), out.action

    async def worker(http: Any) -> None:
        while True:
            try:
                state, teacher = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            record, action = await one(http, state, teacher)
            results[(state.state_id, teacher.name)] = (record, action)
            if progress is not None:
                progress(record, budget)

    async def run(http: Any) -> None:
        await asyncio.gather(*(worker(http) for _ in range(min(concurrency, max(1, len(jobs))))))

    if client is not None:
        await run(client)
    else:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=max(t.timeout_s for t in teachers)) as http:
            await run(http)

    records = [results[(s.state_id, t.name)][0] for s, t in jobs]
    answers = {s.state_id: {t.name: results[(s.state_id, t.name)][1] for t in teachers} for s in states}
    left = [(s, t) for (s, t) in jobs if results[(s.state_id, t.name)][0].status == "not_replayed"]
    worst_left = max((t.worst_case_usd(prompt_token_bound(s.messages, s.tools)) for s, t in left), default=0.0)
    stopped = budget.overrun or (
        f"budget ceiling: ${budget.spent:.4f} spent of ${budget.max_usd:.4f}; {len(left)} calls not replayed "
        f"(one of them may cost up to ${worst_left:.4f}); re-run with the same cache and a larger --max-usd to "
        "continue" if budget.exhausted else None)
    return ReplayResult(list(states), list(teachers), answers, records, budget.spent, budget.max_usd, stopped,
                        time.monotonic() - start, budget.peak_committed)


def _not_replayed(state: State, teacher: Teacher, paid: float = 0.0, attempts: int = 0) -> CallRecord:
    return CallRecord(state.state_id, teacher.name, teacher.model, "not_replayed", 0.0, 0, 0, paid, attempts,
                      "budget ceiling reached before an answer")


def replay_trace_sync(
    states: Sequence[State], teachers: Sequence[Teacher], *, max_total_usd: float, concurrency: int = 8,
    cache: AnswerCache | str | Path | None = None, progress: ProgressFn | None = None, seed: int | None = None,
) -> ReplayResult:
    """:func:`replay_trace` for synchronous callers (runs its own event loop)."""
    return asyncio.run(replay_trace(states, teachers, max_total_usd=max_total_usd, concurrency=concurrency,
                                    cache=cache, progress=progress, seed=seed))


