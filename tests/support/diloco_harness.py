"""Shared helpers for the DiLoCo tests: a tiny model, replicas in threads, and an independent reference.

The reference (:func:`reference_run`) re-implements DiLoCo / Streaming DiLoCo from the papers
(arXiv 2311.08105, 2501.18512) with plain torch and no torchft: every replica runs the same inner
steps; at ``local_step == H/F - delay`` the current fragment's pseudo-gradient ``global - local`` is
taken (through the codec, with error feedback, when asked), at ``H/F`` the mean over replicas is
applied by ``torch.optim.SGD(nesterov=True)`` to the fragment's global parameters and the fragment's
local parameters are reset to them.
"""

from __future__ import annotations

import copy
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diloco_serverless.exchange._io import shard_bounds
from diloco_serverless.exchange.codec import roundtrip
from diloco_serverless.trainer.diloco import (
    DiLoCoReplica,
    build_diloco,
    split_fragments,
)
from diloco_serverless.trainer.fragment_merge import enable_fragment_merge
from diloco_serverless.trainer.outer_schedule import schedule_outer_lr

IN, OUT = 7, 3


def tiny_model(seed: int = 0) -> nn.Module:
    """An MLP whose tensor sizes (91, 13, 39, 3, ...) cross every shard and bucket boundary."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, OUT))


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, IN, generator=gen), torch.randn(4, OUT, generator=gen)


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    x, y = batch(gen)
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def make_inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def run_replicas(base: nn.Module, make_manager: Callable[[int], Any], world: int, *, rounds: int,
                 sync_every: int, fragments: int = 1, delay: int = 0,
                 lr_at: Callable[[int], float] | None = None, merge: str | None = None,
                 after_sync: list[list[dict[str, torch.Tensor]]] | None = None) -> list[DiLoCoReplica]:
    """Train ``world`` replicas in threads for ``rounds`` exchange rounds; returns their DiLoCo states.
    ``lr_at``: an outer lr schedule by round (``outer.lr_schedule``, trainer/outer_schedule.py);
    ``merge``: ``exchange.fragment_merge`` (trainer/fragment_merge.py); ``after_sync[rank]`` gets the
    replica's parameters after each round's sync."""
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            model = copy.deepcopy(base)
            manager = make_manager(rank)
            opt = make_inner(model)
            rep = build_diloco(manager, model, opt, sync_every=sync_every, fragments=fragments,
                               fragment_sync_delay=delay)
            if lr_at is not None:
                schedule_outer_lr(rep, lr_at)
            if merge is not None:
                enable_fragment_merge(rep, merge)
            gen = torch.Generator().manual_seed(100 + rank)
            with rep:
                while manager.current_step() < rounds:
                    before = manager.current_step()
                    inner_step(model, opt, gen)
                    if after_sync is not None and manager.current_step() > before:
                        after_sync[rank].append({n: p.detach().clone() for n, p in model.named_parameters()})
            manager.shutdown()
            out[rank] = rep
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out


def _codec_mean(pgs: list[torch.Tensor], codec: str, residuals: list[torch.Tensor | None]) -> torch.Tensor:
    """Exactly what ObjectStoreAllReduce computes: per-shard codec, rank-order fp32 sum, codec again."""
    world = len(pgs)
    bounds = shard_bounds(pgs[0].numel(), world)
    own = []
    for r, pg in enumerate(pgs):
        flat = pg if residuals[r] is None else pg + residuals[r]
        own.append(torch.cat([roundtrip(flat[a:b], codec) for a, b in bounds]))
        if codec != "fp32":
            residuals[r] = flat - own[-1]
    acc = torch.zeros_like(pgs[0])
    for o in own:
        acc += o
    acc /= world
    return torch.cat([roundtrip(acc[a:b], codec) for a, b in bounds])


def reference_run(base: nn.Module, world: int, *, rounds: int, sync_every: int, fragments: int = 1,
                  delay: int = 0, codec: str = "fp32", error_feedback: bool = False,
                  outer_lr: float = 0.7, momentum: float = 0.9,
                  lr_at: Callable[[int], float] | None = None) -> dict[str, torch.Tensor]:
    """Global parameters after ``rounds`` exchange rounds, computed without torchft (``lr_at``: the outer
    lr of round r's step, else ``outer_lr``)."""
    models = [copy.deepcopy(base) for _ in range(world)]
    opts = [make_inner(m) for m in models]
    gens = [torch.Generator().manual_seed(100 + r) for r in range(world)]
    names = [[n for n, _ in part.named_parameters()] for part in split_fragments(base, fragments)]
    glob = {n: p.detach().clone() for n, p in base.named_parameters()}
    for n in glob:
        glob[n].requires_grad_(True)
    outer = [torch.optim.SGD([glob[n.replace("__", ".")] for n in ns], lr=outer_lr, momentum=momentum,
                             nesterov=True) for ns in names]
    residuals: list[list[torch.Tensor | None]] = [[None] * world for _ in range(fragments)]
    per_round, pending = sync_every // fragments, None
    for r in range(rounds):
        frag = r % fragments
        keys = [n.replace("__", ".") for n in names[frag]]
        for local_step in range(1, per_round + 1):
            for m, o, g in zip(models, opts, gens):
                inner_step(m, o, g)
            if local_step == per_round - delay:
                pending = []
                for m in models:
                    params = dict(m.named_parameters())
                    pending.append(torch.cat([(glob[k].detach() - params[k].detach()).reshape(-1) for k in keys]))
        res = residuals[frag] if error_feedback else [None] * world
        avg = _codec_mean(pending, codec, res)
        offset = 0
        for k in keys:
            n = glob[k].numel()
            glob[k].grad = avg[offset:offset + n].view_as(glob[k]).clone()
            offset += n
        if lr_at is not None:
            for group in outer[frag].param_groups:
                group["lr"] = lr_at(r)
        outer[frag].step()
        outer[frag].zero_grad()
        for m in models:
            params = dict(m.named_parameters())
            with torch.no_grad():
                for k in keys:
                    params[k].copy_(glob[k])
    return {k: v.detach() for k, v in glob.items()}


def assert_close_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, atol: float = 1e-6,
                        rtol: float = 1e-5) -> None:
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


def assert_identical(reps: list[DiLoCoReplica]) -> None:
    first = reps[0].global_named_parameters()
    for rep in reps[1:]:
        other = rep.global_named_parameters()
        for k in first:
            assert torch.equal(first[k], other[k]), f"{k} differs between rank 0 and rank {rep.manager.rank}"


# ---------------------------------------------------------------------------- whole-replica runs
def write_jsonl(path: Path, n: int = 40) -> str:
    """A small JSONL corpus (all three compose_loss channels live); returns its path."""
    import json

    lines = []
    for i in range(n):
        body = f"    y = x * {i % 7}\n    z = y + {i}\n    return z - {i % 3}\n"
        lines.append(json.dumps({"prompt": f"def f{i}(x):\n", "response": body, "hint": f"returns {i % 7}x+{i}"}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def tiny_run_overrides(data_path: str, replicas: int, *, rounds: int = 2, sync_every: int = 2,
                       **extra: object) -> list[str]:
    """--set overrides for a run that takes seconds on 2 CPU cores."""
    base = {
        "replicas": replicas, "rounds": rounds, "checkpoint_every": 1, "eval_every": 1,
        "inner.sync_every": sync_every, "inner.warmup_steps": 1, "data.source": f'"{data_path}"',
        "data.batch_size": 2, "data.seq_len": 32, "data.prompt_len": 8, "data.hint_len": 8,
        "data.eval_batches": 1, "data.eval_fraction": 0.2, "exchange.straggler_timeout_s": 60,
        "exchange.takeover_timeout_s": 20, "exchange.poll_interval_s": 0.05, "exchange.round_timeout_s": 120,
        # DiLoCo's outer step, set explicitly (unset, N and H pick it): the outer momentum is state to keep
        "outer.lr": 0.7, "outer.momentum": 0.9, "outer.nesterov": "true",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def create_tiny_run(store_url: str, data_path: str, replicas: int, run_id: str = "run-test", **kw: object) -> str:
    """Create a run in ``store_url``; returns the run URL."""
    from diloco_serverless.config import RunConfig
    from diloco_serverless.run.record import create_run

    cfg = RunConfig.load(None, [f"run_id={run_id}", *tiny_run_overrides(data_path, replicas, **kw)])
    store, _ = create_run(store_url, cfg)
    return store.url


def wait_replicas(procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout_s: float = 420) -> None:
    """Wait for every replica process to exit 0 within ``timeout_s`` in all; on a timeout kill them all,
    and in either failure raise AssertionError with the tail of the replica's log."""
    deadline = time.monotonic() + timeout_s
    for p, log in zip(procs, logs):
        try:
            code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"replica did not finish\n{log.read_text(errors='replace')[-3000:]}") from None
        assert code == 0, log.read_text(errors="replace")[-3000:]
