"""``replay_trace`` against a local OpenAI-compatible server: answers and tool calls become pairs,
429 (Retry-After) and 500 are retried, a 400 is not, slow answers time out, costs come from usage or
the reported ``usage.cost``, the budget stops the run cleanly, a re-run pays for nothing twice, and
the API key appears nowhere but in the request header."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from conftest import KEY_ENV, teacher

from diloco_serverless.replay import (
    Action,
    State,
    extract_dpo_pairs,
    extract_hints,
    replay_trace_sync,
)
from diloco_serverless.replay.cache import AnswerCache
from diloco_serverless.replay.errors import ReplayInputError
from diloco_serverless.replay.pairs import agreement_rates
from diloco_serverless.replay.teachers import prompt_token_bound
from diloco_serverless.replay.trace import parse_action
from support.fake_openai import FakeOpenAI, Reply, Request, text_reply, tool_reply


def states(n: int) -> list[State]:
    return [State(f"s{i}", ({"role": "system", "content": "You are an agent."},
                            {"role": "user", "content": f"task {i}: list the files"}),
                  Action(content=f"student answer {i}")) for i in range(n)]


def test_pairs_hints_and_reasons(api_key: str) -> None:
    """Three teachers: s0 they agree (a tool call, arguments in any order) against the student; s1 they
    agree with the student; s2 no consensus; s3 one teacher fails (400) and the other two disagree."""
    def script(req: Request) -> Reply:
        task = req.last_user.split(":")[0]
        if task == "task 0":
            args = {"path": "/", "all": True} if req.model != "c" else {"all": True, "path": "/"}
            return tool_reply("ls", args, content=f"{req.model} says list")
        if task == "task 1":
            return text_reply("Student  ANSWER 1")
        if task == "task 3" and req.model == "a":
            return Reply(status=400, error="bad request")
        return text_reply(f"answer from {req.model}")

    with FakeOpenAI(script) as server:
        ts = [teacher(m, server.url) for m in "abc"]
        result = replay_trace_sync(states(4), ts, max_total_usd=1.0, concurrency=4)
    pairs, reasons = extract_dpo_pairs(result, agreement_threshold=2)
    assert [p.state_id for p in pairs] == ["s0"]
    pair = pairs[0]
    assert pair.n_teachers_agreeing == 3 and pair.teachers == ("a", "b", "c")
    assert pair.rejected == Action("student answer 0")
    row = pair.row()
    assert row["chosen"] == 'a says list\n{"arguments": {"all": true, "path": "/"}, "name": "ls"}'
    assert row["rejected"] == "student answer 0"
    assert row["prompt"][-1] == {"role": "user", "content": "task 0: list the files"}
    assert row["chosen_messages"][-1] == {"role": "assistant", "content": row["chosen"]}
    assert row["hint"] == "A reference answer: " + row["chosen"]
    assert reasons == {"s1": "agrees_with_student", "s2": "no_consensus", "s3": "teacher_failed"}
    [failed] = result.failed
    assert (failed.state_id, failed.teacher, failed.attempts) == ("s3", "a", 1)  # a 400 is not retried
    assert "HTTP 400: bad request" in (failed.error or "")
    hints = extract_hints(result)
    assert [h.state_id for h in hints] == ["s0", "s1"]
    assert hints[1].row()["response"] == "student answer 1"
    assert [h.state_id for h in extract_hints(result, only_disagreeing=True)] == ["s0"]
    rates = agreement_rates(result)
    assert rates == {"a": 1.0, "b": 1.0, "c": 1.0}
    # every request carried the bearer key and the trace's messages as they are
    assert all(r.headers["authorization"] == f"Bearer {api_key}" for r in server.requests)
    assert server.requests[0].body["messages"][0] == {"role": "system", "content": "You are an agent."}
    assert server.requests[0].body["max_tokens"] == 64


def test_429_retry_after_and_500_are_retried(api_key: str) -> None:
    seen: dict[str, list[float]] = {}

    def script(req: Request) -> Reply:
        seen.setdefault(req.model, []).append(time.monotonic())
        if req.model == "limited" and req.n == 0:
            return Reply(status=429, headers={"retry-after": "0.4"}, error="rate limited")
        if req.model == "flaky" and req.n < 2:
            return Reply(status=500)
        return text_reply("fine answer")

    with FakeOpenAI(script) as server:
        ts = [teacher("limited", server.url), teacher("flaky", server.url)]
        result = replay_trace_sync(states(1), ts, max_total_usd=1.0, concurrency=2, seed=0)
    recs = {r.teacher: r for r in result.records}
    assert recs["limited"].status == "ok" and recs["limited"].attempts == 2
    assert seen["limited"][1] - seen["limited"][0] >= 0.4  # Retry-After honoured
    assert recs["flaky"].status == "ok" and recs["flaky"].attempts == 3
    # retries that were refused cost nothing; the answer costs its usage at the teacher's prices
    req = server.requests[-1]
    assert result.spent_usd == pytest.approx(sum(r.cost_usd for r in result.records))
    assert recs["flaky"].cost_usd == pytest.approx(
        (recs["flaky"].prompt_tokens * 1.0 + recs["flaky"].completion_tokens * 2.0) / 1e6)
    assert req.body["messages"]


def test_retries_give_up_and_slow_answers_time_out(api_key: str) -> None:
    def script(req: Request) -> Reply:
        if req.model == "down":
            return Reply(status=503)
        return Reply(content="late answer", delay_s=2.0)

    with FakeOpenAI(script) as server:
        ts = [teacher("down", server.url, max_retries=1), teacher("slow", server.url, timeout_s=0.3, max_retries=0,
                                                                      usd_per_m_output=1000.0)]
        result = replay_trace_sync(states(1), ts, max_total_usd=1.0, concurrency=2)
    recs = {r.teacher: r for r in result.records}
    assert recs["down"].status == "failed" and recs["down"].attempts == 2 and "HTTP 503" in (recs["down"].error or "")
    assert recs["down"].cost_usd == 0
    assert recs["slow"].status == "failed" and "Timeout" in (recs["slow"].error or "")
    assert recs["slow"].latency_s < 1.5
    # an attempt that timed out after its request was sent is charged at its worst case (it may be billed)
    assert recs["slow"].cost_usd == pytest.approx(ts[1].worst_case_usd(prompt_token_bound(states(1)[0].messages)))


def test_reported_cost_is_used_when_present(api_key: str) -> None:
    with FakeOpenAI(lambda req: text_reply("an answer", cost=0.000123)) as server:
        reported = teacher("rep", server.url)
        computed = teacher("cmp", server.url, reported_cost=False)
        result = replay_trace_sync(states(1), [reported, computed], max_total_usd=1.0)
    recs = {r.teacher: r for r in result.records}
    assert recs["rep"].cost_usd == pytest.approx(0.000123)
    assert recs["cmp"].cost_usd == pytest.approx((recs["cmp"].prompt_tokens + 2 * recs["cmp"].completion_tokens) / 1e6)


def test_a_dearer_answer_than_reserved_stops_the_run(api_key: str) -> None:
    with FakeOpenAI(lambda req: text_reply("an answer", cost=5.0)) as server:
        result = replay_trace_sync(states(3), [teacher("liar", server.url)], max_total_usd=10.0, concurrency=1)
    assert result.stopped and "not upper bounds" in result.stopped
    assert [r.status for r in result.records] == ["ok", "not_replayed", "not_replayed"]


def test_missing_key_is_a_clear_error_before_any_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    with FakeOpenAI(lambda req: text_reply("x")) as server:
        with pytest.raises(ReplayInputError, match=f"\\${KEY_ENV}, which is not set"):
            replay_trace_sync(states(1), [teacher("a", server.url)], max_total_usd=1.0)
        assert server.requests == []


def test_budget_ceiling_stops_cleanly_and_a_rerun_pays_nothing_twice(api_key: str, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A budget for about half the calls: the run stops, reports spent and not replayed; the re-run with
    the same cache and a larger budget asks only what was not answered, and a third run asks nothing."""
    caplog.set_level(logging.DEBUG)
    calls: list[str] = []
    paid: list[str] = []

    def script(req: Request) -> Reply:
        body = json.dumps(req.body, sort_keys=True)
        calls.append(body)
        if req.model == "b" and req.n == 0:
            return Reply(status=429, headers={"retry-after": "0"}, error=f"echo {req.headers.get('authorization')}")
        paid.append(body)
        return text_reply(f"teacher {req.model} answer for {req.last_user}", completion_tokens=64)

    trace = states(6)
    cache = tmp_path / "cache"
    with FakeOpenAI(script) as server:
        ts = [teacher(m, server.url) for m in "abc"]
        worst = ts[0].worst_case_usd(prompt_token_bound(trace[0].messages))
        budget = worst * 8.5  # room for 8 of the 18 calls' worst cases at a time
        first = replay_trace_sync(trace, ts, max_total_usd=budget, concurrency=3, cache=cache)
        assert first.stopped and "budget ceiling" in first.stopped
        assert first.spent_usd <= budget and first.peak_committed_usd <= budget + 1e-12
        done_first = [r for r in first.records if r.status == "ok"]
        assert 0 < len(done_first) < 18 and first.not_replayed
        assert {r.status for r in first.records} <= {"ok", "not_replayed"}
        assert len(paid) == len(done_first)
        paid_first = len(paid)

        second = replay_trace_sync(trace, ts, max_total_usd=1.0, concurrency=3, cache=cache)
        assert second.stopped is None and not second.not_replayed
        statuses = {(r.state_id, r.teacher): r.status for r in second.records}
        assert all(statuses[(r.state_id, r.teacher)] == "cached" for r in done_first)
        assert sum(s == "ok" for s in statuses.values()) == 18 - len(done_first)
        # nothing answered (paid for) in the first run was asked again
        assert set(paid[:paid_first]).isdisjoint(paid[paid_first:]) and len(set(paid)) == 18 == len(paid)
        n = len(calls)
        third = replay_trace_sync(trace, ts, max_total_usd=0.0, concurrency=3, cache=cache)
        assert len(calls) == n and third.spent_usd == 0 and {r.status for r in third.records} == {"cached"}
        pairs3, _ = extract_dpo_pairs(third)
        pairs2, _ = extract_dpo_pairs(second)
        assert pairs3 == pairs2

    # the key is only ever in the request header: not in the cache, the records, the logs or errors
    files = list(cache.rglob("*.json"))
    assert len(files) == 18
    for f in files:
        assert api_key not in f.read_text()
    blob = json.dumps([r.to_json() for r in first.records + second.records + third.records])
    assert api_key not in blob and api_key not in caplog.text
    assert KEY_ENV not in "".join(f.read_text() for f in files)


def test_paid_requests_are_never_repeated(api_key: str, tmp_path: Path) -> None:
    """Interrupted by the ceiling, then resumed: every request answered with 200 was answered once."""
    answered: list[str] = []

    def script(req: Request) -> Reply:
        answered.append(json.dumps(req.body, sort_keys=True))
        return text_reply("same answer everywhere", completion_tokens=10)

    trace = states(5)
    with FakeOpenAI(script) as server:
        ts = [teacher(m, server.url, max_tokens=10) for m in "ab"]
        for budget in (0.0005, 0.0011, 1.0):
            replay_trace_sync(trace, ts, max_total_usd=budget, concurrency=2, cache=tmp_path / "c")
    assert len(answered) == 10 and len(set(answered)) == 10


def test_cache_entry_that_is_not_its_own_is_ignored(tmp_path: Path) -> None:
    cache = AnswerCache(tmp_path)
    cache.put("ab" * 32, {"answer": {"content": "x", "tool_calls": []}})
    assert cache.get("ab" * 32) is not None
    p = tmp_path / "answers" / "ab" / f"{'ab' * 32}.json"
    other = tmp_path / "answers" / "cd" / f"{'cd' * 32}.json"
    other.parent.mkdir(parents=True)
    other.write_bytes(p.read_bytes())  # an entry copied to another address
    assert cache.get("cd" * 32) is None
    assert parse_action(cache.get("ab" * 32)["answer"], "t") == Action("x")  # type: ignore[index]


def test_cache_in_a_store_url_resumes_too(api_key: str) -> None:
    """The cache can live in the store (any URL ObjectStore reads; memory:// here): a second run asks nothing."""
    url = f"memory://replay-cache-{time.time_ns()}"
    with FakeOpenAI(lambda req: text_reply(f"answer of {req.model}")) as server:
        ts = [teacher(m, server.url) for m in "ab"]
        first = replay_trace_sync(states(3), ts, max_total_usd=1.0, cache=url)
        n = len(server.requests)
        second = replay_trace_sync(states(3), ts, max_total_usd=0.0, cache=AnswerCache(url))
    assert n == 6 and len(server.requests) == 6
    assert {r.status for r in first.records} == {"ok"} and {r.status for r in second.records} == {"cached"}
    assert second.answers == first.answers
    assert [r.cached_cost_usd for r in second.records] == [r.cost_usd for r in first.records]


def test_a_call_dearer_than_the_whole_budget_is_never_made(api_key: str) -> None:
    with FakeOpenAI(lambda req: text_reply("x")) as server:
        result = replay_trace_sync(states(2), [teacher("a", server.url, max_tokens=1000)], max_total_usd=0.0001)
        assert server.requests == []
    assert result.spent_usd == 0 and len(result.not_replayed) == 2
    assert result.stopped and "one of them may cost up to $0.002" in result.stopped


def test_identical_requests_in_one_trace_are_paid_once(api_key: str, tmp_path: Path) -> None:
    """Two states with the same messages (a loop in the agent's trace) ask each teacher once."""
    same = (({"role": "user", "content": "task 0: list the files"}),)
    trace = [State("x", same, Action("a")), State("y", same, Action("b")), State("z", same, Action("c"))]
    with FakeOpenAI(lambda req: text_reply("ls -la", delay_s=0.05)) as server:
        result = replay_trace_sync(trace, [teacher("t", server.url)], max_total_usd=1.0, concurrency=3,
                                   cache=tmp_path / "c")
    assert len(server.requests) == 1
    assert sorted(r.status for r in result.records) == ["cached", "cached", "ok"]
    assert all(a["t"] == Action("ls -la") for a in result.answers.values())
