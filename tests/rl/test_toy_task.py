"""The toy verifiable task (diloco_serverless/rl/toy.py): prompts that show their letter, a reward checked
against the prompt's own answer, and the example's prompt file generated from the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco_serverless.rl.toy import LETTERS, letter_fraction, toy_rows, write_toy_jsonl
from support import REPO_ROOT


def test_toy_rows_are_distinct_and_show_their_letter() -> None:
    rows = toy_rows(64)
    assert len({r["prompt"] for r in rows}) == 64  # distinct records: the content-hash split keeps them all
    for i, row in enumerate(rows):
        assert row["answer"] == LETTERS[i % len(LETTERS)]
        assert set(row["prompt"]) == {row["answer"]} and len(row["prompt"]) >= 3
    assert {r["answer"] for r in rows[:4]} == set(LETTERS)
    assert [r["answer"] for r in toy_rows(3, letters="xy")] == ["x", "y", "x"]
    with pytest.raises(ValueError, match="at least one letter"):
        toy_rows(4, letters="")


def test_letter_fraction_scores_against_the_prompts_letter() -> None:
    out = letter_fraction(["bbb"] * 4, ["bbbb", "bxbx", "aaaa", ""], answer=["b"] * 4)
    assert out == [1.0, 0.5, 0.0, 0.0]
    chat = [[{"role": "assistant", "content": "cc"}]]
    assert letter_fraction([[{"role": "user", "content": "ccc"}]], chat, answer=["c"]) == [1.0]
    with pytest.raises(ValueError, match="'answer' column"):
        letter_fraction(["aaa"], ["a"])


def test_the_example_prompt_file_is_the_toy_rows(tmp_path: Path) -> None:
    committed = (REPO_ROOT / "examples" / "grpo_toy.jsonl").read_text()
    assert committed == Path(write_toy_jsonl(tmp_path / "toy.jsonl", 64)).read_text()
    assert [json.loads(line) for line in committed.splitlines()] == toy_rows(64)
