"""A toy verifiable task for a tiny randomly initialised model on a CPU.

Prompt ``"Say b again and again (7): bbb"`` with ``answer = "b"``; the reward
(:func:`letter_fraction`) is the fraction of the completion's characters that are the letter, so
random sampling scores about ``1 / vocabulary`` and the best policy 1.0. The letter varies with the
prompt (its last characters show it), so the policy must read the prompt: a policy that always says the
same letter scores ``1 / len(LETTERS)``. ``examples/grpo_toy.toml`` trains it;
``benchmarks/rl.py`` measures it. Measured so far: the mean reward rises from ~0.01 to ~0.25 in 20-30
steps and stalls there (benchmarks/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diloco_serverless.rl.rewards import completion_text

LETTERS = "abcd"


def toy_rows(n: int = 64, letters: str = LETTERS) -> list[dict[str, Any]]:
    """``n`` prompt records, cycling through ``letters``."""
    rows = []
    for i in range(n):
        letter = letters[i % len(letters)]
        rows.append({"prompt": f"Say {letter} again and again ({i}): {letter * 3}", "answer": letter})
    return rows


def write_toy_jsonl(path: str | Path, n: int = 64) -> str:
    """The toy prompts as a JSONL file (``data.format = "prompt"``); returns its path."""
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in toy_rows(n)))
    return str(path)


def letter_fraction(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    """Fraction of the completion's characters equal to the ``answer`` letter (0 for an empty one)."""
    answers = columns.get("answer")
    if answers is None or len(answers) != len(completions):
        raise ValueError("letter_fraction needs the 'answer' column (one letter per prompt)")
    out: list[float | None] = []
    for completion, letter in zip(completions, answers):
        text = completion_text(completion)
        out.append(sum(ch == letter for ch in text) / len(text) if text else 0.0)
    return out
