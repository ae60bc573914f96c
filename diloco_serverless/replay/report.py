"""Per-teacher summaries of a replay (the numbers ``diloco replay`` prints), without any rendering."""

from __future__ import annotations

from dataclasses import dataclass

from diloco_serverless.replay.pairs import agreement_rates
from diloco_serverless.replay.replay import ReplayResult

__all__ = ["TeacherSummary", "teacher_summaries"]


@dataclass(frozen=True)
class TeacherSummary:
    """One teacher's calls: answered (asked + cached), failed, not replayed, mean latency of the asked
    calls, tokens, cost paid by this run, and its agreement rate (:func:`~.pairs.agreement_rates`)."""

    teacher: str
    model: str
    answered: int
    cached: int
    failed: int
    not_replayed: int
    mean_latency_s: float | None
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    agreement_rate: float | None


def teacher_summaries(result: ReplayResult, *, agreement_threshold: int = 2) -> list[TeacherSummary]:
    rates = agreement_rates(result, agreement_threshold=agreement_threshold)
    out = []
    for t in result.teachers:
        recs = [r for r in result.records if r.teacher == t.name]
        asked = [r for r in recs if r.status == "ok"]
        out.append(TeacherSummary(
            t.name, t.model, sum(r.status in ("ok", "cached") for r in recs), sum(r.status == "cached" for r in recs),
            sum(r.status == "failed" for r in recs), sum(r.status == "not_replayed" for r in recs),
            sum(r.latency_s for r in asked) / len(asked) if asked else None,
            sum(r.prompt_tokens for r in recs if r.status in ("ok", "cached")),
            sum(r.completion_tokens for r in recs if r.status in ("ok", "cached")),
            sum(r.cost_usd for r in recs), rates[t.name]))
    return out
