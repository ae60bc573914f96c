"""The default corpus: the Python standard library's own ``.py`` files (present on every machine).

Files under ``sysconfig.get_paths()["stdlib"]`` (test suites and site-packages excluded, 1 KiB to
256 KiB) are split into train and held-out eval by a SHA-256 hash of their relative path, and the
train files are dealt to ranks round-robin in hash order, so shards are disjoint and the split is
the same on every machine running the same Python version.

One example is a chunk of whole lines of a file (the response, at most ``seq_len - prompt_len``
tokens) after up to ``prompt_len`` tokens of the lines before it (the prompt). When
``WHOLE_LINE_TRIES`` random positions give no two distinct whole lines that fit (long lines, a
small budget) the response is the budget's tokens from a random line on, cut into pieces inside
lines, so any ``seq_len - prompt_len >= 2`` works (``DataConfig`` requires ``MIN_RESPONSE_TOKENS``).
The self-distillation teacher additionally reads a hint, the file's path and module docstring,
before the prompt. The preference pair is the true chunk (chosen) against the same lines (or
pieces) in a shuffled order (rejected). Example ``i`` of rank ``r`` depends
only on ``(seed, r, i)``, so a data position is just an integer.

Failure: an empty shard raises :class:`DataError` naming the rank and the file counts; a corpus
where no random position gives two distinct pieces (files that repeat one line) names the split,
rank and budget.
"""

from __future__ import annotations

import bisect
import inspect
import os
import re
import sysconfig
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from random import Random
from typing import Any

from diloco_serverless.config import DataConfig
from diloco_serverless.data.examples import (
    DataError,
    Example,
    example_rng,
    shuffle_lines,
    split_fraction,
)

__all__ = ["StdlibSource", "stdlib_root", "list_corpus_files", "split_train_eval", "shard_for_rank"]

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
MIN_FILE_BYTES = 1024
MAX_FILE_BYTES = 256 * 1024
WHOLE_LINE_TRIES = 64


def stdlib_root() -> Path:
    """Folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path) -> dict[str, int]:
    """``{relative posix path: size in bytes}`` of the corpus ``.py`` files under ``root``, sorted."""
    found: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            size = path.stat().st_size
            if MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
                found[path.relative_to(root).as_posix()] = size
    return dict(sorted(found.items()))


def split_train_eval(names: list[str], eval_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic split by name hash; at least one eval item whenever there are >= 2 names."""
    ordered = sorted(names, key=lambda n: (split_fraction(n), n))
    evals = [n for n in ordered if split_fraction(n) < eval_fraction]
    if not evals and len(ordered) >= 2:
        evals = ordered[:1]
    held = set(evals)
    return [n for n in ordered if n not in held], evals


def shard_for_rank(items: list[Any], rank: int, world_size: int, *, what: str, total_eval: int) -> list[Any]:
    """Round-robin shard ``items[rank::world_size]``; DataError naming the rank if it is empty."""
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside the run's {world_size} replicas (ranks 0..{world_size - 1})")
    shard = items[rank::world_size]
    if not shard:
        raise DataError(
            f"{what}: rank {rank} of {world_size} replicas gets no training data ({len(items)} train items, "
            f"{total_eval} held out); use fewer replicas or a larger corpus"
        )
    return shard


@dataclass(frozen=True)
class _Doc:
    path: str
    lines: list[list[int]]  # token ids per source line (newline included)
    hint: list[int]


_DOCSTRING = re.compile(r"""\A(?:[ \t]*(?:\#[^\n]*)?\r?\n)*[ \t]*[rRuU]?(\"\"\"|\'\'\'|\"|\')(.*?)\1""", re.DOTALL)
_PROBE = "def f(x):\n\treturn 'h\u00e9llo \U0001f642' # 1234 \r\n"


def _module_docstring(text: str) -> str | None:
    """The leading triple-quoted string after comments and blank lines (cheap, no full parse)."""
    match = _DOCSTRING.match(text)
    return inspect.cleandoc(match.group(2)) if match else None


def _is_byte_tokenizer(tokenizer: Any) -> bool:
    """True when ``tokenizer`` maps text to its UTF-8 bytes (the tiny preset): lines then need no tokenizer."""
    try:
        return list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"]) == list(_PROBE.encode("utf-8"))
    except Exception:
        return False


def _line_token_ids(tokenizer: Any, text: str, lines: list[str], byte_level: bool) -> list[list[int]]:
    """Token ids of ``text`` grouped by the line each token starts in (one tokenizer call per file)."""
    if byte_level:
        return [list(line.encode("utf-8")) for line in lines]
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    except NotImplementedError:  # slow tokenizers have no offsets: tokenize line by line
        return [list(x) for x in tokenizer(lines, add_special_tokens=False, verbose=False)["input_ids"]]
    starts, pos = [], 0
    for line in lines:
        starts.append(pos)
        pos += len(line)
    out: list[list[int]] = [[] for _ in lines]
    for tid, (begin, _end) in zip(enc["input_ids"], enc["offset_mapping"]):
        out[max(0, bisect.bisect_right(starts, begin) - 1)].append(tid)
    return out


class StdlibSource:
    """Examples cut from stdlib files; see the module docstring. ``root`` overrides the folder (tests)."""

    name = "stdlib"

    def __init__(
        self,
        tokenizer: Any,
        data: DataConfig,
        *,
        rank: int,
        world_size: int,
        seed: int,
        root: str | Path | None = None,
        cache_files: int = 256,
    ) -> None:
        self.root = Path(root) if root is not None else stdlib_root()
        self.tokenizer, self.data, self.rank, self.seed = tokenizer, data, rank, seed
        sizes = list_corpus_files(self.root)
        train, self.eval_files = split_train_eval(list(sizes), data.eval_fraction)
        what = f"stdlib corpus {self.root}"
        self.train_files = shard_for_rank(train, rank, world_size, what=what, total_eval=len(self.eval_files))
        if not self.eval_files:
            raise DataError(f"{what} has {len(sizes)} usable .py files; need at least 2 to hold one out for eval")
        self._weights = {
            "train": self._cumulative([sizes[f] for f in self.train_files]),
            "eval": self._cumulative([sizes[f] for f in self.eval_files]),
        }
        self._byte_level = _is_byte_tokenizer(tokenizer)
        self._cache: OrderedDict[str, _Doc] = OrderedDict()
        self._cache_files = cache_files

    @staticmethod
    def _cumulative(sizes: list[int]) -> list[int]:
        out, acc = [], 0
        for s in sizes:
            acc += s
            out.append(acc)
        return out

    def train_example(self, index: int) -> Example:
        """Training example ``index`` of this rank (depends only on seed, rank, index)."""
        return self._sample("train", self.train_files, example_rng(self.seed, "stdlib-train", self.rank, index))

    def eval_example(self, index: int) -> Example:
        """Held-out example ``index`` (the same on every rank)."""
        return self._sample("eval", self.eval_files, example_rng(self.seed, "stdlib-eval", index))

    def _sample(self, split: str, files: list[str], rng: Random) -> Example:
        """``WHOLE_LINE_TRIES`` random positions cut at line ends, then as many cut into pieces: a
        stream the whole-line chunker produced stays the same; small budgets still get examples."""
        cumulative = self._weights[split]
        for attempt in range(2 * WHOLE_LINE_TRIES):
            pick = bisect.bisect_right(cumulative, rng.randrange(cumulative[-1]))
            example = self._chunk(self._load(files[pick]), rng, pieces=attempt >= WHOLE_LINE_TRIES)
            if example is not None:
                return example
        raise DataError(
            f"stdlib corpus {self.root}: {2 * WHOLE_LINE_TRIES} random positions in the {split} files of rank "
            f"{self.rank} gave no response of >= 2 distinct pieces within data.seq_len - data.prompt_len = "
            f"{self.data.seq_len - self.data.prompt_len} tokens (the files repeat one line); use another corpus"
        )

    def _load(self, rel: str) -> _Doc:
        doc = self._cache.get(rel)
        if doc is not None:
            self._cache.move_to_end(rel)
            return doc
        text = (self.root / rel).read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines(keepends=True) or [text]
        ids = _line_token_ids(self.tokenizer, text, lines, self._byte_level)
        docstring = _module_docstring(text)
        hint_text = f"# file: {rel}\n" + (f'"""{docstring}"""\n' if docstring else "")
        hint_text = hint_text[: 16 * self.data.hint_len]  # enough characters for hint_len tokens
        hint = self.tokenizer(hint_text, add_special_tokens=False, verbose=False)["input_ids"][: self.data.hint_len]
        doc = _Doc(rel, ids, list(hint))
        self._cache[rel] = doc
        if len(self._cache) > self._cache_files:
            self._cache.popitem(last=False)
        return doc

    def _chunk(self, doc: _Doc, rng: Random, *, pieces: bool) -> Example | None:
        """Example at a random line of ``doc`` whose response fits ``seq_len - prompt_len`` tokens:
        whole lines, or with ``pieces`` the budget's tokens cut into pieces (:func:`_line_pieces`).
        None when fewer than two distinct units fit there (the caller tries another position)."""
        budget = self.data.seq_len - self.data.prompt_len
        start = rng.randrange(len(doc.lines))
        units = _line_pieces(doc.lines, start, budget) if pieces else _whole_lines(doc.lines, start, budget)
        rejected = shuffle_lines(units, rng) if len(units) >= 2 else None
        if rejected is None:
            return None
        prompt: list[int] = []
        for line in reversed(doc.lines[max(0, start - self.data.prompt_len) : start]):
            prompt[:0] = line
            if len(prompt) >= self.data.prompt_len:
                break
        prompt = prompt[-self.data.prompt_len :] if prompt else []
        response = [t for unit in units for t in unit]
        return Example(prompt, response, doc.hint + prompt, rejected, [], f"{self.root.name}/{doc.path}:{start + 1}")


def _whole_lines(lines: list[list[int]], start: int, budget: int) -> list[list[int]]:
    """The longest run of whole lines from ``start`` with at most ``budget`` tokens in all."""
    end, used = start, 0
    while end < len(lines) and used + len(lines[end]) <= budget:
        used += len(lines[end])
        end += 1
    return lines[start:end]


def _line_pieces(lines: list[list[int]], start: int, budget: int) -> list[list[int]]:
    """The first ``budget`` tokens from line ``start`` on (the last line cut where the budget ends),
    split at line ends and into pieces of at most ``max(1, budget // 2)`` tokens. With ``budget >= 2``
    (``DataConfig`` guarantees more) and at least ``budget`` tokens left in the file this is >= 2
    pieces, so a shuffled "rejected" order exists unless every piece is the same token string."""
    piece = max(1, budget // 2)
    units: list[list[int]] = []
    used = 0
    for line in lines[start:]:
        take = line[: budget - used]
        units.extend(take[i : i + piece] for i in range(0, len(take), piece))
        used += len(take)
        if used >= budget:
            break
    return units
