"""Inner-loop speed: one replica's inner step against a hand-written PyTorch loop (issue "Your model,
your data", inner-loop speed).

Run (from the repo root, venv active):

    python benchmarks/inner_loop.py              # 7 blocks x 6 steps per row, about 2 minutes
    python benchmarks/inner_loop.py --quick      # 2 blocks x 3 steps per row, under a minute
    python benchmarks/inner_loop.py --set model.precision='"bf16-autocast"'   # any RunConfig override
    python benchmarks/inner_loop.py --quick --table data   # the data-wait table only (text, chat), about a minute

Prints a table and writes benchmarks/results/inner_loop.json. One torch thread, the tiny model
(1,018,368 parameters), the stdlib corpus, batch 8 x 128 tokens, all rows in one process and
interleaved block by block (plain, LM-only, default, plain, ...), so that load from other processes
hits every row alike. Rows:

  plain    a hand-written loop: ``model(input_ids, attention_mask).logits`` (under bf16 autocast for
           ``model.precision = "bf16-autocast"``), response-masked cross-entropy, ``backward``,
           ``clip_grad_norm_``, ``torch.optim.AdamW`` (torch defaults), ``zero_grad`` -- what a user
           would write without this library
  lm       ``ReplicaTrainer._inner_step`` with ``loss.alpha_sdpo = loss.beta_replay = 0``: the real
           replica step (lr schedule, ``compose_loss``, backward, clipping, the inner optimizer with
           torchft's DiLoCo hooks, metrics), H large enough that no exchange happens
  default  the same with the default loss (all three ``compose_loss`` channels live)

Two timings per row: **step** (batches built beforehand and cycled, so only the step is timed:
forward, loss, backward, optimizer) and **+data** (each step also builds its batch with the real
``BatchBuilder``: tokenization, collation and, for the default loss, the two reference-model
forwards of DPO). Times are medians over blocks of the CPU seconds per step of this process
(``time.process_time``: robust to other processes' load on a shared machine); wall medians are in
the JSON. ``host reads`` counts, during one step, every read of a tensor value into Python
(``item``, ``bool``/``int``/``float`` of a tensor, ``tolist``, ``nonzero``, boolean-mask indexing,
``torch.equal``, ...): on a GPU each is a host-device synchronisation (except reads of tensors that
live on the host, such as the step counter of torch's non-fused AdamW); transformers' own SDPA mask
code makes 2 per forward pass (``padding_mask.all()``), in every row. Batches are built in the
calling thread (``data.prefetch = 0`` where the builder has it), so each row is billed its own data
work. Targets: lm >= 0.95x the plain loop's speed (step), default <= 3.6x lm. Benchmarks never assert.

A second table, **data wait** (``--table data`` alone; issue target: data wait <= 2% of a round for
the packed-text and chat formats), trains the same tiny model with the real ``ReplicaTrainer`` and
``BatchBuilder`` on local dataset folders written to a temporary directory (``text``: a parquet file of
plain-text documents, packed; ``chat``: a JSONL file of conversations with a hint column), read with
🤗 datasets offline (its cache in the same directory; nothing is downloaded) and tokenized by the tiny
model's own byte-level tokenizer with its ChatML template. Each format runs with ``data.prefetch`` at
its default (the background worker) and at 0 (all data work in the training thread: the baseline),
interleaved round by round; a round is ``--data-steps`` inner steps (H large enough that no exchange
happens, so the round's wall time is all inner steps: the share is an upper bound for a real round,
whose exchange also gives the worker time). Per row: inner steps per round, wall seconds per round,
``BatchBuilder.reset_data_wait()`` seconds per round (``next_batch`` waiting for data), the wait as %
of the wall time (all timed rounds together, and the worst round), the non-padding share of the
student rows (packing efficiency for ``text``) and the first batch's wait (the worker starting, the
source opening; before the timed rounds). Wall clock, not CPU time: the worker's CPU is what prefetch overlaps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from diloco_serverless.config import DataConfig, RunConfig
from diloco_serverless.data.builder import BatchBuilder
from diloco_serverless.run.record import create_run
from diloco_serverless.trainer.loop import ReplicaTrainer, _Segment
from diloco_serverless.trainer.model import build_model, count_parameters

RESULTS = Path(__file__).parent / "results" / "inner_loop.json"
BATCHES = 4  # distinct pre-built batches cycled in the "step" timing

_READS = {
    torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.numpy,
    torch.equal, torch.Tensor.equal, torch.masked_select, torch.Tensor.masked_select, torch.argwhere,
    torch.Tensor.argwhere, torch.unique, torch.Tensor.unique, torch.repeat_interleave,
}


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values into Python (device syncs on a GPU) while active. Reads of
    ``host`` tensors (the step counters of a non-fused torch optimizer, which stay on the host on a
    GPU too) are not counted."""

    def __init__(self, host: set[int] | None = None) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.host = host or set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _READS and not (args and id(args[0]) in self.host):
            self.counts[getattr(func, "__name__", str(func))] += 1
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                self.counts["bool-mask index"] += 1
        return func(*args, **(kwargs or {}))


class PlainLoop:
    """The hand-written reference: what a user writes around a Hugging Face causal LM."""

    def __init__(self, cfg: RunConfig) -> None:
        self.model, _ = build_model(cfg.model, cfg.seed)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.inner.lr, betas=cfg.inner.betas, weight_decay=cfg.inner.weight_decay
        )
        self.clip = cfg.inner.grad_clip
        self.autocast = getattr(cfg.model, "precision", "fp32") == "bf16-autocast"

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        labels = ids.masked_fill(batch["response_mask"] == 0, -100)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return 0.0


class Row:
    """One configuration: a step function on a given batch and a batch source."""

    def __init__(self, name: str, cfg: RunConfig, tmp: Path) -> None:
        self.name, self.cfg = name, cfg
        lm_cfg = cfg.with_overrides(["loss.alpha_sdpo=0", "loss.beta_replay=0"]) if name != "default" else cfg
        if name == "plain":
            self.plain: PlainLoop | None = PlainLoop(lm_cfg)
            model, tok = build_model(lm_cfg.model, lm_cfg.seed)
            self.builder = BatchBuilder.from_config(lm_cfg, tok, rank=0)
            self.trainer: ReplicaTrainer | None = None
        else:
            self.plain = None
            store, _ = create_run(f"file://{tmp}/{name}", lm_cfg.with_overrides([f"run_id=bench-{name}"]))
            self.trainer = ReplicaTrainer(lm_cfg.with_overrides([f"run_id=bench-{name}"]), store, 0, device="cpu")
            self.builder = self.trainer.data
            self.rep_ctx = self.trainer.rep.__enter__()  # DiLoCo's optimizer hooks, as in ReplicaTrainer.run
        self.real_next = self.builder.next_batch
        self.prebuilt = [self.real_next() for _ in range(BATCHES)]
        self.cycle = itertools.cycle(self.prebuilt)
        self.seg = _Segment()

    def one(self, with_data: bool) -> None:
        if self.trainer is not None:
            self.trainer.data.next_batch = self.real_next if with_data else self.cycle.__next__  # type: ignore[method-assign]
            self.trainer._inner_step(self.seg)
        else:
            assert self.plain is not None
            self.plain.step(self.real_next() if with_data else next(self.cycle))

    def host_tensors(self) -> set[int]:
        """Ids of the step counters of a non-fused optimizer (host tensors even on a GPU)."""
        opt = self.plain.opt if self.plain is not None else self.trainer.inner  # type: ignore[union-attr]
        if any(g.get("fused") or g.get("capturable") for g in opt.param_groups):
            return set()
        return {id(s["step"]) for s in opt.state.values() if "step" in s}

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.rep.__exit__(None, None, None)
            self.trainer.manager.shutdown()


def _timed(row: Row, steps: int, with_data: bool) -> tuple[float, float]:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        row.one(with_data)
    return (time.process_time() - cpu0) / steps, (time.perf_counter() - wall0) / steps


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="2 blocks x 3 steps per row; data table: 2 rounds x 8 inner steps per row")
    ap.add_argument("--blocks", type=int, default=None, help="interleaved blocks per row (default 7)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per block (default 6)")
    ap.add_argument("--table", choices=("all", "step", "data"), default="all",
                    help="which tables to run: the inner-step table, the data-wait table, or both (default)")
    ap.add_argument("--data-rounds", type=int, default=None, help="data table: timed rounds per row (default 3)")
    ap.add_argument("--data-steps", type=int, default=None,
                    help="data table: inner steps per round (default 16)")
    ap.add_argument("--formats", nargs="+", choices=DATA_FORMATS, default=list(DATA_FORMATS),
                    help="data table: the data.format rows (default: text chat)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="RunConfig override K=V")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    if args.table in ("all", "step"):
        out.update(_step_table(args))
        _print(out)
    if args.table in ("all", "data"):
        out["data_wait"] = _data_table(args)
        _print_data(out["data_wait"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return out


def _step_table(args: argparse.Namespace) -> dict[str, Any]:
    """The inner-step table: plain / lm / default, step and +data (see the module docstring)."""
    blocks = args.blocks or (2 if args.quick else 7)
    steps = args.steps or (3 if args.quick else 6)
    base = ["replicas=1", "rounds=1", "inner.sync_every=100000", "inner.warmup_steps=20"]
    if "prefetch" in DataConfig.model_fields:  # build batches in the calling thread: a background
        base.append("data.prefetch=0")  # thread would bill one row's data work to the next row's time
    base += args.overrides
    cfg = RunConfig.load(None, base)
    with tempfile.TemporaryDirectory(prefix="bench-inner-") as tmp:
        rows = [Row(name, cfg, Path(tmp)) for name in ("plain", "lm", "default")]
        reads: dict[str, dict[str, int]] = {}
        for row in rows:  # warm-up (first-call allocations, optimizer state) and host-read counts
            for _ in range(2):
                row.one(False)
            with HostReads(row.host_tensors()) as counter:
                row.one(False)
            reads[row.name] = dict(counter.counts)
        samples: dict[str, dict[str, list[tuple[float, float]]]] = {r.name: {"step": [], "data": []} for r in rows}
        for _ in range(blocks):
            for mode in ("step", "data"):
                for row in rows:
                    samples[row.name][mode].append(_timed(row, steps, mode == "data"))
        for row in rows:
            row.close()
        params = count_parameters(rows[0].plain.model) if rows[0].plain else 0
    out: dict[str, Any] = {
        "config": {"threads": 1, "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len, "params": params,
                   "precision": getattr(cfg.model, "precision", cfg.model.dtype), "blocks": blocks,
                   "steps_per_block": steps, "overrides": args.overrides, "torch": torch.__version__},
        "rows": {},
    }
    for name, by_mode in samples.items():
        out["rows"][name] = {
            f"{mode}_{kind}_s": statistics.median(s[i] for s in vals)
            for mode, vals in by_mode.items() for i, kind in enumerate(("cpu", "wall"))
        }
        for mode, vals in by_mode.items():
            out["rows"][name][f"{mode}_cpu_s_blocks"] = [round(v[0], 5) for v in vals]
        out["rows"][name]["host_reads_per_step"] = sum(reads[name].values())
        out["rows"][name]["host_reads"] = reads[name]
    r = out["rows"]
    out["ratios"] = {
        "lm_speed_vs_plain_step": r["plain"]["step_cpu_s"] / r["lm"]["step_cpu_s"],
        "lm_speed_vs_plain_data": r["plain"]["data_cpu_s"] / r["lm"]["data_cpu_s"],
        "default_vs_lm_step": r["default"]["step_cpu_s"] / r["lm"]["step_cpu_s"],
        "default_vs_lm_data": r["default"]["data_cpu_s"] / r["lm"]["data_cpu_s"],
    }
    return out


# ------------------------------------------------------------------ the data-wait table
DATA_FORMATS = ("text", "chat")
DATA_WAIT_TARGET_PCT = 2.0  # issue target: data wait <= 2% of a round (text and chat)
_WORDS = (
    "the a model learns data from every replica while object stores carry averaged pseudo gradients between "
    "rounds of inner steps and outer updates question answer add sum number colour blue red green because "
    "training tokens packed documents conversation assistant user system hint teacher student loss"
).split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + "."


def write_datasets(root: Path, *, docs: int = 3000, chats: int = 3000, seed: int = 0) -> dict[str, Path]:
    """Local dataset folders: ``text/train-00000.parquet`` (documents of 1-12 sentences, column ``text``)
    and ``chat/train.jsonl`` (a system turn + 1-3 user/assistant exchanges, column ``messages``, and a
    ``hint`` column): chats of about 60 to 600 tokens of the byte tokenizer, some padded, some cut."""
    import pyarrow as pa  # a dependency of 🤗 datasets (the [data] extra)
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    (root / "text").mkdir(parents=True)
    texts = [" ".join(_sentence(rng, rng.randint(4, 16)) for _ in range(rng.randint(1, 12))) for _ in range(docs)]
    pq.write_table(pa.table({"text": texts, "id": list(range(docs))}), root / "text" / "train-00000.parquet")
    (root / "chat").mkdir(parents=True)
    with open(root / "chat" / "train.jsonl", "w") as f:
        for _ in range(chats):
            messages = [{"role": "system", "content": "Be brief."}]
            for _turn in range(rng.choice((1, 1, 2, 3))):
                a, b = rng.randint(0, 999), rng.randint(0, 999)
                messages += [
                    {"role": "user", "content": f"Add {a} and {b}. {_sentence(rng, rng.randint(0, 8))}"},
                    {"role": "assistant", "content": f"{a + b}. {_sentence(rng, rng.randint(0, 16))}"},
                ]
            f.write(json.dumps({"messages": messages, "hint": f"the answer is {a + b}"}) + "\n")
    return {"text": root / "text", "chat": root / "chat"}


def _datasets_offline(cache: Path) -> None:
    """🤗 datasets offline with its cache under ``cache`` (nothing downloaded, nothing outside written)."""
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    datasets.config.HF_DATASETS_CACHE = cache
    datasets.config.HF_DATASETS_OFFLINE = datasets.config.HF_HUB_OFFLINE = True


class DataRow:
    """One (format, prefetch) setting: rank 0 of a 1-replica run on a local dataset folder, trained with
    ``ReplicaTrainer._inner_step`` (the real builder, its prefetch worker, the format's loss channels)."""

    def __init__(self, fmt: str, prefetch: int, cfg: RunConfig, source: Path, tmp: Path) -> None:
        self.fmt, self.prefetch, self.name = fmt, prefetch, f"{fmt}/prefetch={prefetch}"
        run_id = f"bench-data-{fmt}-p{prefetch}"
        sets = [f"run_id={run_id}", f'data.source="{source}"', f"data.format={fmt}", f"data.prefetch={prefetch}",
                "loss.beta_replay=0"]  # text: channel 1 only; chat: channels 1 and 2 (docs/data.md)
        if fmt == "text":
            sets.append("loss.alpha_sdpo=0")
        self.cfg = cfg.with_overrides(sets)
        store, _ = create_run(f"file://{tmp}/{run_id}", self.cfg)
        self.trainer = ReplicaTrainer(self.cfg, store, 0, device="cpu")
        self.trainer.rep.__enter__()  # DiLoCo's optimizer hooks, as in ReplicaTrainer.run
        self.channels = "lm" + ("+sdpo" if self.cfg.loss.alpha_sdpo > 0 else "")
        real_next = self.trainer.data.next_batch
        self.tokens: list[tuple[torch.Tensor, int]] = []  # (non-padding tokens, tokens) of each student batch

        def next_batch() -> dict[str, torch.Tensor]:
            batch = real_next()
            self.tokens.append((batch["attention_mask"].sum(), batch["attention_mask"].numel()))
            return batch

        self.trainer.data.next_batch = next_batch  # type: ignore[method-assign]
        self.seg = _Segment()
        self.rounds: list[tuple[float, float]] = []  # (wall s, data wait s) per timed round

    def warm_up(self, steps: int) -> None:
        """The first steps (opening the dataset, starting the worker, first-call allocations): untimed,
        except that the first batch's wait is kept."""
        self.trainer.data.reset_data_wait()
        self.trainer._inner_step(self.seg)
        self.first_batch_s = self.trainer.data.reset_data_wait()
        for _ in range(steps - 1):
            self.trainer._inner_step(self.seg)
        self.tokens.clear()

    def round(self, steps: int) -> None:
        data = self.trainer.data
        data.reset_data_wait()
        wall0 = time.perf_counter()
        for _ in range(steps):
            self.trainer._inner_step(self.seg)
        wall = time.perf_counter() - wall0
        self.rounds.append((wall, data.reset_data_wait()))

    def result(self, steps: int) -> dict[str, Any]:
        walls, waits = [w for w, _ in self.rounds], [d for _, d in self.rounds]
        nonpad = sum(int(n) for n, _ in self.tokens) / max(1, sum(t for _, t in self.tokens))
        return {
            "format": self.fmt, "prefetch": self.prefetch, "channels": self.channels,
            "inner_steps_per_round": steps, "rounds": len(self.rounds),
            "wall_s_per_round": statistics.median(walls), "data_wait_s_per_round": statistics.median(waits),
            "wall_s_total": sum(walls), "data_wait_s_total": sum(waits),
            "data_wait_pct": 100 * sum(waits) / sum(walls),
            "data_wait_pct_worst_round": max(100 * d / w for w, d in self.rounds),
            "nonpad_pct": 100 * nonpad, "first_batch_wait_s": self.first_batch_s,
            "wall_s_rounds": [round(w, 4) for w in walls], "data_wait_s_rounds": [round(d, 5) for d in waits],
        }

    def close(self) -> None:
        self.trainer.rep.__exit__(None, None, None)
        self.trainer.data.close()
        self.trainer.manager.shutdown()


def _data_table(args: argparse.Namespace) -> dict[str, Any]:
    """Data wait per round for each format, prefetch on (its default) against 0 (the baseline)."""
    rounds = args.data_rounds or (2 if args.quick else 3)
    steps = args.data_steps or (8 if args.quick else 16)
    cfg = RunConfig.load(None, ["replicas=1", "rounds=1", "inner.sync_every=100000", "inner.warmup_steps=20",
                                *args.overrides])
    on = cfg.data.prefetch or DataConfig.model_fields["prefetch"].default
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp_dir:
        tmp = Path(tmp_dir)
        _datasets_offline(tmp / "hf-cache")
        sources = write_datasets(tmp / "datasets")
        rows = [DataRow(fmt, p, cfg, sources[fmt], tmp) for fmt in args.formats for p in (on, 0)]
        try:
            for row in rows:
                row.warm_up(2)
            for _ in range(rounds):  # interleaved: load from other processes hits every row alike
                for row in rows:
                    row.round(steps)
        finally:
            for row in rows:
                row.close()
    results = {row.name: row.result(steps) for row in rows}
    targets = {
        fmt: {"data_wait_pct": results[f"{fmt}/prefetch={on}"]["data_wait_pct"],
              "met": results[f"{fmt}/prefetch={on}"]["data_wait_pct"] <= DATA_WAIT_TARGET_PCT}
        for fmt in args.formats
    }
    return {
        "config": {"threads": 1, "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
                   "rounds": rounds, "inner_steps_per_round": steps, "prefetch_on": on, "formats": args.formats,
                   "tokenizer": "tiny byte-level (ChatML)", "target_pct": DATA_WAIT_TARGET_PCT,
                   "overrides": args.overrides},
        "rows": results,
        "targets": targets,
    }


def _print(out: dict[str, Any]) -> None:
    c, r, q = out["config"], out["rows"], out["ratios"]
    print(f"Inner step, tiny Qwen2 ({c['params']:,} params), batch {c['batch_size']}x{c['seq_len']}, 1 thread, "
          f"{c['precision']}, CPU ms per step (median of {c['blocks']} blocks x {c['steps_per_block']} steps)")
    print(f"{'row':<10}{'step ms':>10}{'+data ms':>10}{'vs lm step':>12}{'vs lm +data':>13}{'host reads':>12}")
    for name in ("plain", "lm", "default"):
        row = r[name]
        print(f"{name:<10}{row['step_cpu_s'] * 1e3:>10.1f}{row['data_cpu_s'] * 1e3:>10.1f}"
              f"{row['step_cpu_s'] / r['lm']['step_cpu_s']:>11.2f}x{row['data_cpu_s'] / r['lm']['data_cpu_s']:>12.2f}x"
              f"{row['host_reads_per_step']:>12d}")
    lm_ok = "met" if q["lm_speed_vs_plain_step"] >= 0.95 else "MISSED"
    ch_ok = "met" if q["default_vs_lm_step"] <= 3.6 and q["default_vs_lm_data"] <= 3.6 else "MISSED"
    print(f"lm speed vs plain loop: {q['lm_speed_vs_plain_step']:.3f}x step, {q['lm_speed_vs_plain_data']:.3f}x "
          f"+data (target >= 0.95x: {lm_ok})")
    print(f"default vs lm: {q['default_vs_lm_step']:.2f}x step, {q['default_vs_lm_data']:.2f}x +data "
          f"(target <= 3.6x: {ch_ok})")


def _print_data(out: dict[str, Any]) -> None:
    c, r = out["config"], out["rows"]
    print()
    print(f"Data wait per round, tiny Qwen2 on local datasets, batch {c['batch_size']}x{c['seq_len']}, 1 thread, "
          f"{c['rounds']} rounds x {c['inner_steps_per_round']} inner steps per row (wall clock)")
    print(f"{'format':<8}{'prefetch':>9}{'channels':>10}{'steps':>7}{'wall s':>9}{'wait s':>9}{'wait %':>8}"
          f"{'worst %':>9}{'non-pad %':>11}{'1st batch s':>13}")
    for row in r.values():
        print(f"{row['format']:<8}{row['prefetch']:>9d}{row['channels']:>10}{row['inner_steps_per_round']:>7d}"
              f"{row['wall_s_per_round']:>9.3f}{row['data_wait_s_per_round']:>9.4f}{row['data_wait_pct']:>8.2f}"
              f"{row['data_wait_pct_worst_round']:>9.2f}{row['nonpad_pct']:>11.1f}{row['first_batch_wait_s']:>13.3f}")
    for fmt, t in out["targets"].items():
        base = r[f"{fmt}/prefetch=0"]
        on = r[f"{fmt}/prefetch={c['prefetch_on']}"]
        print(f"{fmt}: data wait {t['data_wait_pct']:.2f}% of a round with prefetch={c['prefetch_on']} "
              f"(target <= {c['target_pct']:g}%: {'met' if t['met'] else 'MISSED'}); prefetch=0 baseline "
              f"{base['data_wait_pct']:.2f}%, wall {base['wall_s_per_round'] / on['wall_s_per_round']:.2f}x "
              "the prefetch round")


if __name__ == "__main__":
    main(sys.argv[1:])
