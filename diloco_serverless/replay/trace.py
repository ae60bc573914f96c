"""Traces: the frozen states of a student's agentic run that :func:`replay_trace` replays.

A trace file is JSONL, one state per line (docs/data.md, "Teacher replay")::

    {"state_id": "ep3-step7",
     "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": null,
                   "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "ls", "arguments": "{\"path\": \"/\"}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "bin etc"}],
     "action": {"content": "...", "tool_calls": [{"name": "cat", "arguments": {"path": "/etc/hosts"}}]},
     "tools": [ ...OpenAI tool schemas, optional... ]}

``messages`` is the chat prefix the student saw (OpenAI chat-completions messages, sent to the
teachers as they are); ``action`` is what the student did next: a string (a text answer) or an
object with ``content`` and/or ``tool_calls`` (each ``{name, arguments}`` or the OpenAI
``{function: {name, arguments}}`` shape, arguments an object or a JSON string). ``tools`` is
optional and sent with the request when present.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_serverless.replay.errors import ReplayInputError

__all__ = ["Action", "State", "ToolCall", "action_text", "canonical_call", "load_trace", "messages_as_text",
           "parse_action", "parse_state"]

_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class ToolCall:
    """One tool call: its function name and its arguments (a JSON object, or the raw string when the
    model wrote arguments that are not JSON)."""

    name: str
    arguments: dict[str, Any] | str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class Action:
    """An assistant turn: text and/or tool calls."""

    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"content": self.content, "tool_calls": [c.to_json() for c in self.tool_calls]}


@dataclass(frozen=True)
class State:
    """One state of a trace: the messages before the action, and the student's action."""

    state_id: str
    messages: tuple[Mapping[str, Any], ...]
    action: Action
    tools: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)


def _tool_call(raw: Any, where: str) -> ToolCall:
    if not isinstance(raw, Mapping):
        raise ReplayInputError(f"{where}: a tool call must be an object with name and arguments, got {raw!r:.80}")
    inner = raw.get("function")
    fn: Mapping[str, Any] = inner if isinstance(inner, Mapping) else raw
    name, args = fn.get("name"), fn.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise ReplayInputError(f"{where}: a tool call has no function name: {raw!r:.80}")
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError:
            return ToolCall(name, args)
        args = parsed
    if not isinstance(args, (Mapping, str)):
        raise ReplayInputError(f"{where}: tool call {name!r} has arguments {args!r:.60}; they must be a JSON object")
    return ToolCall(name, dict(args) if isinstance(args, Mapping) else args)


def parse_action(raw: Any, where: str) -> Action:
    """An :class:`Action` from a string, ``{content, tool_calls}`` or an OpenAI assistant message."""
    if isinstance(raw, str):
        return Action(content=raw)
    if not isinstance(raw, Mapping):
        raise ReplayInputError(
            f"{where}: 'action' must be a string or an object with content and/or tool_calls, got {type(raw).__name__}")
    content = raw.get("content")
    if isinstance(content, list):  # content parts (some providers answer so): the text parts, joined
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping)) or None
    if content is not None and not isinstance(content, str):
        raise ReplayInputError(f"{where}: action content must be a string or null, got {type(content).__name__}")
    calls = raw.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ReplayInputError(f"{where}: action tool_calls must be a list")
    action = Action(content=content, tool_calls=tuple(_tool_call(c, where) for c in calls))
    if not action.tool_calls and not (action.content or "").strip():
        raise ReplayInputError(f"{where}: the action is empty (no content, no tool calls)")
    return action


def parse_state(obj: Any, where: str) -> State:
    """A :class:`State` from one decoded trace line; ReplayInputError naming the line otherwise."""
    if not isinstance(obj, Mapping):
        raise ReplayInputError(f"{where}: a state must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("state_id", "messages", "action") if k not in obj]
    if missing:
        raise ReplayInputError(f"{where}: missing {', '.join(missing)}; a state needs state_id, messages and action")
    sid = obj["state_id"]
    if not isinstance(sid, (str, int)) or str(sid) == "":
        raise ReplayInputError(f"{where}: state_id must be a non-empty string, got {sid!r}")
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ReplayInputError(f"{where}: messages must be a non-empty list of chat messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ReplayInputError(f"{where}: message {i} must be an object with a string 'role'")
    tools = obj.get("tools") or []
    if not isinstance(tools, list):
        raise ReplayInputError(f"{where}: tools must be a list of OpenAI tool schemas")
    return State(str(sid), tuple(dict(m) for m in msgs), parse_action(obj["action"], where),
                 tuple(dict(t) for t in tools))


def load_trace(path: str | Path) -> list[State]:
    """The states of a JSONL trace file, in file order; state ids must be unique."""
    p = Path(path)
    if not p.is_file():
        raise ReplayInputError(f"trace file {str(p)!r} does not exist; give a JSONL file of states (docs/data.md)")
    states: list[State] = []
    for n, line in enumerate(p.read_text("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ReplayInputError(f"{where}: not JSON ({exc})") from None
        states.append(parse_state(obj, where))
    check_unique(states)
    if not states:
        raise ReplayInputError(f"trace file {str(p)!r} holds no states")
    return states


def check_unique(states: Iterable[State]) -> None:
    seen: set[str] = set()
    for s in states:
        if s.state_id in seen:
            raise ReplayInputError(f"state_id {s.state_id!r} appears twice; state ids must be unique in a trace")
        seen.add(s.state_id)


def messages_as_text(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """``{role, content}`` string messages (what ``data.format`` reads): tool calls of assistant
    turns are appended to their content as canonical JSON lines (:func:`action_text`)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        text = content if isinstance(content, str) else ""
        calls = m.get("tool_calls") or []
        if calls:
            action = Action(text or None, tuple(_tool_call(c, "message") for c in calls))
            text = action_text(action)
        out.append({"role": str(m["role"]), "content": text})
    return out


def canonical_call(call: ToolCall, *, compact: bool = True) -> str:
    """Canonical JSON of one tool call: name + arguments with sorted keys (at every depth); compact
    separators (the agreement key) or ``", "`` / ``": "`` (the flat text, whose words the normalizer
    counts). Arguments that were not JSON are kept as their whitespace-normalised string."""
    args = call.arguments if isinstance(call.arguments, dict) else _SPACE.sub(" ", call.arguments).strip()
    return json.dumps({"name": call.name, "arguments": args}, sort_keys=True,
                      separators=(",", ":") if compact else (", ", ": "), ensure_ascii=False)


def action_text(action: Action) -> str:
    """The flat-string shape of an action: its text, then one canonical JSON line per tool call
    (``{"arguments": {...}, "name": "..."}``, keys sorted)."""
    parts = [action.content.strip()] if action.content and action.content.strip() else []
    parts += [canonical_call(c, compact=False) for c in action.tool_calls]
    return "\n".join(parts)
