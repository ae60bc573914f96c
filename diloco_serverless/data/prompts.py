"""Prompts as data (``data.format = "prompt"``): what the RL channel samples completions of.

A record is a row with the prompt column (``data.columns.prompt``): a string, or a list of
``{role, content}`` messages. Every other column of the row (``answer``, ``tests``, ...) travels with
the prompt to the reward functions. Sources: a ``.jsonl`` file (local path or fsspec URL), or any
datasets source ``data.source`` names (``hf:<repo>``, Parquet/CSV/JSON files or folders, a saved
dataset; read whole, not streamed).

Rendering follows TRL: a string prompt is tokenized as is; messages are rendered with the
tokenizer's chat template and the generation prompt (``add_generation_prompt=True``). A prompt
longer than ``data.seq_len - rl.max_completion_length`` tokens keeps its last tokens.

Order and resume: records are split into train/eval by a hash of their content
(``data.eval_fraction``, at least one eval record), the training records dealt round-robin to the
ranks, and rank ``r`` reads its shard in a seeded shuffled order per epoch: prompt ``i`` of a rank is
a pure function of ``(seed, rank, i)``, so the ``position`` (prompts consumed) is the whole state,
exactly like the other ExampleSource formats.

Bad rows: a row that is not usable (a line that is not JSON or not an object, no prompt column, a
prompt that is neither a string nor a list of messages, or one that renders to no tokens) is skipped,
counted (``bad_rows``, the ``data_bad_rows`` metric) and named (``<source>:<line>`` or ``row <i>``) in
a warning, like the other formats (:mod:`.bad_rows`). The rows are checked when the source is read,
and the fraction judged on all of them (a DataError naming examples past ``data.max_bad_fraction``);
a prompt that cannot be rendered is found when it is first used, gives way to the next usable one in
the same order (so resume stays exact) and is counted then.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec

from diloco_serverless.config import DataConfig, RunConfig
from diloco_serverless.data.bad_rows import BadRows
from diloco_serverless.data.examples import DataError, EpochOrder
from diloco_serverless.data.formats import row_fraction
from diloco_serverless.data.stdlib import shard_for_rank, split_train_eval

__all__ = ["PromptRecord", "PromptBatcher", "PromptSource", "render_prompt"]

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: as given (``prompt``), as token ids (``prompt_ids``), its other ``columns``."""

    prompt: str | Messages
    prompt_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)
    where: str = ""


def _messages(value: Any, where: str, col: str) -> str | Messages:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: column {col!r} is an empty prompt")
        return value
    if isinstance(value, Sequence) and value and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
    raise DataError(
        f"{where}: column {col!r} must be a prompt string or a list of {{role, content}} messages, got "
        f"{repr(value)[:60]}"
    )


def render_prompt(tokenizer: Any, prompt: str | Messages, max_tokens: int, where: str = "prompt") -> list[int]:
    """Token ids of ``prompt`` (messages through the chat template + generation prompt), its last
    ``max_tokens`` tokens when longer."""
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                f"{where}: the prompt is a list of messages but the tokenizer has no chat template; give the prompt "
                "as a string or use a chat model"
            )
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise DataError(f"{where}: the prompt renders to no tokens")
    return ids[-max_tokens:]


def _read_jsonl(url: str, storage_options: dict[str, Any], bad: BadRows) -> list[tuple[str, dict[str, Any]]]:
    """The JSON objects of a ``.jsonl`` file; a line that is not one is counted in ``bad`` and skipped."""
    try:
        with fsspec.open(url, "rt", encoding="utf-8", **storage_options) as fh:
            lines = fh.read().splitlines()
    except (OSError, ValueError, ImportError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read prompt data {url}: {exc}; check data.source") from exc
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            bad.note(DataError(f"{url}:{i}: not JSON ({exc.msg}); each line must be one JSON object"))
            continue
        if not isinstance(obj, dict):
            bad.note(DataError(f"{url}:{i}: must be a JSON object, got {type(obj).__name__}"))
            continue
        rows.append((f"{url}:{i}", obj))
    return rows


def _read_datasets(data: DataConfig, storage_options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    from diloco_serverless.data.hf import _Loader

    loader = _Loader(data, storage_options, streaming=False)
    split = loader.load(data.split)
    label = loader.label(data.split)
    return [(f"{label} row {i}", dict(row)) for i, row in enumerate(split)]


class PromptSource:
    """The prompt records of one rank; ``train_record(i)`` / ``eval_record(i)`` by index."""

    name = "prompts"
    format = "prompt"

    def __init__(
        self,
        tokenizer: Any,
        data: DataConfig,
        *,
        rank: int,
        world_size: int,
        seed: int,
        max_prompt_tokens: int,
        rows: Sequence[Mapping[str, Any]] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer, self.data, self.rank, self.seed = tokenizer, data, rank, seed
        self.max_prompt_tokens = max_prompt_tokens
        col = data.columns.prompt
        opts = dict(storage_options or {})
        self.bad_rows = BadRows(data.max_bad_fraction, f"prompt data {data.source}")
        if rows is not None:
            raw = [(f"rows[{i}]", dict(r)) for i, r in enumerate(rows)]
        elif data.source == "stdlib":
            raise DataError(
                'data.format="prompt" needs prompt records: point data.source at a .jsonl file or a datasets source '
                '("hf:openai/gsm8k", files, a saved dataset) whose rows have a prompt column'
            )
        elif data.source.endswith(".jsonl"):
            raw = _read_jsonl(data.source, opts, self.bad_rows)
        else:
            raw = _read_datasets(data, opts)
        raw = [(where, row) for where, row in raw if self._check_row(where, row)]
        self.bad_rows.check(pass_done=True)  # every row is read: judged on all of them
        if not raw:
            raise DataError(
                f"prompt data {data.source} has no usable prompt records ({self.bad_rows.bad} unusable rows; "
                f"examples: {' | '.join(self.bad_rows.examples)})"
            )
        keyed = {f"{i}:{row_fraction(row, [col])}": (i, where, row) for i, (where, row) in enumerate(raw)}
        train_keys, eval_keys = split_train_eval(list(keyed), data.eval_fraction)
        self.eval_rows = [(w, r) for _, w, r in sorted(keyed[k] for k in eval_keys)]
        train = [(w, r) for _, w, r in sorted(keyed[k] for k in train_keys)]
        self.train_rows = shard_for_rank(
            train, rank, world_size, what=f"prompt data {data.source}", total_eval=len(self.eval_rows)
        )
        if not self.eval_rows:
            raise DataError(f"prompt data {data.source} has 1 record; need at least 2 to hold one out for eval")
        self._order = EpochOrder(len(self.train_rows), seed, "prompt-epoch", rank)
        #: ("train" | "eval", index) of the rows whose prompt cannot be rendered (counted once)
        self._unusable: set[tuple[str, int]] = set()

    def _check_row(self, where: str, row: dict[str, Any]) -> bool:
        """True for a row with a usable prompt column; else counted as unusable and named."""
        col = self.data.columns.prompt
        try:
            if col not in row:
                raise DataError(
                    f"{where}: no prompt column {col!r} (columns: {sorted(row)}); set data.columns.prompt to the "
                    "column that holds it"
                )
            _messages(row[col], where, col)
        except DataError as exc:
            self.bad_rows.note(exc)
            return False
        self.bad_rows.good()
        return True

    def _usable(self, split: str, k: int) -> PromptRecord | None:
        """Row ``k`` of ``split`` as a record, or None when its prompt cannot be rendered (counted once)."""
        if (split, k) in self._unusable:
            return None
        rows = self.train_rows if split == "train" else self.eval_rows
        try:
            return self._record(*rows[k])
        except DataError as exc:
            self._unusable.add((split, k))
            self.bad_rows.note(exc, read=False)  # the row was counted when the source was read
            self.bad_rows.check(pass_done=True, cause=exc)
            return None

    def _record(self, where: str, row: dict[str, Any]) -> PromptRecord:
        col = self.data.columns.prompt
        prompt = _messages(row[col], where, col)
        ids = render_prompt(self.tokenizer, prompt, self.max_prompt_tokens, where)
        return PromptRecord(prompt, ids, {k: v for k, v in row.items() if k != col}, where)

    def train_record(self, index: int) -> PromptRecord:
        """Prompt ``index`` of this rank: epoch ``index // n`` in a seeded shuffled order (a prompt that
        cannot be rendered gives way to the next usable one in that order)."""
        n = len(self.train_rows)
        for k in self._order.candidates(index):
            record = self._usable("train", k)
            if record is not None:
                return record
        raise DataError(
            f"prompt data {self.data.source}: none of rank {self.rank}'s {n} training prompts can be rendered; "
            f"examples: {' | '.join(self.bad_rows.examples)}"
        )

    def eval_record(self, index: int) -> PromptRecord:
        """Held-out prompt ``index`` (the eval records in source order, cycling; a prompt that cannot be
        rendered gives way to the next usable one)."""
        m = len(self.eval_rows)
        for step in range(m):
            record = self._usable("eval", (index + step) % m)
            if record is not None:
                return record
        raise DataError(
            f"prompt data {self.data.source}: none of its {m} held-out prompts can be rendered; "
            f"examples: {' | '.join(self.bad_rows.examples)}"
        )


class PromptBatcher:
    """``data.batch_size`` prompts per :meth:`next_batch`; the same position / state API as BatchBuilder."""

    def __init__(self, source: PromptSource, data: DataConfig, *, rank: int, seed: int) -> None:
        self.source, self.data, self.rank, self.seed = source, data, rank, seed
        self.format = "prompt"
        self._position = 0
        self._wait_s = 0.0

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        tokenizer: Any,
        *,
        rank: int,
        world_size: int | None = None,
        rows: Sequence[Mapping[str, Any]] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> PromptBatcher:
        budget = cfg.data.seq_len - cfg.rl.max_completion_length
        if budget < 1:
            raise DataError(
                f"data.seq_len ({cfg.data.seq_len}) must exceed rl.max_completion_length "
                f"({cfg.rl.max_completion_length}): a sequence is the prompt and the completion"
            )
        source = PromptSource(
            tokenizer, cfg.data, rank=rank, world_size=cfg.replicas if world_size is None else world_size,
            seed=cfg.seed, max_prompt_tokens=budget, rows=rows, storage_options=storage_options,
        )  # fmt: skip
        return cls(source, cfg.data, rank=rank, seed=cfg.seed)

    def next_batch(self) -> list[PromptRecord]:
        """The next ``data.batch_size`` prompts; advances the position by as many."""
        t0 = time.perf_counter()
        try:
            batch = [self.source.train_record(self._position + i) for i in range(self.data.batch_size)]
        finally:
            self._wait_s += time.perf_counter() - t0
        self._position += self.data.batch_size
        return batch

    def eval_batches(self, num_batches: int | None = None) -> Iterator[list[PromptRecord]]:
        n = self.data.eval_batches if num_batches is None else num_batches
        b = self.data.batch_size
        for k in range(n):
            yield [self.source.eval_record(k * b + i) for i in range(b)]

    @property
    def data_wait_s(self) -> float:
        return self._wait_s

    def reset_data_wait(self) -> float:
        waited, self._wait_s = self._wait_s, 0.0
        return waited

    def close(self) -> None:
        """Nothing runs in the background; here for BatchBuilder's interface."""

    @property
    def position(self) -> int:
        """Prompts consumed (``batch_size`` per batch)."""
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DataError(f"rank {self.rank}: data position must be a non-negative int, got {value!r}")
        self._position = value

    def state_dict(self) -> dict[str, Any]:
        return {
            "position": self._position, "rank": self.rank, "seed": self.seed, "source": self.data.source,
            "batch_size": self.data.batch_size, "format": self.format,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in {"seed": self.seed, "source": self.data.source, "format": self.format}.items():
            if key in state and state[key] != value:
                raise DataError(
                    f"rank {self.rank}: data position was saved with {key}={state[key]!r}, this run has "
                    f"{key}={value!r}; it cannot resume that stream"
                )
        self.position = state.get("position")  # type: ignore[assignment]  # checked by the setter
