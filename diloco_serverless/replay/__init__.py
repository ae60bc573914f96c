"""Teacher replay: preference pairs and hints from teacher disagreement, within a hard budget.

The user's side (no torch): each state of a student's frozen agentic trace (:mod:`.trace`) is sent
to several teachers, OpenAI-compatible chat-completions endpoints (:mod:`.teachers`, :mod:`.client`),
concurrently and under a ceiling that in-flight calls cannot overshoot (:mod:`.budget`), answers
cached by content so a re-run pays nothing twice (:mod:`.cache`). Where enough teachers agree
(:mod:`.agreement`) on an action other than the student's, the consensus and the student's action
become a preference pair (:mod:`.pairs`), filtered by :mod:`.normalize` and written as a dataset that
``data.format = "preference"`` trains (:mod:`.output`). docs/data.md, "Teacher replay".
"""

from __future__ import annotations

from diloco_serverless.replay.agreement import Consensus, action_key, consensus, normalize_text
from diloco_serverless.replay.budget import Budget
from diloco_serverless.replay.cache import AnswerCache
from diloco_serverless.replay.errors import ReplayInputError
from diloco_serverless.replay.normalize import PairFilters, filter_pairs, filter_pairs_dataset
from diloco_serverless.replay.pairs import DPOPair, Hint, extract_dpo_pairs, extract_hints
from diloco_serverless.replay.replay import CallRecord, ReplayResult, replay_trace, replay_trace_sync
from diloco_serverless.replay.teachers import PRESETS, Teacher, load_teachers
from diloco_serverless.replay.trace import Action, State, ToolCall, load_trace

__all__ = [
    "Action", "AnswerCache", "Budget", "CallRecord", "Consensus", "DPOPair", "Hint", "PRESETS", "PairFilters",
    "ReplayInputError", "ReplayResult", "State", "Teacher", "ToolCall", "action_key",
    "consensus", "extract_dpo_pairs", "extract_hints", "filter_pairs", "filter_pairs_dataset", "load_teachers",
    "load_trace", "normalize_text", "replay_trace", "replay_trace_sync",
]
