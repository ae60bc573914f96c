"""The pair normalizer: four filters over preference records, both record shapes kept.

Defaults (:class:`PairFilters`) are those of the framework this comes from:

1. length: ``chosen`` and ``rejected`` each 8 to 32,000 characters;
2. words: each 2 to 4,096 whitespace-separated words;
3. non-alphabetic: at most 50% of each side's characters (whitespace not counted) are not letters;
4. de-duplication: of records whose ``chosen`` has the same normalised hash (SHA-256 of the text with
   whitespace runs collapsed and casefolded), the first is kept.

Filters 1-3 look at the flat strings; the records keep every column (the ``chosen_messages`` /
``rejected_messages`` chat shape included). Two engines give the same result (tested):
:func:`filter_pairs` (plain Python over a list of dicts) and :func:`filter_pairs_dataset` (🤗
``datasets``: ``Dataset.filter`` + ``select``). ``py-data-juicer`` is not used: its 1.6 release pins
``dill==0.3.8`` and ``multiprocess==0.70.16`` exactly, against the tested ``dill==0.4.1`` and
``multiprocess==0.70.19`` of constraints.txt (docs/data.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from diloco_serverless.replay.agreement import normalize_text

__all__ = ["PairFilters", "filter_pairs", "filter_pairs_dataset", "reject_reason", "text_hash"]


@dataclass(frozen=True)
class PairFilters:
    """The normalizer's thresholds; each applies to both ``chosen`` and ``rejected``."""

    min_chars: int = 8
    max_chars: int = 32_000
    min_words: int = 2
    max_words: int = 4_096
    max_non_alpha: float = 0.5
    dedup: bool = True
    sides: tuple[str, ...] = ("chosen", "rejected")


def non_alpha_ratio(text: str) -> float:
    """Share of the non-whitespace characters that are not letters (0.0 for an all-space text)."""
    chars = [c for c in text if not c.isspace()]
    return sum(not c.isalpha() for c in chars) / len(chars) if chars else 0.0


def reject_reason(row: Mapping[str, Any], f: PairFilters) -> str | None:
    """Why filters 1-3 drop ``row`` ("chosen: 5 characters < 8"), or None if it passes."""
    for side in f.sides:
        text = row.get(side)
        if not isinstance(text, str):
            return f"{side}: not a string"
        n = len(text)
        if not f.min_chars <= n <= f.max_chars:
            return f"{side}: {n} characters, outside [{f.min_chars}, {f.max_chars}]"
        w = len(text.split())
        if not f.min_words <= w <= f.max_words:
            return f"{side}: {w} words, outside [{f.min_words}, {f.max_words}]"
        r = non_alpha_ratio(text)
        if r > f.max_non_alpha:
            return f"{side}: {r:.0%} non-alphabetic characters > {f.max_non_alpha:.0%}"
    return None


def text_hash(text: str) -> str:
    """SHA-256 of the normalised text (whitespace collapsed, casefolded)."""
    return hashlib.sha256(normalize_text(text).encode("utf-8")).hexdigest()


def filter_pairs(
    rows: Iterable[Mapping[str, Any]], filters: PairFilters | None = None
) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """(kept rows, [(index, reason)] of the dropped ones), in input order."""
    f = filters or PairFilters()
    kept: list[dict[str, Any]] = []
    dropped: list[tuple[int, str]] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        reason = reject_reason(row, f)
        if reason is None and f.dedup:
            h = text_hash(str(row["chosen"]))
            if h in seen:
                reason = "chosen: duplicate of an earlier record"
            seen.add(h)
        if reason is None:
            kept.append(dict(row))
        else:
            dropped.append((i, reason))
    return kept, dropped


def filter_pairs_dataset(dataset: Any, filters: PairFilters | None = None) -> Any:
    """The same filters on a 🤗 ``datasets.Dataset``: the kept rows, as a Dataset."""
    f = filters or PairFilters()
    passing = dataset.filter(lambda row: reject_reason(row, f) is None, keep_in_memory=True)
    if not f.dedup or len(passing) == 0:
        return passing
    hashes = passing.map(lambda row: {"_chosen_hash": text_hash(row["chosen"])},
                         keep_in_memory=True)["_chosen_hash"]
    first: dict[str, int] = {}
    for i, h in enumerate(hashes):
        first.setdefault(h, i)
    return passing.select(sorted(first.values()))
