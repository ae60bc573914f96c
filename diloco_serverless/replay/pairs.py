"""Preference pairs and hints from teacher disagreement.

For each state, the teachers' answers are grouped by :func:`~.agreement.action_key`. Where at least
``agreement_threshold`` teachers agree (and no other group is as large) on an action that differs
from the student's, the consensus is ``chosen`` and the student's action ``rejected``: a
:class:`DPOPair`. ``chosen`` is the answer of the first agreeing teacher in teacher order. Every
other state gets a reason (:data:`REASONS`). The consensus can also be a *hint* (channel 2): the
self-distillation teacher reads the state with the consensus appended (docs/data.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diloco_serverless.replay.agreement import action_key, consensus
from diloco_serverless.replay.replay import ReplayResult
from diloco_serverless.replay.trace import Action, State, action_text, messages_as_text

__all__ = ["DPOPair", "Hint", "REASONS", "extract_dpo_pairs", "extract_hints", "HINT_TEMPLATE"]

#: why a state gave no pair
REASONS = {
    "agrees_with_student": "the teachers' consensus is the student's own action",
    "no_consensus": "fewer than agreement_threshold teachers agree (or two groups tie)",
    "teacher_failed": "no consensus, and a teacher failed (its answer might have made one)",
    "not_replayed": "no consensus, and the budget ceiling left teachers unasked",
}
HINT_TEMPLATE = "A reference answer: {answer}"


@dataclass(frozen=True)
class DPOPair:
    """One preference pair: the state's messages, the consensus (chosen) and the student's action."""

    state_id: str
    state_messages: tuple[Mapping[str, Any], ...]
    chosen: Action
    rejected: Action
    n_teachers_agreeing: int
    teachers: tuple[str, ...] = ()

    def row(self, hint_template: str | None = HINT_TEMPLATE) -> dict[str, Any]:
        """The training record, both shapes: ``prompt`` (string messages), ``chosen`` / ``rejected``
        (flat strings) and ``chosen_messages`` / ``rejected_messages`` (the prompt + the answer as an
        assistant turn), a ``hint`` (the consensus, for channel 2) and provenance columns."""
        prompt = messages_as_text(self.state_messages)
        chosen, rejected = action_text(self.chosen), action_text(self.rejected)
        row: dict[str, Any] = {
            "state_id": self.state_id, "prompt": prompt, "chosen": chosen, "rejected": rejected,
            "chosen_messages": [*prompt, {"role": "assistant", "content": chosen}],
            "rejected_messages": [*prompt, {"role": "assistant", "content": rejected}],
            "n_teachers_agreeing": self.n_teachers_agreeing, "teachers": list(self.teachers),
        }
        if hint_template is not None:
            row["hint"] = hint_template.format(answer=chosen)
        return row


@dataclass(frozen=True)
class Hint:
    """The consensus of a state as a hint for channel 2, with the student's action as the response."""

    state_id: str
    state_messages: tuple[Mapping[str, Any], ...]
    response: Action
    consensus: Action
    n_teachers_agreeing: int

    def row(self, hint_template: str = HINT_TEMPLATE) -> dict[str, Any]:
        """A ``prompt_response`` record with a hint column (``data.format = "prompt_response"``)."""
        return {"state_id": self.state_id, "prompt": messages_as_text(self.state_messages),
                "response": action_text(self.response),
                "hint": hint_template.format(answer=action_text(self.consensus)),
                "n_teachers_agreeing": self.n_teachers_agreeing}


def _state_consensus(
    state: State, answers: Mapping[str, Action | None], teachers: Sequence[str], agreement_threshold: int
) -> tuple[Action | None, tuple[str, ...]]:
    actions = [answers.get(t) for t in teachers]
    c = consensus(actions, agreement_threshold)
    if not c.reached:
        return None, ()
    first = actions[c.members[0]]
    return first, tuple(teachers[i] for i in c.members)


def extract_dpo_pairs(result: ReplayResult, *, agreement_threshold: int = 2) -> tuple[list[DPOPair], dict[str, str]]:
    """(pairs, reasons): a pair per state where a consensus differs from the student's action, and for
    every other state the key of its reason in :data:`REASONS`."""
    if agreement_threshold < 1:
        raise ValueError(f"agreement_threshold must be >= 1, got {agreement_threshold}")
    names = [t.name for t in result.teachers]
    pairs: list[DPOPair] = []
    reasons: dict[str, str] = {}
    for state in result.states:
        answers = result.answers.get(state.state_id, {})
        chosen, members = _state_consensus(state, answers, names, agreement_threshold)
        if chosen is not None:
            if action_key(chosen) == action_key(state.action):
                reasons[state.state_id] = "agrees_with_student"
            else:
                pairs.append(DPOPair(state.state_id, state.messages, chosen, state.action, len(members), members))
            continue
        missing = [n for n in names if answers.get(n) is None]
        statuses = {result.status_of(state.state_id, n) for n in missing}
        if "not_replayed" in statuses:
            reasons[state.state_id] = "not_replayed"
        elif missing:
            reasons[state.state_id] = "teacher_failed"
        else:
            reasons[state.state_id] = "no_consensus"
    return pairs, reasons


def extract_hints(result: ReplayResult, *, agreement_threshold: int = 2, only_disagreeing: bool = False) -> list[Hint]:
    """A hint per state with a consensus (``only_disagreeing``: only where it differs from the student)."""
    names = [t.name for t in result.teachers]
    hints = []
    for state in result.states:
        chosen, members = _state_consensus(state, result.answers.get(state.state_id, {}), names, agreement_threshold)
        if chosen is None or (only_disagreeing and action_key(chosen) == action_key(state.action)):
            continue
        hints.append(Hint(state.state_id, state.messages, state.action, chosen, len(members)))
    return hints


def agreement_rates(result: ReplayResult, *, agreement_threshold: int = 2) -> dict[str, float | None]:
    """Per teacher: the share of the states it answered, among those with a consensus, where it was
    part of the consensus (None when there is no such state)."""
    names = [t.name for t in result.teachers]
    hits = dict.fromkeys(names, 0)
    seen = dict.fromkeys(names, 0)
    for state in result.states:
        answers = result.answers.get(state.state_id, {})
        chosen, members = _state_consensus(state, answers, names, agreement_threshold)
        if chosen is None:
            continue
        for n in names:
            if answers.get(n) is not None:
                seen[n] += 1
                hits[n] += n in members
    return {n: (hits[n] / seen[n] if seen[n] else None) for n in names}
