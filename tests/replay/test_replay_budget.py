"""The budget cannot be overshot: a property test over random latencies, prices, answer lengths,
concurrency and ceilings against the fake server, which counts what it billed; and the budget's
reservation rules on their own."""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import teacher
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_serverless.replay import replay_trace_sync
from diloco_serverless.replay.budget import Budget
from diloco_serverless.replay.trace import Action, State
from support.fake_openai import FakeOpenAI, Reply, Request

TRACE = [State(f"s{i}", ({"role": "user", "content": f"step {i}: " + "context " * (i % 4)},),
               Action(f"student {i}")) for i in range(6)]


@pytest.fixture(scope="module")
def server() -> FakeOpenAI:
    """One server for all examples; each example installs its own script."""
    srv = FakeOpenAI(lambda req: Reply())
    srv.start()
    yield srv  # type: ignore[misc]
    srv.stop()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prices=st.lists(st.tuples(st.floats(0.1, 50.0), st.floats(0.1, 80.0), st.integers(4, 200)),
                    min_size=1, max_size=3),
    ceiling_calls=st.floats(0.0, 14.0),
    concurrency=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    reported=st.booleans(),
)
def test_budget_never_exceeded_under_concurrency(
    server: FakeOpenAI, api_key: str, prices: list[tuple[float, float, int]], ceiling_calls: float,
    concurrency: int, seed: int, reported: bool,
) -> None:
    rng = random.Random(seed)
    ts = [teacher(f"t{i}", server.url, usd_per_m_input=pin, usd_per_m_output=pout, max_tokens=mt,
                  reported_cost=reported, retry_backoff_s=0.005) for i, (pin, pout, mt) in enumerate(prices)]
    by_model = {t.model: t for t in ts}

    def script(req: Request) -> Reply:
        t = by_model[req.model]
        prompt = rng.randint(1, len(req.body["messages"][0]["content"]) + 4)  # within the byte bound
        completion = rng.randint(1, t.max_tokens)
        cost = t.cost_usd(prompt, completion)
        if rng.random() < 0.15:
            return Reply(status=rng.choice([429, 500]), headers={"retry-after": "0"}, delay_s=rng.uniform(0, 0.01))
        return Reply(content=rng.choice(["yes", "no"]), prompt_tokens=prompt, completion_tokens=completion,
                     cost=cost if reported else None, billed=cost, delay_s=rng.uniform(0.0, 0.02))

    server.script = script
    server.billed, server.peak_in_flight = 0.0, 0
    mean_worst = sum(t.worst_case_usd(64) for t in ts) / len(ts)
    ceiling = ceiling_calls * mean_worst
    result = replay_trace_sync(TRACE, ts, max_total_usd=ceiling, concurrency=concurrency, seed=seed)
    assert server.billed <= ceiling + 1e-12
    assert result.spent_usd <= ceiling + 1e-12
    assert result.peak_committed_usd <= ceiling + 1e-12
    assert result.spent_usd == pytest.approx(server.billed, abs=1e-12)
    assert server.peak_in_flight <= concurrency
    statuses = {r.status for r in result.records}
    if result.stopped:
        assert "not_replayed" in statuses and "budget ceiling" in result.stopped
    else:
        assert "not_replayed" not in statuses


def test_reservations() -> None:
    async def main() -> None:
        b = Budget(1.0)
        r1 = b.try_reserve(0.6)
        assert r1 is not None and b.try_reserve(0.5) is None and b.remaining == pytest.approx(0.4)
        waiter = asyncio.ensure_future(b.reserve(0.5))  # waits: 0.6 in flight
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await b.settle(r1, 0.2)  # settles below its worst case: now 0.5 fits
        r2 = await waiter
        assert r2 is not None and b.spent == pytest.approx(0.2) and b.in_flight == pytest.approx(0.5)
        await b.settle(r2, 0.5)
        assert await b.reserve(0.31) is None and b.exhausted  # nothing in flight and it does not fit
        assert b.try_reserve(0.01) is None  # exhausted stays exhausted: the run stops
        with pytest.raises(RuntimeError, match="twice"):
            await b.settle(r2, 0.0)
        assert b.peak_committed == pytest.approx(0.7)  # 0.2 spent + 0.5 in flight

    asyncio.run(main())
    with pytest.raises(ValueError, match="max_usd"):
        Budget(-1)
