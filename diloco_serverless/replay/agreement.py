"""Agreement between actions, after a normalisation that fits agentic traces.

Two actions agree when their *keys* are equal:

* an action with tool calls is its calls, in order, each as canonical JSON: ``{"arguments": ...,
  "name": ...}`` with the arguments' keys sorted at every depth and no insignificant whitespace (the
  text beside tool calls is commentary and is not compared);
* a text action is its text with whitespace runs collapsed to one space, stripped, and casefolded.

:func:`consensus` finds the largest group of agreeing teachers; it is a consensus when it has at
least ``agreement_threshold`` members and no other group is as large.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from diloco_serverless.replay.trace import Action, canonical_call

__all__ = ["Consensus", "action_key", "canonical_call", "consensus", "normalize_text"]

_SPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Whitespace runs -> one space, stripped, casefolded."""
    return _SPACE.sub(" ", text).strip().casefold()


def action_key(action: Action) -> str:
    """The normalised form two actions are compared by."""
    if action.tool_calls:
        return "tool:" + "\n".join(canonical_call(c) for c in action.tool_calls)
    return "text:" + normalize_text(action.content or "")


@dataclass(frozen=True)
class Consensus:
    """The agreeing group: its key, the members' indices (into the answers given) and whether a tie
    with another group of the same size prevented a consensus."""

    key: str | None
    members: tuple[int, ...]
    tie: bool = False

    @property
    def reached(self) -> bool:
        return self.key is not None


def consensus(actions: Sequence[Action | None], agreement_threshold: int) -> Consensus:
    """The consensus of ``actions`` (None = that teacher gave no answer)."""
    if agreement_threshold < 1:
        raise ValueError(f"agreement_threshold must be >= 1, got {agreement_threshold}")
    groups: dict[str, list[int]] = {}
    for i, a in enumerate(actions):
        if a is not None:
            groups.setdefault(action_key(a), []).append(i)
    if not groups:
        return Consensus(None, ())
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    key, members = ranked[0]
    tie = len(ranked) > 1 and len(ranked[1][1]) == len(members)
    if len(members) < agreement_threshold or tie:
        return Consensus(None, tuple(members), tie=tie and len(members) >= agreement_threshold)
    return Consensus(key, tuple(members))
