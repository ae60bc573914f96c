"""User data read through 🤗 datasets: Hub datasets, data files and ``save_to_disk`` folders.

``data.source`` is ``hf:<repo id>`` (with ``data.config``, ``data.split``, ``data.revision``; streamed
unless ``data.streaming = false``), or a local path / fsspec URL of parquet, jsonl / json, csv, arrow
or txt files (one file, a glob, or a folder whose file names give the splits: ``train-*.parquet``,
``test.jsonl``...), or a folder written by ``Dataset.save_to_disk``. Local and fsspec files are
prepared into the datasets cache unless ``data.streaming = true``. ``datasets`` is imported here
only, lazily: without it the error names the ``data`` extra.

Records become examples by ``data.format`` (:mod:`.formats`); ``text`` documents are tokenized,
given an EOS and packed back to back into ``seq_len``-token rows (no padding; a document may span
rows). Each rank reads a disjoint shard of the train split: rows ``[start, end)`` of a prepared
split (contiguous, ``datasets.distributed.split_dataset_by_node``'s layout), or
``split_dataset_by_node`` of a stream (whole files per rank when their count divides the world
size, else every world-size-th record). Order: a prepared shard is permuted per epoch from
``(seed, rank, epoch)``; a stream is cut into windows of ``data.shuffle_buffer`` records, each
permuted from ``(seed, rank, epoch, window)`` (and datasets reorders its files every epoch).

The position is exact: :meth:`DatasetsSource.open` takes the JSON state a previous iterator's
``state()`` returned and continues with the next record (the stream's datasets ``state_dict`` at
the start of the current window, the offset in it, and for ``text`` how many tokens of the
document in flight were already packed). Eval is ``data.eval_split``, or else the records whose
content hash falls below ``data.eval_fraction`` (left out of training on every rank); eval
examples are the first ones of that set in file order, the same on every rank.

Unusable rows (wrong types, a chat without an assistant turn or one its template cannot render)
are skipped, counted (``bad_rows``, the ``data_bad_rows`` metric) and named in a warning, up to
``data.max_bad_fraction`` of the rows read (:mod:`.bad_rows`).

Failure: :class:`DataError` in one line naming the source, split, column and record: missing
columns, more unusable rows than ``data.max_bad_fraction`` (with examples), an empty shard, an
unloadable source.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import numpy as np

from diloco_serverless.config import HF_SOURCE_PREFIX, DataConfig
from diloco_serverless.data.bad_rows import BadRows
from diloco_serverless.data.examples import DataError, Example, example_rng
from diloco_serverless.data.formats import (
    Encoder,
    detect_format,
    format_columns,
    hint_from_row,
    messages_from_row,
    record_from_row,
    row_fraction,
    text_from_row,
)
from diloco_serverless.store.objectstore import storage_options_from_env

__all__ = ["DatasetsSource", "import_datasets", "DATA_EXTRA_HINT"]

DATA_EXTRA_HINT = "pip install 'diloco-serverless[data]'"
_BUILDERS = {
    ".parquet": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv",
    ".arrow": "arrow", ".txt": "text",
}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_SAVED_MARKERS = ("state.json", "dataset_dict.json")

Row = dict[str, Any]
RecordKey = tuple[int, ...]


def _pass_done(key: RecordKey) -> bool:
    """Whether a training record of this key comes after a whole pass over the shard (epoch >= 1)."""
    return len(key) >= 2 and key[0] >= 1


def import_datasets() -> Any:
    """The ``datasets`` module, or DataError naming the extra to install."""
    try:
        import datasets
    except ImportError as exc:
        raise DataError(
            f"this data.source is read with 🤗 datasets, which is not installed ({exc.msg}); {DATA_EXTRA_HINT}"
        ) from None
    return datasets


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _builder_for(paths: list[str], what: str) -> tuple[str, dict[str, Any]]:
    kinds = set()
    for path in paths:
        name = posixpath.basename(path.rstrip("/")).lower()
        for comp in _COMPRESSION:
            name = name.removesuffix(comp)
        ext = os.path.splitext(name)[1]
        if ext in _BUILDERS:
            kinds.add(_BUILDERS[ext])
    if len(kinds) != 1:
        found = "none of them" if not kinds else f"several kinds ({', '.join(sorted(kinds))})"
        raise DataError(
            f"{what}: need data files of one kind ({', '.join(sorted(_BUILDERS))}, optionally compressed), "
            f"found {found}; point data.source at one kind of file"
        )
    kind = kinds.pop()
    return kind, ({"sample_by": "document"} if kind == "text" else {})


class _Loader:
    """Loads splits of ``data.source`` (see the module docstring for the forms)."""

    def __init__(self, data: DataConfig, storage_options: dict[str, Any], streaming: bool) -> None:
        self.data, self.opts, self.streaming = data, storage_options, streaming
        self.ds = import_datasets()
        self.source = data.source
        self._files: dict[str, list[str]] | None = None
        self._saved: Any = None
        if not self.source.startswith(HF_SOURCE_PREFIX):
            for key in ("config", "revision"):
                if getattr(data, key) is not None:
                    raise DataError(
                        f"data.{key} ({getattr(data, key)!r}) applies to Hub datasets (hf:...) only; {self.source} "
                        "is files: unset it, or point data.source at the files you mean"
                    )

    def label(self, split: str) -> str:
        config = f" config {self.data.config!r}" if self.data.config else ""
        return f"{self.source}{config} split {split!r}"

    def load(self, split: str) -> Any:
        """The whole split (a Dataset, or an IterableDataset when streaming)."""
        try:
            progress = self.ds.utils.are_progress_bars_disabled()
            self.ds.utils.disable_progress_bars()
            try:
                return self._load(split)
            finally:
                if not progress:
                    self.ds.utils.enable_progress_bars()
        except DataError:
            raise
        except Exception as exc:  # datasets, fsspec and the Hub raise many kinds; one line each
            raise DataError(
                f"cannot load {self.label(split)}: {_one_line(exc)}; check data.source, data.config, data.split / "
                "data.eval_split, data.revision and credentials (HF_TOKEN for gated Hub datasets)"
            ) from exc

    def _load(self, split: str) -> Any:
        if self.source.startswith(HF_SOURCE_PREFIX):
            return self.ds.load_dataset(
                self.source[len(HF_SOURCE_PREFIX) :], name=self.data.config, split=split,
                revision=self.data.revision, streaming=self.streaming,
            )
        remote = "://" in self.source and not self.source.startswith("file://")
        opts = self.opts if remote else {}
        fs, path = fsspec.core.url_to_fs(self.source, **opts)
        pattern = any(c in self.source for c in "*?[")
        if not pattern and not fs.exists(path):
            raise DataError(f"data.source {self.source} does not exist; check the path (and credentials for a URL)")
        is_dir = not pattern and fs.isdir(path)
        if is_dir and any(fs.exists(posixpath.join(path, m)) for m in _SAVED_MARKERS):
            return self._load_saved(split, opts)
        files = self._data_files(is_dir, opts)
        if split not in files:
            raise DataError(
                f"{self.source} has no split {split!r} (found {', '.join(sorted(files))}); name data files by split "
                "(train-*.parquet, test.jsonl, ...) or set data.split / data.eval_split"
            )
        kind, kwargs = _builder_for(files[split], f"{self.source} split {split!r}")
        return self.ds.load_dataset(
            kind, data_files={split: files[split]}, split=split, streaming=self.streaming,
            storage_options=opts or None, **kwargs,
        )

    def _data_files(self, is_dir: bool, opts: dict[str, Any]) -> dict[str, list[str]]:
        if self._files is None:
            if is_dir:
                from datasets.data_files import DataFilesDict, get_data_patterns

                config = self.ds.DownloadConfig(storage_options=opts)
                patterns = get_data_patterns(self.source, config)
                found = DataFilesDict.from_patterns(patterns, base_path=self.source, download_config=config)
                self._files = {str(k): [str(f) for f in v] for k, v in found.items()}
            else:  # one file or a glob: the train split
                self._files = {self.data.split: [self.source]}
        return self._files

    def _load_saved(self, split: str, opts: dict[str, Any]) -> Any:
        if self._saved is None:
            self._saved = self.ds.load_from_disk(self.source, storage_options=opts or None)
        saved = self._saved
        if isinstance(saved, self.ds.DatasetDict):
            if split not in saved:
                raise DataError(f"{self.source} has no split {split!r} (found {', '.join(sorted(saved))})")
            saved = saved[split]
        elif split != self.data.split:
            raise DataError(
                f"{self.source} is a single saved Dataset, so it has no split {split!r}; save a DatasetDict or "
                "unset data.eval_split to hold out data.eval_fraction"
            )
        if self.streaming:
            shards = max(1, min(64, len(saved) // 1000))
            return saved.to_iterable_dataset(num_shards=shards)
        return saved


def _fresh(stream: Any) -> Any:
    """A stream with its own iteration state: datasets keeps that state on the objects a stream is
    made of, so two iterators of one stream object would move each other's positions."""
    return stream.shard(num_shards=1, index=0)


def _column_names(ds: Any, label: str) -> list[str]:
    names = ds.column_names
    if names is None:  # a stream without declared features: peek at the first record
        try:
            first = next(iter(_fresh(ds)))
        except StopIteration:
            raise DataError(f"{label} has no records") from None
        names = list(first)
    return list(names)


# ------------------------------------------------------------------------------------- records
class _MapRecords:
    """Training records of a prepared split: rows ``[start, end)``, permuted per epoch, held-out rows
    skipped. State ``{"epoch", "index"}``: the next record is row ``order(epoch)[index]``."""

    def __init__(self, ds: Any, start: int, end: int, *, seed: int, rank: int, keep: Callable[[Row], bool],
                 label: str, state: dict[str, Any] | None) -> None:
        self.ds, self.start, self.n = ds, start, end - start
        self.seed, self.rank, self.keep, self.label = seed, rank, keep, label
        self.epoch = int((state or {}).get("epoch", 0))
        self.index = int((state or {}).get("index", 0))
        self._order: tuple[int, Any] = (-1, None)
        self._kept_this_pass = 0
        self._full_pass = self.index == 0

    def _perm(self) -> Any:
        if self._order[0] != self.epoch:
            rng = np.random.default_rng([self.seed, self.rank, self.epoch])
            self._order = (self.epoch, rng.permutation(self.n))
        return self._order[1]

    def next(self) -> tuple[Row, str, RecordKey]:
        while True:
            if self.index >= self.n:
                if self._full_pass and not self._kept_this_pass:
                    raise DataError(
                        f"{self.label}: rank {self.rank}'s shard (rows {self.start}..{self.start + self.n - 1}) has "
                        "no training records, all held out for eval; lower data.eval_fraction or use fewer replicas"
                    )
                self.epoch, self.index, self._kept_this_pass, self._full_pass = self.epoch + 1, 0, 0, True
            row_id = self.start + int(self._perm()[self.index])
            key = (self.epoch, self.index)
            self.index += 1
            row = self.ds[row_id]
            if self.keep(row):
                self._kept_this_pass += 1
                return row, f"{self.label} row {row_id}", key

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}


class _StreamRecords:
    """Training records of this rank's stream, shuffled in windows of ``window`` kept records.

    State ``{"epoch", "window", "window_state", "offset"}``: ``window_state`` is the stream's datasets
    ``state_dict`` where the window starts (None: the epoch's start); the next record is the
    ``offset``-th of that window in its permuted order. Restoring re-reads that one window.
    """

    def __init__(self, make_stream: Callable[[], Any], *, window: int, seed: int, rank: int,
                 keep: Callable[[Row], bool], label: str, state: dict[str, Any] | None) -> None:
        self.make_stream, self.size = make_stream, window
        self.seed, self.rank, self.keep, self.label = seed, rank, keep, label
        st = state or {}
        self.epoch, self.window = int(st.get("epoch", 0)), int(st.get("window", 0))
        self.window_state: dict[str, Any] | None = st.get("window_state")
        self.offset = int(st.get("offset", 0))
        self._rows: list[tuple[int, Row]] | None = None
        self._stream: Any = None
        self._it: Iterator[Row] | None = None
        self._exhausted = False

    def _open(self) -> None:
        self.close()
        self._stream = self.make_stream()
        self._stream.set_epoch(self.epoch)
        if self.window_state is not None:
            self._stream.load_state_dict(self.window_state)
        self._it = iter(self._stream)
        self._exhausted = False

    def _fill(self) -> None:
        """Read the window at (epoch, window, window_state) from the live iterator."""
        assert self._it is not None
        rows: list[Row] = []
        while len(rows) < self.size:
            try:
                row = next(self._it)
            except StopIteration:
                self._exhausted = True
                break
            if self.keep(row):
                rows.append(row)
        order = list(range(len(rows)))
        example_rng(self.seed, "hf-window", self.rank, self.epoch, self.window).shuffle(order)
        self._rows = [(i, rows[i]) for i in order]

    def _advance(self) -> None:
        """Move to the next window (or epoch) once this one is used up."""
        if self._exhausted:
            if self.window == 0 and not self._rows:
                raise DataError(
                    f"{self.label}: rank {self.rank} read no training records in epoch {self.epoch} (its shard "
                    "is empty or all held out for eval); use fewer replicas, more data or a lower data.eval_fraction"
                )
            self.epoch, self.window, self.window_state = self.epoch + 1, 0, None
            self._open()
        else:
            assert self._stream is not None
            self.window, self.window_state = self.window + 1, self._stream.state_dict()
        self.offset = 0
        self._fill()

    def next(self) -> tuple[Row, str, RecordKey]:
        if self._rows is None:
            self._open()
            self._fill()
        assert self._rows is not None
        while self.offset >= len(self._rows):
            self._advance()
        i, row = self._rows[self.offset]
        key = (self.epoch, self.window, self.offset)
        self.offset += 1
        k = self.window * self.size + i
        return row, f"{self.label}: rank {self.rank}'s training record {k} of epoch {self.epoch}", key

    def state(self) -> dict[str, Any]:
        if self._rows is None or self.offset < len(self._rows):
            return {"epoch": self.epoch, "window": self.window, "window_state": self.window_state,
                    "offset": self.offset}
        if self._exhausted:
            return {"epoch": self.epoch + 1, "window": 0, "window_state": None, "offset": 0}
        assert self._stream is not None
        return {"epoch": self.epoch, "window": self.window + 1, "window_state": self._stream.state_dict(),
                "offset": 0}

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if callable(close):
            close()
        self._it = None


class _EvalRecords:
    """Eval records in file order (held-out ones filtered by ``keep``); ends with the split."""

    def __init__(self, ds: Any, keep: Callable[[Row], bool], label: str) -> None:
        self._rows = ((i, r) for i, r in enumerate(ds) if keep(r))
        self.label = label

    def next(self) -> tuple[Row, str, RecordKey]:
        i, row = next(self._rows)
        return row, f"{self.label} record {i}", (i,)

    def state(self) -> dict[str, Any]:
        return {}


# ------------------------------------------------------------------------------------- examples
class _RecordExamples:
    """One example per record (chat, prompt_response, preference). State ``{"records": ...}``."""

    def __init__(self, records: Any, encode: Callable[[Row, str, RecordKey], Example | None]) -> None:
        self.records, self.encode = records, encode

    def __iter__(self) -> _RecordExamples:
        return self

    def __next__(self) -> Example:
        while True:  # None: an unusable row, skipped (and counted) by ``encode``
            example = self.encode(*self.records.next())
            if example is not None:
                return example

    def state(self) -> dict[str, Any]:
        return {"records": self.records.state()}

    def close(self) -> None:
        getattr(self.records, "close", lambda: None)()


class _PackedExamples:
    """``text``: documents (tokens + EOS) back to back, cut into rows of ``length`` tokens.

    State ``{"records": <state of the document in flight>, "skip_tokens": <its tokens already in
    rows>}``: the rest of a row-spanning document is a suffix of the last one read, so this is exact.
    Row = prompt ``[t0]`` + response ``[t1..]``: every token after the first is scored, none is padding.
    """

    def __init__(self, records: Any, document: Callable[[Row, str, RecordKey], list[int]], length: int,
                 skip_tokens: int = 0) -> None:
        self.records, self.document, self.length = records, document, length
        self._buf: list[int] = []
        self._pos = 0
        self._skip = skip_tokens
        self._doc_state: dict[str, Any] = {}
        self._doc_len = 0
        self._where = ""
        self._empty_since: int | None = None  # epoch where the current run of empty documents began

    def __iter__(self) -> _PackedExamples:
        return self

    def __next__(self) -> Example:
        while len(self._buf) - self._pos < self.length:
            state = self.records.state()
            row, where, key = self.records.next()
            tokens = self.document(row, where, key)
            rest, self._skip = tokens[self._skip :], 0
            if not rest:
                self._check_not_all_empty(key, where)
                continue
            self._empty_since = None
            self._buf = self._buf[self._pos :] + rest
            self._pos = 0
            self._doc_state, self._doc_len, self._where = state, len(tokens), where
        block = self._buf[self._pos : self._pos + self.length]
        self._pos += self.length
        return Example(block[:1], block[1:], [], [], [], f"{self._where} (packed)")

    def _check_not_all_empty(self, key: RecordKey, where: str) -> None:
        if len(key) < 2:  # eval records end; only the endless training stream can spin
            return
        if self._empty_since is None:
            self._empty_since = key[0]
        elif key[0] >= self._empty_since + 2:
            raise DataError(f"{where}: every document of this shard is empty (a whole epoch gave no tokens)")

    def state(self) -> dict[str, Any]:
        left = len(self._buf) - self._pos
        if left:
            return {"records": self._doc_state, "skip_tokens": self._doc_len - left}
        return {"records": self.records.state(), "skip_tokens": 0}

    def close(self) -> None:
        getattr(self.records, "close", lambda: None)()


# ------------------------------------------------------------------------------------- source
class DatasetsSource:
    """Examples of one rank from a datasets source; see the module docstring.

    :meth:`open` returns an iterator of training examples with a ``state()``; :meth:`eval_example`
    gives held-out example ``i`` (the same on every rank).
    """

    name = "datasets"

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
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside the run's {world_size} replicas (ranks 0..{world_size - 1})")
        self.data, self.rank, self.world_size, self.seed = data, rank, world_size, seed
        self.streaming = data.streaming if data.streaming is not None else data.source.startswith(HF_SOURCE_PREFIX)
        opts = storage_options if storage_options is not None else dict(storage_options_from_env() or {})
        self._loader = _Loader(data, opts, self.streaming)
        self.label = self._loader.label(data.split)
        self._train = self._loader.load(data.split)
        self._eval = self._loader.load(data.eval_split) if data.eval_split is not None else None
        self.format = self._check_columns()
        self.encoder = Encoder(tokenizer, data.hint_len)
        self.bad_rows = BadRows(data.max_bad_fraction, self.label)
        if self.format == "chat" and not self.encoder.has_template:
            raise DataError(
                f"{self.label}: data.format='chat' renders messages with the tokenizer's chat template, and this "
                "tokenizer has none; use a chat model or data.format='prompt_response'"
            )
        self._shard = (0, 0)
        if not self.streaming:
            n = len(self._train)
            div, mod = divmod(n, world_size)
            start = div * rank + min(rank, mod)
            self._shard = (start, start + div + (1 if rank < mod else 0))
            if self._shard[0] >= self._shard[1]:
                raise DataError(
                    f"{self.label}: rank {rank} of {world_size} replicas gets no training data ({n} records); "
                    "use fewer replicas or more data"
                )
        self._eval_cache: list[Example] = []
        self._eval_iter: Iterator[Example] | None = None
        self._eval_done = False

    # ------------------------------------------------------------ columns and format
    def _check_columns(self) -> str:
        cols = self.data.columns
        have = _column_names(self._train, self.label)
        fmt = detect_format(have, cols, self.label) if self.data.format == "auto" else self.data.format
        required, optional = format_columns(fmt, cols)
        # an optional column is checked when renamed (fields_set does not survive run.json)
        renamed = {getattr(cols, f) for f, info in type(cols).model_fields.items() if getattr(cols, f) != info.default}
        for col in required + [c for c in optional if c in renamed]:
            if col not in have:
                field = next(f for f in type(cols).model_fields if getattr(cols, f) == col)
                raise DataError(
                    f"{self.label}: data.format={fmt!r} needs column {col!r}, which it lacks (columns: "
                    f"{', '.join(have)}); set data.columns.{field} to the column that holds it"
                )
        self.used = [c for c in dict.fromkeys(required + optional) if c in have]
        self._train = self._train.select_columns(self.used)
        if self._eval is not None:
            label = self._loader.label(self.data.eval_split or "")
            eval_have = _column_names(self._eval, label)
            missing = [c for c in required if c not in eval_have]
            if missing:
                raise DataError(f"{label}: lacks column {missing[0]!r} that data.format={fmt!r} needs")
            self._eval = self._eval.select_columns([c for c in self.used if c in eval_have])
        return fmt

    def _is_train(self, row: Row) -> bool:
        return self._eval is not None or row_fraction(row, self.used) >= self.data.eval_fraction

    def _is_eval(self, row: Row) -> bool:
        return self._eval is not None or row_fraction(row, self.used) < self.data.eval_fraction

    # ------------------------------------------------------------ encoding
    def _document(self, row: Row, where: str, key: RecordKey) -> list[int]:
        try:
            tokens = self.encoder.document(text_from_row(row, self.data.columns, where))
        except DataError as exc:
            self.bad_rows.skip(exc, pass_done=_pass_done(key))
            return []
        self.bad_rows.good()
        return tokens

    def _encode(self, row: Row, where: str, key: RecordKey, kind: str) -> Example | None:
        cols = self.data.columns
        try:
            if self.format == "chat":
                example = self.encoder.chat(
                    messages_from_row(row, cols, where), hint_from_row(row, cols, where), where
                )
            else:
                rec = record_from_row(row, self.format, cols, where)
                example = self.encoder.prompt_response(rec, example_rng(self.seed, kind, self.rank, *key))
        except DataError as exc:
            self.bad_rows.skip(exc, pass_done=_pass_done(key))
            return None
        self.bad_rows.good()
        return example

    def _examples(self, records: Any, kind: str, skip_tokens: int = 0) -> Any:
        if self.format == "text":
            return _PackedExamples(records, self._document, self.data.seq_len, skip_tokens)
        return _RecordExamples(records, lambda row, where, key: self._encode(row, where, key, kind))

    # ------------------------------------------------------------ training stream
    def _stream_shard(self) -> Any:
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(_fresh(self._train), rank=self.rank, world_size=self.world_size)

    def open(self, state: dict[str, Any] | None = None) -> Any:
        """Training examples from ``state`` (None = the start), with ``state()`` after each."""
        st = state or {}
        records_state = st.get("records")
        try:
            skip = int(st.get("skip_tokens", 0))
        except (TypeError, ValueError):
            raise DataError(f"{self.label}: data position {st!r} does not fit this source") from None
        if records_state is not None and not isinstance(records_state, dict):
            raise DataError(f"{self.label}: data position {st!r} does not fit this source")
        records: Any
        if self.streaming:
            records = _StreamRecords(
                self._stream_shard, window=self.data.shuffle_buffer, seed=self.seed, rank=self.rank,
                keep=self._is_train, label=self.label, state=records_state,
            )
        else:
            records = _MapRecords(
                self._train, *self._shard, seed=self.seed, rank=self.rank, keep=self._is_train, label=self.label,
                state=records_state,
            )
        return self._examples(records, "hf-train", skip)

    # ------------------------------------------------------------ eval
    def eval_example(self, index: int) -> Example:
        """Held-out example ``index``: the eval split (or held-out records) in order, cycling."""
        if self._eval_iter is None:
            split = self._eval if self._eval is not None else self._train
            if self.streaming:
                split = _fresh(split)
            label = self._loader.label(self.data.eval_split or self.data.split)
            self._eval_iter = self._examples(_EvalRecords(split, self._is_eval, label), "hf-eval")
        while not self._eval_done and len(self._eval_cache) <= index:
            example = next(self._eval_iter, None)
            if example is None:
                self._eval_done = True
            else:
                self._eval_cache.append(example)
        if not self._eval_cache:
            where = (
                f"data.eval_split {self.data.eval_split!r}" if self._eval is not None
                else f"data.eval_fraction={self.data.eval_fraction} of {self.label}"
            )
            raise DataError(
                f"{where} gives no eval examples; use a larger split or fraction (text needs at least "
                f"data.seq_len={self.data.seq_len} tokens of eval documents)"
            )
        return self._eval_cache[index % len(self._eval_cache)] if self._eval_done else self._eval_cache[index]
