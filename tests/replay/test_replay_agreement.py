"""Agreement after normalisation: text by whitespace and case, tool calls by canonical JSON; the
consensus threshold and ties; trace parsing errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco_serverless.replay.agreement import action_key, consensus
from diloco_serverless.replay.errors import ReplayInputError
from diloco_serverless.replay.trace import Action, ToolCall, action_text, load_trace, parse_action


def call(name: str, args: object) -> Action:
    return parse_action({"tool_calls": [{"name": name, "arguments": args}]}, "test")


def test_text_agrees_across_whitespace_and_case() -> None:
    assert action_key(Action("Run  the\n tests")) == action_key(Action("  run the TESTS "))
    assert action_key(Action("run the tests")) != action_key(Action("run the test"))


def test_tool_calls_agree_on_name_and_sorted_arguments() -> None:
    a = call("read", {"path": "/etc/hosts", "opts": {"b": 1, "a": [1, 2]}})
    b = call("read", '{"opts": {"a": [1, 2], "b": 1},   "path": "/etc/hosts"}')  # JSON string, other order
    openai_shape = parse_action({"content": "let me look", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "read", "arguments": json.dumps(
            {"path": "/etc/hosts", "opts": {"a": [1, 2], "b": 1}})}}]}, "test")
    assert action_key(a) == action_key(b) == action_key(openai_shape)  # commentary beside calls is ignored
    assert action_key(a) != action_key(call("write", {"path": "/etc/hosts", "opts": {"b": 1, "a": [1, 2]}}))
    assert action_key(a) != action_key(call("read", {"path": "/etc/HOSTS", "opts": {"b": 1, "a": [1, 2]}}))
    assert action_key(a) != action_key(call("read", {"path": "/etc/hosts", "opts": {"b": 1, "a": [2, 1]}}))
    # a tool call never agrees with text, even text that spells the same JSON
    assert action_key(a) != action_key(Action(action_text(a)))


def test_arguments_that_are_not_json_compare_as_normalised_strings() -> None:
    a, b = call("sh", "ls   -la /tmp"), call("sh", "ls -la /tmp")
    assert a.tool_calls[0] == ToolCall("sh", "ls   -la /tmp")
    assert action_key(a) == action_key(b)


def test_action_text_is_canonical() -> None:
    a = parse_action({"content": " I will read it. ", "tool_calls": [{"name": "read", "arguments": {"z": 1, "a": 2}}]},
                     "t")
    assert action_text(a) == 'I will read it.\n{"arguments": {"a": 2, "z": 1}, "name": "read"}'


@pytest.mark.parametrize(("answers", "threshold", "key", "members", "tie"), [
    (["a", "A ", "b"], 2, "text:a", (0, 1), False),
    (["a", "b", "c"], 2, None, (0,), False),
    (["a", "a", "b", "b"], 2, None, (0, 1), True),   # a tie between two groups is no consensus
    (["a", "b", None], 1, None, (0,), True),          # threshold 1, but the two answers tie
    (["a", None, "a"], 2, "text:a", (0, 2), False),  # a failed teacher does not block a consensus
    (["a", "a", "a"], 3, "text:a", (0, 1, 2), False),
    ([None, None], 1, None, (), False),
])
def test_consensus(answers: list[str | None], threshold: int, key: str | None, members: tuple[int, ...],
                   tie: bool) -> None:
    c = consensus([None if a is None else Action(a) for a in answers], threshold)
    assert (c.key, c.members, c.tie) == (key, members, tie)
    assert c.reached == (key is not None)


def test_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="agreement_threshold"):
        consensus([Action("a")], 0)


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    good = {"state_id": "s1", "messages": [{"role": "user", "content": "hi"}], "action": "hello"}
    p.write_text(json.dumps(good) + "\n" + json.dumps({"state_id": "s2", "messages": []}) + "\n")
    with pytest.raises(ReplayInputError, match=r"t.jsonl:2: missing action"):
        load_trace(p)
    p.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(ReplayInputError, match="'s1' appears twice"):
        load_trace(p)
    p.write_text(json.dumps(dict(good, action={"content": "  "})) + "\n")
    with pytest.raises(ReplayInputError, match="t.jsonl:1: the action is empty"):
        load_trace(p)
    with pytest.raises(ReplayInputError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    p.write_text(json.dumps(good) + "\n\n")
    [state] = load_trace(p)
    assert (state.state_id, state.action) == ("s1", Action("hello"))


def test_content_parts_are_joined() -> None:
    a = parse_action({"content": [{"type": "text", "text": "Run the "}, {"type": "text", "text": "tests"}]}, "t")
    assert a == Action("Run the tests")
