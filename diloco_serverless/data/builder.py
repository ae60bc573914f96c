"""Batches for ``compose_loss``: one replica's deterministic, restartable stream of training data.

``BatchBuilder.from_config(cfg, tokenizer, rank=r, ref_model=ref)`` yields dicts with the batch
keys :mod:`diloco_serverless.loss.compose` reads (all ``torch.long`` ``[B, T]`` except the ``[B]``
fp32 reference log-probs)::

    input_ids, attention_mask, response_mask                                   channel 1 (always)
    ctx_teacher_input_ids, ctx_teacher_attention_mask, ctx_teacher_response_mask   channel 2 (alpha_sdpo > 0)
    dpo_{chosen,rejected}_{input_ids,attention_mask,response_mask}             channel 3 (beta_replay > 0)
    dpo_chosen_ref_logprobs, dpo_rejected_ref_logprobs                         channel 3 with dpo_variant="dpo"

The keys of a channel whose weight is 0 are left out (``compose_loss`` then skips it and no work is
spent building it). Reference log-probs come from a frozen copy of the *initial* model
(:func:`make_reference_model`, DPO: Rafailov et al., arXiv 2305.18290); SimPO (Meng et al., arXiv
2405.14734) needs none. Student rows are ``seq_len`` long, teacher rows ``seq_len + hint_len``.
``data.format = "text"`` feeds channel 1 only and ``"chat"`` channels 1 and 2: other weights must be 0.

Sources: :class:`ExampleSource` (stdlib, JSONL) gives example ``i`` of a rank as a pure function of
``(seed, rank, i)``; :class:`StreamSource` (:mod:`.hf`, 🤗 datasets) gives an iterator with a JSON
``state()``. ``position`` counts the examples consumed; :meth:`BatchBuilder.state_dict` is
``{"position", ...}`` plus, for a stream, ``"stream"`` (the iterator state there), and
:meth:`~BatchBuilder.load_state_dict` resumes at exactly the next example. Setting ``position``
moves there: directly for an ExampleSource, by reading forward (or from the start, when moving
back) for a stream. :meth:`BatchBuilder.eval_batches` walks the held-out split (the same batches
on every call and rank) and carries only the channel-1 keys: eval loss is lm_ce.

A background thread (``data.prefetch`` batches ahead, 0 = inline) reads, tokenizes, packs and
collates while the caller trains; the batches are identical either way. ``data_wait_s`` is the time
:meth:`~BatchBuilder.next_batch` spent waiting for data (``reset_data_wait()`` returns and zeroes it,
e.g. once per round). Moving to the device and the DPO reference forward run in the caller's thread.

Failure: :class:`DataError` for bad records, empty shards, a rank outside the run, a format whose
loss channels are not all available, or a DPO config without a reference model; the message names
the rank, file, line or record and column and the fix. A producer error is raised by ``next_batch``.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from diloco_serverless.config import DataConfig, LossConfig, RunConfig
from diloco_serverless.data.examples import DataError, Example, collate
from diloco_serverless.data.hf import DatasetsSource
from diloco_serverless.data.jsonl import JsonlSource, is_jsonl_file
from diloco_serverless.data.prefetch import Prefetcher
from diloco_serverless.data.stdlib import StdlibSource
from diloco_serverless.loss import sequence_logprobs

__all__ = [
    "DataError",
    "Example",
    "ExampleSource",
    "StreamSource",
    "BatchBuilder",
    "make_source",
    "make_reference_model",
    "reference_logprobs",
    "check_channels",
    "STUDENT_KEYS",
    "TEACHER_KEYS",
    "DPO_KEYS",
    "REF_KEYS",
]

STUDENT_KEYS = ("input_ids", "attention_mask", "response_mask")
TEACHER_KEYS = tuple(f"ctx_teacher_{k}" for k in STUDENT_KEYS)
DPO_KEYS = tuple(f"dpo_{side}_{k}" for side in ("chosen", "rejected") for k in STUDENT_KEYS)
REF_KEYS = ("dpo_chosen_ref_logprobs", "dpo_rejected_ref_logprobs")


class ExampleSource(Protocol):
    """Examples addressed by index (``StdlibSource``, ``JsonlSource``)."""

    name: str

    def train_example(self, index: int) -> Example: ...

    def eval_example(self, index: int) -> Example: ...


@runtime_checkable
class StreamSource(Protocol):
    """Examples read in order (``DatasetsSource``): ``open(state)`` returns an iterator of examples
    whose ``state()`` (JSON) reopens it at the next one; ``format`` is the resolved data.format."""

    name: str
    format: str

    def open(self, state: dict[str, Any] | None = None) -> Any: ...

    def eval_example(self, index: int) -> Example: ...


def make_source(
    data: DataConfig,
    tokenizer: Any,
    *,
    rank: int,
    world_size: int,
    seed: int,
    storage_options: dict[str, Any] | None = None,
) -> ExampleSource | StreamSource:
    """``"stdlib"`` -> StdlibSource; a single ``.jsonl`` file with ``data.format = "auto"`` (and no
    datasets-only option) -> JsonlSource; anything else -> DatasetsSource (🤗 datasets)."""
    if data.format == "prompt":  # RL prompts: diloco_serverless.data.prompts
        raise DataError('data.format="prompt" holds prompts to sample from, not training sequences: it is read by '
                        'PromptBatcher (loss.channel1 = "grpo" or "dppo")')
    if data.source == "stdlib":
        return StdlibSource(tokenizer, data, rank=rank, world_size=world_size, seed=seed)
    builtin = data.format == "auto" and data.eval_split is None and data.streaming is None
    if builtin and is_jsonl_file(data.source) and data.config is None and data.revision is None:
        return JsonlSource(
            tokenizer, data, rank=rank, world_size=world_size, seed=seed, storage_options=storage_options
        )
    return DatasetsSource(tokenizer, data, rank=rank, world_size=world_size, seed=seed, storage_options=storage_options)


def check_channels(fmt: str | None, loss: LossConfig, rank: int) -> None:
    """DataError when a loss channel is on that data of format ``fmt`` cannot feed."""
    if fmt == "text" and (loss.alpha_sdpo > 0 or loss.beta_replay > 0):
        raise DataError(
            f"rank {rank}: data.format='text' (packed documents: no prompt, hint or preference pair) trains the "
            f"language-modelling loss only, but loss.alpha_sdpo={loss.alpha_sdpo} and loss.beta_replay="
            f"{loss.beta_replay}; set both to 0"
        )
    if fmt == "chat" and loss.beta_replay > 0:
        raise DataError(
            f"rank {rank}: data.format='chat' has no preference pairs for loss.beta_replay={loss.beta_replay}; set "
            "loss.beta_replay=0, or use data.format='preference' (prompt, chosen, rejected)"
        )


def make_reference_model(model: nn.Module) -> nn.Module:
    """A frozen deep copy (eval mode, no grad) of ``model``: call it on the initial model, before any
    training step or checkpoint load, so every replica (also a restarted one) has the same reference."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


@torch.no_grad()
def reference_logprobs(ref_model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``dpo_{chosen,rejected}_ref_logprobs`` ([B], fp32) of ``batch``'s DPO rows under ``ref_model``."""
    seq_lp = sequence_logprobs
    out = {}
    for side in ("chosen", "rejected"):
        p = f"dpo_{side}_"
        out[f"{p}ref_logprobs"] = seq_lp(
            ref_model, batch[f"{p}input_ids"], batch[f"{p}attention_mask"], batch[f"{p}response_mask"]
        ).float()
    return out


def _start_id(tokenizer: Any) -> int:
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    raise DataError("tokenizer has no BOS, EOS or pad token; set tokenizer.pad_token before building batches")


class _IndexedExamples:
    """An ExampleSource's training examples from ``index`` on, as an iterator with a state."""

    def __init__(self, source: ExampleSource, index: int) -> None:
        self.source, self.index = source, index

    def __iter__(self) -> _IndexedExamples:
        return self

    def __next__(self) -> Example:
        example = self.source.train_example(self.index)
        self.index += 1
        return example

    def state(self) -> dict[str, Any]:
        return {"index": self.index}


Batch = dict[str, torch.Tensor]


def _produce(
    open_examples: Callable[[], Any],
    skip: int,
    batch_size: int,
    make_batch: Callable[[list[Example]], Batch],
    lock: threading.Lock,
    pin: bool,
) -> Generator[tuple[Batch, dict[str, Any]], None, None]:
    """(CPU batch, iterator state after it) forever, after skipping ``skip`` examples. Holds
    ``lock`` while it touches the source (the tokenizer and caches are shared with eval)."""
    with lock:
        examples = open_examples()
    try:
        for _ in range(skip):
            with lock:
                next(examples)
        while True:
            with lock:
                batch = make_batch([next(examples) for _ in range(batch_size)])
                state = examples.state()
            if pin:
                batch = {k: v.pin_memory() for k, v in batch.items()}
            yield batch, state
    finally:
        close = getattr(examples, "close", None)
        if callable(close):
            close()


def _close_worker(holder: list[Prefetcher[Any] | None]) -> None:
    worker, holder[0] = holder[0], None
    if worker is not None:
        worker.close()


class BatchBuilder:
    """Deterministic batches of one rank; iterate it or call :meth:`next_batch`."""

    def __init__(
        self,
        source: ExampleSource | StreamSource,
        tokenizer: Any,
        data: DataConfig,
        loss: LossConfig,
        *,
        rank: int,
        seed: int,
        ref_model: nn.Module | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.format: str | None = getattr(source, "format", None)
        check_channels(self.format, loss, rank)
        if loss.needs_reference and ref_model is None:
            raise DataError(
                f"rank {rank}: loss.dpo_variant='dpo' with loss.beta_replay={loss.beta_replay} needs reference "
                "log-probs; pass ref_model=make_reference_model(initial_model), or set dpo_variant='simpo'"
            )
        self.source, self.data, self.loss = source, data, loss
        self.rank, self.seed, self.ref_model = rank, seed, ref_model
        self.device = torch.device(device)
        pad = getattr(tokenizer, "pad_token_id", None)
        self._start = _start_id(tokenizer)
        self._pad = int(pad) if pad is not None else self._start
        self._stream = isinstance(source, StreamSource)
        self._position = 0
        # how to reach self._position: open the source at _resume (None = its start), skip _skip examples
        self._resume: dict[str, Any] | None = None
        self._skip = 0
        self._lock = threading.Lock()
        self._inline: Generator[tuple[Batch, dict[str, Any]], None, None] | None = None
        self._worker: list[Prefetcher[tuple[Batch, dict[str, Any]]] | None] = [None]
        self._finalizer = weakref.finalize(self, _close_worker, self._worker)
        self._wait_s = 0.0

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        tokenizer: Any,
        *,
        rank: int,
        ref_model: nn.Module | None = None,
        device: torch.device | str = "cpu",
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> BatchBuilder:
        """The builder for ``rank`` of a run (world size = ``cfg.replicas`` unless given)."""
        world = cfg.replicas if world_size is None else world_size
        if cfg.data.format != "auto":  # before loading anything
            check_channels(cfg.data.format, cfg.loss, rank)
        source = make_source(
            cfg.data, tokenizer, rank=rank, world_size=world, seed=cfg.seed, storage_options=storage_options
        )
        return cls(source, tokenizer, cfg.data, cfg.loss, rank=rank, seed=cfg.seed, ref_model=ref_model, device=device)

    # ------------------------------------------------------------------ batches
    def _make_batch(self, *, teacher: bool, dpo: bool) -> Callable[[list[Example]], Batch]:
        return functools.partial(
            collate, seq_len=self.data.seq_len, hint_len=self.data.hint_len, pad_id=self._pad,
            start_id=self._start, teacher=teacher, dpo=dpo,
        )

    def _producer(self) -> Generator[tuple[Batch, dict[str, Any]], None, None]:
        opener: Callable[[], Any]
        if isinstance(self.source, StreamSource):
            opener, skip = functools.partial(self.source.open, self._resume), self._skip
        else:
            opener, skip = functools.partial(_IndexedExamples, self.source, self._position), 0
        make_batch = self._make_batch(teacher=self.loss.alpha_sdpo > 0, dpo=self.loss.beta_replay > 0)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        return _produce(opener, skip, self.data.batch_size, make_batch, self._lock, pin)

    def _take(self) -> tuple[Batch, dict[str, Any]]:
        if self.data.prefetch == 0:
            if self._inline is None:
                self._inline = self._producer()
            return next(self._inline)
        worker = self._worker[0]
        if worker is None:
            worker = self._worker[0] = Prefetcher(self._producer(), self.data.prefetch, f"diloco-data-{self.rank}")
        return worker.get()

    def next_batch(self) -> Batch:
        """The next training batch; advances the position by ``batch_size`` examples."""
        t0 = time.perf_counter()
        try:
            cpu, state = self._take()
        except BaseException:
            self._stop()  # the next call starts again from the last good position
            raise
        finally:
            self._wait_s += time.perf_counter() - t0
        self._position += self.data.batch_size
        if self._stream:
            self._resume, self._skip = state, 0
        batch = {k: v.to(self.device, non_blocking=True) for k, v in cpu.items()}
        if self.loss.needs_reference:
            assert self.ref_model is not None
            batch.update(reference_logprobs(self.ref_model, batch))
        return batch

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def eval_batches(self, num_batches: int | None = None) -> Iterator[Batch]:
        """``num_batches`` (default ``data.eval_batches``) held-out batches with the channel-1 keys;
        the same batches on every call and every rank."""
        n = self.data.eval_batches if num_batches is None else num_batches
        b = self.data.batch_size
        make_batch = self._make_batch(teacher=False, dpo=False)
        for k in range(n):
            with self._lock:
                examples = [self.source.eval_example(k * b + i) for i in range(b)]
            yield {key: v.to(self.device) for key, v in make_batch(examples).items()}

    # ------------------------------------------------------------------ data wait
    @property
    def data_wait_s(self) -> float:
        """Seconds :meth:`next_batch` waited for data (reading, tokenizing, packing) since the builder
        was made or :meth:`reset_data_wait` was called; with ``data.prefetch = 0`` all that work."""
        return self._wait_s

    def reset_data_wait(self) -> float:
        """Return :attr:`data_wait_s` and start counting from 0 again (call once per round)."""
        waited, self._wait_s = self._wait_s, 0.0
        return waited

    @property
    def bad_rows(self) -> int:
        """Unusable rows this builder's source skipped so far (:mod:`.bad_rows`; 0 for sources that
        have none to skip)."""
        counts = getattr(self.source, "bad_rows", None)
        return int(counts.bad) if counts is not None else 0

    # ------------------------------------------------------------------ lifecycle
    def _stop(self) -> None:
        """Drop the batches made ahead (their position is not ours any more)."""
        _close_worker(self._worker)
        if self._inline is not None:
            self._inline.close()
            self._inline = None

    def close(self) -> None:
        """Stop the background thread; the builder stays usable (the thread restarts on demand)."""
        self._stop()

    def __enter__(self) -> BatchBuilder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ position
    @property
    def position(self) -> int:
        """Training examples consumed (``batch_size`` per batch)."""
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        """Move to example ``value``: the next batch starts there. A stream reads forward to it (from
        the start when moving back), which costs reading and tokenizing the examples skipped."""
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DataError(f"rank {self.rank}: data position must be a non-negative int, got {value!r}")
        if value == self._position:
            return
        self._stop()
        if self._stream and value > self._position:
            self._skip += value - self._position
        elif self._stream:
            self._resume, self._skip = None, value
        self._position = value

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe data position: ``{"position", "rank", "seed", "source", "batch_size", "format"}`` and,
        for a stream, ``"stream"`` (its iterator state) and ``"stream_skip"`` (examples still to skip)."""
        state: dict[str, Any] = {
            "position": self._position,
            "rank": self.rank,
            "seed": self.seed,
            "source": self.data.source,
            "batch_size": self.data.batch_size,
            "format": self.format,
        }
        if self._stream:
            state["stream"] = copy.deepcopy(self._resume)
            state["stream_skip"] = self._skip
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["position"]`` (for a stream: at its ``"stream"`` state, the exact next
        record; without one, by reading forward from the start). DataError if it was saved for another
        seed, source or format (the stream would differ); a different rank is allowed (e.g. a rank
        taking over a shard)."""
        current = {"seed": self.seed, "source": self.data.source, "format": self.format}
        for key, value in current.items():
            if key in state and state[key] != value:
                raise DataError(
                    f"rank {self.rank}: data position was saved with {key}={state[key]!r}, this run has "
                    f"{key}={value!r}; it cannot resume that stream"
                )
        position = state.get("position")
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise DataError(f"rank {self.rank}: data position must be a non-negative int, got {position!r}")
        stream, skip = state.get("stream"), state.get("stream_skip", 0)
        if stream is not None and not isinstance(stream, dict) or not isinstance(skip, int) or skip < 0:
            raise DataError(f"rank {self.rank}: data position has an invalid stream state {stream!r:.80}")
        self._stop()
        self._position = position
        if self._stream:
            self._resume, self._skip = (copy.deepcopy(stream), skip) if "stream" in state else (None, position)
