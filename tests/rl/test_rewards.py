"""Built-in rewards and the reward-call contract (import paths, errors naming function and prompt)."""

from __future__ import annotations

import math
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco_serverless.rl import rewards
from diloco_serverless.rl.reward_calls import RewardError, load_reward_funcs, score


def test_exact_match_reads_answer_tags_and_the_column() -> None:
    completions = ["<think>x</think><answer> 42 </answer>", "41", [{"role": "assistant", "content": "42"}], "7"]
    out = rewards.exact_match(["p"] * 4, completions, answer=["42", "42", "42", None])
    assert out == [1.0, 0.0, 1.0, None]
    with pytest.raises(ValueError, match="'answer'"):
        rewards.exact_match(["p"], ["1"], solution=["1"])


def test_format_reward() -> None:
    good = "<think>because</think>\n<answer>3</answer>"
    assert rewards.format(["p", "p", "p"], [good, "3", "<answer>3</answer>"]) == [1.0, 0.0, 0.0]
    assert rewards.format(["p"], ["abc"], format_regex=[r"^a.c$"]) == [1.0]


def test_length_penalty_is_dapo_soft_overlong() -> None:
    ids = [[0] * n for n in (10, 12, 14, 16, 17)]
    out = rewards.length_penalty(["p"] * 5, ["c"] * 5, completion_ids=ids, max_completion_length=16)
    # cache = 4: free up to 12 tokens, then (12 - L) / 4 down to -1 at 16, -1 beyond
    assert out == [0.0, 0.0, -0.5, -1.0, -1.0]


def test_math_verify() -> None:
    pytest.importorskip("math_verify")
    out = rewards.math_verify(
        ["p"] * 3, ["so the answer is $\\frac{1}{2}$", "\\boxed{0.5}", "it is 3"], answer=["0.5", "\\frac{1}{2}", "4"]
    )
    assert out == [1.0, 1.0, 0.0]


def _columns(n: int) -> dict[str, list[Any]]:
    return {"answer": ["1"] * n}


def test_score_table_with_none_as_nan() -> None:
    funcs = load_reward_funcs(["diloco_serverless.rl.rewards:exact_match", "diloco_serverless.rl.rewards:format"])
    table = score(funcs, ["q", "q"], ["1", "2"], [[5], [6]], {"answer": ["1", None]}, max_completion_length=8)
    assert table[0] == [1.0, 0.0]
    assert math.isnan(table[1][0]) and table[1][1] == 0.0


@pytest.fixture
def user_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "my_rewards_i34.py").write_text(
        textwrap.dedent(
            """
            def boom(prompts, completions, **kw):
                raise KeyError("no such thing")

            def short(prompts, completions, **kw):
                return [1.0]

            def text(prompts, completions, **kw):
                return ["good"] * len(completions)

            def sees(prompts, completions, completion_ids, max_completion_length, answer, **kw):
                return [float(len(ids) + max_completion_length + int(a)) for ids, a in zip(completion_ids, answer)]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_i34"
    sys.modules.pop("my_rewards_i34", None)


def test_user_function_sees_trl_arguments(user_rewards: str) -> None:
    funcs = load_reward_funcs([f"{user_rewards}:sees"])
    table = score(funcs, ["q", "q"], ["a", "b"], [[1, 2], [3]], {"answer": ["10", "20"]}, max_completion_length=8)
    assert table == [[20.0], [29.0]]


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("boom", r"my_rewards_i34:boom raised KeyError.*first prompt 'What is 1\+1\?'"),
        ("short", r"my_rewards_i34:short returned 1 rewards for 2 completions.*'What is 1\+1\?'"),
        ("text", r"my_rewards_i34:text returned 'good' for completion 0 of prompt 'What is 1\+1\?'"),
    ],
)
def test_broken_reward_fails_naming_function_and_prompt(user_rewards: str, name: str, match: str) -> None:
    funcs = load_reward_funcs([f"{user_rewards}:{name}"])
    with pytest.raises(RewardError, match=match):
        score(funcs, ["What is 1+1?"] * 2, ["2", "3"], [[1], [2]], _columns(2), max_completion_length=4)


def test_unresolvable_paths_are_named() -> None:
    with pytest.raises(RewardError, match="cannot import module 'no_such_module_i34'"):
        load_reward_funcs(["no_such_module_i34:f"])
    with pytest.raises(RewardError, match="has no function 'nope'"):
        load_reward_funcs(["diloco_serverless.rl.rewards:nope"])
    with pytest.raises(RewardError, match="module:function"):
        load_reward_funcs(["diloco_serverless.rl.rewards"])
