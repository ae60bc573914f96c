"""Synthetic records of each data.format and writers of local dataset folders (parquet, jsonl)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from support.tiny_tokenizer import sentence


# ---------------------------------------------------------------------------------- records
def text_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Documents of 5..60 words, each starting with its number (so it can be recognised)."""
    rng = random.Random(seed)
    return [{"text": f"doc{i} " + sentence(rng, rng.randint(5, 60)), "meta": i} for i in range(n)]


def chat_rows(n: int, seed: int = 0, *, hint: str = "answer") -> list[dict[str, Any]]:
    """Chats, every third one with two user/assistant exchanges, and a hint column ``hint``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"Q{i}: add {i} and {i + 1}"},
            {"role": "assistant", "content": f"A{i}: the sum is {2 * i + 1}"},
        ]
        if i % 3 == 0:
            messages += [
                {"role": "user", "content": f"Q{i}b: and {sentence(rng, 3)}?"},
                {"role": "assistant", "content": f"A{i}b: {sentence(rng, 4)}"},
            ]
        rows.append({"messages": messages, hint: f"{2 * i + 1}", "source": "synthetic"})
    return rows


def pr_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """prompt_response records under the columns question / answer / tip; every 4th has a pair."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        row: dict[str, Any] = {
            "question": f"Add {i} and {i + 1}.", "answer": f"The sum is\n{2 * i + 1}.\n{sentence(rng, 4)}",
            "tip": "Add the numbers.", "good": None, "bad": None,
        }
        if i % 4 == 0:
            row["good"], row["bad"] = f"It is {2 * i + 1}.", f"It is {2 * i}."
        rows.append(row)
    return rows


def pref_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Preference records like UltraFeedback's: prompt + chosen / rejected conversations."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = f"Add {i} and {i + 1}."
        user = {"role": "user", "content": prompt}
        rows.append({
            "prompt": prompt,
            "chosen": [user, {"role": "assistant", "content": f"The sum is {2 * i + 1}. {sentence(rng, 3)}"}],
            "rejected": [user, {"role": "assistant", "content": f"The sum is {2 * i}. {sentence(rng, 3)}"}],
            "score_chosen": 8.0,
        })
    return rows


def write_split(folder: Path, name: str, rows: list[dict[str, Any]], kind: str, shards: int = 1) -> list[Path]:
    """``rows`` as ``shards`` files ``<name>-0000i.<kind>`` (parquet or jsonl) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        part = rows[s::shards]
        path = folder / f"{name}-{s:05d}.{kind}"
        if kind == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(part), path)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in part))
        paths.append(path)
    return paths
