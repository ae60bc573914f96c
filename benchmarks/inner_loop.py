"""Inner-loop speed: one replica's inner step against a hand-written PyTorch loop (issue "Your model,
your data", inner-loop speed).

Run (from the repo root, venv active):

    python benchmarks/inner_loop.py              # 7 blocks x 6 steps per row, about 2 minutes
    python benchmarks/inner_loop.py --quick      # 2 blocks x 3 steps per row, under a minute
    python benchmarks/inner_loop.py --set model.precision='"bf16-autocast"'   # any RunConfig override

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
"""

from __future__ import annotations

import argparse
import itertools
import json
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
    ap.add_argument("--quick", action="store_true", help="2 blocks x 3 steps per row")
    ap.add_argument("--blocks", type=int, default=None, help="interleaved blocks per row (default 7)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per block (default 6)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="RunConfig override K=V")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = ap.parse_args(argv)
    blocks = args.blocks or (2 if args.quick else 7)
    steps = args.steps or (3 if args.quick else 6)
    torch.set_num_threads(1)
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
    _print(out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return out


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


if __name__ == "__main__":
    main(sys.argv[1:])
