"""User data: JSONL records ``{"prompt", "response", "hint"?, "chosen"?, "rejected"?}``.

The file is a local path or any fsspec URL (``s3://``, ``gs://``, ``memory://``...; credentials from
the environment as for the store). Records are split into train / held-out eval by a SHA-256 hash of
the line, and train records are dealt to ranks round-robin. Each epoch of a rank visits its records
in an order shuffled from ``(seed, rank, epoch)``.

Tokenization uses the model's chat template when it has one (the prompt as the user turn, the
response as the assistant turn); otherwise the prompt's tokens followed by the response's and EOS.
The teacher's prompt is the user turn ``prompt + "\\n\\n" + hint`` (the student's prompt when the
record has no hint). The preference pair is (``chosen``, ``rejected``) when the record has both,
otherwise the response against its lines (or, for one line, its words) shuffled.

This reader serves ``data.format = "auto"`` (the default) on a single ``.jsonl`` file and needs no extra
package; ``data.columns`` renames the fields. Any other format or layout goes through
:mod:`.hf` (🤗 datasets). Tokenization is :class:`~diloco_serverless.data.formats.Encoder`'s.

Unusable rows (a line that is not valid JSON or not a JSON object, lacks a non-empty string
``prompt`` / ``response``, has a non-string optional field or only one of ``chosen`` / ``rejected``)
are skipped, counted (``bad_rows``, the ``data_bad_rows`` metric) and named (file:line) in a warning
when the file is read, before any index is given out, so the records that examples are addressed
by are the same on every replica and after a resume. A record that parses but cannot be encoded
(e.g. the chat template raises on it) is found when its example is first asked for: it is counted
and named once, and its examples (and those of every later index that lands on it) are those of
the next usable record in the epoch's order, so example ``i`` stays a pure function of
``(seed, rank, i)``. Every replica reads the whole file, so the share is judged on all its lines.

Failure: :class:`DataError` naming example lines (file:line) when more than ``data.max_bad_fraction``
of the lines are unusable (:mod:`.bad_rows`; ``0`` stops at the first); and for an unreadable file
or an empty shard.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec

from diloco_serverless.config import DataColumns, DataConfig
from diloco_serverless.data.bad_rows import BadRows
from diloco_serverless.data.examples import DataError, EpochOrder, Example, example_rng
from diloco_serverless.data.formats import Encoder, Record
from diloco_serverless.data.stdlib import shard_for_rank, split_train_eval
from diloco_serverless.store.objectstore import storage_options_from_env

__all__ = ["Record", "JsonlSource", "read_jsonl_records", "parse_record", "is_jsonl_file"]

_DEFAULT_COLUMNS = DataColumns()


def is_jsonl_file(source: str) -> bool:
    """True for a single ``.jsonl`` file (no glob), the built-in reader's case."""
    return source.lower().endswith(".jsonl") and not any(c in source for c in "*?[")


def parse_record(line: str, where: str, columns: DataColumns | None = None) -> Record:
    """One JSONL line -> Record; DataError naming ``where`` (url:line) and the problem."""
    cols = columns or _DEFAULT_COLUMNS
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(
            f"{where}: expected a JSON object with {cols.prompt} and {cols.response}, got {type(obj).__name__}"
        )
    for key in (cols.prompt, cols.response):
        if not isinstance(obj.get(key), str) or not obj[key]:
            raise DataError(f"{where}: field {key!r} must be a non-empty string, got {obj.get(key)!r:.60}")
    for key in (cols.hint, cols.chosen, cols.rejected):
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise DataError(f"{where}: optional field {key!r} must be a string, got {type(obj[key]).__name__}")
    if (obj.get(cols.chosen) is None) != (obj.get(cols.rejected) is None):
        raise DataError(f"{where}: give both {cols.chosen!r} and {cols.rejected!r} or neither")
    return Record(
        obj[cols.prompt], obj[cols.response], obj.get(cols.hint), obj.get(cols.chosen), obj.get(cols.rejected), where
    )


def read_jsonl_records(
    url: str,
    storage_options: dict[str, Any] | None = None,
    columns: DataColumns | None = None,
    bad_rows: BadRows | None = None,
) -> list[Record]:
    """All records of a JSONL file (blank lines skipped). DataError if unreadable or empty.

    Without ``bad_rows`` an unusable line is a DataError naming it. With ``bad_rows`` each one is
    skipped, counted there and named in a warning, and once the whole file is read a DataError
    naming examples says when more than its ``max_fraction`` of the lines are unusable."""
    try:
        with fsspec.open(url, "rb", **(storage_options or {})) as fh:
            raw: bytes = fh.read()
    except (OSError, ValueError, ImportError) as exc:
        raise DataError(f"cannot read JSONL data {url}: {exc}; check data.source and credentials") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"JSONL data {url} is not UTF-8 (byte {exc.start}); re-encode it") from None
    records: list[Record] = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = parse_record(line, f"{url}:{i}", columns)
        except DataError as exc:
            if bad_rows is None:
                raise
            bad_rows.note(exc)
            continue
        if bad_rows is not None:
            bad_rows.good()
        records.append(record)
    if bad_rows is not None:
        bad_rows.check(pass_done=True)  # the whole file is read: judged on all its lines
    if not records:
        bad = bad_rows.bad if bad_rows is not None else 0
        what = f"no usable records ({bad} unusable lines)" if bad else "no records"
        raise DataError(f"JSONL data {url} has {what}; each line must be a JSON object")
    return records


def _default_storage_options() -> dict[str, Any]:
    return dict(storage_options_from_env() or {})


class JsonlSource:
    """Examples from a JSONL file; see the module docstring."""

    name = "jsonl"
    format = "prompt_response"

    def __init__(
        self,
        tokenizer: Any,
        data: DataConfig,
        *,
        rank: int,
        world_size: int,
        seed: int,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer, self.data, self.rank, self.seed = tokenizer, data, rank, seed
        opts = storage_options if storage_options is not None else _default_storage_options()
        self.bad_rows = BadRows(data.max_bad_fraction, f"JSONL data {data.source}")
        records = read_jsonl_records(data.source, opts, data.columns, self.bad_rows)
        # split key: record index + content, so the split does not depend on where the file lives
        by_key = {f"{i}:{r.prompt}\x00{r.response}": (i, r) for i, r in enumerate(records)}
        train_keys, eval_keys = split_train_eval(list(by_key), data.eval_fraction)
        self.eval_records = [r for _, r in sorted(by_key[k] for k in eval_keys)]
        self.train_records = shard_for_rank(
            [r for _, r in sorted(by_key[k] for k in train_keys)], rank, world_size,
            what=f"JSONL data {data.source}", total_eval=len(self.eval_records),
        )
        if not self.eval_records:
            raise DataError(
                f"JSONL data {data.source} has 1 usable record; need at least 2 to hold one out for eval"
            )
        self.encoder = Encoder(tokenizer, data.hint_len)
        self._order = EpochOrder(len(self.train_records), seed, "jsonl-epoch", rank)
        self._unusable: set[tuple[str, int]] = set()  # ("train" | "eval", record) that cannot be encoded

    # -------------------------------------------------------------- order
    def train_example(self, index: int) -> Example:
        """Example ``index`` of this rank: epoch ``index // n`` in a seeded shuffled order (a record that
        cannot be encoded gives way to the next usable one in that order)."""
        n = len(self.train_records)
        for k in self._order.candidates(index):
            example = self._usable("train", k, example_rng(self.seed, "jsonl-train", self.rank, index))
            if example is not None:
                return example
        raise DataError(
            f"JSONL data {self.data.source}: none of rank {self.rank}'s {n} training records can be encoded; "
            f"examples: {' | '.join(self.bad_rows.examples)}"
        )

    def eval_example(self, index: int) -> Example:
        """Held-out example ``index`` (cycling through the eval records in file order; a record that cannot
        be encoded gives way to the next usable one)."""
        m = len(self.eval_records)
        for step in range(m):
            example = self._usable("eval", (index + step) % m, example_rng(self.seed, "jsonl-eval", index))
            if example is not None:
                return example
        raise DataError(
            f"JSONL data {self.data.source}: none of its {m} held-out eval records can be encoded; "
            f"examples: {' | '.join(self.bad_rows.examples)}"
        )

    def _usable(self, split: str, k: int, rng: Any) -> Example | None:
        """Record ``k`` of ``split`` encoded, or None when it cannot be (counted and named once)."""
        if (split, k) in self._unusable:
            return None
        records = self.train_records if split == "train" else self.eval_records
        try:
            return self._encode(records[k], rng)
        except DataError as exc:
            self._unusable.add((split, k))
            self.bad_rows.note(exc, read=False)  # its line was counted when the file was read
            self.bad_rows.check(pass_done=True, cause=exc)
            return None

    def _encode(self, rec: Record, rng: Any) -> Example:
        return self.encoder.prompt_response(rec, rng)
