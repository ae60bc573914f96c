"""A toy verifiable task for a tiny randomly initialised model on a CPU: copy the prompt's letter.

Prompt ``"bbbbb"`` (the letter repeated 3 or more times; the run length varies so that every record is
distinct) with ``answer = "b"``; the reward (:func:`letter_fraction`) is the fraction of the
completion's characters that are the letter, checked against the prompt's own ``answer`` column. Random
sampling scores about ``1 / vocabulary`` (~0.004 with the 259-token byte vocabulary), the best policy 1.0.
The letter varies with the prompt, so the policy must read it: one that always writes the same letter
scores ``1 / len(LETTERS)``.

Why this task and these settings (measured, benchmarks/README.md "rl.py --compare"): the first version
(prompt ``"Say b again and again (7): bbb"``, inner lr 1e-2) stalled at a mean reward of 0.25. At lr 1e-2
the policy's entropy falls from 5.5 to 0.1 nats within 20 inner steps, onto one letter for every prompt
(with or without the text prefix); the groups of the other letters then all score 0, have zero std and
get zero advantage, so nothing can teach the policy to read the prompt. At lr 2e-3-3e-3 the entropy falls
slowly enough for GRPO to learn to copy, and without the prefix (text every prompt shares, so probably a
large common part of the last hidden state) it learns faster. One process, 4 prompts x G=8 per step, mean
reward over steps 50-59: 0.29 with the prefix (lr 3e-3; 0.44 over steps 70-79), 0.59-0.77 without (lr
2e-3 and 3e-3, 3 runs; ``benchmarks/rl_toy.py``). ``examples/grpo_toy.toml`` trains it;
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
