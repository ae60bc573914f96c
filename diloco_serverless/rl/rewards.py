"""Built-in reward functions, TRL's signature: ``f(prompts, completions, **columns) -> list[float | None]``.

Name them by import path in ``rl.reward_funcs``: ``"diloco_serverless.rl.rewards:exact_match"``.
A completion is a string, or (chat prompts) a list of messages whose last ``content`` is scored.
``None`` means "cannot score this completion" (TRL's semantics: left out of its group's baseline).
Every other column of the prompt's record arrives as a keyword argument, one value per completion;
the trainer adds ``completion_ids`` (token ids per completion) and ``max_completion_length``.

- :func:`exact_match`: 1.0 when the answer equals the ``answer`` column (stripped), else 0.0; the
  answer is the text of the last ``<answer>...</answer>`` if present, else the whole completion.
- :func:`format`: 1.0 when the completion is ``<think>...</think>`` then ``<answer>...</answer>``
  (the regex is :data:`FORMAT_PATTERN`, or the ``format_regex`` column), else 0.0.
- :func:`length_penalty`: DAPO's soft overlong punishment: 0 up to ``max_completion_length`` minus
  a quarter of it, falling linearly to -1 at ``max_completion_length`` tokens.
- :func:`math_verify`: 1.0 when ``math-verify`` finds the completion's answer equal to the ``answer``
  column, 0.0 when not, ``None`` when the gold answer does not parse (optional extra
  ``pip install 'diloco-serverless[rl]'``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

FORMAT_PATTERN = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def completion_text(completion: Any) -> str:
    """The text of a completion: the string itself, or the last message's ``content``."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion must be a string or a list of messages, got {type(completion).__name__}")


def extract_answer(text: str) -> str:
    """The text of the last ``<answer>...</answer>``, else the whole text; stripped."""
    found = _ANSWER.findall(text)
    return (found[-1] if found else text).strip()


def _column(columns: dict[str, Any], name: str, n: int, func: str) -> list[Any]:
    values = columns.get(name)
    if values is None:
        raise ValueError(
            f"reward {func} needs the column {name!r} in the prompt records (got columns {sorted(columns)}); "
            "add it to the data or drop the reward"
        )
    if len(values) != n:
        raise ValueError(f"reward {func}: column {name!r} has {len(values)} values for {n} completions")
    return list(values)


def exact_match(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    """1.0 where the completion's answer equals the ``answer`` column, 0.0 elsewhere, None when it is missing."""
    answers = _column(columns, "answer", len(completions), "exact_match")
    out: list[float | None] = []
    for completion, answer in zip(completions, answers):
        if answer is None:
            out.append(None)
            continue
        out.append(1.0 if extract_answer(completion_text(completion)) == str(answer).strip() else 0.0)
    return out


def format(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:  # noqa: A001
    """1.0 where the completion matches the format regex (DOTALL), else 0.0."""
    patterns = columns.get("format_regex") or [FORMAT_PATTERN] * len(completions)
    return [
        1.0 if re.match(pattern or FORMAT_PATTERN, completion_text(c), re.DOTALL) else 0.0
        for c, pattern in zip(completions, patterns)
    ]


def length_penalty(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    """DAPO's soft overlong punishment from ``completion_ids`` and ``max_completion_length``."""
    ids = columns.get("completion_ids")
    limit = columns.get("max_completion_length")
    if ids is None or limit is None:
        raise ValueError(
            "reward length_penalty needs completion_ids and max_completion_length (the trainer passes them)"
        )
    limit = int(limit[0]) if isinstance(limit, (list, tuple)) else int(limit)
    cache = max(1, limit // 4)
    out: list[float | None] = []
    for tokens in ids:
        length = len(tokens)
        if length <= limit - cache:
            out.append(0.0)
        elif length <= limit:
            out.append((limit - cache - length) / cache)
        else:
            out.append(-1.0)
    return out


def math_verify(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    """Math answer checking with ``math-verify`` against the ``answer`` column."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:  # an optional extra
        raise ImportError(
            "reward math_verify needs the math-verify package: pip install 'diloco-serverless[rl]' "
            "(or math-verify) in the replica image"
        ) from exc
    answers = _column(columns, "answer", len(completions), "math_verify")
    out: list[float | None] = []
    for completion, answer in zip(completions, answers):
        gold_text = str(answer)
        gold = parse(gold_text if "$" in gold_text or "\\" in gold_text else f"${gold_text}$")
        if not gold:
            out.append(None)
            continue
        guess = parse(completion_text(completion))
        out.append(1.0 if guess and verify(gold, guess) else 0.0)
    return out
