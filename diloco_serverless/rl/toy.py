"""A toy verifiable task for a tiny randomly initialised model on a CPU: copy the prompt's letter.

Prompt ``"bbbbb"`` (the letter repeated 3 or more times; the run length varies so that every record is
distinct) with ``answer = "b"``; the reward (:func:`letter_fraction`) is the fraction of the
completion's characters that are the letter, checked against the prompt's own ``answer`` column. Random
sampling scores about ``1 / vocabulary`` (~0.004 with the 259-token byte vocabulary), the best policy 1.0.
The letter varies with the prompt, so the policy must read it: one that always writes the same letter
scores ``1 / len(LETTERS)``.

Why the prompt is the bare letter run (measured, benchmarks/README.md "The toy task"): with a text prefix
(``"Say b again and again (7): bbb"``) the last hidden state is dominated by the prefix every prompt
shares, the policy collapses onto one letter for every prompt within 20 steps (entropy 5.5 -> 0.1 nats
at inner lr 1e-2), the groups of the other letters then all score 0, have zero std and get zero
advantage, and the mean reward stalls at 0.25. With the bare run, at inner lr 2e-3, GRPO learns to copy:
from ~0.01 to >= 0.5 within about 40 inner steps of 4 prompts x G=8. ``examples/grpo_toy.toml`` trains it;
``benchmarks/rl.py --compare`` measures DiLoCo-GRPO against synchronous GRPO on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diloco_serverless.rl.rewards import completion_text

LETTERS = "abcd"


def toy_rows(n: int = 64, letters: str = LETTERS) -> list[dict[str, Any]]:
    """``n`` distinct prompt records, cycling through ``letters``: record ``i`` is the letter
    ``letters[i % len(letters)]`` repeated ``3 + i // len(letters)`` times."""
    if n < 1 or not letters:
        raise ValueError(f"toy_rows needs n >= 1 and at least one letter (got n={n}, letters={letters!r})")
    rows = []
    for i in range(n):
        letter = letters[i % len(letters)]
        rows.append({"prompt": letter * (3 + i // len(letters)), "answer": letter})
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
