"""The pair normalizer's four filters, their defaults, both record shapes kept, and the same result
from the plain-Python and the 🤗 datasets engines."""

from __future__ import annotations

from typing import Any

import pytest

from diloco_serverless.replay.normalize import PairFilters, filter_pairs, filter_pairs_dataset, non_alpha_ratio

GOOD = "use the read tool on the hosts file"


def row(chosen: str, rejected: str = "the student did something else here", sid: str = "s") -> dict[str, Any]:
    prompt = [{"role": "user", "content": "what now?"}]
    return {"state_id": sid, "prompt": prompt, "chosen": chosen, "rejected": rejected,
            "chosen_messages": [*prompt, {"role": "assistant", "content": chosen}],
            "rejected_messages": [*prompt, {"role": "assistant", "content": rejected}]}


def test_defaults() -> None:
    f = PairFilters()
    assert (f.min_chars, f.max_chars, f.min_words, f.max_words, f.max_non_alpha, f.dedup) == (
        8, 32_000, 2, 4_096, 0.5, True)


@pytest.mark.parametrize(("chosen", "rejected", "reason"), [
    ("ok done", None, "chosen: 7 characters, outside [8, 32000]"),           # length, low
    ("word " * 6500, None, "chosen: 32500 characters"),                     # length, high
    ("a" * 40, None, "chosen: 1 words, outside [2, 4096]"),                 # words, low
    ("ab " * 5000, None, "chosen: 5000 words, outside [2, 4096]"),          # words, high (15,000 chars)
    ("x = 1 + 2 * (3 / 4) - 5;", None, "chosen: 93% non-alphabetic"),       # non-alphabetic: 13 of 14
    (GOOD, "12345 67890", "rejected: 100% non-alphabetic"),                 # the rejected side too
    (GOOD, "no", "rejected: 2 characters"),
])
def test_each_filter_drops_with_its_reason(chosen: str, rejected: str | None, reason: str) -> None:
    rows = [row(chosen, rejected or "the student did something else here")]
    kept, dropped = filter_pairs(rows)
    assert kept == [] and len(dropped) == 1
    assert dropped[0][0] == 0 and dropped[0][1].startswith(reason), dropped


def test_boundaries_are_inclusive() -> None:
    exactly = row("abcd efg")  # 8 characters, 2 words, 1/7 non-alphabetic (the space is not counted)
    half = row("ab 12 cd 34")  # 4 of 8 non-space characters are digits: 50%
    kept, dropped = filter_pairs([exactly, half])
    assert [r["chosen"] for r in kept] == ["abcd efg", "ab 12 cd 34"] and dropped == []
    assert non_alpha_ratio("ab 12 cd 34") == 0.5


def test_dedup_keeps_the_first_by_normalised_chosen() -> None:
    rows = [row(GOOD, sid="a"), row("  Use the READ tool\non the hosts   file", sid="b"),
            row(GOOD + " now", sid="c"), row(GOOD, rejected="another bad action entirely", sid="d")]
    kept, dropped = filter_pairs(rows)
    assert [r["state_id"] for r in kept] == ["a", "c"]
    assert dropped == [(1, "chosen: duplicate of an earlier record"), (3, "chosen: duplicate of an earlier record")]
    kept, _ = filter_pairs(rows, PairFilters(dedup=False))
    assert len(kept) == 4


def test_both_shapes_are_kept() -> None:
    kept, _ = filter_pairs([row(GOOD)])
    assert kept[0]["chosen_messages"][-1] == {"role": "assistant", "content": GOOD}
    assert kept[0]["rejected_messages"][-1]["content"] == kept[0]["rejected"]
    assert kept[0]["prompt"] == [{"role": "user", "content": "what now?"}]


def test_datasets_engine_gives_the_same_result() -> None:
    datasets = pytest.importorskip("datasets")
    rows = [row(GOOD, sid="0"), row("ok done", sid="1"), row("a" * 40, sid="2"), row("x = 1 + 2 * 3;", sid="3"),
            row(GOOD.upper(), sid="4"), row("another fine answer", "1 2 3 4 5", sid="5"),
            row("another fine answer", sid="6"), row("a third answer here", sid="7")]
    expected, _ = filter_pairs(rows)
    got = filter_pairs_dataset(datasets.Dataset.from_list(rows))
    assert got.to_list() == expected
    assert [r["state_id"] for r in expected] == ["0", "6", "7"]
    strict = PairFilters(min_words=4)
    assert filter_pairs_dataset(datasets.Dataset.from_list(rows), strict).to_list() == filter_pairs(rows, strict)[0]
